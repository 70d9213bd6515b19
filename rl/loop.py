"""The training loop (`run_loop`): dispatch updates, hand their metrics and checkpoints on, stop when told.

It knows three collaborators through small interfaces and nothing of the run's settings:

    updates      dispatch(state) -> (state, metrics) of one update, `pipelined`, the LLM time-share meter
                 (`rl.trainer.Updates`, from `Trainer.updates`)
    RunOutputs   record(update, metrics, ...) and checkpoint(update, state): one object in front of the metrics
                 log and checkpoints (`rl.rundir`), the status line (`rl.progress`) and the trackers (`rl.tracking`)
    StopRule     after an update: go on? (the last update of this invocation, --time-limit, Ctrl-C; agreed by all
                 processes)

Update u + 1 is dispatched before update u's metrics are read (except where the encoder runs the update on the host,
or while the LLM share is timed), so the device never idles while the host logs, checks and checkpoints; a NaN at
update u still stops with state u - 1 saved. A record's `seconds` is the time between the moments its update's and
the previous update's results became ready (`ReadyTime`: a thread waits for each), not between the host's reads: on a
GPU, dispatching update u + 1 can keep the host busy for most of an update (it launches the kernels), so a read after
it came an update late, and the last update of an invocation, which had nothing dispatched after it, showed 0.02 s.
"""
from __future__ import annotations

import math
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import numpy as np

from rl.interrupt import StopOnInterrupt
from rl.progress import Progress
from rl.rundir import Checkpoints, MetricsLog
from rl.sharding import agree_with_main_process
from rl.tracking import Trackers


class TrainingDiverged(RuntimeError):
    """The loss became NaN/inf; the last good state is in the run directory's checkpoints."""


class StopRule:
    """When the loop stops: after update `last`, once `time_limit` seconds passed since `start()`, or when
    `should_stop()` says so (asked after every update; an `rl.interrupt.StopOnInterrupt` is also told which updates
    are running). With a clock or `should_stop`, process 0 decides for all processes."""

    def __init__(self, last: int, time_limit: float | None = None,
                 should_stop: Callable[[], bool] | None = None) -> None:
        self.last, self.time_limit, self.should_stop = last, time_limit, should_stop
        self.tell = should_stop.running if isinstance(should_stop, StopOnInterrupt) else lambda *_: None
        self.t_start = time.perf_counter()

    def start(self) -> None:
        """The time limit counts from now."""
        self.t_start = time.perf_counter()

    def go_on(self, update: int) -> bool:
        """Whether an update follows `update` (now in flight, 1-based) in this invocation."""
        self.tell(update, update)  # so that a Ctrl-C can say which updates still run: a stop asked for now ends here
        stop = self.should_stop() if self.should_stop is not None else False
        if self.time_limit is not None:
            stop = stop or time.perf_counter() - self.t_start >= self.time_limit
        if self.time_limit is not None or self.should_stop is not None:  # clocks and Ctrl-C differ between processes
            stop = agree_with_main_process(stop)
        more = update < self.last and not stop
        self.tell(update, update + 1 if more else update)  # from here on, the next update is started
        return more


class RunOutputs:
    """The run directory's metrics log and checkpoints, the status line and the trackers behind `record`,
    `checkpoint`, `stopped` and `finished`.

    `batch_size`: env steps per update (a record's `timestep` and `sps`); `achievement_names`: the names of the
    metrics' achievement rates; `checkpoint_every`: the checkpoint cadence (`checkpoint_due`). `saved_at`: the
    update count of the newest checkpoint (None: none yet)."""

    def __init__(self, run_dir: Path, ckpt: Checkpoints, log: MetricsLog, progress: Progress,
                 trackers: Trackers | None = None, *, batch_size: int, achievement_names: Sequence[str],
                 checkpoint_every: int) -> None:
        self.run_dir, self.ckpt, self.log, self.progress, self.trackers = run_dir, ckpt, log, progress, trackers
        self.batch_size, self.names, self.every = batch_size, tuple(achievement_names), checkpoint_every
        self.saved_at: int | None = None  # set by `start_from`
        self.recorded = 0  # records written by this invocation

    def start_from(self, state: Any, start: int) -> tuple[Any, int]:
        """(state, updates done) that the loop starts from: `state` itself when `start` is 0, else the newest
        checkpoint that restores into its structure (one that does not is reported and set aside). The metrics log
        keeps the records up to there; the status line says that the first update compiles."""
        if start:
            start, state = self.ckpt.restore_newest(state)
            if self.progress.enabled:
                print(f"resuming {self.run_dir} at update {start}/{self.progress.num_updates}", flush=True)
        self.log.truncate_after(start)
        self.saved_at = start if start else None
        self.progress.compiling(jax.default_backend())
        return state, start

    def record(self, update: int, metrics: dict, seconds: float, llm_share: float | None) -> dict:
        """Write update `update`'s record: its metrics (host arrays; achievement rates by name), the env steps so
        far, its `seconds` (since the previous update's metrics arrived), SPS and the LLM's time share. The first
        record of an invocation is marked `first_call_includes_compile`: its seconds include the first call's start
        (compiling, unless `rl.train` compiled the update ahead, and loading the executable; 0.86 s against 0.33 s
        steady in an H100 run), so curves leave it out. Returns the record."""
        rec = {"update": update, "timestep": update * self.batch_size, "sps": self.batch_size / seconds,
               "seconds": seconds, "llm_time_share": llm_share}
        for k, v in metrics.items():
            if k == "achievements":
                rec["achievements"] = {n: float(x) for n, x in zip(self.names, np.asarray(v))}
            else:
                rec[k] = float(v)
        if self.recorded == 0:
            rec["first_call_includes_compile"] = True
        self.log.append(rec)
        self.progress.record(rec)
        if self.trackers is not None:
            self.trackers.record(rec)
        self.recorded += 1
        return rec

    def checkpoint_due(self, update: int) -> bool:
        """Whether the cadence (`--checkpoint-every`) checkpoints update `update`."""
        return update % self.every == 0

    def save(self, update: int, state: Any) -> None:
        """Save `state` as the checkpoint of update `update` (silently)."""
        self.ckpt.save(update, state)
        self.saved_at = update

    def checkpoint(self, update: int, state: Any) -> None:
        """Save `state` as the checkpoint of update `update`, and say so (with --quiet, the one line per save)."""
        self.save(update, state)
        self.progress.checkpoint(update)

    def stopped(self, update: int) -> None:
        """The run stopped before its end (after update `update`, checkpointed): say how to continue."""
        self.progress.stopped(update)

    def finished(self) -> None:
        """The run reached its last update: the closing lines, and the trackers get the learning curves."""
        self.progress.finished()
        if self.trackers is not None:
            self.trackers.finish(_curves_png(self.run_dir) if self.trackers.opts.wandb else None)


def _curves_png(run_dir: Path) -> Path | None:
    """The run's learning curves drawn into run_dir/curves.png (for the trackers); None when drawing fails."""
    from rl.curves import plot_runs

    try:
        return plot_runs([run_dir], run_dir / "curves.png")
    except (OSError, ValueError) as e:
        print(f"warning: could not draw {run_dir}/curves.png ({e})", file=sys.stderr)
        return None


class ReadyTime:
    """When one update's results became ready: a thread waits for them (`jax.block_until_ready` lets go of the
    interpreter while it waits) and notes the time, whatever the main thread is doing then."""

    def __init__(self, results: Any, clock: Callable[[], float] = time.perf_counter) -> None:
        self.at: float | None = None
        self._clock = clock
        self._thread = threading.Thread(target=self._wait, args=(results,), name="update-ready", daemon=True)
        self._thread.start()

    def _wait(self, results: Any) -> None:
        try:
            jax.block_until_ready(results)
        finally:
            self.at = self._clock()

    def time(self) -> float:
        """The moment the results were ready (waits for them)."""
        self._thread.join()
        assert self.at is not None
        return self.at


def _start(updates: Any, state: Any) -> tuple[Any, Any, ReadyTime]:
    """Dispatch one update: (state, metrics, when they are ready)."""
    new_state, metrics = updates.dispatch(state)
    return new_state, metrics, ReadyTime(metrics)


def run_loop(updates: Any, state: Any, start: int, total: int, outputs: RunOutputs, stop: StopRule) -> None:
    """Updates `start + 1`... of a run of `total` from `state` (the state after update `start`) until `stop` says so:
    each update's metrics go to `outputs.record`, checkpoints (the cadence, the last update, a stop) to
    `outputs.checkpoint`. Raises TrainingDiverged on a NaN/inf loss, with the state before it saved."""
    before = state  # the state the update in flight started from
    share = updates.share_meter(lambda: before)
    done_here = 0
    stop.start()
    t_ready = time.perf_counter()  # when the previous update's results were ready (for the first: before its compile)
    in_flight = _start(updates, state)
    for update in range(start + 1, stop.last + 1):  # `update`: the update now in flight (1-based count)
        new_state, metrics, ready = in_flight
        more = stop.go_on(update)
        timing = more and share.due(done_here + 1)  # with nothing in flight: not ahead
        ahead = more and updates.pipelined and not timing
        if ahead:
            in_flight = _start(updates, new_state)
        metrics = jax.device_get(metrics)  # waits for `update` only
        seconds = max(ready.time() - t_ready, 1e-9)  # this update's own time, whenever the host got to read it
        t_ready = ready.time()
        loss = float(metrics["total_loss"])
        if not math.isfinite(loss):
            if outputs.saved_at != update - 1:
                outputs.save(update - 1, before)
            raise TrainingDiverged(
                f"loss is {loss} at update {update}; stopped. The last good state (update {update - 1}) is "
                f"checkpointed in {outputs.run_dir}/checkpoints; lower --lr or check the inputs")
        outputs.record(update, metrics, seconds, share.value_for(seconds))
        done_here += 1
        finished = update == total
        if finished or not more or outputs.checkpoint_due(update):
            outputs.checkpoint(update, new_state)
        if not more and not finished:
            outputs.stopped(update)
            return
        before = new_state
        if timing:
            share.measure()  # from `before`, the state the next update starts from
            t_ready = time.perf_counter()  # the next update's seconds leave the timing out
        if more and not ahead:
            in_flight = _start(updates, new_state)
    outputs.finished()
