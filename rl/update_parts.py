"""What an encoder kind builds with: the parts of the trainer it serves, handed over as one explicit value.

`rl.trainer.Trainer` builds an `UpdateParts` of itself and passes it to its encoder (`rl.encoder_kinds.Encoder`:
`attach`, `start`, `make_update`, `share_meter`), so the dependency runs one way: the trainer imports and calls the
encoder kinds, and they know of the trainer only these fields (never the `Trainer` type, nor its other members).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class UpdateParts:
    """The trainer's mesh, env batch and update pieces that an encoder kind uses."""

    # where the envs live --------------------------------------------------------------------------------------
    mesh: Any  # jax.sharding.Mesh: the 1-D device mesh the env batch is split over
    env: Any  # rl.envs.BatchedEnv of the whole batch (num_envs, reset_pool, block_slots)
    sharded: Callable  # (fn, in_specs, out_specs) -> fn jitted as a shard_map over the env axis
    env_index: Callable[[], Any]  # inside `sharded`: global indices of this device's envs
    place_llm_args: Callable  # LLMArgs -> LLMArgs replicated over the mesh

    # what one update is made of -------------------------------------------------------------------------------
    num_steps: int  # rollout length per update
    records: bool  # the update also returns its rollout's samples (--save-trajectories)
    runner_specs: Any  # rl.trainer.RunnerState of PartitionSpecs
    carry_specs: Any  # rl.trainer.RolloutCarry of PartitionSpecs
    run_window: Callable  # (params, carry, length, env_index=) -> (carry, Steps): env+policy steps, hidden held
    finish_update: Callable  # (runner, carry, key_ppo, transitions, infos) -> (runner, metrics): PPO on a rollout
    update: Callable  # (runner, llm_args) -> (runner, metrics[, samples]): the whole update as one jitted call
    update_from_clock: Callable  # (runner, llm_args, clock) -> an update with the LLM window clock set (timing)
