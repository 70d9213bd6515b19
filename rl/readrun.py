"""Reading a run directory back (below every tool): what kind of run it is, its settings as a policy plays them,
and its newest good checkpoint (one restore policy: `Checkpoints.restore_newest`, falling back to the previous
good one). Nothing here builds a trainer, loads an LLM or compiles anything; `rl.runs.restore_policy` builds the
trainer on top of it (eval, video), `restore_params` serves the probe.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from rl.config import TrainConfig, load_config
from rl.offline.config import KIND as OFFLINE_KIND

ONLINE, OFFLINE = "online", "offline"


def run_kind(run_dir: str | Path) -> tuple[str, dict]:
    """("online" | "offline", config.json as a dict) of a run directory written by rl.train or rl.offline train.
    FileNotFoundError / ValueError (one line) for a directory that is not a run."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no config.json); pass a directory written by "
                                f"rl.train or rl.offline train")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); pass a run directory written by rl.train") from None
    return (OFFLINE if isinstance(raw, dict) and raw.get("kind") == OFFLINE_KIND else ONLINE), raw


def is_offline(run_dir: str | Path) -> bool:
    """Whether RUN_DIR holds an offline AWR run (rl.offline train); False for anything else, a non-run too."""
    try:
        return run_kind(run_dir)[0] == OFFLINE
    except (OSError, ValueError):
        return False


@dataclass(frozen=True)
class RunParams:
    """What `restore_params` returns: a run's settings and its newest checkpoint's policy params."""

    cfg: TrainConfig  # `play_settings` of the run
    params: Any  # the policy network's params (as restored: host arrays, no target structure)
    step: int  # that checkpoint's update count


def play_settings(run_dir: str | Path) -> TrainConfig:
    """RUN_DIR/config.json (any version rl.train wrote: `rl.config.load_config`) as a policy plays it: on one device
    whatever the run trained on, nothing recorded, and an HTTP-encoder run with the in-scan encoder of the same model
    (which computes the same hidden states) and the reset rule it trained with (`--reset-hidden` resolved: "zero"
    for an HTTP run, whose "auto" would read "pool" on the in-scan encoder)."""
    cfg = load_config(Path(run_dir) / "config.json").replace(devices=1, save_trajectories=None)
    return cfg.replace(encoder="inscan", reset_hidden=cfg.hidden_on_reset) if cfg.uses_llm else cfg


def trained_in_scan(run_dir: str | Path) -> bool:
    """Whether RUN_DIR's run trained with the in-scan encoder, so that its checkpoints carry an LLM window
    (`rl.encoder_kinds.LLMWindow`); an HTTP run's carry none although `play_settings` plays it in-scan."""
    return load_config(Path(run_dir) / "config.json").hidden.kind.in_scan


def read_checkpoint(run_dir: str | Path, target: Callable[[], Any] | None = None, *,
                    purpose: str = "use") -> tuple[int, Any]:
    """(update count, state) of RUN_DIR's newest checkpoint that restores (the one restore policy of every tool:
    `rl.rundir.Checkpoints.restore_newest`, which falls back to the previous good one and sets a damaged one
    aside), restored into the structure and shardings of the state `target()` returns (None: as saved, host
    arrays; `target` is called only once a checkpoint is found). FileNotFoundError (one line: "has no checkpoint
    to {purpose}") when there is none; ValueError (one line) when none restores."""
    from rl.rundir import CheckpointError, Checkpoints

    ckpt = Checkpoints(Path(run_dir))
    try:
        if ckpt.latest_step() is None:
            raise FileNotFoundError(f"{run_dir} has no checkpoint to {purpose}")
        try:
            step, state = ckpt.restore_newest(None if target is None else target())
        except CheckpointError as e:
            raise ValueError(str(e)) from None
        return int(step), state
    finally:
        ckpt.close()


def restore_params(run_dir: str | Path, *, purpose: str = "use") -> RunParams:
    """The light restore: a run's `play_settings` and its newest checkpoint's policy params, without building a
    trainer, loading an LLM or compiling anything (the probe checks them against the network it builds)."""
    cfg = play_settings(run_dir)
    step, state = read_checkpoint(run_dir, None, purpose=purpose)
    return RunParams(cfg, state["params"], step)
