"""A decode step captured as CUDA graph pieces cut where the host must decide: at every MoE layer
whose experts are partly in host memory (mempath.model.moe_slots).

A whole-step graph replays fixed work, but such a layer's misses are copied on a decision the
host makes after the router has run. So the step is captured in pieces: a layer's router ends
one piece, the layer's experts start the next, and between them replay runs the layer's
``SlotStep`` (read the expert ids, copy misses into slots, write the slot table). Everything
else of the step — attention, norms, the dense projections, the LM head — stays inside the
pieces, so per MoE layer the host adds one read-back and one graph launch instead of every
kernel launch of the layer.

The pieces share one memory pool and are captured and replayed in the same order, which is
what makes sharing it safe (a tensor that one piece allocates and a later piece frees is
reused only by allocations after that, in replay order too).
"""
from contextlib import contextmanager

import torch

# One side stream for every capture: cuBLAS keeps a workspace per stream it runs on, so a new
# stream per capture would put a new workspace into each graph's pool.
_capture_stream: torch.cuda.Stream | None = None


class PiecewiseGraph:
    """The pieces of one captured decode step and the host steps between them."""

    def __init__(self):
        self.pieces: list[torch.cuda.CUDAGraph] = []
        self.host_steps: list = []  # host_steps[i] runs after pieces[i]
        self._pool = None
        self._open: torch.cuda.CUDAGraph | None = None

    def capture(self, forward, pool=None) -> None:
        """Capture ``forward()`` (its MoE layers call ``cut``) on a side stream, as CUDA graphs do."""
        self._pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        global _capture_stream
        torch.cuda.synchronize()
        if _capture_stream is None:
            _capture_stream = torch.cuda.Stream()
        stream = _capture_stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._begin()
            try:
                forward()
            finally:
                self._end()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def cut(self, make_host_step) -> None:
        """End the open piece, make its host step (outside any capture: it may allocate), open the next."""
        self._end()
        self.host_steps.append(make_host_step())
        self._begin()

    def pool(self):
        return self._pool

    def replay(self, rows: int | None = None) -> None:
        """Run the step for its first ``rows`` rows (the rest pad the captured batch; None: all)."""
        for i, piece in enumerate(self.pieces):
            piece.replay()
            if i < len(self.host_steps):
                self.host_steps[i](rows)

    def _begin(self) -> None:
        self._open = torch.cuda.CUDAGraph()
        self._open.capture_begin(pool=self._pool)

    def _end(self) -> None:
        if self._open is not None:
            self._open.capture_end()
            self.pieces.append(self._open)
            self._open = None


@contextmanager
def cuts_at(blocks, graph: PiecewiseGraph):
    """While capturing: each of ``blocks`` (MoE layers on the slot kernel) cuts ``graph`` at its experts."""
    for block in blocks:
        block.__dict__["graph_cut"] = graph.cut
    try:
        yield graph
    finally:
        for block in blocks:
            block.__dict__.pop("graph_cut", None)
