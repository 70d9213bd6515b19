"""The in-scan LLM's share of a training update's time, measured so that it can be believed.

The LLM runs inside the one jitted update, so its time cannot be read off on its own; timing the LLM call as a
separate function also misses what it costs inside the update's scan (on a 2-core CPU the call alone took
0.47-0.49 s where the same window added 0.62-0.82 s to an update). The share is therefore measured as what the update loses without it:

    share = 1 - (seconds of an update with no LLM window) / (mean seconds of the run's recent updates)

The update without a window is the run's own compiled update, called on a copy of the current state whose window
clock is set beyond the rollout (so no window opens; the result is thrown away), waited for with
`jax.block_until_ready` while nothing else runs, the fastest of a few calls. It is timed after the first update of
an invocation and then every `REMEASURE_EVERY` updates (`due`). The run's updates each ran alone on the devices
(the loop leaves the timing out of their intervals) and are averaged over the most recent whole periods of the
window schedule (with skip_n > num_steps only some updates open a window). The share is None until both are
known and is never clipped: a value outside [0, 1] is a measurement problem shown as such.
"""
from __future__ import annotations

import math
import time
from collections import deque
from typing import Any, Callable

REMEASURE_EVERY = 32  # updates between two timings of the update without the LLM, after the first one
RECENT_UPDATES = 32  # at most this many recent updates (rounded down to whole window periods) make the mean


def window_period(num_steps: int, skip_n: int) -> int:
    """Updates after which the window schedule repeats (skip_n / gcd(skip_n, num_steps); 1 for skip_n 0)."""
    return skip_n // math.gcd(skip_n, num_steps) if skip_n > 0 else 1


class LLMShare:
    """Share of the update time spent in the in-scan LLM (see the module docstring).

    `without_llm`: runs one update with no LLM window on the run's current state and returns its (device) outputs,
    which are thrown away; called with nothing in flight. The loop calls `due(k)` after its k-th update of this
    invocation (then, when True, `time_without_llm` before it starts the next update), `add_update(seconds)` for
    every update after the compiling one, and reads `value`. `clock` and `block` are for tests (defaults:
    time.perf_counter, jax.block_until_ready).
    """

    def __init__(self, without_llm: Callable[[], Any], num_steps: int, skip_n: int, *, repeats: int = 2,
                 clock: Callable[[], float] = time.perf_counter, block: Callable[[Any], Any] | None = None) -> None:
        if block is None:
            import jax

            block = jax.block_until_ready
        self.without_llm, self.repeats, self.clock, self.block = without_llm, repeats, clock, block
        self.encodes = skip_n > 0  # skip_n 0: one encode at the start of the run, none during training
        self.period = window_period(num_steps, skip_n)
        cap = max(self.period, RECENT_UPDATES // self.period * self.period)
        self.updates: deque[float] = deque(maxlen=cap)
        self.seconds_without_llm: float | None = None
        self.timings = 0  # how many times the update without the LLM was timed

    def due(self, done: int) -> bool:
        """Whether to time the update without the LLM after the `done`-th update of this invocation: after the
        first, then every REMEASURE_EVERY (never when no window opens during training)."""
        return self.encodes and (done == 1 or (done > 0 and done % REMEASURE_EVERY == 0))

    def time_without_llm(self) -> float:
        """Time the update without the LLM (the fastest of `repeats` calls, after one untimed call the first time);
        returns the seconds it kept the devices busy, timing included."""
        start = self.clock()
        if self.timings == 0:
            self.block(self.without_llm())  # the run's compiled update: this only warms caches
        best = math.inf
        for _ in range(self.repeats):
            t0 = self.clock()
            self.block(self.without_llm())
            best = min(best, self.clock() - t0)
        self.seconds_without_llm = best
        self.timings += 1
        return self.clock() - start

    def add_update(self, seconds: float) -> None:
        """The seconds of one update that ran alone (not the compiling one, not one overlapping the timing)."""
        self.updates.append(seconds)

    @property
    def update_seconds(self) -> float | None:
        """Mean seconds of the recent updates, over whole periods of the window schedule when there are enough."""
        n = len(self.updates)
        if n == 0:
            return None
        if n >= self.period:
            n = n // self.period * self.period
        return sum(list(self.updates)[-n:]) / n

    @property
    def value(self) -> float | None:
        """1 - seconds without the LLM / mean update seconds; 0.0 when no window opens; None until measured."""
        if not self.encodes:
            return 0.0
        per_update = self.update_seconds
        if self.seconds_without_llm is None or per_update is None or per_update <= 0:
            return None
        return 1.0 - self.seconds_without_llm / per_update
