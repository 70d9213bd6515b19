"""`OfflineConfig`: the settings of one offline AWR run (frozen), its validation and JSON round trip."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl.settings import check_at_least_one, check_known, option

HIDDEN_MODES = ("real", "zero", "shuffle", "none")
RESIDENT = ("auto", "on", "off")
KIND = "offline-awr"  # config.json's "kind" (online rl.train run directories have none)

DATA, AWR, LOOP, RUN = "data", "AWR", "training loop", "run directory"
GROUPS = (DATA, AWR, LOOP, RUN)


def _opt(default: Any, group: str, help: str, metavar: str | None = None) -> Any:
    return option(default, group, help, metavar=metavar)


@dataclass(frozen=True)
class OfflineConfig:
    """Everything that defines an offline AWR run. Defaults = the reference pipeline (REFERENCE §8)."""

    # data
    data: str | None = _opt(None, DATA, "directory of trajectory files (.npz; labelled by rl.label for --hidden "
                                        "real/zero/shuffle)", metavar="DIR")
    hidden: str = _opt("real", DATA, "LLM hidden state input: real, zero (z-scored zeros), shuffle (another "
                                     "sample's, within the batch) or none (observation-only network)")
    hidden_layer: int | None = field(default=None, metadata={
        "group": DATA, "type": int, "metavar": "K",
        "help": "hidden-state index to train on, of files labelled with several (rl.label --llm-layer 8,16,24,-1); "
                "default: the first labelled layer (`hidden_state`)"})
    hidden_skip_n: int = _opt(1, DATA, "each env stream holds a hidden state for this many steps (refreshed at "
                                       "every episode start and after every gap)")
    val_fraction: float = _opt(0.05, DATA, "fraction of the files held out for the validation loss (evenly spread)")
    file_envs: int = _opt(128, DATA, "envs per file, time-major, of files without `recording` metadata (the "
                                     "reference pipeline's: 64 steps x 128 envs)")
    resident: str = _opt("auto", DATA, "keep the whole dataset on the device: on, off (stream shards with a "
                                       "prefetching reader) or auto (on when it fits)")
    shard_samples: int = _opt(1_000_000, DATA, "samples per streamed shard when the dataset is not resident")
    # AWR
    steps: int = _opt(100_000, AWR, "gradient updates")
    batch_size: int = _opt(256, AWR, "samples per update (uniform over the training files)")
    beta: float = _opt(10.0, AWR, "advantage temperature: weight = exp(advantage / beta)")
    weight_clip: float = _opt(20.0, AWR, "upper clamp of the advantage weights")
    gamma: float = _opt(0.99, AWR, "discount of the Monte-Carlo return-to-go")
    lr: float = _opt(3e-4, AWR, "Adam learning rate (no gradient clipping)")
    value_coef: float = _opt(0.5, AWR, "value-loss coefficient")
    width: int = _opt(512, AWR, "hidden width of the actor and critic towers")
    seed: int = _opt(0, AWR, "seed of the network init and the sampling")
    # training loop
    updates_per_dispatch: int = _opt(500, LOOP, "updates run inside one jitted lax.scan call")
    log_every: int = _opt(1000, LOOP, "updates between metrics records (with the validation loss)")
    val_samples: int = _opt(65_536, LOOP, "held-out samples the validation loss is computed on (at most)")
    # run directory
    out: str | None = _opt(None, RUN, "run directory: config.json, metrics.jsonl, checkpoints/", metavar="DIR")
    checkpoint_every: int = _opt(10_000, RUN, "updates between checkpoints (and one at the end)")
    keep_checkpoints: int = _opt(2, RUN, "checkpoints kept on disk")

    @property
    def uses_hidden(self) -> bool:
        return self.hidden != "none"

    def validate(self) -> "OfflineConfig":
        """Raise ValueError (one line naming the flag and the fix); return self when fine."""
        if self.hidden not in HIDDEN_MODES:
            raise ValueError(f"--hidden {self.hidden!r} is not one of: {', '.join(HIDDEN_MODES)}")
        if self.resident not in RESIDENT:
            raise ValueError(f"--resident {self.resident!r} is not one of: {', '.join(RESIDENT)}")
        check_at_least_one(self, ("hidden_skip_n", "file_envs", "shard_samples", "steps", "batch_size", "width",
                                  "updates_per_dispatch", "log_every", "val_samples", "checkpoint_every",
                                  "keep_checkpoints"))
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.beta <= 0 or self.weight_clip <= 0:
            raise ValueError(f"--beta and --weight-clip must be > 0, got {self.beta} and {self.weight_clip}")
        if self.data is None:
            raise ValueError("--data DIR is required (a directory of trajectory files)")
        if self.out is None:
            raise ValueError("--out RUN_DIR is required (where the run is written)")
        return self

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any], source: str = "config") -> "OfflineConfig":
        check_known(d, {f.name for f in dataclasses.fields(cls)},
                    f"{source}: unknown settings {{unknown}} (python -m rl.offline train --help lists them)")
        return cls(**d)


# Settings a --resume may change (they do not change what an update computes).
RESUME_MUTABLE = ("steps", "out", "log_every", "checkpoint_every", "keep_checkpoints", "resident", "shard_samples",
                  "updates_per_dispatch")


def read_run_config(run_dir: Path) -> dict[str, Any]:
    """config.json of an offline run directory (ValueError, one line, if it is not one)."""
    path = Path(run_dir) / "config.json"
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} not found: is {run_dir} a run directory written by python -m rl.offline "
                         f"train?") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); the run directory is damaged") from None
    if d.get("kind") != KIND:
        raise ValueError(f"{run_dir} is not an offline AWR run (config.json has no \"kind\": \"{KIND}\"); "
                         f"online runs are evaluated with python -m rl.eval")
    return d


def config_of(run: dict[str, Any]) -> OfflineConfig:
    """The OfflineConfig stored in a run's config.json (its `settings` entry)."""
    return OfflineConfig.from_json(run["settings"], source="config.json")
