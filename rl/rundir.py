"""Run directories: config.json, metrics.jsonl and orbax checkpoints.

Layout of a run directory:
    config.json          the resolved TrainConfig
    metrics.jsonl        one JSON object per update, appended and flushed as the run goes
    checkpoints/<step>/  orbax checkpoints (step = updates done), written atomically by orbax
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from rl.config import TrainConfig, load_config, save_config


class RunDirError(ValueError):
    """A run directory that cannot be used as asked (another config, missing files...)."""


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
    elif run_dir.exists() and any(run_dir.iterdir()):
        raise RunDirError(f"{run_dir} is not empty and has no config.json; pick an empty or new --run-dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    if not cfg_path.exists():
        tmp = cfg_path.with_suffix(".json.tmp")
        save_config(cfg, tmp)
        os.replace(tmp, cfg_path)
    return run_dir


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
    `truncate_after` do nothing, so that one process writes the file.
    """

    def __init__(self, path: Path, writable: bool = True):
        self.path = Path(path)
        self.writable = writable

    def truncate_after(self, update: int) -> None:
        """Drop lines of updates > `update` (written after the checkpoint a resume restarts from)."""
        if not self.writable or not self.path.exists():
            return
        kept = [line for line in self.read() if line["update"] <= update]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path)

    def append(self, record: dict[str, Any]) -> None:
        if not self.writable:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(_jsonable(record)) + "\n")
            f.flush()

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:  # a line cut by a kill mid-write
                    break
        return out


class Checkpoints:
    """Orbax CheckpointManager over DIR/checkpoints; steps are update counts.

    With several processes every process must create it and call `save` / `restore` with the same
    steps (orbax writes each process's shards into the one shared directory and synchronises itself).
    """

    def __init__(self, run_dir: Path, keep: int = 2):
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        self.manager = ocp.CheckpointManager(Path(run_dir).resolve() / "checkpoints", options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any) -> None:
        self.manager.save(step, args=ocp.args.StandardSave(state), force=True)
        self.manager.wait_until_finished()

    def restore(self, target: Any, step: int | None = None) -> Any:
        step = self.latest_step() if step is None else step
        if step is None:
            raise RunDirError(f"no checkpoint in {self.manager.directory}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        return self.manager.restore(step, args=ocp.args.StandardRestore(abstract))

    def close(self) -> None:
        self.manager.close()
