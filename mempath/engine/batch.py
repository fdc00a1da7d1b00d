"""What the scheduler hands the runner: one step's requests and their new tokens."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mempath.engine.request import Request

if TYPE_CHECKING:
    from mempath.engine.runner import PendingTokens


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
