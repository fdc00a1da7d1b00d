"""The allowed-token bitmask: filled on the host while the device runs the forward, applied in place.

One bit per vocabulary entry, 32 to an int32 word, a row per sampled request. Both
buffers (pinned host, device) are allocated once with the step buffers, for
max_num_seqs rows (``memory.formulas.grammar_bitmask_bytes``). The runner calls
``apply`` after it has launched the forward and the logits: on CUDA those are still
running when the host fills the rows. The rows are filled in one call to xgrammar's
batched fill (its threads; xgrammar's calls release the GIL), go over in one asynchronous copy on a
side stream, so the copy too overlaps the forward, and xgrammar's kernel masks the
logits in place once both are done (its CPU function on the CPU). Rows of requests
without a grammar, or whose request has finished, are all ones.
"""
import os

import numpy as np
import torch

from mempath.memory.formulas import grammar_bitmask_bytes

# xgrammar's threads for a batch of rows (half the host's cores, at most this many). 64 rows
# of a JSON schema at a 128k vocabulary took 2.5 ms on one thread (BENCHMARKS.md), against a
# 5.8 ms 8B-shape step on the H200; the cap leaves cores to the server's and tiers' threads.
MAX_FILL_THREADS = 8


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def fill_threads() -> int:
    return max(1, min(MAX_FILL_THREADS, len(os.sched_getaffinity(0)) // 2))


class GrammarBitmask:
    def __init__(self, max_rows: int, vocab_size: int, device: torch.device):
        pin = device.type == "cuda"
        shape = (max_rows, bitmask_words(vocab_size))
        self.vocab_size = vocab_size
        self.host = torch.full(shape, -1, dtype=torch.int32, pin_memory=pin)
        self.host_np = self.host.numpy()
        self.device_rows = torch.full(shape, -1, dtype=torch.int32, device=device) if pin else self.host
        self.copy_stream = torch.cuda.Stream(device) if pin else None
        self.copied = torch.cuda.Event() if pin else None  # the host rows may be rewritten after it
        self.read = torch.cuda.Event() if pin else None  # the device rows may be rewritten after it
        self._matchers = None  # xgrammar.BatchGrammarMatcher, made with the first grammar row
        assert self.nbytes() == grammar_bitmask_bytes(vocab_size, max_rows)

    def nbytes(self) -> int:
        """Device bytes (the pinned host twin holds as many)."""
        return self.device_rows.numel() * self.device_rows.element_size()

    def apply(self, logits: torch.Tensor, grammars: list) -> None:
        """Mask ``logits`` [rows, V] in place: row i by ``grammars[i]`` (None: no constraint).

        A grammar that allows no token gets ``error`` set and its row left open, so the
        batch samples normally and the output processor fails that request alone.
        """
        import xgrammar
        rows = len(grammars)
        if self.copied is not None:
            self.copied.synchronize()
        self.fill(grammars)
        for row in np.flatnonzero(~self.host_np[:rows].any(axis=1)):
            grammars[row].error = ("the grammar allows no next token (the output so far cannot be "
                                   "continued in this vocabulary)")
            self.host_np[row] = -1
        mask = self.device_rows[:rows]
        if self.copy_stream is not None:
            self._upload(rows)
        xgrammar.apply_token_bitmask_inplace(logits, mask, vocab_size=logits.shape[-1])
        if self.read is not None:
            self.read.record()

    def allows_only(self, row: int, token_ids: list[int]) -> bool:
        """Whether host row ``row``, as the last ``apply`` left it, allows no token but ``token_ids``."""
        words = self.host_np[row].view(np.uint32).copy()
        ids = np.asarray(token_ids, dtype=np.int64)
        np.bitwise_and.at(words, ids >> 5, ~np.left_shift(np.uint32(1), (ids & 31).astype(np.uint32)))
        if self.vocab_size % 32:  # the last word's bits past the vocabulary are no tokens
            words[-1] &= np.uint32((1 << (self.vocab_size % 32)) - 1)
        return not words.any()

    def fill(self, grammars: list) -> None:
        """Write host row i: the tokens ``grammars[i]`` allows next, all ones for None."""
        host = self.host_np
        constrained = [i for i, g in enumerate(grammars) if g is not None]
        if len(constrained) < len(grammars):
            host[[i for i, g in enumerate(grammars) if g is None]] = -1
        if not constrained:
            return
        if self._matchers is None:
            import xgrammar
            self._matchers = xgrammar.BatchGrammarMatcher(fill_threads())
        self._matchers.batch_fill_next_token_bitmask([grammars[i].matcher for i in constrained], self.host,
                                                     constrained)

    def _upload(self, rows: int) -> None:
        """Host rows → device rows on the side stream; the current stream waits for them."""
        compute = torch.cuda.current_stream(self.device_rows.device)
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self.read)  # the last apply has read the device rows
            self.device_rows[:rows].copy_(self.host[:rows], non_blocking=True)
            self.copied.record(self.copy_stream)
        compute.wait_event(self.copied)
