"""A byte-level BPE tokenizer with a large vocabulary, trained here (no hub access):
the grammar benchmarks need a Llama-3-sized vocabulary, and dummy-weight shapes ship none.

Trained with `tokenizers` on this Python's standard library sources; the special
tokens follow Llama-3's names so that generation_config's EOS has a token.
"""
import json
import sys
import sysconfig
from pathlib import Path

SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]


def corpus(max_bytes: int):
    """Source files of the standard library, up to max_bytes in all."""
    total = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        total += len(text)
        if total > max_bytes:
            return
        yield text


def train(directory: str | Path, vocab_size: int, max_corpus_bytes: int = 40 << 20) -> Path:
    """Write tokenizer.json and tokenizer_config.json into `directory`; return it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus(max_corpus_bytes), trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL[0], "eos_token": SPECIAL[2]}))
    return directory


if __name__ == "__main__":
    out = train(sys.argv[1], int(sys.argv[2]))
    print(out, json.loads((out / "tokenizer.json").read_text())["model"]["vocab"].__len__())
