"""Offline RL on recorded (and LLM-labelled) trajectories: AWR trained on the device, evaluated in the game.

    python -m rl.offline train --data DIR --out RUN_DIR [--hidden real|zero|shuffle|none] [--hidden-skip-n N] ...
    python -m rl.offline eval RUN_DIR [--episodes N] [--modes real zero shuffled]

Modules: `targets` (returns-to-go, hidden-skip schedule), `data` (reading, checking, per-stream plan, compact
layout), `shards` (device-resident or streamed rows), `networks`, `update` (the jitted AWR step, many per
dispatch), `train` (the loop, checkpoints, resume), `policy` (`load_policy`), `evaluate` (in-game play).
"""
from rl.offline.targets import returns_to_go


def load_policy(run_dir):
    """The newest checkpoint of an offline run as an `OfflinePolicy` (see rl.offline.policy)."""
    from rl.offline.policy import load_policy as _load

    return _load(run_dir)


__all__ = ["returns_to_go", "load_policy"]
