"""The in-scan LLM's share of a training update's time, measured so that it can be believed.

Inside the jitted update the LLM cannot be timed on its own, so its share is put together from two measurements
taken the same way (a call waited for with `jax.block_until_ready`, nothing else running on the devices):

    share = LLM windows per update x seconds of one window alone / seconds of an update

The window alone is the function the update runs when a window opens (the run's own shapes, the reset pool's
worlds included when the pool is on), timed while no update is in flight, at a few updates early in the run and
then every `REMEASURE_EVERY` updates (`due`). An update's seconds are those of the training loop's own updates,
each of which ran alone on the devices (their interval leaves the window timing out), averaged over the most recent
whole periods of the window schedule (with skip_n > num_steps only some updates open a window). The share is None
until both are known, and never clipped: a value above 1 would be a measurement error shown as such.
"""
from __future__ import annotations

import math
import time
from collections import deque
from typing import Any, Callable

REMEASURE_EVERY = 64  # updates between two timings of the window after the early ones (1, 2, 4, ..., 32)
RECENT_UPDATES = 32  # at most this many recent updates (rounded down to whole window periods) make the mean


def windows_per_update(num_steps: int, skip_n: int) -> float:
    """LLM windows opened per update on average: num_steps / skip_n (0 for skip_n 0: one encode at the start)."""
    return num_steps / skip_n if skip_n > 0 else 0.0


def window_period(num_steps: int, skip_n: int) -> int:
    """Updates after which the window schedule repeats (skip_n / gcd(skip_n, num_steps); 1 for skip_n 0)."""
    return skip_n // math.gcd(skip_n, num_steps) if skip_n > 0 else 1


class LLMShare:
    """Share of the update time spent in the in-scan LLM (see the module docstring).

    `window`: runs one LLM window opening on the run's current state and returns its (device) outputs; called with
    nothing in flight. The loop calls `due(k)` after its k-th update of this invocation (then, when True, `time_window`
    before dispatching the next one), `add_update(seconds)` for every update after the compiling one, and reads `value`.
    `clock` and `block` are parameters for tests (defaults: time.perf_counter, jax.block_until_ready).
    """

    def __init__(self, window: Callable[[], Any], num_steps: int, skip_n: int, *, repeats: int = 3,
                 clock: Callable[[], float] = time.perf_counter, block: Callable[[Any], Any] | None = None) -> None:
        if block is None:
            import jax

            block = jax.block_until_ready
        self.window, self.repeats, self.clock, self.block = window, repeats, clock, block
        self.windows = windows_per_update(num_steps, skip_n)
        self.period = window_period(num_steps, skip_n)
        cap = max(self.period, RECENT_UPDATES // self.period * self.period)
        self.updates: deque[float] = deque(maxlen=cap)
        self.window_seconds: float | None = None
        self.timings = 0  # how many times the window was timed

    def due(self, done: int) -> bool:
        """Whether to time the window after the `done`-th update of this invocation: after updates 1, 2, 4, ..., 32,
        then every REMEASURE_EVERY (never when no window opens during training)."""
        if self.windows == 0 or done < 1:
            return False
        return (done & (done - 1)) == 0 if done < REMEASURE_EVERY else done % REMEASURE_EVERY == 0

    def time_window(self) -> float:
        """Time the window alone (the fastest of `repeats` calls, after one untimed call the first time); returns the
        seconds it kept the devices busy, timing included."""
        start = self.clock()
        if self.timings == 0:
            self.block(self.window())  # compiled with the runner's first window; this also warms caches
        best = math.inf
        for _ in range(self.repeats):
            t0 = self.clock()
            self.block(self.window())
            best = min(best, self.clock() - t0)
        self.window_seconds = best
        self.timings += 1
        return self.clock() - start

    def add_update(self, seconds: float) -> None:
        """The seconds of one update that ran alone (not the compiling one, not one overlapping `time_window`)."""
        self.updates.append(seconds)

    @property
    def update_seconds(self) -> float | None:
        """Mean seconds of the recent updates, over whole periods of the window schedule when there are enough."""
        n = len(self.updates)
        if n == 0:
            return None
        if n >= self.period:
            n = n // self.period * self.period
        recent = list(self.updates)[-n:]
        return sum(recent) / n

    @property
    def value(self) -> float | None:
        """windows per update x window seconds / update seconds; 0.0 when no window opens; None until measured."""
        if self.windows == 0:
            return 0.0
        per_update = self.update_seconds
        if self.window_seconds is None or per_update is None or per_update <= 0:
            return None
        return self.windows * self.window_seconds / per_update
