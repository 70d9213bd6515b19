"""Qwen3 parameters: deterministic random init, and loading HF safetensors checkpoints into the stacked layout.

Loading works leaf by leaf: each stacked array is preallocated on the host in the target dtype, filled tensor by
tensor from the memory-mapped shards (transposing [out, in] -> [in, out]), moved to the device and released, so
peak host memory stays near one copy of the weights (on a GPU backend: near the largest stacked leaf).
"""
from __future__ import annotations

import contextlib
import json
import re
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from safetensors import SafetensorError, safe_open

from . import fp8
from .config import Qwen3Config
from .model import Params
from .params import EXPERT_LEAVES, TOP_LEAVES, layer_stacks, leaf_of, layer_leaves

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_EXPERT_KEY = re.compile(r"\.mlp\.experts\.(\d+)\.")
# Buffers some exporters write that carry no weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint directory or file that cannot be loaded as the configured Qwen3 model."""


def layer_shapes(config: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """Per-layer (unstacked) shapes of the leaves stacked over all layers (`params["layers"]`), [in, out] layout."""
    return {name: leaf.shape(config) for name, leaf in layer_leaves(config).items()}


def param_shapes(config: Qwen3Config, with_lm_head: bool | None = None) -> dict[str, Any]:
    """Shapes of the full params pytree. `with_lm_head` defaults to "untied"."""
    if with_lm_head is None:
        with_lm_head = not config.tie_word_embeddings
    shapes: dict[str, Any] = {name: leaf.shape(config) for name, leaf in TOP_LEAVES.items()
                              if name != "lm_head" or with_lm_head}
    for stack, (leaves, indices) in layer_stacks(config).items():
        shapes[stack] = {k: (len(indices),) + leaf.shape(config) for k, leaf in leaves.items()}
    return shapes


@partial(jax.jit, static_argnames=("config", "dtype", "fp8_experts"))
def init_params(config: Qwen3Config, dtype: Any = jnp.float32, seed: int | jax.Array = 0,
                fp8_experts: bool = False) -> Params:
    """Deterministic random params like HF's init: matrices ~ N(0, initializer_range), norm weights = 1.

    Values are drawn in float32 then cast, so one seed gives the same model (up to rounding) in every dtype,
    process and backend. Runs under jit, so the arrays are created directly on the default device. An MoE's
    experts are drawn one layer at a time and, with `fp8_experts`, quantised as they are drawn
    (`fp8.quantize_out_in`), so neither a float32 nor a second full copy of them ever exists.
    """
    shapes = param_shapes(config)
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    base = jax.random.key(seed)
    leaves = []
    for index, (path, shape) in enumerate(flat):
        names = tuple(k.key for k in path)
        if leaf_of(names).init == "ones":
            leaves.append(jnp.ones(shape, dtype))
        elif names[0] == "experts":
            # one layer at a time: a float32 draw of a whole expert stack would be 77 GB at Qwen3-30B-A3B's shape
            key = jax.random.fold_in(base, index)
            quantize = fp8_experts and names[1] in fp8.EXPERT_QUANTIZED_LEAVES
            leaves.append(lax.map(lambda i, key=key, shape=shape, quantize=quantize: _expert_transform(quantize)(
                _normal(jax.random.fold_in(key, i), shape[1:], config.initializer_range, dtype)),
                jnp.arange(shape[0])))
        else:
            leaves.append(_normal(jax.random.fold_in(base, index), shape, config.initializer_range, dtype))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _expert_transform(quantize: bool) -> Any:
    return fp8.quantize_out_in if quantize else (lambda w: w)


def _normal(key: jax.Array, shape: tuple[int, ...], std: float, dtype: Any) -> jax.Array:
    return (jax.random.normal(key, shape, jnp.float32) * std).astype(dtype)


# One stacked slice of a leaf, read from the checkpoint: a list of (HF key, transpose) whose tensors are
# concatenated along axis 0 (one key for most leaves; per-expert keys for the experts) and an optional final
# stacking of groups (the experts' axis).
class _Slice(NamedTuple):
    groups: tuple[tuple[tuple[str, bool], ...], ...]  # per expert (or one group): keys concatenated on axis 0
    stacked: bool = False  # the groups are stacked on a new axis 0 (the experts)


def _expert_slice(name: str, layer_prefix: str, config: Qwen3Config, fused: bool) -> _Slice:
    """Where sparse layer `layer_prefix`'s expert leaf `name` comes from: transformers' fused tensor, or one
    tensor (gate_up: two) per expert, as the hub publishes them."""
    if fused:
        return _Slice(((( f"{layer_prefix}{EXPERT_LEAVES[name].hf_name}", False),),))
    parts = ("gate_proj", "up_proj") if name == "gate_up" else ("down_proj",)
    return _Slice(tuple(tuple((f"{layer_prefix}mlp.experts.{e}.{part}.weight", False) for part in parts)
                        for e in range(config.num_experts)), stacked=True)


def _hf_key_plan(config: Qwen3Config, prefix: str, with_lm_head: bool,
                 keys: set[str] = frozenset()) -> dict[str, list[_Slice]]:
    """Our leaf path ('layers/q_proj', 'experts/gate_up', 'embed_tokens', ...) -> one `_Slice` per stacked
    layer (one for a top leaf). `keys`: the checkpoint's keys (chooses fused or per-expert expert tensors)."""
    plan: dict[str, list[_Slice]] = {}
    for name, leaf in TOP_LEAVES.items():
        if name != "lm_head":
            plan[name] = [_Slice((((f"{prefix}{leaf.hf_name}", leaf.transpose),),))]
    for stack, (leaves, indices) in layer_stacks(config).items():
        for name, leaf in leaves.items():
            slices = []
            for i in indices:
                layer_prefix = f"{prefix}layers.{i}."
                if stack == "experts" and name != "router":
                    fused = f"{layer_prefix}{EXPERT_LEAVES['gate_up'].hf_name}" in keys
                    slices.append(_expert_slice(name, layer_prefix, config, fused))
                else:
                    slices.append(_Slice((((f"{layer_prefix}{leaf.hf_name}", leaf.transpose),),)))
            plan[f"{stack}/{name}"] = slices
    if with_lm_head:
        head = TOP_LEAVES["lm_head"]
        plan["lm_head"] = [_Slice((((head.hf_name, head.transpose),),))]
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


def _layout_name(config: Qwen3Config, prefix: str) -> str:
    base = "Qwen3Moe" if config.is_moe else "Qwen3"
    return f"{base}ForCausalLM" if prefix else f"{base}Model"


def _unexpected_message(key: str, path: Path, count: int, config: Qwen3Config) -> str:
    """One line for a checkpoint tensor the config does not account for (an expert count that disagrees first)."""
    match = _EXPERT_KEY.search(key)
    if match and int(match.group(1)) >= config.num_experts:
        return (f"{path}: tensor '{key}' is expert {match.group(1)}, but config.json says num_experts="
                f"{config.num_experts}; the checkpoint and its config disagree on the expert count")
    if ".mlp.experts." in key or ".mlp.gate." in key:
        return (f"{path}: unexpected tensor '{key}' ({count} in all): an expert or router where config.json has "
                f"a dense layer (num_experts, decoder_sparse_step, mlp_only_layers)")
    return (f"{path}: unexpected tensor '{key}' ({count} in all); the checkpoint does not match its config.json "
            f"(e.g. num_hidden_layers)")


def _expected_key_shapes(leaf_shape: tuple[int, ...], piece: _Slice, transpose: bool) -> list[tuple[int, ...]]:
    """The HF shape of each tensor of one stacked slice, in `piece.groups` order."""
    shapes = []
    for group in piece.groups:
        part = leaf_shape[1:] if piece.stacked else leaf_shape
        rows = part[0] // len(group)
        for _ in group:
            shape = (rows,) + tuple(part[1:]) if len(group) > 1 else tuple(part)
            shapes.append(tuple(reversed(shape)) if transpose else shape)
    return shapes


def load_params(ckpt_dir: str | Path, config: Qwen3Config, dtype: Any,
                host_stack_bytes: int = 1 << 30, fp8_experts: bool = False) -> Params:
    """Loads a safetensors checkpoint (single file or sharded) into the stacked params pytree on the device.

    Accepts Qwen3ForCausalLM / Qwen3MoeForCausalLM (keys under `model.`, `lm_head.weight` required when untied,
    ignored when tied) and bare Qwen3Model / Qwen3MoeModel layouts (no prefix, no head: such a model has no logits
    when untied). MoE experts come one tensor per expert (the hub's layout, as save_pretrained writes it) or
    fused per layer (`experts.gate_up_proj`, `experts.down_proj`). Any missing, unexpected or mis-shaped tensor
    raises CheckpointError naming the file and key; nothing is ever partially loaded.

    Streamed: a stacked leaf of at most `host_stack_bytes` is assembled on the host and moved in one copy; a larger
    one (the experts of a big MoE) is moved layer by layer into its device buffer, so host memory stays near one
    layer's slice of it. `fp8_experts`: an MoE's experts are quantised layer by layer on the device as they arrive
    (`fp8.quantize_out_in`), so their 16-bit copy never exists whole.
    """
    ckpt_dir = Path(ckpt_dir)
    key_to_file = _index_files(ckpt_dir)
    prefix = _detect_prefix(list(key_to_file))
    # A Qwen3ForCausalLM checkpoint with untied embeddings must carry its LM head; a bare Qwen3Model has none.
    load_lm_head = bool(prefix) and not config.tie_word_embeddings
    plan = _hf_key_plan(config, prefix, load_lm_head, set(key_to_file))
    shapes = param_shapes(config, with_lm_head=load_lm_head)

    expected = {key for slices in plan.values() for piece in slices for group in piece.groups for key, _ in group}
    missing = sorted(expected - set(key_to_file))
    if missing:
        raise CheckpointError(f"{ckpt_dir}: {len(missing)} tensor(s) missing for a {_layout_name(config, prefix)} "
                              f"checkpoint with {config.num_hidden_layers} layers, e.g. '{missing[0]}'")
    unexpected = sorted(k for k in set(key_to_file) - expected
                        if not k.endswith(_IGNORED_SUFFIXES) and k != TOP_LEAVES["lm_head"].hf_name)
    if unexpected:
        k = next((k for k in unexpected if _EXPERT_KEY.search(k)), unexpected[0])
        raise CheckpointError(_unexpected_message(k, key_to_file[k], len(unexpected), config))

    np_dtype = np.dtype(jnp.dtype(dtype))
    device = jax.devices()[0]
    params: dict[str, Any] = {}
    with contextlib.ExitStack() as stack, jax.default_device(jax.devices("cpu")[0]):
        handles: dict[Path, Any] = {}

        def read(key: str, transpose: bool, want: tuple[int, ...]) -> np.ndarray:
            path = key_to_file[key]
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(str(path), framework="flax"))
            try:
                tensor = np.asarray(handles[path].get_tensor(key))
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{path}: cannot read tensor '{key}' ({e})") from None
            if tensor.shape != want:
                raise CheckpointError(f"{path}: tensor '{key}' has shape {tensor.shape}, expected {want} from "
                                      f"config.json")
            return tensor.T if transpose else tensor

        def assemble(piece: _Slice, leaf_shape: tuple[int, ...]) -> np.ndarray:
            transposes = [t for group in piece.groups for _, t in group]
            wants = iter(_expected_key_shapes(leaf_shape, piece, transposes[0]))
            groups = [np.concatenate([read(key, t, next(wants)) for key, t in group], axis=0)
                      if len(group) > 1 else read(group[0][0], group[0][1], next(wants)) for group in piece.groups]
            out = np.stack(groups) if piece.stacked else groups[0]
            return out.astype(np_dtype, copy=False)

        for path, slices in plan.items():
            parts = path.split("/")
            shape = shapes[parts[0]][parts[1]] if len(parts) == 2 else shapes[path]
            quantize = fp8_experts and parts[0] == "experts" and parts[-1] in fp8.EXPERT_QUANTIZED_LEAVES
            if len(parts) == 1:
                value = jax.device_put(assemble(slices[0], shape), device)
            elif not quantize and np.prod(shape) * np_dtype.itemsize <= host_stack_bytes:
                host = np.empty(shape, np_dtype)
                for i, piece in enumerate(slices):
                    host[i] = assemble(piece, shape[1:])
                value = jax.device_put(host, device)
                del host
            else:
                transform = _quantize_on_device if quantize else (lambda layer: layer)
                layers = (transform(jax.device_put(assemble(piece, shape[1:]), device)) for piece in slices)
                value = _stack_on_device(layers, len(slices), jax.ShapeDtypeStruct(shape[1:], np_dtype), transform,
                                         device)
            if len(parts) == 2:
                params.setdefault(parts[0], {})[parts[1]] = value
            else:
                params[path] = value
    return params


_quantize_on_device = jax.jit(fp8.quantize_out_in)


def _zeros_on(device: Any, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    with jax.default_device(device):
        return jax.jit(lambda: jnp.zeros(shape, dtype))()


def _stack_on_device(layers: Any, count: int, layer_shape: jax.ShapeDtypeStruct, transform: Any,
                     device: Any) -> Any:
    """The `count` per-layer results of `layers` (each `transform` of a `layer_shape` slice: an array or a pytree
    such as an Fp8Matrix) stacked on a new axis 0, written one by one into buffers allocated once on `device`."""
    value = jax.tree.map(lambda a: _zeros_on(device, (count,) + a.shape, a.dtype),
                         jax.eval_shape(transform, layer_shape))
    for i, layer in enumerate(layers):
        value = jax.tree.map(lambda stacked, new, i=i: _set_layer(stacked, new, i), value, layer)
    return value


@partial(jax.jit, donate_argnums=0)
def _set_layer_donated(stacked: jax.Array, layer: jax.Array, index: int) -> jax.Array:
    return lax.dynamic_update_index_in_dim(stacked, layer, index, 0)


def _set_layer(stacked: jax.Array, layer: jax.Array, index: int) -> jax.Array:
    """stacked with `layer` written at `index` of axis 0, in place where the backend can donate buffers."""
    if stacked.devices() == {jax.devices("cpu")[0]}:
        return lax.dynamic_update_index_in_dim(stacked, layer, index, 0)
    return _set_layer_donated(stacked, layer, index)
