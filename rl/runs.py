"""A trained run's policy, restored from its run directory for playing (rl.eval, rl.video, probes, offline eval)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from rl.config import TrainConfig, load_config
from rl.encoders import LLMArgs, LLMSetup


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

    Reads RUN_DIR/config.json (any version rl.train wrote: `rl.config.load_config`) and the newest checkpoint under
    RUN_DIR/checkpoints. The policy plays on one device whatever the run trained on (orbax reshards the checkpoint
    on restore), and nothing is recorded. A run with an LLM hidden state gets its LLM loaded (`--model` must be
    loadable here) and `encode`, the in-scan encoder built from the run's LLM settings; an HTTP-encoder run is
    played with the in-scan encoder of the same model, which computes the same hidden states.

    Raises FileNotFoundError (one line, naming `purpose`: "has no checkpoint to {purpose}") when the run has no
    checkpoint, and what `load_config` raises for a missing or damaged config.json.
    """
    from rl.encoder_kinds import InScanEncoder
    from rl.encoders import load_llm
    from rl.rundir import Checkpoints
    from rl.trainer import Trainer

    run_dir = Path(run_dir)
    cfg = load_config(run_dir / "config.json").replace(devices=1, save_trajectories=None)
    llm = encoder = None
    if cfg.uses_llm:
        cfg = cfg.replace(encoder="inscan")
        llm = load_llm(cfg)
        encoder = InScanEncoder(cfg, llm)
    trainer = Trainer(cfg, encoder)
    ckpt = Checkpoints(run_dir)
    try:
        step = ckpt.latest_step()
        if step is None:
            raise FileNotFoundError(f"{run_dir} has no checkpoint to {purpose}")
        runner = ckpt.restore(trainer.init_state(trainer.encoder.jit_args()), step)
    finally:
        ckpt.close()
    return RunPolicy(cfg, trainer, runner, int(step), llm, encoder.encode if encoder is not None else None)
