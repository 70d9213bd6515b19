"""The one LLM path: everything a tool needs to put an LLM hidden state beside an observation.

Every tool that runs the LLM (the trainer's encoders, `rl.label`, `rl.eval`, `rl.video`, `rl.offline eval`,
`rl.probe`) goes through this module, so they agree by construction:

- `load_llm(settings, env=..., source="state"|"obs")`: tokenizer, template and model from one `LLMConfig`
  section, and the prompt head's KV cache through `jaxllm.Model.prefill` (compiled the fast way);
- `labelling_settings` / `labelled_llm_config`: the `labelling` metadata of a labelled file, written and read
  here; it holds the system prompt's text (None: render's default) and its hash, so a dataset labelled behind a
  custom prompt is rebuilt from its files alone;
- `make_ids_encoder` / `make_inscan_encoder` / `label_observations`: the pure encode functions, used under
  `compile_llm` (= `jaxllm.compile.jit` with the LLM's XLA options), the only way a program that runs the LLM is
  compiled (tests/test_compile_rule.py).

The hidden-state ablation modes (one table for every tool) live in `rl.modes`.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from rl.config import LLM_ENCODES, LLMConfig
from rl.jit import compile_llm, compile_program  # noqa: F401 - the LLM path's compile (rl.jit)


class LLMArgs(NamedTuple):
    """The LLM arrays a jitted program takes as explicit arguments (both None without an LLM)."""

    params: Any = None
    prefix_cache: Any = None  # jaxllm.PrefixCache of the template's prompt head


@dataclass
class LLMSetup:
    """Host-side LLM objects: the model (params + config), tokenizer, template and prefix cache."""

    model: Any  # jaxllm.Model (None when loaded without the model, e.g. for --encoder vllm)
    tokenizer: Any
    template: Any  # render.Template
    prefix_cache: Any  # jaxllm.PrefixCache (None without the model)
    hidden_size: int

    @property
    def jit_args(self) -> LLMArgs:
        """The arrays a jitted program takes for the LLM."""
        return LLMArgs(self.model.params, self.prefix_cache) if self.model is not None else LLMArgs()

    @property
    def prompt_sha256(self) -> str:
        return prompt_sha256(self.template)

    def with_prompt(self, system_prompt: Any) -> "LLMSetup":
        """The same model and tokenizer behind another system prompt (a new template and prefix cache)."""
        from render import build_template

        tpl = self.template
        template = build_template(self.tokenizer, tpl.env_name, fmt=tpl.fmt.name, system_prompt=system_prompt,
                                  assembly=tpl.assembly, source=tpl.source)
        cache = None if self.model is None else prefix_cache(self.model, template)
        return LLMSetup(self.model, self.tokenizer, template, cache, self.hidden_size)


def prompt_sha256(template) -> str:
    """The hash of a template's whole prompt frame (chat head with the system prompt, and chat tail)."""
    return hashlib.sha256((template.head + "\x00" + template.tail).encode()).hexdigest()


def prefix_cache(model, template):
    """The KV cache of `template`'s constant prompt head (`jaxllm.Model.prefill`, compiled with the LLM's options)."""
    return model.prefill(np.asarray(template.prefix_ids, np.int32))


def make_template(tokenizer, cfg, env: str, *, source: str = "state", system_prompt: Any = None):
    """The token template of LLM settings `cfg` for `env`: the state template (with `cfg.template_assembly`) or,
    for `source="obs"`, the observation template. `system_prompt` overrides `cfg.system_prompt`."""
    from render import build_template

    system_prompt = cfg.system_prompt if system_prompt is None else system_prompt
    kw = dict(assembly=cfg.template_assembly) if source == "state" else dict(source="obs")
    return build_template(tokenizer, env, fmt=cfg.obs_format, system_prompt=system_prompt, **kw)


def load_model(cfg):
    """The `jaxllm.Model` of LLM settings `cfg` (its `model` and `llm_dtype`)."""
    from jaxllm import load_model as load

    return load(cfg.model, dtype=None if cfg.llm_dtype == "auto" else cfg.llm_dtype)


def load_llm(cfg, *, env: str | None = None, with_model: bool = True, system_prompt: Any = None,
             source: str = "state") -> LLMSetup:
    """Load the model, tokenizer and template of LLM settings `cfg` (`rl.config.LLMConfig`, or a config that has
    them, e.g. `TrainConfig`) for game `env` (default: `cfg.env`); compute the prompt head's KV cache once.

    `system_prompt` overrides `cfg.system_prompt`; `source` "obs" builds the observation template (labelling,
    offline policies; `template_assembly` does not apply to it)."""
    from jaxllm import load_tokenizer

    tokenizer = load_tokenizer(cfg.model)
    template = make_template(tokenizer, cfg, env or cfg.env, source=source, system_prompt=system_prompt)
    if not with_model:
        return LLMSetup(None, tokenizer, template, None, 0)
    model = load_model(cfg)
    return LLMSetup(model, tokenizer, template, prefix_cache(model, template), int(model.config.hidden_size))


def llm_shapes(cfg, *, env: str | None = None) -> LLMSetup:
    """`load_llm(cfg, env=env)` without the weights: the tokenizer and template loaded, the model's params and the
    prompt head's cache as `jax.ShapeDtypeStruct`s (`jaxllm.model_shapes`: nothing drawn, read or allocated). What
    compiling the LLM's programs ahead needs while `load_weights` reads the weights."""
    from jaxllm import load_tokenizer, model_shapes, prefill_shapes

    tokenizer = load_tokenizer(cfg.model)
    template = make_template(tokenizer, cfg, env or cfg.env)
    model = model_shapes(cfg.model, dtype=None if cfg.llm_dtype == "auto" else cfg.llm_dtype)
    return LLMSetup(model, tokenizer, template, prefill_shapes(model, len(template.prefix_ids)),
                    int(model.config.hidden_size))


def load_weights(cfg, shapes: LLMSetup) -> LLMSetup:
    """The `LLMSetup` of `llm_shapes(cfg)`'s `shapes` with the model loaded and the prompt head's cache computed
    (its tokenizer and template kept: the same objects)."""
    model = load_model(cfg)
    return LLMSetup(model, shapes.tokenizer, shapes.template, prefix_cache(model, shapes.template),
                    int(model.config.hidden_size))


# ------------------------------------------------------------------------------------------------ labelling metadata

def custom_prompt_text(system_prompt: Any, env: str, fmt: str) -> str | None:
    """The text of a custom system prompt (a file's text for a path), None for render's default."""
    if system_prompt is None:
        return None
    from render.chat import resolve_system_prompt

    return resolve_system_prompt(system_prompt, env, fmt)


def labelling_settings(cfg, template, hidden_size: int, env: str) -> dict:
    """The `labelling` entry of a file labelled with LLM settings `cfg` (`LLMConfig`) through `template`: what
    makes two labellings comparable, and everything `labelled_llm_config` needs to rebuild the path."""
    return {"model": cfg.model, "llm_layer": cfg.llm_layer, "pooling": cfg.pooling, "obs_format": cfg.obs_format,
            "prompt_sha256": prompt_sha256(template), "llm_dtype": cfg.llm_dtype, "llm_encode": cfg.llm_encode,
            "hidden_size": int(hidden_size), "env": env,
            "system_prompt": custom_prompt_text(cfg.system_prompt, env, cfg.obs_format)}


COMPARED_WITHOUT = ("system_prompt",)  # labelling keys a resume does not compare (the prompt hash covers them)


def comparable(settings: dict | None) -> dict | None:
    """`settings` without the keys that older labellings lack but whose meaning the prompt hash already holds."""
    return None if settings is None else {k: v for k, v in settings.items() if k not in COMPARED_WITHOUT}


def labelled_llm_config(labelling: dict, system_prompt: Any = None):
    """The `LLMConfig` of a `labelling` entry (rl.label's keys; a few older spellings too). `system_prompt`
    overrides the stored text (only needed for files labelled before the text was stored)."""
    if "model" not in labelling:
        raise ValueError("the labelling metadata names no model; cannot rebuild its LLM")
    get = lambda *names, default=None: next((labelling[n] for n in names if n in labelling), default)
    d = LLMConfig()
    return LLMConfig(model=labelling["model"], llm_layer=int(get("llm_layer", "layer", default=d.llm_layer)),
                     pooling=get("pooling", default=d.pooling), obs_format=get("obs_format", "format",
                                                                                default=d.obs_format),
                     llm_dtype=get("llm_dtype", "dtype", default=d.llm_dtype),
                     llm_encode=get("llm_encode", default=d.llm_encode),
                     system_prompt=system_prompt if system_prompt is not None else get("system_prompt"))


def load_labelled_llm(labelling: dict, env: str, system_prompt: Any = None, *, source: str = "obs"):
    """(LLMConfig, LLMSetup) of a labelled dataset's `labelling` entry: the path its labels were made on, with the
    observation template (`source="state"`: the state template of the same format and prompt, for the probe's
    edited states). ValueError (one line) when the prompt hash or the hidden size differ."""
    from jaxllm import load_tokenizer

    cfg = labelled_llm_config(labelling, system_prompt)
    tokenizer = load_tokenizer(cfg.model)
    template = make_template(tokenizer, cfg, env, source=source)
    sha = prompt_sha256(template)
    if sha != labelling.get("prompt_sha256"):
        raise ValueError(f"the training files were labelled behind another prompt (prompt_sha256 "
                         f"{str(labelling.get('prompt_sha256'))[:12]}..., this template's {sha[:12]}...); pass the "
                         f"system prompt given to rl.label with --system-prompt")
    model = load_model(cfg)
    hidden_size = int(model.config.hidden_size)
    if hidden_size != int(labelling.get("hidden_size", hidden_size)):
        raise ValueError(f"model {cfg.model} has hidden size {hidden_size}, the labels "
                         f"{labelling['hidden_size']}: is it the model the files were labelled with?")
    return cfg, LLMSetup(model, tokenizer, template, prefix_cache(model, template), hidden_size)


# ------------------------------------------------------------------------------------------------ encode functions

ENCODE_METHODS = LLM_ENCODES  # how make_ids_encoder lays a batch of prompts out for the LLM (rl.config)


def make_ids_encoder(llm_config, *, layer: int, pooling: str, method: str = "bucketed", capacity: int = 0,
                     chunk: int = 64) -> Callable:
    """Pure function (llm_params, prefix_cache, ids int [B, T], lengths int [B]) -> hidden float32 [B, D] for use
    under jit: the one LLM call that the trainer (in-scan) and the labeller (`rl.label`) share.

    method "packed" (`jaxllm.encode_packed`): only real tokens are computed, laid end to end in passes of at most
    `capacity` tokens (0: `jaxllm.default_capacity`). "bucketed" (`jaxllm.encode_bucketed`): `chunk` prompts at a
    time, sorted by length, each chunk padded to the shortest length bucket that holds it. Both cost what the
    prompts' real lengths cost rather than the template's worst-case `max_len` (Craftax compact: ~274-360 tokens
    on average vs max_len 1,138); packed also drops the padding inside each chunk and bucket (docs/BENCHMARKS.md).
    """
    from jaxllm import encode_bucketed, encode_packed

    if method not in ENCODE_METHODS:
        raise ValueError(f"LLM encode method must be one of {ENCODE_METHODS}, got {method!r}")

    def encode_ids(llm_params, prefix_cache, ids, lengths):
        if method == "bucketed":
            return encode_bucketed(llm_params, llm_config, ids, lengths, layer=layer, pooling=pooling,
                                   prefix=prefix_cache, chunk=chunk)
        return encode_packed(llm_params, llm_config, ids, lengths, layer=layer, pooling=pooling, prefix=prefix_cache,
                             capacity=capacity or None)

    return encode_ids


def make_inscan_encoder(template, llm_config, *, layer: int, pooling: str, method: str = "bucketed",
                        capacity: int = 0, chunk: int = 64) -> Callable:
    """Pure function (llm_params, prefix_cache, raw_states [B]) -> hidden float32 [B, D] for use under jit:
    the template's ids of every state, then `make_ids_encoder`'s LLM call."""
    if method == "packed" and capacity and capacity < template.max_len:
        raise ValueError(f"--llm-capacity {capacity} tokens cannot hold one prompt of this template (max_len "
                         f"{template.max_len} for {template.env_name}); use --llm-capacity >= "
                         f"{template.max_len} or 0 (automatic)")
    encode_ids = make_ids_encoder(llm_config, layer=layer, pooling=pooling, method=method, capacity=capacity,
                                  chunk=chunk)

    def encode_states(llm_params, prefix_cache, raw_states):
        ids, lengths = jax.vmap(template)(raw_states)
        return encode_ids(llm_params, prefix_cache, ids, lengths)

    return encode_states


def make_llm_encoder(llm_cfg, llm: LLMSetup) -> Callable:
    """The in-scan encoder that LLM settings `llm_cfg` (`rl.config.LLMConfig`) describe, on the loaded `llm`: a pure
    function (llm_params, prefix_cache, raw_states [B]) -> hidden float32 [B, D] (`make_inscan_encoder`)."""
    return make_inscan_encoder(llm.template, llm.model.config, **llm_cfg.encode_options())


def label_observations(tpl, encode_ids) -> Callable:
    """The labels' function: (llm params, prefix cache, obs [b, O], valid bool [b]) -> float16 [b, D], the
    template `tpl` rendering each observation and `encode_ids` (`make_ids_encoder`) encoding it; rows with valid
    False get length 0 (the LLM skips them) and come back meaningless. The labeller runs it per device; offline
    evaluation and the probe run it to read what an offline policy sees the same way."""
    import jax.numpy as jnp

    def chunk(params, cache, obs, valid):
        ids, lengths = jax.vmap(tpl)(obs)
        lengths = jnp.where(valid, lengths, 0)
        return encode_ids(params, cache, ids, lengths).astype(jnp.float16)

    return chunk


def make_obs_encoder(llm_cfg, llm: LLMSetup) -> Callable:
    """(llm_params, cache, obs [B, O], need bool [B]) -> float32 [B, D]: an observation's hidden state exactly as
    `rl.label` stores it (rounded to float16), rows with `need` False left out of the LLM call (meaningless)."""
    import jax.numpy as jnp

    labels = label_observations(llm.template, make_ids_encoder(llm.model.config, **llm_cfg.encode_options()))

    def encode(llm_params, prefix_cache, obs, need):
        return labels(llm_params, prefix_cache, obs, need).astype(jnp.float32)

    return encode
