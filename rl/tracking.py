"""Experiment tracking of a training run: Weights & Biases (`--track`) and TensorBoard event files (`--tensorboard`).

Both receive the run's config once and every metrics.jsonl record as it is written (achievement rates as
`achievements/<name>`, x axis = env steps). They are optional extras: `pip install -e ".[track]"`.
"""
from __future__ import annotations

import math
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WANDB_ID_FILE = "wandb_run_id.txt"  # in the run directory: a --resume continues the same wandb run
TENSORBOARD_DIR = "tensorboard"  # under the run directory


class TrackingUnavailable(RuntimeError):
    """A tracking flag was given but its package is not installed."""


@dataclass(frozen=True)
class TrackingOptions:
    """What to track and where (rl.train's --track, --tensorboard, --wandb-* and --run-name)."""

    wandb: bool = False
    tensorboard: bool = False
    project: str = "craftax-llm"
    entity: str | None = None
    group: str | None = None
    run_name: str | None = None

    @property
    def any(self) -> bool:
        return self.wandb or self.tensorboard

    def check_installed(self) -> None:
        """Raise TrackingUnavailable naming the extra to install (before any work is done)."""
        import importlib.util

        needed = [(self.wandb, "wandb", "--track"), (self.tensorboard, "tensorboardX", "--tensorboard")]
        missing = [(mod, flag) for on, mod, flag in needed if on and importlib.util.find_spec(mod) is None]
        if missing:
            raise TrackingUnavailable(
                f"{' and '.join(flag for _, flag in missing)} need{'s' if len(missing) == 1 else ''} "
                f"{', '.join(mod for mod, _ in missing)}: pip install -e \".[track]\"")


def flat_metrics(rec: dict[str, Any]) -> dict[str, float]:
    """A metrics.jsonl record as scalar series: achievements become `achievements/<name>`; None, NaN, inf and
    non-numbers are left out (an update where no episode ended has no return)."""
    out: dict[str, float] = {}
    for k, v in rec.items():
        if isinstance(v, dict):
            out.update({f"{k}/{n}": float(x) for n, x in v.items() if _finite(x)})
        elif _finite(v):
            out[k] = float(v)
    return out


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


class Trackers:
    """The open trackers of one run: `record(rec)` for every metrics record, `finish(curves_png)` at the end."""

    def __init__(self, opts: TrackingOptions, run_dir: Path, config: dict[str, Any]) -> None:
        """Checks that the packages are installed; the trackers open with the first record (a run that fails
        to start leaves no tracking run behind)."""
        opts.check_installed()
        self.opts, self.run_dir, self.config = opts, Path(run_dir), config
        self._wandb_run = self._tb = None
        self._opened = False

    def _open(self) -> None:
        self._opened = True
        if self.opts.wandb:
            self._wandb_run = self._open_wandb(self.config)
        if self.opts.tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(logdir=str(self.run_dir / TENSORBOARD_DIR), flush_secs=10)
            self._tb.add_text("config", "\n".join(f"    {k}: {v}" for k, v in sorted(self.config.items())), 0)

    def _open_wandb(self, config: dict[str, Any]):
        import wandb

        id_file = self.run_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
        settings = {} if os.environ.get("WANDB_DIR") else {"dir": str(self.run_dir)}
        run = wandb.init(project=self.opts.project, entity=self.opts.entity, group=self.opts.group,
                         name=self.opts.run_name or self.run_dir.name, config=config, id=run_id, resume="allow",
                         **settings)
        id_file.write_text(run.id + "\n")
        run.define_metric("timestep")
        run.define_metric("*", step_metric="timestep")
        return run

    def record(self, rec: dict[str, Any]) -> None:
        """Log one metrics.jsonl record (x = its env steps)."""
        if not self._opened:
            self._open()
        scalars = flat_metrics(rec)
        if self._wandb_run is not None:
            self._wandb_run.log(scalars)
        if self._tb is not None:
            step = int(rec["timestep"])
            for k, v in scalars.items():
                if k != "timestep":
                    self._tb.add_scalar(k, v, step)

    def finish(self, curves_png: Path | None = None) -> None:
        """Attach the learning-curve picture (when given) and close every tracker."""
        if self._wandb_run is not None:
            if curves_png is not None and Path(curves_png).exists():
                import wandb

                self._wandb_run.log({"curves": wandb.Image(str(curves_png))})
            self._wandb_run.finish()
            self._wandb_run = None
        self.close()

    def close(self) -> None:
        """Close without the picture (an interrupted or failed run); safe to call twice."""
        if self._wandb_run is not None:
            self._wandb_run.finish(exit_code=1)
            self._wandb_run = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
