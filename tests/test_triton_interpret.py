"""The Triton kernels on small shapes, on the CPU, under ``TRITON_INTERPRET=1``.

Catches indexing and masking mistakes without a GPU. Skipped where Triton is
missing, and where CUDA is present (``test_triton_kernels.py`` runs the real
thing there).

Triton reads ``TRITON_INTERPRET`` once, when it is first imported (its own
library functions are decorated then), and other tests of the session may
have imported it already; so the checks run in one child interpreter started
with the flag set, and each test reports one check's outcome.

The attention checks use float32 and float16: the interpreter multiplies
bfloat16 tiles as raw uint16 bits (bfloat16 is covered on the GPU).
"""
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from test_triton_kernels import (Case, assert_close, check_attention, check_decode_seq_order,  # noqa: E402
                                check_decode_split_rows, check_write_kv)

DEVICE = "cpu"


def check_write_kv_cast(ta):
    check_write_kv(ta, 37, 2, 32, 8, torch.float32, torch.bfloat16, DEVICE, seed=1, exact=False)
    check_write_kv(ta, 37, 2, 32, 8, torch.float32, torch.float32, DEVICE, seed=3)


def check_write_kv_same_dtype(ta):
    check_write_kv(ta, 20, 3, 64, 16, torch.bfloat16, torch.bfloat16, DEVICE, seed=2)


def check_decode(ta, group, dtype):
    lens = [1, 7, 8, 9, 63, 64, 65, 200]
    case = Case([(1, n) for n in lens], 2 * group, 2, 32, 8, dtype, DEVICE, seed=group)
    for splits in (1, 2, 8):
        check_attention(ta, case, dtype, "decode", num_splits=splits)
    check_attention(ta, case, dtype, "auto")


def check_decode_padding_and_workspace(ta):
    ws = ta.alloc_decode_workspace(4, 4, 2, 32, DEVICE)
    case = Case([(1, 5), (1, 130), (1, 70)], 4, 2, 32, 16, torch.float32, DEVICE, seed=3,
                table_garbage="negative")
    check_attention(ta, case, torch.float32, "decode", workspace=ws)
    case.seq_lens[1] = 0
    out = ta.triton_decode_attention(case.query, case.k_cache, case.v_cache, case.block_tables,
                                     case.seq_lens, case.scale, out=case.poisoned_out(), workspace=ws,
                                     num_splits=4)
    assert torch.all(out[1] == 0)
    assert not torch.isnan(out).any()


def check_prefill_mixed(ta, group, dtype):
    # Fresh prompts at tile edges, chunks over cached prefixes, decode rows.
    # (5, 35), (5, 67), (5, 68): a chunk starting one or two keys before a KV tile edge.
    seqs = [(1, 1), (9, 9), (1, 77), (64, 64), (33, 100), (70, 70), (1, 16), (5, 200),
            (5, 35), (5, 67), (5, 68)]
    case = Case(seqs, 2 * group, 2, 32, 8, dtype, DEVICE, seed=group)
    check_attention(ta, case, dtype, "prefill")
    check_attention(ta, case, dtype, "auto", max_query_len=case.max_query_len)
    check_attention(ta, case, dtype, "auto", split_decodes=False)


def check_mixed_decode_rows(ta):
    """The decode kernel on a mixed batch: its rows right, the others untouched."""
    seqs = [(1, 77), (33, 100), (1, 5), (7, 7), (1, 200)]
    case = Case(seqs, 8, 2, 32, 8, torch.float32, DEVICE, seed=9)
    ref = case.reference()
    rows = torch.tensor([0, 34, 42])
    for splits in (1, 4):
        out = case.poisoned_out()
        ta.triton_decode_attention(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                   case.scale, out=out, num_splits=splits, query_start_loc=case.query_start_loc)
        assert_close(out[rows], ref[rows], torch.float32)
        others = torch.ones(case.num_tokens, dtype=torch.bool)
        others[rows] = False
        assert torch.isnan(out[others]).all()


def check_odd_head_dim(ta):
    case = Case([(1, 30), (1, 90)], 6, 2, 96, 16, torch.float32, DEVICE, seed=4)  # group 3
    check_attention(ta, case, torch.float32, "decode", num_splits=2)
    case = Case([(12, 40), (3, 3)], 6, 2, 96, 16, torch.float32, DEVICE, seed=4)
    check_attention(ta, case, torch.float32, "prefill")


CHECKS = {
    "write_kv_cast": check_write_kv_cast,
    "write_kv_same_dtype": check_write_kv_same_dtype,
    "decode_padding_and_workspace": check_decode_padding_and_workspace,
    "odd_head_dim": check_odd_head_dim,
    "mixed_decode_rows": check_mixed_decode_rows,
    "decode_seq_order": lambda ta: check_decode_seq_order(ta, DEVICE, torch.float32),
    "decode_split_rows": lambda ta: check_decode_split_rows(ta, DEVICE, torch.float32),
}
for _group in (1, 4):
    for _dtype in (torch.float32, torch.float16):
        CHECKS[f"decode_g{_group}_{_dtype}"] = (
            lambda ta, g=_group, d=_dtype: check_decode(ta, g, d))
for _group in (1, 2, 8):
    for _dtype in (torch.float32, torch.float16):
        CHECKS[f"prefill_mixed_g{_group}_{_dtype}"] = (
            lambda ta, g=_group, d=_dtype: check_prefill_mixed(ta, g, d))


def _patch_interpreter_for_numpy() -> None:
    """Triton 3.6's interpreter turns a scalar into an index with
    ``int(array)``, which numpy >= 2.4 refuses for shape-(1,) arrays (a loop
    bound computed from a loaded value is one); ``.item()`` accepts both."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patched


def _run_all() -> dict:
    """Child side: every check, name -> None or its traceback."""
    _patch_interpreter_for_numpy()
    from mempath.kernels import attention_triton as ta

    results = {}
    for name, check in CHECKS.items():
        try:
            check(ta)
            results[name] = None
        except Exception:  # noqa: BLE001 - reported to the parent
            results[name] = traceback.format_exc()
    return results


@pytest.fixture(scope="module")
def outcomes():
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("CUDA present: test_triton_kernels.py tests the compiled kernels")
    # Extended, not replaced; no empty entry when it was unset (that would put the working directory first).
    path = os.pathsep.join(p for p in (str(HERE.parent), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child"], env=env,
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"interpreter child failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[-1])


@pytest.mark.parametrize("name", list(CHECKS))
def test_interpreted(outcomes, name):
    if outcomes[name] is not None:
        pytest.fail(outcomes[name], pytrace=False)


if __name__ == "__main__" and sys.argv[1:] == ["--child"]:
    print(json.dumps(_run_all()))
