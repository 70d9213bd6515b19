"""Where the policy's LLM hidden state comes from: the in-scan JAX encoder or a vLLM-API server.

Both turn a batch of raw craftax states into float32 [B, D] through the same token template
(`render.build_template`): the constant prompt head (`tpl.prefix_ids`) is followed by the state's
ids. In-scan, the head's KV cache is computed once per run (`jaxllm.prefill`) and passed to every
jitted call as an argument (never a closed-over constant: for Qwen3-4B it is gigabytes).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import jax
import numpy as np


class LLMArgs(NamedTuple):
    """The LLM arrays the jitted trainer takes as explicit arguments (both None without an in-scan LLM)."""

    params: Any = None
    prefix_cache: Any = None  # jaxllm.PrefixCache of the template's prompt head


@dataclass
class LLMSetup:
    """Host-side LLM objects of a run: the model (params + config), tokenizer, template and prefix cache."""

    model: Any  # jaxllm model (None for --encoder vllm)
    tokenizer: Any
    template: Any  # render.Template
    prefix_cache: Any  # jaxllm.PrefixCache (None for --encoder vllm)
    hidden_size: int

    @property
    def jit_args(self) -> LLMArgs:
        """The arrays the jitted trainer takes as explicit arguments."""
        return LLMArgs(self.model.params, self.prefix_cache) if self.model is not None else LLMArgs()


def load_llm(cfg, *, env: str | None = None, with_model: bool = True, system_prompt: Any = None) -> LLMSetup:
    """Load the model, tokenizer and template of LLM settings `cfg` (`rl.config.LLMConfig`, or a config that has
    them, e.g. `TrainConfig`) for game `env` (default: `cfg.env`); compute the prompt head's KV cache once.

    `system_prompt` overrides `cfg.system_prompt` (used by rl.eval's other-prompt ablation).
    """
    from jaxllm import load_model, load_tokenizer, prefill
    from render import build_template

    system_prompt = cfg.system_prompt if system_prompt is None else system_prompt
    tokenizer = load_tokenizer(cfg.model)
    template = build_template(tokenizer, env or cfg.env, fmt=cfg.obs_format, system_prompt=system_prompt,
                              assembly=cfg.template_assembly)
    if not with_model:
        return LLMSetup(None, tokenizer, template, None, 0)
    dtype = None if cfg.llm_dtype == "auto" else cfg.llm_dtype
    model = load_model(cfg.model, dtype=dtype)
    cache = jax.jit(prefill, static_argnums=1)(model.params, model.config,
                                               np.asarray(template.prefix_ids, np.int32))
    return LLMSetup(model, tokenizer, template, cache, int(model.config.hidden_size))


ENCODE_METHODS = ("bucketed", "packed")  # how make_ids_encoder lays a batch of prompts out for the LLM


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


def make_token_fn(template) -> Callable:
    """Jitted raw_states [B] -> (ids int32 [B, T], lengths int32 [B]) (the host path's first half)."""
    return jax.jit(jax.vmap(template))


def check_vllm_reachable(url: str, timeout: float) -> None:
    """Raise ConnectionError naming `url` unless its `/health` answers within `timeout` seconds."""
    from jaxllm.http.client import VLLMClient

    client = VLLMClient(url, timeout=timeout, retries=0)
    try:
        client.health()
    except Exception as e:  # the client's VLLMError (or a bad URL): say what the trainer needed
        raise ConnectionError(f"vLLM server at {url} is not reachable ({e}); start one (scripts/start_vllm.sh, "
                              f"or `python -m jaxllm.http.server --model tiny --port PORT`) or pass --vllm-url") from None
    finally:
        client.close()


class VLLMEncoder:
    """Hidden states from an HTTP server speaking vLLM's `/v1/embeddings` (token ids, never strings)."""

    def __init__(self, url: str, template, *, timeout: float = 30.0):
        from jaxllm.http.client import VLLMClient

        self.url = url
        self.prefix = list(template.prefix_ids)
        self.client = VLLMClient(url, timeout=timeout, encoding_format="base64")
        self.seconds = 0.0  # wall time spent waiting for the server (for the LLM time share)

    def __call__(self, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        t0 = time.perf_counter()
        prompts = [self.prefix + ids[i, : int(lengths[i])].tolist() for i in range(ids.shape[0])]
        out = np.asarray(self.client.embed(prompts), np.float32)
        self.seconds += time.perf_counter() - t0
        return out
