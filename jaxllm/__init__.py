"""jaxllm: a pure-JAX Qwen3 encoder (HF-exact numerics) that turns prompts into hidden states inside jit.

    from jaxllm import load_model, load_tokenizer
    model = load_model("tiny")                      # or a checkpoint dir / cached hub id / "qwen3-4b"
    vec = model.encode(ids, lengths, layer=-1, pooling="last", prefix=model.prefill(prefix_ids))

Pure functions for use inside another jit/scan: `encode`, `prefill`, `hidden_states` (config static).
"""
from .api import Model, default_dtype, load_model, model_shapes, prefill_shapes
from .config import PRESETS, ConfigError, Qwen3Config
from .encoder import PrefixCache, default_capacity, encode, encode_bucketed, encode_packed, length_buckets, pass_capacities, prefill
from .memory import ModelTooLargeError, check_fits, weight_bytes
from .model import hidden_states, logits
from .resolve import ModelNotFoundError
from .tokenizer import check_tokenizer, load_tokenizer
from .weights import CheckpointError, init_params, load_params

__all__ = [
    "CheckpointError", "ConfigError", "Model", "ModelNotFoundError", "ModelTooLargeError", "check_fits", "weight_bytes", "PRESETS", "PrefixCache", "Qwen3Config",
    "check_tokenizer", "default_capacity", "default_dtype", "encode", "encode_bucketed", "encode_packed", "length_buckets", "pass_capacities", "hidden_states", "init_params", "load_model", "load_params", "model_shapes", "prefill_shapes",
    "load_tokenizer", "logits", "prefill",
]
