"""The allowed-token bitmask: filled on the host while the device runs the forward, applied in place.

One bit per vocabulary entry, 32 to an int32 word, a row per sampled request. Both
buffers (pinned host, device) are allocated once with the step buffers, for
max_num_seqs rows (``memory.formulas.grammar_bitmask_bytes``). The runner calls
``apply`` after it has launched the forward and the logits: on CUDA those are still
running when the host fills the rows, so the grammar's work hides behind the
device's; the rows then go over in one asynchronous copy and xgrammar's kernel
masks the logits in place (its CPU function on the CPU). Rows of requests without a
grammar are all ones.
"""
import torch

from mempath.memory.formulas import grammar_bitmask_bytes


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


class GrammarBitmask:
    def __init__(self, max_rows: int, vocab_size: int, device: torch.device):
        pin = device.type == "cuda"
        shape = (max_rows, bitmask_words(vocab_size))
        self.vocab_size = vocab_size
        self.host = torch.full(shape, -1, dtype=torch.int32, pin_memory=pin)
        self.host_np = self.host.numpy()
        self.device_rows = torch.full(shape, -1, dtype=torch.int32, device=device) if pin else self.host
        self.copied = torch.cuda.Event() if pin else None  # the host rows may be rewritten after it
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
        host = self.host_np
        for row, grammar in enumerate(grammars):
            if grammar is None:
                host[row] = -1
                continue
            grammar.fill(self.host, row)
            if not host[row].any():
                grammar.error = ("the grammar allows no next token (the output so far cannot be "
                                 "continued in this vocabulary)")
                host[row] = -1
        mask = self.device_rows[:rows]
        if self.copied is not None:
            mask.copy_(self.host[:rows], non_blocking=True)
            self.copied.record()
        xgrammar.apply_token_bitmask_inplace(logits, mask, vocab_size=logits.shape[-1])

