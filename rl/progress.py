"""What a training run tells its user: what was loaded, a status line per update, and how it ended.

All output goes to one stream (stderr), only from process 0. The status line rewrites itself on a terminal
(clearing what a longer line left) and is one line per update otherwise; `quiet` keeps one line per checkpoint.
"""
from __future__ import annotations

import math
import statistics
import sys
import time
from collections import deque
from typing import Any, Callable, TextIO


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class UpdateRate:
    """Seconds per update for the status line's SPS and ETA: the compiling update is left out, and the estimate is
    the mean of the last `window` updates, leaving out those more than `factor` times off their median (a checkpoint
    written, another program busy for a moment), so that one slow update does not swing the ETA. A lasting change of
    speed is followed within about half the window."""

    def __init__(self, window: int = 10, factor: float = 3.0) -> None:
        self.factor = factor
        self.recent: deque[float] = deque(maxlen=window)
        self.count = 0  # steady (non-compiling) updates seen

    def add(self, seconds: float, compiling: bool = False) -> None:
        """Account one update's seconds; a `compiling` one (the first of a process) is left out."""
        if not compiling:
            self.recent.append(seconds)
            self.count += 1

    @property
    def seconds_per_update(self) -> float | None:
        """The smoothed seconds of one update; None before a steady update was seen."""
        if not self.recent:
            return None
        mid = statistics.median(self.recent)
        kept = [s for s in self.recent if mid / self.factor <= s <= mid * self.factor]
        return sum(kept) / len(kept)

    def eta(self, updates_left: int) -> float | None:
        """Seconds until `updates_left` more updates are done, at the smoothed rate (None before one is known)."""
        per = self.seconds_per_update
        return None if per is None else per * updates_left


class Progress:
    """The run's messages. `record` per update, `checkpoint` per save, `finished` / `stopped` at the end.

    `num_updates`: the run's length; `batch_size`: env steps per update; `shows_llm`: the status line shows the
    LLM's share of the time."""

    def __init__(self, run_dir: Any, num_updates: int, batch_size: int, *, shows_llm: bool = False,
                 quiet: bool = False, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.run_dir, self.num_updates, self.batch_size, self.shows_llm = run_dir, num_updates, batch_size, shows_llm
        self.quiet, self.enabled = quiet, enabled
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()
        self.first_seconds: float | None = None  # the first update (includes compilation)
        self.steady: list[float] = []  # seconds of every later update
        self.rate = UpdateRate()
        self.last: dict | None = None
        self._open_line = False
        self.update_compiled = False  # `compiled_ahead`: the first update runs without compiling

    def say(self, text: str) -> None:
        """A message on its own line (ends a pending status line first)."""
        if not self.enabled:
            return
        if self._open_line:
            print(file=self.stream)
            self._open_line = False
        print(text, file=self.stream, flush=True)

    def starting(self, what: str, devices: int, backend: str) -> None:
        """Before anything is loaded: what runs (the game and the run's size), where it runs and its directory."""
        self.step(f"{what} on {devices} {backend} device{'s' if devices > 1 else ''}; run directory {self.run_dir}")

    def step(self, text: str) -> None:
        """One line about what the run does next while it sets up (nothing with `quiet`)."""
        if not self.quiet:
            self.say(text)

    def compiling(self, backend: str) -> None:
        """Right before the first update: it compiles first, unless `compiled_ahead` said it is compiled."""
        if self.update_compiled:
            self.step("running the first update (compiled) ...")
            return
        self.step(f"compiling the first update ({compile_hint(backend)}) ...")

    def compiled_ahead(self, seconds: float) -> None:
        """The update was compiled before the first update (in the background, `seconds` of it)."""
        self.update_compiled = True
        self.step(f"the update is compiled ({seconds:.0f} s in the background)")

    def record(self, rec: dict) -> None:
        """Account one update's metrics record and show the status line."""
        if self.first_seconds is None:
            self.first_seconds = rec["seconds"]
        else:
            self.steady.append(rec["seconds"])
        self.rate.add(rec["seconds"], compiling=len(self.steady) == 0)
        self.last = rec
        if self.quiet or not self.enabled:
            return
        line = self.status_line(rec)
        if self.tty:
            print("\r\033[K" + line, end="", file=self.stream, flush=True)
            self._open_line = True
        else:
            print(line, file=self.stream, flush=True)

    def status_line(self, rec: dict) -> str:
        update = rec["update"]
        elapsed = time.perf_counter() - self.t0
        ret = rec.get("episode_return")
        parts = [f"[update {update}/{self.num_updates}] {rec['timestep']:,} steps"]
        per_update = self.rate.seconds_per_update
        if per_update is None:
            parts.append(f"{rec['sps']:,.0f} SPS ({'first update' if self.update_compiled else 'includes compilation'})")
        else:  # smoothed: say over what
            parts.append(f"{self.batch_size / per_update:,.0f} SPS (last {len(self.rate.recent)} updates)")
        parts.append(f"elapsed {_duration(elapsed)}")
        if per_update is not None and update < self.num_updates:
            parts.append(f"ETA {_duration(self.rate.eta(self.num_updates - update))}")
        parts.append("return " + ("-" if ret is None or not math.isfinite(ret) else f"{ret:.2f}"))
        if self.shows_llm:
            share = rec.get("llm_time_share")
            shown = "-" if share is None or not math.isfinite(share) else f"{share:.0%}"
            parts.append(f"LLM {shown} of time")
        return " | ".join(parts)

    def mean_sps(self) -> float:
        """Env steps per second over the updates after the first (the first one also compiles)."""
        if not self.steady:
            return self.batch_size / self.first_seconds if self.first_seconds else float("nan")
        return self.batch_size * len(self.steady) / sum(self.steady)

    def checkpoint(self, update: int) -> None:
        """A checkpoint was saved: with `quiet`, this is the one line the run prints."""
        if self.quiet and self.enabled:
            self.say("checkpoint saved " + (self.status_line(self.last) if self.last else f"at update {update}"))

    def stopped(self, update: int) -> None:
        self.say(f"stopped at update {update}/{self.num_updates}; continue with "
                 f"python -m rl.train --resume {self.run_dir}")

    def finished(self) -> None:
        """The end of a finished run: final return, mean SPS, where it is and what to run next."""
        if not self.enabled:
            return
        rec = self.last or {}
        ret = rec.get("episode_return")
        d = self.run_dir
        here = len(self.steady) + (self.first_seconds is not None)  # updates run by this invocation
        sps = (f"(mean of this invocation's {len(self.steady):,} updates after its compiling first)" if self.steady
               else "(one update here, compilation included)")
        took = _duration(time.perf_counter() - self.t0)
        ran = (f"finished {self.num_updates:,} updates in {took}" if here == self.num_updates else
               f"finished {self.num_updates:,} updates ({here:,} of them in this invocation, {took})")
        self.say(f"{ran}: final "
                 f"return {'-' if ret is None or not math.isfinite(ret) else f'{ret:.2f}'}, {self.mean_sps():,.0f} SPS "
                 f"{sps}; run directory {d}")
        if not self.quiet:
            self.say(f"  curves:   python -m rl.plot {d}\n  evaluate: python -m rl.eval {d}")


class StatusLine:
    """A status line for long waits: rewritten in place on a terminal, else printed at most every `interval`
    seconds; `say` prints a message on its own line (ending a pending status line first)."""

    def __init__(self, stream: TextIO | None = None, interval: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.interval, self.clock = (0.2 if self.tty else interval), clock
        self._shown: float | None = None  # when the status was last shown
        self._open = False

    def update(self, text: str) -> None:
        """Show `text` as the current status (skipped when the last one is more recent than the interval)."""
        now = self.clock()
        if self._shown is not None and now - self._shown < self.interval:
            return
        self._shown = now
        if self.tty:
            print("\r\033[K" + text, end="", file=self.stream, flush=True)
            self._open = True
        else:
            print(text, file=self.stream, flush=True)

    def say(self, text: str) -> None:
        """`text` on its own line; the next `update` shows at once."""
        self.done()
        print(text, file=self.stream, flush=True)
        self._shown = None

    def done(self) -> None:
        """End a rewritten status line."""
        if self._open:
            print(file=self.stream, flush=True)
            self._open = False


def compile_hint(backend: str, what: str = "update") -> str:
    """How long compiling a program takes where it runs, for the setup lines: the first time, and from the
    persistent compilation cache (`--compile-cache`) after."""
    if what == "update":
        first = "about a minute on a GPU" if backend == "gpu" else "a minute or more on a CPU"
    else:
        first = "~30 s on a GPU" if backend == "gpu" else "~30 s on a CPU"
    return f"first time {first}; seconds from the compile cache after"
