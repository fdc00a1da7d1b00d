"""The fast detokenizer (a `tokenizers` DecodeStream) against the slow one (two decodes a token).

Both must give the same text, per step and in all, on every kind of tokenizer the
engine meets; the slow one is the detokenizer the engine ran before the fast one.
"""
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from mempath.engine.detokenizer import (FastIncrementalDetokenizer, SlowIncrementalDetokenizer,
                                        incremental_detokenizer)
from tests.conftest import TRAIN_TEXT, build_tokenizer

TINY = Path(__file__).resolve().parents[1] / "mempath" / "assets" / "mempath-tiny"
# Multi-byte characters (CJK, emoji, accents) split across byte tokens; words to test leading spaces.
MIXED_TEXT = ("Hello world, 中文字符 and emoji 😀🎉👩‍👩‍👧 café naïve — ünïcödé\n" * 3 +
              TRAIN_TEXT[:400])


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style BPE (Metaspace pre-tokenizer and decoder, byte fallback), like Llama-2's."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1, right=0)])
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"] + byte_tokens,
                                  show_progress=False)
    tok.train_from_iterator([MIXED_TEXT.replace("😀", "").replace("中文", "")], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module", params=["mempath-tiny", "byte-level-bpe", "metaspace"])
def tokenizer(request):
    if request.param == "mempath-tiny":
        return AutoTokenizer.from_pretrained(TINY)
    if request.param == "byte-level-bpe":
        return build_tokenizer(512)
    return metaspace_tokenizer()


def run(detokenizer, token_ids: list[int]) -> tuple[list[str], str]:
    """Every step's delta, and the flush at the end."""
    return [detokenizer.delta(token_id) for token_id in token_ids], detokenizer.flush()


def assert_same_text(tokenizer, token_ids: list[int], skip_special_tokens: bool) -> None:
    fast = FastIncrementalDetokenizer(tokenizer.backend_tokenizer, skip_special_tokens)
    slow = SlowIncrementalDetokenizer(tokenizer, skip_special_tokens)
    fast_steps, fast_tail = run(fast, token_ids)
    slow_steps, slow_tail = run(slow, token_ids)
    assert fast_steps == slow_steps
    assert fast_tail == slow_tail
    assert "".join(fast_steps) + fast_tail == "".join(slow_steps) + slow_tail


def test_the_engine_takes_the_fast_path_for_a_rust_backed_tokenizer(tokenizer):
    assert type(incremental_detokenizer(tokenizer)) is FastIncrementalDetokenizer


def test_a_tokenizer_without_a_rust_backend_gets_the_slow_path():
    class PythonTokenizer:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(97 + i % 26) for i in ids)

    assert type(incremental_detokenizer(PythonTokenizer())) is SlowIncrementalDetokenizer


def test_space_clean_up_keeps_the_slow_path():
    """transformers' clean-up rewrites the backend's text; the stream would not."""
    tokenizer = AutoTokenizer.from_pretrained(TINY, clean_up_tokenization_spaces=True)
    assert type(incremental_detokenizer(tokenizer)) is SlowIncrementalDetokenizer


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_real_text_decodes_the_same_and_whole(tokenizer, skip_special_tokens):
    ids = tokenizer.encode(MIXED_TEXT, add_special_tokens=False)
    special = [tokenizer.convert_tokens_to_ids(tokenizer.eos_token)]
    ids = ids[:40] + special + ids[40:] + special
    assert_same_text(tokenizer, ids, skip_special_tokens)
    fast = FastIncrementalDetokenizer(tokenizer.backend_tokenizer, skip_special_tokens)
    steps, tail = run(fast, ids)
    assert "".join(steps) + tail == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_token_ids_decode_the_same(tokenizer, skip_special_tokens):
    """Any ids, byte tokens cut mid-character and special tokens included."""
    rng = random.Random(17)
    vocab = len(tokenizer)
    for _ in range(40):
        length = rng.choice([1, 2, 5, 30, 120])
        assert_same_text(tokenizer, [rng.randrange(vocab) for _ in range(length)], skip_special_tokens)


def test_random_byte_tokens_decode_the_same(tokenizer):
    """Runs of single-byte tokens: multi-byte characters split, completed, and broken."""
    byte_ids = [i for i in range(len(tokenizer)) if len(tokenizer.decode([i]).encode()) <= 1
                or tokenizer.decode([i]) == "\ufffd"]
    rng = random.Random(3)
    for _ in range(40):
        assert_same_text(tokenizer, [rng.choice(byte_ids) for _ in range(rng.choice([3, 20, 80]))], True)


def test_a_split_character_is_held_back_until_whole_and_flush_returns_a_broken_one():
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    ids = tokenizer.encode("a😀", add_special_tokens=False)
    assert len(ids) > 2  # the emoji is several byte tokens
    detok = incremental_detokenizer(tokenizer)
    deltas = [detok.delta(i) for i in ids]
    assert deltas[0] == "a" and deltas[-1] == "😀" and set(deltas[1:-1]) == {""}
    detok = incremental_detokenizer(tokenizer)
    assert [detok.delta(i) for i in ids[:2]] == ["a", ""]
    assert detok.flush() == "\ufffd"


def test_byte_fallback_that_rewrites_earlier_text_takes_the_slow_rule_then_the_stream_again():
    """"A" then a stray byte decode to "��" together: the stream refuses, the slow rule cuts by length."""
    tokenizer = metaspace_tokenizer()
    vocab = tokenizer.get_vocab()
    word = min(token for token in vocab if token.startswith("▁") and token[1:].isalpha() and len(token) > 3)
    ids = [vocab["<0x41>"], vocab["<0xFB>"], vocab[word], vocab[word], vocab[word]]
    fast = FastIncrementalDetokenizer(tokenizer.backend_tokenizer, skip_special_tokens=False)
    slow = SlowIncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    fast_steps = [fast.delta(i) for i in ids[:3]]
    assert fast_steps == [slow.delta(i) for i in ids[:3]]
    assert fast_steps[0] == "A" and "\ufffd" in fast_steps[2]
    assert fast.stream is not None  # started again once nothing was held back
    assert [fast.delta(i) for i in ids[3:]] == [slow.delta(i) for i in ids[3:]] == [" " + word[1:]] * 2


def test_a_metaspace_first_output_word_loses_its_space_and_later_words_keep_theirs():
    """As the slow path always did: the prompt is not context, so "▁word" first is "word"."""
    tokenizer = metaspace_tokenizer()
    vocab = tokenizer.get_vocab()
    word = min(token for token in vocab if token.startswith("▁") and token[1:].isalpha() and len(token) > 3)
    detok = incremental_detokenizer(tokenizer)
    assert [detok.delta(vocab[word]) for _ in range(3)] == [word[1:], " " + word[1:], " " + word[1:]]
