"""The in-scan LLM's share of a training update's time, measured so that it can be believed.

The LLM runs inside the one jitted update, so its time cannot be read off on its own. Timing the LLM call as a
separate function misses part of what it costs inside the update's scan (on the 2-core CPU the call alone took
0.47-0.49 s where the same window added 0.62-0.82 s to an update), and comparing any timing with the run's own
update times mixes moments: on a shared machine the speed changes by 2-5x within a minute. So the share is measured
with two updates timed back to back, both the run's own compiled update on a copy of the current state (results
thrown away), each waited for with `jax.block_until_ready` while nothing else runs (the fastest of 2 of each):

    without  the window clock set beyond the rollout: no LLM window opens         -> E seconds
    with     the clock set to 1: k windows open (the first step, then every skip_n) -> E + k L seconds

    share = w L / (E + w L),   w = num_steps / skip_n windows per update on average

This is timed after the first update of an invocation and then every `REMEASURE_EVERY` updates (`due`); it costs
about two updates each time. The share is None until measured and never clipped: a value outside [0, 1] is a
measurement problem shown as such.
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable

REMEASURE_EVERY = 32  # updates between two measurements, after the first one


def windows_opened(clock: int, num_steps: int, skip_n: int) -> int:
    """LLM windows that open during a rollout of `num_steps` steps starting with `clock` steps left in the current
    window (one when the clock reaches 0, then every skip_n steps)."""
    if skip_n <= 0 or clock > num_steps:
        return 0
    return 1 + (num_steps - clock) // skip_n


class LLMShare:
    """Share of the update time spent in the in-scan LLM (see the module docstring).

    `update_from_clock(c)`: runs one update on the run's current state with its window clock set to `c` and returns
    its (device) outputs, which are thrown away; called with nothing in flight. The loop calls `due(k)` after its
    k-th update of this invocation and, when True, `measure()` before it starts the next update; `value` is the
    share. `clock` and `block` are for tests (defaults: time.perf_counter, jax.block_until_ready).
    """

    def __init__(self, update_from_clock: Callable[[int], Any], num_steps: int, skip_n: int, *, repeats: int = 2,
                 clock: Callable[[], float] = time.perf_counter, block: Callable[[Any], Any] | None = None) -> None:
        if block is None:
            import jax

            block = jax.block_until_ready
        self.update_from_clock, self.clock, self.block = update_from_clock, clock, block
        self.num_steps, self.skip_n, self.repeats = num_steps, skip_n, repeats
        self.windows = num_steps / skip_n if skip_n > 0 else 0.0  # per update, on average
        self.seconds_without: float | None = None  # E
        self.seconds_per_window: float | None = None  # L
        self.measured = 0

    def due(self, done: int) -> bool:
        """Whether to measure after the `done`-th update of this invocation: after the first, then every
        REMEASURE_EVERY (never when no window opens during training: skip_n 0 encodes once, at the start)."""
        return self.windows > 0 and (done == 1 or (done > 0 and done % REMEASURE_EVERY == 0))

    def _timed(self, start_clock: int) -> float:
        t0 = self.clock()
        self.block(self.update_from_clock(start_clock))
        return self.clock() - t0

    def measure(self) -> float:
        """Time an update without and one with LLM windows, back to back, `repeats` times (the fastest of each: a
        moment of another program's work on the machine is left out); returns the seconds spent."""
        start = self.clock()
        if self.measured == 0:
            self._timed(self.num_steps + 1)  # the run's compiled update: this only warms caches
        without = with_windows = math.inf
        for _ in range(self.repeats):
            without = min(without, self._timed(self.num_steps + 1))
            with_windows = min(with_windows, self._timed(1))
        k = windows_opened(1, self.num_steps, self.skip_n)
        self.seconds_without, self.seconds_per_window = without, (with_windows - without) / k
        self.measured += 1
        return self.clock() - start

    @property
    def value(self) -> float | None:
        """w L / (E + w L); 0.0 when no window opens during training; None until measured."""
        if self.windows == 0:
            return 0.0
        if self.seconds_without is None or self.seconds_per_window is None:
            return None
        llm = self.windows * self.seconds_per_window
        return llm / (self.seconds_without + llm)

    def value_for(self, update_seconds: float) -> float | None:
        """`value`: every share meter (`FixedShare`, `ServerShare`, this) is read as value_for(update seconds);
        the in-scan share does not depend on the latest update's seconds."""
        return self.value


# The share meters of the other encoder kinds (rl.encoder_kinds picks one per kind): the same four calls.


class FixedShare:
    """The share of a run without an LLM: 0, nothing to measure."""

    def due(self, done: int) -> bool:
        return False

    def measure(self) -> float:
        return 0.0

    def value_for(self, update_seconds: float) -> float | None:
        return 0.0


class ServerShare:
    """The share of an HTTP run: the seconds the latest update waited for the server (`seconds()`, read after the
    update) over the update's own seconds; nothing to measure apart."""

    def __init__(self, seconds: Callable[[], float]) -> None:
        self.seconds = seconds

    def due(self, done: int) -> bool:
        return False

    def measure(self) -> float:
        return 0.0

    def value_for(self, update_seconds: float) -> float | None:
        return self.seconds() / max(update_seconds, 1e-9)
