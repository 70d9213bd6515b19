"""Where the policy's LLM hidden state comes from: the in-scan JAX encoder or a vLLM-API server.

Both turn a batch of raw craftax states into float32 [B, D] through the same token template
(`render.build_template`): the constant prompt head (`tpl.prefix_ids`) is followed by the state's
ids. In-scan, the head's KV cache is computed once per run (`rl.llm.load_llm`: `jaxllm.Model.prefill`) and passed to
every jitted call as an argument (never a closed-over constant: for Qwen3-4B it is gigabytes). Loading the LLM and
its encode functions live in `rl.llm`, the one LLM path of every tool.
"""
from __future__ import annotations

import time
from typing import Callable

import jax
import numpy as np


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
