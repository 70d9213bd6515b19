"""Training configuration: one frozen dataclass, presets, validation and JSON round trip."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxllm.encoder import POOLINGS
from render.envs import ENV_NAMES, FORMATS
from render.template import ASSEMBLIES
from rl.encoders import ENCODE_METHODS
from rl.networks import FUSIONS
from rl.ppo import SHUFFLES
from rl.sharding import resolve_device_count

ENCODERS = ("none", "inscan", "vllm")
OBS_FORMATS = FORMATS  # render.build_template's `fmt`
TEMPLATE_ASSEMBLIES = ASSEMBLIES  # render.build_template's `assembly` (same ids, different kernels)
LLM_DTYPES = ("auto", "float32", "bfloat16", "fp8")  # fp8: W8A8 matmuls (jaxllm.fp8), bf16 elsewhere
LLM_ENCODES = ENCODE_METHODS  # how a batch of prompts meets the LLM (rl.encoders.make_ids_encoder)

# Flags that `--resume` accepts (they do not change results: the server's address, which kernels build the ids,
# where the rollouts are recorded).
RESUME_OVERRIDABLE = ("vllm_url", "template_assembly", "save_trajectories", "samples_per_file")
# Fields that may differ between a run directory's config and a resumed run.
RESUME_MUTABLE = RESUME_OVERRIDABLE + ("run_dir",)


@dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a training run. Defaults = the reference trainer (REFERENCE §2)."""

    env: str = "Craftax-Symbolic-v1"
    encoder: str = "none"
    seed: int = 0
    num_envs: int = 1024
    num_steps: int = 64
    total_timesteps: int = 10_000_000
    lr: float = 2e-4
    anneal_lr: bool = True
    adam_eps: float = 1e-5
    max_grad_norm: float = 1.0
    update_epochs: int = 4
    num_minibatches: int = 8
    # minibatch shuffle: "global" = reference (all T*B samples; several devices gather the rollout); "per_env" =
    # each env's time steps, every sample stays on its device (rl.ppo.ppo_update, docs/MULTIGPU.md)
    shuffle: str = "global"
    gamma: float = 0.99
    gae_lambda: float = 0.8
    clip_eps: float = 0.2
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    reset_ratio: int = 16
    width: int = 512
    # data parallelism (docs/MULTIGPU.md): devices the env batch is split over; 0 = all visible devices.
    # train() writes the resolved count into config.json, so a resume uses the same count.
    devices: int = 0
    # LLM encoder (inscan / vllm)
    skip_n: int = 1
    model: str = "tiny"
    llm_layer: int = -1
    pooling: str = "last"
    obs_format: str = "compact"
    template_assembly: str = "auto"  # auto: one Pallas kernel on a CUDA GPU, XLA ops elsewhere (docs/RENDER.md)
    llm_dtype: str = "auto"
    system_prompt: str | None = None
    fusion: str = "norm"
    # bucketed: llm_chunk prompts per call, sorted by length, each chunk padded to its length bucket;
    # packed: real tokens end to end, passes of at most llm_capacity tokens (0 = jaxllm.default_capacity).
    # bucketed stays the default until packed is measured faster in the trainer (docs/BENCHMARKS.md)
    llm_encode: str = "bucketed"
    llm_capacity: int = 0
    llm_chunk: int = 64
    vllm_url: str = "http://127.0.0.1:8000"
    vllm_timeout: float = 30.0
    # run directory
    run_dir: str | None = None
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    # recording (docs/OFFLINE.md): every rollout's samples written to this directory as trajectory files
    save_trajectories: str | None = None
    samples_per_file: int = 8192

    # derived -----------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.num_envs * self.num_steps

    @property
    def num_updates(self) -> int:
        return self.total_timesteps // self.batch_size

    @property
    def uses_llm(self) -> bool:
        return self.encoder != "none"

    def validate(self, num_devices: int | None = None) -> "TrainConfig":
        """Raise ValueError naming the bad field and the fix; return self when fine.

        `num_devices` (the resolved `--devices`, `resolve_devices`) adds the checks that the batch splits
        over that many devices."""
        _choice("env", self.env, ENV_NAMES)
        _choice("encoder", self.encoder, ENCODERS)
        _choice("obs_format", self.obs_format, OBS_FORMATS)
        _choice("template_assembly", self.template_assembly, TEMPLATE_ASSEMBLIES)
        _choice("pooling", self.pooling, POOLINGS)
        _choice("llm_dtype", self.llm_dtype, LLM_DTYPES)
        _choice("llm_encode", self.llm_encode, LLM_ENCODES)
        if self.llm_capacity < 0:
            raise ValueError(f"--llm-capacity must be >= 0 (tokens per packed LLM pass; 0 = automatic), got "
                             f"{self.llm_capacity}")
        _choice("fusion", self.fusion, FUSIONS)
        _choice("shuffle", self.shuffle, SHUFFLES)
        for name in ("num_envs", "num_steps", "total_timesteps", "update_epochs", "num_minibatches",
                     "skip_n", "checkpoint_every", "reset_ratio", "width", "keep_checkpoints", "llm_chunk",
                     "samples_per_file"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.devices < 0:
            raise ValueError(f"--devices must be >= 0 (0 = all visible devices), got {self.devices}")
        if self.num_updates < 1:
            raise ValueError(
                f"--total-timesteps {self.total_timesteps} is smaller than one update "
                f"(num_envs x num_steps = {self.batch_size}); raise it or shrink the batch")
        if self.batch_size % self.num_minibatches:
            raise ValueError(
                f"num_envs x num_steps = {self.batch_size} does not split into --num-minibatches "
                f"{self.num_minibatches}; pick a divisor")
        if self.shuffle == "per_env" and self.num_steps % self.num_minibatches:
            raise ValueError(
                f"--shuffle per_env splits each env's --num-steps {self.num_steps} time steps into "
                f"--num-minibatches {self.num_minibatches} equal parts; pick num_steps a multiple of "
                f"num_minibatches (or --shuffle global)")
        if self.uses_llm and self.num_steps % self.skip_n:
            fit = -(-self.num_steps // self.skip_n) * self.skip_n
            raise ValueError(
                f"--skip-n {self.skip_n} must divide --num-steps {self.num_steps} (the LLM re-encodes every env "
                f"once per skip_n-step window, and a rollout holds whole windows); e.g. --num-steps {fit}")
        if num_devices is not None:
            self._check_split(num_devices)
        return self

    def _check_split(self, devices: int) -> None:
        """The env batch must split evenly over the devices, and so must the optimistic-reset blocks (a device
        holds whole blocks of `reset_ratio` envs, or lies inside one block) and, for the global shuffle, every
        minibatch (each device computes an equal share of it)."""
        if self.num_envs % devices:
            lo = self.num_envs // devices * devices or devices
            raise ValueError(f"--num-envs {self.num_envs} does not split over {devices} devices; pick a multiple of "
                             f"{devices} (e.g. --num-envs {lo}) or change --devices")
        local = self.num_envs // devices
        if devices > 1 and local % self.reset_ratio and self.reset_ratio % local:
            raise ValueError(f"the optimistic-reset pool (one fresh world per block of --reset-ratio "
                             f"{self.reset_ratio} envs) does not split over {devices} devices of {local} envs each; "
                             f"pick --reset-ratio so that it divides {local} (or is a multiple of it)")
        minibatch = self.batch_size // self.num_minibatches
        if devices > 1 and self.shuffle == "global" and minibatch % devices:
            raise ValueError(f"a minibatch of {minibatch} samples (--num-steps x --num-envs / --num-minibatches) "
                             f"does not split over {devices} devices; change one of them, or use --shuffle per_env")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any], source: str = "config") -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"{source}: unknown config fields {unknown}; was it written by another version?")
        return cls(**d)

    def differences(self, other: "TrainConfig") -> dict[str, tuple[Any, Any]]:
        """Fields (apart from RESUME_MUTABLE) whose values differ: {name: (self, other)}."""
        a, b = self.to_json(), other.to_json()
        return {k: (a[k], b[k]) for k in a if k not in RESUME_MUTABLE and a[k] != b[k]}


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"--{name.replace('_', '-')} {value!r} is not one of: {', '.join(choices)}")


# Named presets: a few fields overriding the defaults. Explicit flags override a preset.
PRESETS: dict[str, dict[str, Any]] = {
    # The README's main command on a 2-core CPU: Classic, small batch, small network, tiny LLM.
    "cpu": dict(env="Craftax-Classic-Symbolic-v1", num_envs=32, num_steps=32, total_timesteps=32 * 32 * 50,
                num_minibatches=4, update_epochs=2, width=128, skip_n=8, checkpoint_every=10, lr=5e-4),
    # The tests' runs: seconds, not minutes.
    "test": dict(env="Craftax-Classic-Symbolic-v1", num_envs=8, num_steps=8, total_timesteps=8 * 8 * 3,
                 num_minibatches=2, update_epochs=1, width=32, skip_n=4, checkpoint_every=1),
}


def resolve_devices(cfg: TrainConfig, *, resumed: bool = False) -> TrainConfig:
    """`cfg` validated, with `devices` resolved to the count used (0 = all visible) and the batch checked to split
    over it. `resumed`: the count comes from a run directory's config.json (the error says so)."""
    cfg.validate()  # refuses --devices < 0 before it is resolved
    try:
        n = resolve_device_count(cfg.devices)
    except ValueError as e:
        if resumed:
            raise ValueError(f"this run was trained on {cfg.devices} devices (config.json) and resumes only on "
                             f"{cfg.devices}: {e}") from None
        raise
    resolved = dataclasses.replace(cfg, devices=n)
    resolved._check_split(n)
    return resolved


def save_config(cfg: TrainConfig, path: Path) -> None:
    path.write_text(json.dumps(cfg.to_json(), indent=2, sort_keys=True) + "\n")


def load_config(path: Path) -> TrainConfig:
    try:
        d = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} not found: is this a run directory written by rl.train?") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); the run directory is damaged") from None
    return TrainConfig.from_json(d, source=str(path))
