"""Run directories: config.json, metrics.jsonl and orbax checkpoints.

Layout of a run directory:
    config.json          the resolved TrainConfig
    metrics.jsonl        one JSON object per update, appended and flushed as the run goes
    checkpoints/<step>/  orbax checkpoints (step = updates done), written atomically by orbax
    unreadable_checkpoints/<step>/  checkpoints a resume could not restore, set aside (kept for inspection)

Failures end in one line: a run directory that cannot be written is refused before any work; a checkpoint
that cannot be written stops the run (the previous one stays); a checkpoint that cannot be read is skipped
for the newest older one that can.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp

from rl.config import TrainConfig, load_config, save_config
from rl.files import atomic_write
from rl.sharding import agree_with_main_process, is_main_process


class RunDirError(ValueError):
    """A run directory that cannot be used as asked (another config, missing files, not writable...)."""


class CheckpointError(RunDirError):
    """A checkpoint that cannot be written, or no checkpoint that can be read."""


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _one_line(exc: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message``, cut to ``limit`` characters (orbax and TensorStore errors run long)."""
    text = " ".join(str(exc).split()) or "(no message)"
    text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_writable(run_dir: Path) -> None:
    """Raise RunDirError naming the first of run_dir, run_dir/checkpoints and run_dir/metrics.jsonl that exists
    and cannot be written (tried by writing, so it also holds for root, read-only mounts and full disks)."""
    for directory in (run_dir, run_dir / "checkpoints"):
        if not directory.exists() and directory != run_dir:
            continue
        probe = directory / f".write-test-{os.getpid()}"
        try:
            with open(probe, "w") as f:
                f.write("ok")
            probe.unlink()
        except OSError as exc:
            raise RunDirError(f"cannot write to {directory}: {exc.strerror or exc}; pick another --run-dir or "
                              "fix its permissions / free space") from None
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        try:
            open(metrics, "a").close()
        except OSError as exc:
            raise RunDirError(f"cannot append to {metrics}: {exc.strerror or exc}") from None


def open_run_dir(cfg: TrainConfig, run_dir: Path, *, resume: bool) -> Path:
    """Create `run_dir` for `cfg`, or check that an existing one holds the same config.

    A directory holding another config is refused (rather than mixing two runs in one place).
    """
    run_dir = Path(run_dir)
    cfg_path = run_dir / "config.json"
    if cfg_path.exists():
        old = load_config(cfg_path)
        diff = old.differences(cfg)
        if diff:
            lines = ", ".join(f"{k}: {a!r} there vs {b!r} now" for k, a, b in
                              ((k, *v) for k, v in sorted(diff.items())))
            raise RunDirError(f"{run_dir} holds another run's config ({lines}); use another --run-dir, or "
                              f"`--resume {run_dir}` to continue that run")
    elif resume:
        raise RunDirError(f"{run_dir} has no config.json: not a run directory to resume")
    elif run_dir.is_dir() and any(run_dir.iterdir()):
        raise RunDirError(f"{run_dir} is not empty and has no config.json; pick an empty or new --run-dir")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunDirError(f"cannot create the run directory {run_dir}: {exc.strerror or exc}; pick another "
                          "--run-dir") from None
    check_writable(run_dir)
    if not cfg_path.exists():
        atomic_write(cfg_path, lambda tmp: save_config(cfg, tmp))
    return run_dir


def open_run_files(cfg: TrainConfig, run_dir: Path, *, resume: bool) -> tuple["Checkpoints", "MetricsLog"]:
    """`open_run_dir` in process 0 only (every process raises if it refused: a collective), then the run's
    checkpoints (`cfg.keep_checkpoints` kept; every process writes) and metrics log (process 0 writes)."""
    error = None
    if is_main_process():
        try:
            open_run_dir(cfg, run_dir, resume=resume)
        except RunDirError as e:
            error = e
    if not agree_with_main_process(error is None):
        raise error or RunDirError(f"process 0 refused the run directory {run_dir} (its log says why)")
    return Checkpoints(run_dir, keep=cfg.keep_checkpoints), MetricsLog(run_dir / "metrics.jsonl",
                                                                        writable=is_main_process())


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.ndarray, np.generic, jax.Array)):
        x = np.asarray(x)
        return _jsonable(x.tolist()) if x.ndim else _jsonable(x.item())
    if isinstance(x, float) and not math.isfinite(x):
        return None  # JSON has no NaN; null = "no value this update" (e.g. no episode ended)
    return x


class MetricsLog:
    """Append-only metrics.jsonl: one JSON object per update, flushed at once so it can be tailed.

    `writable=False` (every process but the main one of a multi-process run) makes `append` and
    `truncate_after` do nothing, so that one process writes the file. Lines that do not parse (a line cut by
    a kill mid-write, damage) are skipped and reported through `report`, never the good lines after them.
    """

    def __init__(self, path: Path, writable: bool = True, report: Callable[[str], None] = _stderr):
        self.path = Path(path)
        self.writable = writable
        self.report = report

    def truncate_after(self, update: int) -> None:
        """Drop lines of updates > `update` (written after the checkpoint a resume restarts from)."""
        if not self.writable or not self.path.exists():
            return
        kept = [line for line in self.read() if line["update"] <= update]
        atomic_write(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def append(self, record: dict[str, Any]) -> None:
        if not self.writable:
            return
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(_jsonable(record)) + "\n")
                f.flush()
        except OSError as exc:  # a full disk mid-run: one line, the checkpoints are untouched
            raise RunDirError(f"cannot append to {self.path}: {exc.strerror or exc}; free space, then --resume "
                              f"{self.path.parent}") from None

    def read(self) -> list[dict[str, Any]]:
        """The records in file order; unreadable lines are skipped and reported (one line)."""
        if not self.path.exists():
            return []
        out, bad = [], []
        for number, line in enumerate(self.path.read_text(errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            if isinstance(record, dict) and isinstance(record.get("update"), int):
                out.append(record)
            else:
                bad.append(number)
        if bad:
            shown = ", ".join(map(str, bad[:10])) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
            self.report(f"warning: {self.path}: skipped {len(bad)} unreadable line(s) (line {shown}); a line cut "
                        "by a kill mid-write is recomputed by the resume, other damaged records are lost")
        return out


@contextlib.contextmanager
def _quiet_orbax_errors(after_failure_too: bool = False):
    """Silence orbax's own ERROR logs (a traceback per worker thread) while it works: a failure reaches the caller
    as one line instead. ``after_failure_too``: stay silent after a failure (a failed save's threads keep
    logging after it returned; the run stops on it anyway)."""
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.CRITICAL)
    try:
        yield
    except BaseException:
        if after_failure_too:
            # The failed writes' asyncio tasks are collected later, each logging "Task exception was never
            # retrieved" with a traceback through the asyncio logger; the failure is reported once already.
            logging.getLogger("asyncio").setLevel(logging.CRITICAL)
        else:
            absl.setLevel(level)
        raise
    absl.setLevel(level)


def _drop_closed_loop_reports() -> None:
    """When a save fails orbax closes its asyncio loop while TensorStore writes still complete; each of their
    callbacks then reports "RuntimeError: Event loop is closed" with a traceback (dozens of them), noise around a
    failure that CheckpointError reports. Installed before the first save, it filters only those reports."""
    if getattr(sys.excepthook, "drops_closed_loop", False):
        return

    def closed_loop(exc: BaseException | None) -> bool:
        return isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"

    previous_hook, previous_unraisable = sys.excepthook, sys.unraisablehook

    def excepthook(kind, value, tb):
        if not closed_loop(value):
            previous_hook(kind, value, tb)

    def unraisablehook(info):
        if not closed_loop(info.exc_value):
            previous_unraisable(info)

    excepthook.drops_closed_loop = True
    sys.excepthook, sys.unraisablehook = excepthook, unraisablehook


class Checkpoints:
    """Orbax CheckpointManager over DIR/checkpoints; steps are update counts.

    Saves are synchronous (no orbax background threads: a failed save raises CheckpointError here, leaves the
    previous checkpoints as they were, and nothing is left running that could keep the process alive).
    With several processes every process must create it and call `save` / `restore` with the same
    steps (orbax writes each process's shards into the one shared directory and synchronises itself).
    """

    def __init__(self, run_dir: Path, keep: int = 2):
        self.run_dir = Path(run_dir).resolve()
        # No cleanup_tmp_directories: rl.eval opening a run that is still training must not delete its save in
        # progress; a failed save removes its own partial directory.
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False)
        try:
            self.manager = ocp.CheckpointManager(self.run_dir / "checkpoints", options=options)
        except OSError as exc:
            raise CheckpointError(f"cannot open {self.run_dir / 'checkpoints'}: {_one_line(exc)}") from None

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: Any) -> None:
        """Write checkpoint ``step``; CheckpointError (one line, naming the directory) if that fails."""
        _drop_closed_loop_reports()
        try:
            with _quiet_orbax_errors(after_failure_too=True):
                self.manager.save(step, args=ocp.args.StandardSave(state), force=True)
                self.manager.wait_until_finished()
        except Exception as exc:  # orbax/TensorStore raise OSError, ValueError or bare Exception
            for partial in (self.run_dir / "checkpoints").glob(f"{step}.orbax-checkpoint-tmp*"):
                shutil.rmtree(partial, ignore_errors=True)  # give back what a full disk lent us
            previous = [s for s in self.all_steps() if s < step]
            kept = f"checkpoint {previous[-1]} is intact" if previous else "there is no earlier checkpoint"
            raise CheckpointError(f"cannot write checkpoint {step} in {self.run_dir / 'checkpoints'} ({_one_line(exc)}); "
                                  f"stopped, {kept}: free space or fix permissions, then --resume "
                                  f"{self.run_dir}") from None

    def restore(self, target: Any, step: int | None = None) -> Any:
        """Checkpoint ``step`` (default: the newest) into ``target``'s structure; ``target`` None restores it
        as saved. Raises what orbax raises for a damaged checkpoint."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise RunDirError(f"no checkpoint in {self.manager.directory}")
        if target is None:
            return self.manager.restore(step, args=ocp.args.StandardRestore())
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        return self.manager.restore(step, args=ocp.args.StandardRestore(abstract))

    def restore_newest(self, target: Any, report: Callable[[str], None] = _stderr) -> tuple[int, Any]:
        """The newest checkpoint that restores, as (step, state), trying newest first.

        Each one that fails is reported (step and why) and set aside in ``unreadable_checkpoints/`` by process 0,
        so the run can write that step again. Raises CheckpointError (one line) when none restores.
        """
        failures = []
        for step in reversed(self.all_steps()):
            try:
                with _quiet_orbax_errors():
                    state = self.restore(target, step)
            except Exception as exc:  # TensorStore raises a bare Exception for a truncated file
                failures.append((step, _one_line(exc, 200)))
                report(f"warning: checkpoint {step} in {self.run_dir / 'checkpoints'} does not restore "
                       f"({failures[-1][1]}); trying the previous one")
                continue
            self._set_aside([s for s, _ in failures], report)
            return step, state
        if not failures:
            raise CheckpointError(f"no checkpoint in {self.run_dir / 'checkpoints'}")
        raise CheckpointError(f"no checkpoint in {self.run_dir / 'checkpoints'} restores: " +
                              "; ".join(f"{s}: {why}" for s, why in failures))

    def _set_aside(self, steps: list[int], report: Callable[[str], None]) -> None:
        if not steps:
            return
        aside = self.run_dir / "unreadable_checkpoints"
        if jax.process_index() == 0:
            aside.mkdir(exist_ok=True)
            for step in steps:
                target = aside / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
                shutil.move(str(self.run_dir / "checkpoints" / str(step)), str(target))
                report(f"checkpoint {step} set aside in {target}")
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("rl.rundir.set_aside")
        self.manager.reload()

    def close(self) -> None:
        self.manager.close()
