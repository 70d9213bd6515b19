"""A trained run's policy, restored from its run directory for playing (rl.eval, rl.video, probes, offline eval).

The one place that knows how an `rl.train` run is read back: `play_settings` (config.json as a policy plays it),
`read_checkpoint` (the newest checkpoint that restores), and from them `restore_params` (settings + the policy's params: no
trainer, no LLM, nothing compiled) and `restore_policy` (also the trainer that plays it and its LLM).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from rl.config import TrainConfig
from rl.llm import LLMArgs, LLMSetup
from rl.readrun import (RunParams, play_settings, read_checkpoint, restore_params,  # noqa: F401 - the light reader
                        trained_in_scan)


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


def restore_policy(run_dir: str | Path, *, purpose: str = "use") -> RunPolicy:
    """Restore the policy of a run directory written by `rl.train`, with the settings it was trained with.

    `play_settings` and the newest checkpoint under RUN_DIR/checkpoints (orbax reshards it onto one device), as a
    full `RunnerState` of the trainer built from those settings. A run with an LLM hidden state gets its LLM
    loaded (`--model` must be loadable here) and `encode`, the in-scan encoder built from the run's LLM settings.

    Raises FileNotFoundError (one line, naming `purpose`: "has no checkpoint to {purpose}") when the run has no
    checkpoint, and what `load_config` raises for a missing or damaged config.json. An HTTP run's state has no LLM
    window (`runner.window` None); its play opens windows of its own (`rl.play.trainer_window`).
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
    saved_window = trained_in_scan(run_dir)  # an HTTP run's checkpoints hold no LLM window

    def target():
        state = trainer.init_state(trainer.encoder.jit_args())
        return state if saved_window else state._replace(window=None)

    step, runner = read_checkpoint(run_dir, target, purpose=purpose)
    return RunPolicy(cfg, trainer, runner, step, llm, encoder.encode if encoder is not None else None)
