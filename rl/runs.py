"""A trained run's policy, restored from its run directory for playing (rl.eval, rl.video, probes, offline eval).

The one place that knows how an `rl.train` run is read back: `play_settings` (config.json as a policy plays it),
`read_checkpoint` (the newest checkpoint that restores), and from them `restore_params` (settings + the policy's params: no
trainer, no LLM, nothing compiled) and `restore_policy` (also the trainer that plays it and its LLM).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from rl.config import TrainConfig, load_config
from rl.llm import LLMArgs, LLMSetup


@dataclass(frozen=True)
class RunParams:
    """What `restore_params` returns: a run's settings and its newest checkpoint's policy params."""

    cfg: TrainConfig  # `play_settings` of the run
    params: Any  # the policy network's params (as restored: host arrays, no target structure)
    step: int  # that checkpoint's update count


@dataclass(frozen=True)
class RunPolicy:
    """What `restore_policy` returns: the run's settings, the trainer that plays it, and its newest checkpoint."""

    cfg: TrainConfig  # the run's config.json, on one device, without recording; an LLM run reads the in-scan encoder
    trainer: Any  # rl.trainer.Trainer of `cfg`: env, network (`trainer.apply`), `run_window`
    runner: Any  # rl.trainer.RunnerState of the newest checkpoint (`runner.params`: the network's params)
    step: int  # that checkpoint's update count
    llm: LLMSetup | None  # model, tokenizer, template and prefix cache (None for --encoder none runs)
    encode: Callable | None  # pure (llm_params, prefix_cache, raw_states [B]) -> hidden float32 [B, D], or None

    @property
    def params(self) -> Any:
        return self.runner.params

    @property
    def llm_args(self) -> LLMArgs:
        """The arguments `encode` (and the trainer's jitted functions) take for the LLM."""
        return self.llm.jit_args if self.llm is not None else LLMArgs()


def play_settings(run_dir: str | Path) -> TrainConfig:
    """RUN_DIR/config.json (any version rl.train wrote: `rl.config.load_config`) as a policy plays it: on one device
    whatever the run trained on, nothing recorded, and an HTTP-encoder run with the in-scan encoder of the same model
    (which computes the same hidden states)."""
    cfg = load_config(Path(run_dir) / "config.json").replace(devices=1, save_trajectories=None)
    return cfg.replace(encoder="inscan") if cfg.uses_llm else cfg


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


def restore_policy(run_dir: str | Path, *, purpose: str = "use") -> RunPolicy:
    """Restore the policy of a run directory written by `rl.train`, with the settings it was trained with.

    `play_settings` and the newest checkpoint under RUN_DIR/checkpoints (orbax reshards it onto one device), as a
    full `RunnerState` of the trainer built from those settings. A run with an LLM hidden state gets its LLM
    loaded (`--model` must be loadable here) and `encode`, the in-scan encoder built from the run's LLM settings.

    Raises FileNotFoundError (one line, naming `purpose`: "has no checkpoint to {purpose}") when the run has no
    checkpoint, and what `load_config` raises for a missing or damaged config.json.
    """
    from rl.encoder_kinds import InScanEncoder
    from rl.llm import load_llm
    from rl.trainer import Trainer

    cfg = play_settings(run_dir)
    llm = encoder = None
    if cfg.uses_llm:
        llm = load_llm(cfg)
        encoder = InScanEncoder(cfg.hidden, cfg.llm, llm)
    trainer = Trainer.from_config(cfg, encoder)
    step, runner = read_checkpoint(run_dir, lambda: trainer.init_state(trainer.encoder.jit_args()), purpose=purpose)
    return RunPolicy(cfg, trainer, runner, step, llm, encoder.encode if encoder is not None else None)
