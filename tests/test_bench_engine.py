"""benchmarks/bench_engine.py: the bytes a decode step reads, which its read limits divide (CPU, tiny models)."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_engine  # noqa: E402
from mempath import LLM  # noqa: E402


@pytest.mark.parametrize("tied", [False, True])
def test_a_decode_step_reads_one_embedding_row_a_sequence_not_the_table(model_factory, tied):
    """An untied embedding table is read a row a sequence, so the limit leaves the rest of it out; a tied
    one is also the LM head, read whole."""
    path, hf = model_factory("llama", tie_word_embeddings=tied)
    llm = LLM(path, device="cpu", show_progress=False)
    weights = llm.engine.ledger.get("weights")
    table = hf.model.embed_tokens.weight
    row_bytes = table.shape[1] * table.element_size()
    for batch in (1, 3):
        read = bench_engine.decode_weight_bytes(llm.engine, batch)
        if tied:
            assert read == weights
        else:
            assert read == weights - table.numel() * table.element_size() + batch * row_bytes
