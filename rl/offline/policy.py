"""`load_policy(run_dir)`: an offline AWR run's newest checkpoint as a policy (CONTRACTS.md)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jax.numpy as jnp
import optax

from rl.offline.config import config_of, read_run_config
from rl.offline.networks import AWRNetwork, normalise
from rl.offline.update import init_state
from rl.rundir import Checkpoints, CheckpointError


@dataclass(frozen=True)
class OfflinePolicy:
    """A trained offline policy. `apply(params, obs f32 [B, O], hidden f32 [B, D] | None) -> (distrax.Categorical,
    value f32 [B])` takes RAW hidden states (as the in-scan encoder returns them) and z-scores them with the
    checkpoint's own statistics inside."""

    env: str
    params: Any
    apply: Callable
    uses_hidden: bool
    labelling: dict | None
    hidden_skip_n: int
    stats: dict | None = None  # the checkpoint's {"mean", "std"} of the hidden states (None without hidden)
    step: int = 0  # the checkpoint's update
    hidden_mode: str = "real"  # what the run trained on: real, zero, shuffle or none


def load_policy(run_dir: str | Path) -> OfflinePolicy:
    """The newest checkpoint of an offline run directory that restores (ValueError, one line, if `run_dir` is
    not an offline run or has no checkpoint)."""
    run_dir = Path(run_dir)
    run = read_run_config(run_dir)
    cfg = config_of(run)
    net = AWRNetwork(run["num_actions"], cfg.width)
    hidden_size = run["hidden_size"] if cfg.uses_hidden else None
    target = init_state(net, optax.adam(cfg.lr), run["obs_size"], hidden_size, cfg.seed)
    if cfg.uses_hidden:
        target["stats"] = {"mean": jnp.zeros(hidden_size, jnp.float32), "std": jnp.ones(hidden_size, jnp.float32)}
    ckpt = Checkpoints(run_dir)
    try:
        step, state = ckpt.restore_newest(target)
    except CheckpointError as e:
        raise ValueError(str(e)) from None
    finally:
        ckpt.close()
    stats = state.get("stats")

    def apply(params, obs, hidden=None):
        if stats is None:
            return net.apply(params, obs, None)
        return net.apply(params, obs, normalise(hidden, stats))

    return OfflinePolicy(run["env"], state["params"], apply, cfg.uses_hidden, run.get("labelling"),
                         cfg.hidden_skip_n, stats, int(step), cfg.hidden)
