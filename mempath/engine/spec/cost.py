"""The draft length each step: K in 0..max_k maximising expected tokens per second.

A step of batch b that proposes K tokens per row costs K draft forwards of b rows
(``draft[b]``) and one target forward of b rows of K + 1 tokens (``verify[b][K + 1]``);
plain decoding is ``verify[b][1]``. A row with acceptance rate a emits
(1 - a^(K+1)) / (1 - a) tokens (every proposal kept independently with probability a,
plus the corrected or bonus token). K = 0 unless the best K beats plain decoding by
``min_gain``. Times are kept per batch-size bucket (powers of two), calibrated at
start-up and moved towards what each step measures (an exponential average); a query
length never measured in a bucket is interpolated linearly between measured ones.
"""
import math


def bucket(batch_size: int) -> int:
    """The power of two at or above batch_size."""
    return 1 << max(0, math.ceil(math.log2(max(1, batch_size))))


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a row emits per step with K proposals each kept with probability ``acceptance``."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


class SpecCostModel:
    def __init__(self, max_k: int, min_gain: float = 1.03, smoothing: float = 0.2):
        self.max_k = max_k
        self.min_gain = min_gain
        self.smoothing = smoothing
        self.draft: dict[int, float] = {}  # bucket -> seconds of one draft forward (one token per row)
        self.verify: dict[int, dict[int, float]] = {}  # bucket -> query length -> seconds
        # Set where the verify runs on CUDA graphs of max_k + 1 tokens a row: every K >= 1 costs that.
        self.fixed_verify_len: int | None = None

    # ------------------------------------------------------------ measurements
    def _blend(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)

    def observe_draft(self, batch_size: int, seconds: float) -> None:
        b = bucket(batch_size)
        self.draft[b] = self._blend(self.draft.get(b), seconds)

    def _verify_len(self, query_len: int) -> int:
        return self.fixed_verify_len if self.fixed_verify_len is not None and query_len > 1 else query_len

    def observe_verify(self, batch_size: int, query_len: int, seconds: float) -> None:
        query_len = self._verify_len(query_len)
        table = self.verify.setdefault(bucket(batch_size), {})
        table[query_len] = self._blend(table.get(query_len), seconds)

    def _nearest(self, table: dict, b: int):
        return table.get(b) if b in table else (table[min(table, key=lambda x: abs(math.log2(x) - math.log2(b)))]
                                               if table else None)

    def draft_time(self, batch_size: int) -> float | None:
        return self._nearest(self.draft, bucket(batch_size))

    def verify_time(self, batch_size: int, query_len: int) -> float | None:
        table = self._nearest(self.verify, bucket(batch_size))
        if not table:
            return None
        query_len = self._verify_len(query_len)
        if query_len in table:
            return table[query_len]
        lower = [q for q in table if q < query_len]
        upper = [q for q in table if q > query_len]
        if lower and upper:
            lo, hi = max(lower), min(upper)
            return table[lo] + (table[hi] - table[lo]) * (query_len - lo) / (hi - lo)
        if len(table) < 2:
            return None
        # Outside the measured lengths: extend the line through the two nearest.
        a, b = sorted(table, key=lambda q: abs(q - query_len))[:2]
        value = table[a] + (table[b] - table[a]) * (query_len - a) / (b - a)
        return max(value, min(table.values()) if query_len > a else 0.0) or None

    def draft_prefill_time(self, num_tokens: int) -> float:
        """Seconds of a draft forward over ``num_tokens`` tokens (a catch-up): the measured
        forward of as many one-token rows, linear past the largest bucket measured."""
        if not self.draft:
            return 0.0
        largest = max(self.draft)
        if num_tokens > largest:
            return self.draft[largest] * num_tokens / largest
        return self.draft_time(num_tokens)

    # ------------------------------------------------------------ the choice
    def step_time(self, batch_size: int, k: int, draft_free: bool = False, overhead: float = 0.0) -> float | None:
        """Seconds of a step with K proposals per row; ``overhead``: added to any K > 0 (the draft's catch-up)."""
        verify = self.verify_time(batch_size, k + 1)
        draft = 0.0 if draft_free or k == 0 else self.draft_time(batch_size)
        if verify is None or draft is None:
            return None
        return k * draft + verify + (overhead if k else 0.0)

    def predicted_speedup(self, batch_size: int, k: int, acceptances: list[float],
                          draft_free: bool = False, overhead: float = 0.0) -> float | None:
        """Expected tokens per second with K proposals over plain decoding's, for these rows."""
        plain, spec = self.step_time(batch_size, 0), self.step_time(batch_size, k, draft_free, overhead)
        if plain is None or spec is None or spec <= 0:
            return None
        tokens = sum(expected_tokens(a, k) for a in acceptances)
        return (tokens / spec) / (len(acceptances) / plain)

    def choose(self, acceptances: list[float], draft_free: bool = False, overhead: float = 0.0) -> int:
        """The best K for rows with these acceptance rates (0: plain decoding pays best)."""
        b = len(acceptances)
        best_k, best = 0, self.min_gain
        for k in range(1, self.max_k + 1):
            gain = self.predicted_speedup(b, k, acceptances, draft_free, overhead)
            if gain is not None and gain > best:
                best_k, best = k, gain
        return best_k

    def could_pay(self, batch_size: int, draft_free: bool = False, overhead: float = 0.0) -> bool:
        """Whether some K would beat plain decoding at this batch size if every proposal were kept
        (``choose`` of all-ones acceptances, whose tokens per row are K + 1: no pass over the rows)."""
        plain = self.step_time(batch_size, 0)
        if plain is None:
            return False
        for k in range(1, self.max_k + 1):
            spec = self.step_time(batch_size, k, draft_free, overhead)
            if spec is not None and spec > 0 and (k + 1) * plain / spec > self.min_gain:
                return True
        return False
