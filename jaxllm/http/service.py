"""The HTTP-independent half of the server: request limits, validation, batching hand-off, response bodies.

Limits bound the work one request and one encoder call may ask for, as vLLM's ``--max-model-len`` and
``--max-num-batched-tokens`` do: a prompt over ``max_model_len`` tokens gets 400 (vLLM's message), a request
over ``max_request_tokens`` tokens or ``max_body_bytes`` bytes gets 413, and the encoder never runs a call of
more than ``max_batch_tokens`` padded tokens. Their defaults fit the memory of the device the server runs on
(``default_limits``).
"""
from __future__ import annotations

import base64
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from .batching import BatchingEncoder, bucket

__all__ = ["EmbeddingService", "Limits", "RequestError", "default_limits", "free_device_memory", "limits_for",
           "short_repr"]


class RequestError(Exception):
    """A request the server refuses: HTTP ``status``, vLLM error ``kind`` and a message for the caller."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


def short_repr(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, so an error never echoes a huge bad value back."""
    text = repr(value) if not isinstance(value, (list, dict)) or len(value) < limit else \
        f"<{type(value).__name__} of {len(value)} items>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


TEXT_REFUSAL = ("this server takes token ids, not text: send 'input' as a list of token-id lists "
                "(tokenize with the model's tokenizer first, e.g. render's template)")


@dataclass(frozen=True)
class Limits:
    """What one request and one encoder call may ask for (see the module docstring)."""

    max_model_len: int  # tokens in one prompt
    max_batch_tokens: int  # padded B x T of one encoder call
    max_request_tokens: int  # tokens in one request, all prompts together
    max_body_bytes: int  # bytes of one request body

    def __post_init__(self):
        bad = {k: v for k, v in vars(self).items() if not isinstance(v, int) or v < 1}
        if bad:
            raise ValueError(f"limits must be positive integers, got {bad}")
        if self.max_request_tokens < self.max_model_len:
            raise ValueError(f"max_request_tokens={self.max_request_tokens} is below max_model_len="
                             f"{self.max_model_len}: one full-length prompt could never be sent")


def free_device_memory() -> int:
    """Bytes free for activations on the default JAX device: the allocator's limit minus what is in use on a
    GPU, MemAvailable of /proc/meminfo on a CPU (4 GiB where neither is known)."""
    import jax

    stats = jax.local_devices()[0].memory_stats() if jax.default_backend() != "cpu" else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30 if os.name != "posix" else int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def bytes_per_token(config: Any, length: int, quadratic_attention: bool) -> int:
    """A generous estimate of the activation bytes one padded token costs in one encoder call (float32, one
    layer live at a time, the layer scan's carry and the MLP's intermediates), plus the [heads, T] float32
    attention logits and probabilities per token where attention is materialised (XLA; not cuDNN's flash)."""
    mlp = 3 * config.intermediate_size
    if config.is_moe:  # each of its k token-expert rows: the gathered input, gate+up, the product, the output
        mlp = max(mlp, config.num_experts_per_tok * (2 * config.hidden_size + 3 * config.moe_intermediate_size))
    linear = 4 * (6 * config.hidden_size + mlp
                  + 2 * (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim)
    return linear + (3 * 4 * config.num_attention_heads * length if quadratic_attention else 0)


ALWAYS_FITTING_LEN = 8192


def default_limits(config: Any, free_bytes: int, *, quadratic_attention: bool, max_batch: int,
                   per_octave: int = 2, memory_fraction: float = 0.5) -> Limits:
    """Limits that fit ``memory_fraction`` of ``free_bytes`` per encoder call.

    max_model_len: the longest bucketed length, at most the model's positions, whose one prompt costs at most
    1/8 of that budget (a call can hold eight of them), or up to ``ALWAYS_FITTING_LEN`` tokens (every Craftax
    prompt) whose one prompt fits the whole budget; max_batch_tokens: the budget over the per-token cost at that
    length (at least one full-length prompt); max_request_tokens: ``max_batch`` full-length prompts.
    """
    budget = int(free_bytes * memory_fraction)
    longest, length = 16, 16
    while length <= config.max_position_embeddings:
        cost = length * bytes_per_token(config, length, quadratic_attention)
        if cost > budget // 8 and not (length <= ALWAYS_FITTING_LEN and cost <= budget):
            break
        longest = length
        length = bucket(length + 1, 16, 1 << 40, per_octave)
    max_model_len = max(16, min(longest, config.max_position_embeddings))
    max_batch_tokens = max(max_model_len, budget // bytes_per_token(config, max_model_len, quadratic_attention))
    max_request_tokens = max_batch * max_model_len
    return Limits(max_model_len, max_batch_tokens, max_request_tokens, body_bytes_for(max_request_tokens))


def limits_for(max_model_len: int, max_batch: int = 64) -> Limits:
    """Limits without a memory model: ``max_batch`` prompts of ``max_model_len`` per call and per request."""
    tokens = max_batch * max_model_len
    return Limits(max_model_len, tokens, tokens, body_bytes_for(tokens))


def body_bytes_for(request_tokens: int) -> int:
    """A body limit that holds ``request_tokens`` ids written as JSON with generous spacing (16 bytes each)."""
    return max(1 << 20, 16 * request_tokens)


class EmbeddingService:
    """Validation, batching and response bodies of vLLM's embeddings API, independent of the HTTP server.

    It can exist before the model does (the server answers /health with 503 while loading): ``attach``
    the encoder and limits once the model is loaded, then set ``ready`` after warm-up.
    """

    def __init__(self, model_name: str, encoder: BatchingEncoder | None = None, *, vocab_size: int = 0,
                 limits: Limits | None = None):
        self.model_name = model_name
        self.encoder = encoder
        self.vocab_size = vocab_size
        self.limits = limits
        self.ready = threading.Event()
        self.created = int(time.time())

    @property
    def max_body_bytes(self) -> int:
        """The body limit in force (64 MiB while the model loads)."""
        return self.limits.max_body_bytes if self.limits else 64 << 20

    def attach(self, encoder: BatchingEncoder, vocab_size: int, limits: Limits) -> None:
        """Plug in the loaded model's encoder and limits (``ready`` stays unset until the caller sets it)."""
        self.encoder, self.vocab_size, self.limits = encoder, vocab_size, limits

    def models(self) -> dict:
        max_len = self.limits.max_model_len if self.limits else None
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "jaxllm",
                "root": self.model_name, "parent": None, "max_model_len": max_len, "permission": []}
        return {"object": "list", "data": [card]}

    def parse_prompts(self, request: Any) -> tuple[list[list[int]], str]:
        """Validated prompts and encoding format of a decoded request body; RequestError when bad."""
        if not isinstance(request, dict):
            raise RequestError(400, f"the request body must be a JSON object, got {type(request).__name__}")
        model = request.get("model")
        if model is not None and model != self.model_name:
            name = model[:60] if isinstance(model, str) else short_repr(model)
            raise RequestError(404, f"The model `{name}` does not exist; this server serves "
                               f"{self.model_name!r} (GET /v1/models)", kind="NotFoundError", param="model")
        if "input" not in request:
            raise RequestError(400, "'input' is required: a list of token-id lists", param="input")
        raw = request["input"]
        fmt = request.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise RequestError(400, f"encoding_format must be 'float' or 'base64', got {short_repr(fmt)}",
                               param="encoding_format")
        for unsupported in ("dimensions", "truncate_prompt_tokens"):
            if request.get(unsupported) is not None:
                raise RequestError(400, f"'{unsupported}' is not supported by this server", param=unsupported)
        if isinstance(raw, str) or (isinstance(raw, list) and any(isinstance(x, str) for x in raw)):
            raise RequestError(400, TEXT_REFUSAL, param="input")
        if not isinstance(raw, list):
            raise RequestError(400, f"'input' must be a list of token-id lists (or one token-id list), got "
                               f"{type(raw).__name__}", param="input")
        if not raw:
            raise RequestError(400, "'input' is empty: send at least one non-empty token-id list", param="input")
        prompts = [raw] if all(not isinstance(x, list) for x in raw) else raw
        self._check_budget(prompts)
        for i, prompt in enumerate(prompts):
            self._check_prompt(i, prompt)
        return prompts, fmt

    def _check_budget(self, prompts: list) -> None:
        limits = self.limits
        total = sum(len(p) if isinstance(p, list) else 1 for p in prompts)
        if total > limits.max_request_tokens:
            raise RequestError(413, f"the request holds {total} tokens, over this server's limit of "
                               f"{limits.max_request_tokens} per request (--max-request-tokens): send fewer or "
                               "shorter prompts per request", param="input")

    def _check_prompt(self, i: int, prompt: Any) -> None:
        if not isinstance(prompt, list) or not prompt:
            raise RequestError(400, f"input[{i}] must be a non-empty list of token ids, got {short_repr(prompt)}",
                               param="input")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = next(t for t in prompt if not isinstance(t, int) or isinstance(t, bool))
            if isinstance(bad, str):
                raise RequestError(400, TEXT_REFUSAL, param="input")
            raise RequestError(400, f"input[{i}] holds {short_repr(bad)}; token ids must be integers", param="input")
        max_len = self.limits.max_model_len
        if len(prompt) > max_len:
            raise RequestError(400, f"This model's maximum context length is {max_len} tokens. However, "
                               f"you requested {len(prompt)} tokens in the input for embedding generation "
                               f"(input[{i}]). Please reduce the length of the input.", param="input")
        low, high = min(prompt), max(prompt)
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            raise RequestError(400, f"input[{i}] has token id {bad} outside the vocabulary [0, {self.vocab_size})",
                               param="input")

    def check_ready(self) -> None:
        if not self.ready.is_set():
            raise RequestError(503, "the model is still loading or compiling; poll GET /health",
                               kind="ServiceUnavailableError")

    def response(self, vectors: Any, prompts: list[list[int]], fmt: str) -> dict:
        """The body of a successful ``POST /v1/embeddings``."""
        if fmt == "base64":
            encoded = [base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") for v in vectors]
        else:
            encoded = [v.tolist() for v in vectors]
        tokens = sum(len(p) for p in prompts)
        return {"id": f"embd-{time.time_ns():x}", "object": "list", "created": int(time.time()),
                "model": self.model_name,
                "data": [{"index": i, "object": "embedding", "embedding": e} for i, e in enumerate(encoded)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                          "prompt_tokens_details": None}}

    def embeddings(self, request: Any, timeout: float | None = None) -> dict:
        """The response body of ``POST /v1/embeddings`` computed in the calling thread (raises RequestError)."""
        self.check_ready()
        prompts, fmt = self.parse_prompts(request)
        return self.response(self.encoder.submit(prompts).result(timeout=timeout), prompts, fmt)
