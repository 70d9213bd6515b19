"""Qwen3 parameters: deterministic random init, and loading HF safetensors checkpoints into the stacked layout.

Loading works leaf by leaf: each stacked array is preallocated on the host in the target dtype, filled tensor by
tensor from the memory-mapped shards (transposing [out, in] -> [in, out]), moved to the device and released, so
peak host memory stays near one copy of the weights (on a GPU backend: near the largest stacked leaf).
"""
from __future__ import annotations

import contextlib
import json
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open

from .config import Qwen3Config
from .model import Params
from .params import LAYER_KEYS, LAYER_LEAVES, TOP_LEAVES, leaf_of

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Buffers some exporters write that carry no weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint directory or file that cannot be loaded as the configured Qwen3 model."""


def layer_shapes(config: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """Per-layer (unstacked) shapes of the decoder-layer leaves, in our [in, out] layout."""
    return {name: leaf.shape(config) for name, leaf in LAYER_LEAVES.items()}


def param_shapes(config: Qwen3Config, with_lm_head: bool | None = None) -> dict[str, Any]:
    """Shapes of the full params pytree. `with_lm_head` defaults to "untied"."""
    if with_lm_head is None:
        with_lm_head = not config.tie_word_embeddings
    n = config.num_hidden_layers
    shapes: dict[str, Any] = {name: leaf.shape(config) for name, leaf in TOP_LEAVES.items()
                              if name != "lm_head" or with_lm_head}
    shapes["layers"] = {k: (n,) + s for k, s in layer_shapes(config).items()}
    return shapes


@partial(jax.jit, static_argnames=("config", "dtype"))
def init_params(config: Qwen3Config, dtype: Any = jnp.float32, seed: int | jax.Array = 0) -> Params:
    """Deterministic random params like HF's init: matrices ~ N(0, initializer_range), norm weights = 1.

    Values are drawn in float32 then cast, so one seed gives the same model (up to rounding) in every dtype,
    process and backend. Runs under jit, so the arrays are created directly on the default device.
    """
    shapes = param_shapes(config)
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    base = jax.random.key(seed)
    leaves = []
    for index, (path, shape) in enumerate(flat):
        if leaf_of(tuple(k.key for k in path)).init == "ones":
            leaves.append(jnp.ones(shape, dtype))
        else:
            noise = jax.random.normal(jax.random.fold_in(base, index), shape, jnp.float32)
            leaves.append((noise * config.initializer_range).astype(dtype))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _hf_key_plan(config: Qwen3Config, prefix: str, with_lm_head: bool) -> dict[str, list[tuple[str, bool]]]:
    """Our leaf path ('layers/q_proj', 'embed_tokens', ...) -> list of (HF key, transpose), one per layer."""
    plan: dict[str, list[tuple[str, bool]]] = {}
    for name, leaf in TOP_LEAVES.items():
        if name != "lm_head":
            plan[name] = [(f"{prefix}{leaf.hf_name}", leaf.transpose)]
    for name, leaf in LAYER_LEAVES.items():
        plan[f"layers/{name}"] = [(f"{prefix}layers.{i}.{leaf.hf_name}", leaf.transpose)
                                  for i in range(config.num_hidden_layers)]
    if with_lm_head:
        head = TOP_LEAVES["lm_head"]
        plan["lm_head"] = [(head.hf_name, head.transpose)]
    return plan


def _index_files(ckpt_dir: Path) -> dict[str, Path]:
    """HF key -> shard path, from the index file or the single safetensors file, checking headers."""
    index_path = ckpt_dir / INDEX_FILE
    single_path = ckpt_dir / SINGLE_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path}: not a valid safetensors index (needs a 'weight_map'): {e}") from None
        files = sorted(set(weight_map.values()))
    elif single_path.is_file():
        weight_map, files = None, [SINGLE_FILE]
    else:
        raise CheckpointError(f"{ckpt_dir}: no weights found; expected {SINGLE_FILE} or {INDEX_FILE} "
                              f"(safetensors checkpoints as written by save_pretrained)")
    key_to_file: dict[str, Path] = {}
    for name in files:
        path = ckpt_dir / name
        if not path.is_file():
            raise CheckpointError(f"{path}: shard listed in {INDEX_FILE} is missing")
        try:
            with safe_open(str(path), framework="flax") as f:
                keys = list(f.keys())
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path}: corrupt or unreadable safetensors file ({e})") from None
        for key in keys:
            key_to_file[key] = path
    if weight_map is not None:
        for key, name in weight_map.items():
            if key_to_file.get(key) != ckpt_dir / name:
                raise CheckpointError(f"{index_path}: key '{key}' is mapped to {name}, but that shard does not "
                                      f"contain it")
    return key_to_file


def _detect_prefix(keys: list[str]) -> str:
    """'model.' for Qwen3ForCausalLM checkpoints, '' for bare Qwen3Model checkpoints."""
    return "model." if any(k.startswith("model.") for k in keys) else ""


def load_params(ckpt_dir: str | Path, config: Qwen3Config, dtype: Any) -> Params:
    """Loads a safetensors checkpoint (single file or sharded) into the stacked params pytree on the device.

    Accepts Qwen3ForCausalLM (keys under `model.`, `lm_head.weight` required when untied, ignored when tied) and
    bare Qwen3Model layouts (no prefix, no head: such a model has no logits when untied). Any missing, unexpected or mis-shaped tensor raises CheckpointError naming the file and key;
    nothing is ever partially loaded.
    """
    ckpt_dir = Path(ckpt_dir)
    key_to_file = _index_files(ckpt_dir)
    prefix = _detect_prefix(list(key_to_file))
    # A Qwen3ForCausalLM checkpoint with untied embeddings must carry its LM head; a bare Qwen3Model has none.
    load_lm_head = bool(prefix) and not config.tie_word_embeddings
    plan = _hf_key_plan(config, prefix, load_lm_head)
    shapes = param_shapes(config, with_lm_head=load_lm_head)

    expected = {key for entries in plan.values() for key, _ in entries}
    missing = sorted(expected - set(key_to_file))
    if missing:
        layout = "Qwen3ForCausalLM" if prefix else "Qwen3Model"
        raise CheckpointError(f"{ckpt_dir}: {len(missing)} tensor(s) missing for a {layout} checkpoint with "
                              f"{config.num_hidden_layers} layers, e.g. '{missing[0]}'")
    unexpected = sorted(k for k in set(key_to_file) - expected
                        if not k.endswith(_IGNORED_SUFFIXES) and k != TOP_LEAVES["lm_head"].hf_name)
    if unexpected:
        k = unexpected[0]
        raise CheckpointError(f"{key_to_file[k]}: unexpected tensor '{k}' ({len(unexpected)} in all); the "
                              f"checkpoint does not match its config.json (e.g. num_hidden_layers)")

    np_dtype = np.dtype(jnp.dtype(dtype))
    cpu = jax.devices("cpu")[0]
    params: dict[str, Any] = {"layers": {}}
    with contextlib.ExitStack() as stack, jax.default_device(cpu):
        handles: dict[Path, Any] = {}

        def read(key: str) -> np.ndarray:
            path = key_to_file[key]
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(str(path), framework="flax"))
            try:
                return np.asarray(handles[path].get_tensor(key))
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{path}: cannot read tensor '{key}' ({e})") from None

        for leaf, entries in plan.items():
            shape = shapes["layers"][leaf.split("/")[1]] if leaf.startswith("layers/") else shapes[leaf]
            host = np.empty(shape, np_dtype)
            stacked = leaf.startswith("layers/")
            for i, (key, transpose) in enumerate(entries):
                tensor = read(key)
                if transpose:
                    tensor = tensor.T
                want = shape[1:] if stacked else shape
                if tensor.shape != tuple(want):
                    hf_shape = tuple(reversed(want)) if transpose else tuple(want)
                    raise CheckpointError(f"{key_to_file[key]}: tensor '{key}' has shape "
                                          f"{tuple(reversed(tensor.shape)) if transpose else tensor.shape}, "
                                          f"expected {hf_shape} from config.json")
                if stacked:
                    host[i] = tensor
                else:
                    host[...] = tensor
                del tensor
            with jax.default_device(jax.devices()[0]):
                on_device = jax.device_put(host, jax.devices()[0])
            del host
            if stacked:
                params["layers"][leaf.split("/")[1]] = on_device
            else:
                params[leaf] = on_device
    assert set(params["layers"]) == set(LAYER_KEYS)
    return params
