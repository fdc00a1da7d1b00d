"""What passes between scheduler, runner and engine: one step's requests, its plan, tokens in flight."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from mempath.engine.request import Request


@dataclass
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.requests)

    def sampling_requests(self) -> list[Request]:
        """Requests whose every token will have been computed after this step: they sample."""
        return [r for r, n in zip(self.requests, self.num_new_tokens)
                if r.num_computed_tokens + n == r.num_tokens]


@dataclass
class PendingTokens:
    """A launched step's sampled tokens, still on their way to the host.

    ``tokens`` stays on the device so that the next step can read its inputs from it;
    ``host`` is the pinned buffer the copy lands in, ``ready`` marks its arrival.
    ``deliver`` hands them to their requests (``emit``, the engine's output processing:
    stops, grammars advanced, finished requests freed) once, whoever asks first: the
    engine after the next step is launched, or that step itself before it fills its
    grammar masks.
    """
    sampling: list[Request]
    tokens: torch.Tensor
    host: torch.Tensor
    ready: "torch.cuda.Event | None"
    emit: Callable[[list[Request], list[int]], list] | None = None
    outputs: list | None = None  # what emit returned

    def token_ids(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()

    def deliver(self) -> list:
        if self.outputs is None:
            self.outputs = []  # never twice, even if emit raises
            self.outputs = self.emit(self.sampling, self.token_ids())
        return self.outputs


@dataclass
class StepPlan:
    """One step as the scheduler decided it.

    ``batch`` runs (it may be empty) and ``sampling`` samples; with ``defer`` its tokens
    stay on the device until the next step reads them back. ``previous`` is the decode
    step still in flight from the last call, whose tokens this step reads back; when
    this step runs ahead of it, ``feed`` names the rows of ``previous`` whose tokens are
    this batch's inputs. ``failed`` are requests the scheduler finished with an error.
    """
    batch: ScheduledBatch
    sampling: list[Request] = field(default_factory=list)
    defer: bool = False
    previous: PendingTokens | None = None
    feed: list[int] | None = None
    failed: list[Request] = field(default_factory=list)
