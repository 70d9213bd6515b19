"""Training configuration: one frozen dataclass, presets, validation and JSON round trip."""
from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxllm.encoder import POOLINGS
from render.envs import ENV_NAMES, FORMATS
from render.template import ASSEMBLIES
from rl.networks import FUSIONS
from rl.ppo import SHUFFLES
from rl.settings import check_at_least_one, check_known, option, resume_differences
from rl.sharding import resolve_device_count



@dataclass(frozen=True)
class EncoderFacts:
    """What an `--encoder` kind is, as data (the settings' checks and `rl.encoder_kinds` read it; nothing else
    compares kind names)."""

    uses_llm: bool  # the policy reads an LLM hidden state
    in_scan: bool  # the LLM runs inside the jitted rollout (template kernels, reset pool, any skip_n)
    http: bool  # hidden states come from an embedding server, window by window on the host


ENCODER_FACTS = {
    "none": EncoderFacts(uses_llm=False, in_scan=False, http=False),
    "inscan": EncoderFacts(uses_llm=True, in_scan=True, http=False),
    "vllm": EncoderFacts(uses_llm=True, in_scan=False, http=True),
}
ENCODERS = tuple(ENCODER_FACTS)
OBS_FORMATS = FORMATS  # render.build_template's `fmt`
TEMPLATE_ASSEMBLIES = ASSEMBLIES  # render.build_template's `assembly` (same ids, different kernels)
LLM_DTYPES = ("auto", "float32", "bfloat16", "fp8")  # fp8: W8A8 matmuls (jaxllm.fp8), bf16 elsewhere
LLM_ENCODES = ("bucketed", "packed")  # how a batch of prompts meets the LLM (rl.llm.make_ids_encoder)
RESET_HIDDEN = ("auto", "pool", "zero")

# Flags that `--resume` accepts (they do not change results: the server's address, which kernels build the ids,
# where the rollouts are recorded).
RESUME_OVERRIDABLE = ("vllm_url", "template_assembly", "save_trajectories", "samples_per_file", "rollout_unroll",
                      "env_unroll", "lazy_reset", "batch_resets", "trainer_xla")
# Fields that may differ between a run directory's config and a resumed run.
RESUME_MUTABLE = RESUME_OVERRIDABLE + ("run_dir",)


# Option groups (--help lists the fields under these headings, in this order).
ENV, PPO, LLM, HTTP, DEVICES, RUN, RECORD, SPEED = (
    "environment", "PPO", "LLM encoder (--encoder inscan|vllm)", "HTTP embedding server (--encoder vllm)", "devices",
    "run directory", "recording", "program shape (same results, other kernels; docs/BENCHMARKS.md)")
GROUPS = (ENV, PPO, LLM, HTTP, DEVICES, RUN, RECORD, SPEED)


def _opt(default: Any, group: str, help: str, applies: str | None = None, metavar: str | None = None) -> Any:
    """A TrainConfig field with its --help line (`rl.settings.option`). `applies`: "llm" = has an effect only with
    an LLM encoder, "vllm" = only with --encoder vllm (an explicit flag outside that is refused:
    `inapplicable_flags`); None: always."""
    f = option(default, group, help, applies, metavar)
    f.metadata = {**f.metadata, "applies": applies}
    return f


@dataclass(frozen=True)
class EnvConfig:
    """The env batch: which game, how many envs, seeds and optimistic resets."""

    env: str = _opt("Craftax-Symbolic-v1", ENV, "Craftax game: full Craftax or Craftax-Classic, symbolic observations")
    seed: int = _opt(0, ENV, "seed of the env worlds, the network init and the PPO sampling")
    num_envs: int = _opt(1024, ENV, "envs stepped in parallel (all devices together)")
    reset_ratio: int = _opt(16, ENV, "optimistic resets: one fresh world per block of this many envs")


@dataclass(frozen=True)
class PPOConfig:
    """PPO and the actor-critic network (the reference trainer's hyperparameters)."""

    total_timesteps: int = _opt(10_000_000, PPO, "env steps of the whole run (updates = this / (num_envs x num_steps))")
    num_steps: int = _opt(64, PPO, "rollout length per env between two updates")
    lr: float = _opt(2e-4, PPO, "Adam learning rate")
    anneal_lr: bool = _opt(True, PPO, "decay the learning rate linearly to 0 over the run (true/false)")
    adam_eps: float = _opt(1e-5, PPO, "Adam epsilon (numerical floor of the update denominator)")
    max_grad_norm: float = _opt(1.0, PPO, "clip the global gradient norm to this")
    update_epochs: int = _opt(4, PPO, "passes over each rollout per update")
    num_minibatches: int = _opt(8, PPO, "minibatches per epoch (must divide num_envs x num_steps)")
    shuffle: str = _opt("global", PPO, "minibatch shuffle: global = over all samples (reference; several devices "
                                       "gather the rollout), per_env = each env's steps stay on its device")
    gamma: float = _opt(0.99, PPO, "discount factor of future rewards")
    gae_lambda: float = _opt(0.8, PPO, "GAE lambda (bias-variance trade-off of the advantage estimate)")
    clip_eps: float = _opt(0.2, PPO, "PPO clip range of the policy ratio")
    ent_coef: float = _opt(0.01, PPO, "entropy bonus coefficient")
    vf_coef: float = _opt(0.5, PPO, "value loss coefficient")
    width: int = _opt(512, PPO, "hidden width of the actor-critic MLP")


@dataclass(frozen=True)
class HiddenConfig:
    """Where the policy's hidden state comes from (`--encoder`), how often it is refreshed, what a reset env reads, how
    the policy fuses it, and the HTTP server of `--encoder vllm`."""

    encoder: str = _opt("none", LLM, "LLM hidden state as extra input: none (plain PPO), inscan (the JAX Qwen3 "
                                     "inside the rollout scan), vllm (an HTTP embedding server)")
    skip_n: int = _opt(1, LLM, "re-encode each env's game state every skip_n steps (in-scan: any value, windows "
                               "carry across rollouts, 0 = once at the start; vllm: must divide num_steps)",
                       applies="llm")
    reset_hidden: str = _opt("auto", LLM, "what an env that resets inside an LLM window reads until the window ends: "
                                          "pool = its fresh world's real hidden state (one world per reset block "
                                          "encoded at each window start), zero = zeros; auto = pool for in-scan "
                                          "with skip_n >= 1, else zero", applies="llm")
    fusion: str = _opt("norm", LLM, "how the hidden state joins the symbolic observation in the policy",
                       applies="llm")
    vllm_url: str = _opt("http://127.0.0.1:8000", HTTP, "base URL of the vLLM / jaxllm.http.server embedding "
                                                        "server", applies="vllm", metavar="URL")
    vllm_timeout: float = _opt(30.0, HTTP, "seconds to wait for one embedding request", applies="vllm")

    @property
    def kind(self) -> EncoderFacts:
        """The facts of `encoder` (an unknown name is refused by `TrainConfig.validate`)."""
        return ENCODER_FACTS[self.encoder]

    @property
    def on_reset(self) -> str:
        """The reset policy in force: "pool" or "zero" (`reset_hidden` with "auto" resolved)."""
        if self.reset_hidden != "auto":
            return self.reset_hidden
        return "pool" if self.kind.in_scan and self.skip_n > 0 else "zero"


@dataclass(frozen=True)
class LLMConfig:
    """The LLM and how it reads a game state: the settings training, evaluation, video and labelling share."""

    model: str = _opt("tiny", LLM, "LLM: checkpoint directory, Hugging Face hub id (downloaded once) or preset "
                                   "(tiny = random 2-layer Qwen3, qwen3-4b = random init of the 4B shape)",
                      applies="llm", metavar="NAME")
    llm_layer: int = _opt(-1, LLM, "the ONE hidden-state index fed to the policy (HF numbering; -1 = final layer); "
                                    "one layer only", applies="llm")
    pooling: str = _opt("last", LLM, "how the prompt's token states become one vector: last token or mean",
                        applies="llm")
    obs_format: str = _opt("compact", LLM, "text rendering of the game state: compact or full (docs/RENDER.md)",
                           applies="llm")
    template_assembly: str = _opt("auto", LLM, "kernels that build the prompt ids: auto = one Pallas kernel on a "
                                               "CUDA GPU, XLA ops elsewhere (docs/RENDER.md)", applies="llm")
    llm_dtype: str = _opt("auto", LLM, "LLM weights/compute dtype: auto = the checkpoint's; fp8 = W8A8 matmuls, "
                                       "bf16 elsewhere", applies="llm")
    system_prompt: str | None = _opt(None, LLM, "system prompt before the game text (default: the template's own)",
                                     applies="llm")
    # packed: measured 1.30x bucketed's SPS in the trainer on an H100 (issue 23, docs/BENCHMARKS.md)
    llm_encode: str = _opt("packed", LLM, "batching of prompts: bucketed = llm_chunk prompts per call, sorted by "
                                            "length, padded to a length bucket; packed = real tokens only, in "
                                            "passes of llm_capacity tokens", applies="llm")
    llm_capacity: int = _opt(0, LLM, "tokens per packed LLM pass (0 = jaxllm.default_capacity)", applies="llm")
    llm_chunk: int = _opt(64, LLM, "prompts per LLM call with --llm-encode bucketed", applies="llm")

    def check(self) -> None:
        """ValueError (one line naming the flag) for a setting outside its choices or range."""
        _choice("obs_format", self.obs_format, OBS_FORMATS)
        _choice("template_assembly", self.template_assembly, TEMPLATE_ASSEMBLIES)
        _choice("pooling", self.pooling, POOLINGS)
        _choice("llm_dtype", self.llm_dtype, LLM_DTYPES)
        _choice("llm_encode", self.llm_encode, LLM_ENCODES)
        if self.llm_capacity < 0:
            raise ValueError(f"--llm-capacity must be >= 0 (tokens per packed LLM pass; 0 = automatic), got "
                             f"{self.llm_capacity}")
        check_at_least_one(self, ("llm_chunk",))

    def encode_options(self) -> dict[str, Any]:
        """The keyword arguments of `rl.encoders.make_ids_encoder` (and `make_inscan_encoder`) these settings give."""
        return dict(layer=self.llm_layer, pooling=self.pooling, method=self.llm_encode, capacity=self.llm_capacity,
                    chunk=self.llm_chunk)


@dataclass(frozen=True)
class RunConfig:
    """Devices and the run directory."""

    devices: int = _opt(0, DEVICES, "devices the env batch is split over (0 = all visible; docs/MULTIGPU.md); "
                                    "config.json stores the resolved count")
    run_dir: str | None = _opt(None, RUN, "where config.json, metrics.jsonl and checkpoints/ go "
                                          "(default: checkpoints/<env>-<encoder>-s<seed>-<time>)", metavar="DIR")
    checkpoint_every: int = _opt(50, RUN, "save a checkpoint every this many updates (and at the end)")
    keep_checkpoints: int = _opt(2, RUN, "checkpoints kept on disk (older ones are deleted)")


@dataclass(frozen=True)
class RecordConfig:
    """Recording the rollouts as trajectory files (docs/OFFLINE.md)."""

    save_trajectories: str | None = _opt(None, RECORD, "write every rollout's samples to this directory as "
                                                       "trajectory files (rl.label can label them)", metavar="DIR")
    samples_per_file: int = _opt(8192, RECORD, "samples per trajectory file of --save-trajectories")


@dataclass(frozen=True)
class SpeedConfig:
    """How the trainer's jitted programs are shaped: each setting changes the kernels XLA launches, never the results
    (same-seed metrics are bit-equal on a CPU: tests/test_rl_speed.py). The rollout is launch-bound on a GPU (a Craftax
    step is ~2,500 small kernels), so these aim at fewer, larger kernels."""

    rollout_unroll: int = _opt(1, SPEED, "env steps per iteration of the rollout's scan (lax.scan unroll)")
    env_unroll: int = _opt(-1, SPEED, "fully unroll Craftax's own inner scans of at most this many steps in the env "
                                      "step and reset (0 = off; 12 = all of them): fewer launches, longer compile. "
                                      "-1 = auto: 12 on a GPU for plain PPO (--encoder none: 1.7-2.8x its SPS on an "
                                      "H100, docs/BENCHMARKS.md), else 0")
    lazy_reset: bool = _opt(False, SPEED, "draw a step's fresh worlds (optimistic resets) only when an env finished "
                                          "(lax.cond): saves world generation on steps where none did")
    batch_resets: bool = _opt(False, SPEED, "draw a rollout's fresh worlds for all its steps in one batched call before "
                                            "its scan (the same worlds): world generation leaves the step loop; holds "
                                            "num_steps x num_envs / reset_ratio worlds at once (1,024 envs: ~1.3 GB)")
    trainer_xla: str = _opt("", SPEED, "XLA options of the trainer's programs, 'name=value name=value', e.g. "
                                       "xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,"
                                       "CONDITIONAL,WHILE (one the installed XLA refuses is dropped with a warning)",
                            metavar="OPTIONS")

    def env_unroll_for(self, uses_hidden: bool, backend: str | None = None) -> int:
        """`env_unroll` with auto (-1) resolved: 12 on a GPU when no LLM state is read (plain PPO, where the env is the
        whole update and its ~2,500 launches per step the bottleneck), else 0 (an LLM run's compile time and its
        first status line matter more there than the env's share of the update; on a CPU unrolling buys nothing)."""
        if self.env_unroll >= 0:
            return self.env_unroll
        if backend is None:
            import jax  # the config module itself stays light: jax only when a run is built

            backend = jax.default_backend()
        return 12 if backend == "gpu" and not uses_hidden else 0

    def xla_options(self) -> dict[str, Any]:
        """`trainer_xla` as a dict of XLA compiler options (ints and true/false converted; ValueError when malformed)."""
        return parse_xla_options(self.trainer_xla)


def parse_xla_options(text: str) -> dict[str, Any]:
    """'name=value name=value' -> {name: value}: integers become int, true/false bool, anything else stays a string."""
    out: dict[str, Any] = {}
    for item in text.split():
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise ValueError(f"--trainer-xla: {item!r} is not name=value (separate several with spaces)")
        low = value.lower()
        out[name] = (low == "true") if low in ("true", "false") else int(value) if value.lstrip("-").isdigit() \
            else value
    return out


class Sectioned:
    """Base of a frozen dataclass whose fields are sections (frozen dataclasses of settings) and plain settings:
    every setting also goes by its flat name, the name of its flag.

    `Cls(name=value, ...)` builds one from flat names (sections may also be passed whole; flat names override
    them), `obj.name` reads a setting of a section, `obj.replace(...)` (or `dataclasses.replace`) changes some.
    Declare subclasses with `@dataclass(frozen=True, init=False)`; section fields need a default instance."""

    def __init__(self, **settings: Any) -> None:
        owners = flat_owners(type(self))
        unknown = sorted(set(settings) - set(owners) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(f"{type(self).__name__} got unknown settings {unknown}")
        for f in dataclasses.fields(self):
            value = settings.get(f.name, f.default)
            if dataclasses.is_dataclass(f.default):  # a section: its flat names override it
                mine = {k: v for k, v in settings.items() if owners.get(k) == f.name}
                value = dataclasses.replace(value, **mine) if mine else value
            elif value is dataclasses.MISSING:
                raise TypeError(f"{type(self).__name__} needs {f.name}")
            object.__setattr__(self, f.name, value)

    def __getattr__(self, name: str) -> Any:
        """A section's setting by its flat name (only called for names that are not attributes of the class)."""
        section = flat_owners(type(self)).get(name)
        if section is None:
            raise AttributeError(f"{type(self).__name__} has no setting {name!r}")
        return getattr(object.__getattribute__(self, section), name)

    def replace(self, **settings: Any):
        """A copy with some settings (flat names, or whole sections) changed."""
        return dataclasses.replace(self, **settings)


@functools.lru_cache(maxsize=None)
def flat_owners(cls: type) -> dict[str, str]:
    """{flat name: the section field of `cls` that holds it} for a `Sectioned` dataclass."""
    return {f.name: section.name for section in dataclasses.fields(cls) if dataclasses.is_dataclass(section.default)
            for f in dataclasses.fields(section.default)}


@dataclass(frozen=True, init=False)
class TrainConfig(Sectioned):
    """Everything that defines a training run, in sections that the parts of the project take on their own:
    `envs`, `ppo`, `hidden` (the encoder kind and its window), `llm`, `run`, `record`. Defaults = the reference
    trainer (REFERENCE §2). Settings also go by their flat names (`Sectioned`): the flags and config.json keys."""

    envs: EnvConfig = EnvConfig()
    ppo: PPOConfig = PPOConfig()
    hidden: HiddenConfig = HiddenConfig()
    llm: LLMConfig = LLMConfig()
    run: RunConfig = RunConfig()
    record: RecordConfig = RecordConfig()
    speed: SpeedConfig = SpeedConfig()

    # derived -----------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.num_envs * self.num_steps

    @property
    def num_updates(self) -> int:
        return self.total_timesteps // self.batch_size

    @property
    def kind(self) -> EncoderFacts:
        """The facts of `encoder` (an unknown name is refused by `validate`)."""
        return self.hidden.kind

    @property
    def uses_llm(self) -> bool:
        return self.kind.uses_llm

    @property
    def hidden_on_reset(self) -> str:
        """The reset policy in force: "pool" or "zero" (`reset_hidden` with "auto" resolved)."""
        return self.hidden.on_reset

    def validate(self, num_devices: int | None = None) -> "TrainConfig":
        """Raise ValueError naming the bad field and the fix; return self when fine.

        `num_devices` (the resolved `--devices`, `resolve_devices`) adds the checks that the batch splits
        over that many devices."""
        _choice("env", self.env, ENV_NAMES)
        _choice("encoder", self.encoder, ENCODERS)
        self.llm.check()
        _choice("fusion", self.fusion, FUSIONS)
        _choice("shuffle", self.shuffle, SHUFFLES)
        check_at_least_one(self, ("num_envs", "num_steps", "total_timesteps", "update_epochs", "num_minibatches",
                                  "checkpoint_every", "reset_ratio", "width", "keep_checkpoints",
                                  "samples_per_file", "rollout_unroll"))
        if self.env_unroll < -1:
            raise ValueError(f"--env-unroll must be >= 0 (0 = off) or -1 (auto), got {self.env_unroll}")
        self.speed.xla_options()
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
        _choice("reset_hidden", self.reset_hidden, RESET_HIDDEN)
        if self.skip_n < 0:
            raise ValueError(f"--skip-n must be >= 0 (0 = encode once at the start), got {self.skip_n}")
        if self.kind.http and (self.skip_n < 1 or self.num_steps % self.skip_n):
            fit = -(-self.num_steps // max(self.skip_n, 1)) * max(self.skip_n, 1)
            raise ValueError(
                f"--encoder vllm: --skip-n {self.skip_n} must divide --num-steps {self.num_steps} (the host loop "
                f"re-encodes every env once per skip_n-step window, and a rollout holds whole windows); e.g. "
                f"--num-steps {fit}, or --encoder inscan (any skip_n)")
        if self.uses_llm and self.reset_hidden == "pool" and (not self.kind.in_scan or self.skip_n == 0):
            raise ValueError(f"--reset-hidden pool needs --encoder inscan and --skip-n >= 1 (the pool is drawn at "
                             f"every window start); got --encoder {self.encoder} --skip-n {self.skip_n}. Use "
                             f"--reset-hidden zero (or auto)")
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
        """Every setting by its flat name (config.json's layout: the names of the flags)."""
        return {f.name: getattr(self, f.name) for f in flat_fields()}

    @classmethod
    def from_json(cls, d: dict[str, Any], source: str = "config") -> "TrainConfig":
        check_known(d, SECTION_OF, f"{source}: unknown config fields {{unknown}}; was it written by another version?")
        return cls(**d)

    def differences(self, other: "TrainConfig") -> dict[str, tuple[Any, Any]]:
        """Fields (apart from RESUME_MUTABLE) whose values differ: {name: (self, other)}."""
        return resume_differences(self.to_json(), other.to_json(), RESUME_MUTABLE)


SECTION_OF = flat_owners(TrainConfig)  # every setting by its flat name (flag, config.json key) -> its section


def flat_fields() -> tuple[dataclasses.Field, ...]:
    """Every setting of a run, section by section (with its --help line and group in `metadata`)."""
    return tuple(f for section in dataclasses.fields(TrainConfig) for f in dataclasses.fields(section.default))


# Fields that take one of a fixed set of values (the CLI lists them; validate() checks them).
CHOICES: dict[str, tuple[str, ...]] = {
    "env": ENV_NAMES, "encoder": ENCODERS, "obs_format": OBS_FORMATS, "template_assembly": TEMPLATE_ASSEMBLIES,
    "pooling": POOLINGS, "llm_dtype": LLM_DTYPES, "llm_encode": LLM_ENCODES, "fusion": FUSIONS, "shuffle": SHUFFLES,
    "reset_hidden": RESET_HIDDEN}


def inapplicable_flags(given: set[str] | list[str], encoder: str) -> str | None:
    """One line refusing the explicitly given fields that have no effect with `encoder`, or None when all apply."""
    applies = {f.name: f.metadata.get("applies") for f in flat_fields()}
    facts = ENCODER_FACTS[encoder]
    serves = {None: True, "llm": facts.uses_llm, "vllm": facts.http}
    idle = [n for n in given if not serves[applies.get(n)]]
    if not idle:
        return None
    flags = f"{', '.join('--' + n.replace('_', '-') for n in idle)} {'has' if len(idle) == 1 else 'have'}"
    if not facts.uses_llm:
        return (f"{flags} no effect with --encoder {encoder} (plain PPO, no LLM); add --encoder inscan (or vllm) to "
                f"use an LLM, or drop them")
    return f"{flags} no effect with --encoder {encoder}; add --encoder vllm to use an embedding server, or drop them"


def read_mapping_file(path: str | Path) -> dict[str, Any]:
    """The mapping a JSON or YAML settings file holds, its keys with '-' read as '_' (ValueError, one line naming
    `--config PATH`, when it cannot be read, parsed or is not a mapping). Shared by every command's --config."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"--config {path}: cannot read it ({e.strerror or e})") from None
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            d = yaml.safe_load(text)
        else:
            d = json.loads(text)
    except Exception as e:  # noqa: BLE001 - yaml and json raise different types; both mean "not parseable"
        raise ValueError(f"--config {path}: not valid {'YAML' if path.suffix.lower() in ('.yaml', '.yml') else 'JSON'}"
                         f" ({str(e).splitlines()[0]})") from None
    if not isinstance(d, dict):
        raise ValueError(f"--config {path}: expected a mapping of setting names to values, got {type(d).__name__}")
    return {k.replace("-", "_"): v for k, v in d.items()}


def read_settings_file(path: str | Path) -> dict[str, Any]:
    """TrainConfig fields from a JSON or YAML file (e.g. a run directory's config.json), checked by name.

    Its `run_dir` is dropped: a file names settings, not where the new run goes (pass --run-dir)."""
    d = read_mapping_file(path)
    unknown = sorted(set(d) - set(SECTION_OF))
    if unknown:
        import difflib

        guesses = {u: difflib.get_close_matches(u, sorted(SECTION_OF), n=1) for u in unknown}
        hints = [g[0] if len(unknown) == 1 else f"{g[0]} for {u}" for u, g in guesses.items() if g]
        raise ValueError(f"--config {path}: unknown setting{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(map(repr, unknown))}" + (f" (did you mean {', '.join(hints)}?)" if hints else ""))
    d.pop("run_dir", None)
    return d


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
    resolved = cfg.replace(devices=n)
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
