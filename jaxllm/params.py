"""The Qwen3 parameter table: every leaf of the params pytree described once.

Each `Leaf` gives the HF checkpoint name, the shape in our layout (projections [in, out]), whether loading
transposes HF's [out, in], and how random init fills it. The decoder-layer leaves (`LAYER_LEAVES`) are stacked on a
leading layer axis; `LAYER_KEYS`, `weights.param_shapes`, the checkpoint key plan, `weights.init_params` and
`fp8.QUANTIZED_LEAVES` are all derived from these tables.

A mixture-of-experts config (`Qwen3Config.is_moe`) keeps the attention leaves and norms in `layers` (all L layers)
and moves each layer's feed-forward block to one of two stacks of its own: `experts` (the sparse layers: router
and the stacked experts, `EXPERT_LEAVES`) and `dense_mlp` (the dense layers among them, `MLP_LEAVES`).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from .config import Qwen3Config

INITS = ("normal", "ones")  # N(0, initializer_range) | 1.0 (norm weights)


class Leaf(NamedTuple):
    """One parameter leaf: HF name (under `layers.{i}.` for a layer leaf), shape in our layout, transpose, init."""

    hf_name: str
    shape: Callable[[Qwen3Config], tuple[int, ...]]  # per layer for a layer leaf
    transpose: bool  # HF stores [out, in]; we store [in, out]
    init: str  # one of INITS


def _norm(hf_name: str, size: Callable[[Qwen3Config], int]) -> Leaf:
    return Leaf(hf_name, lambda c: (size(c),), False, "ones")


def _proj(hf_name: str, n_in: Callable[[Qwen3Config], int], n_out: Callable[[Qwen3Config], int]) -> Leaf:
    return Leaf(hf_name, lambda c: (n_in(c), n_out(c)), True, "normal")


_d = lambda c: c.hidden_size  # noqa: E731
_i = lambda c: c.intermediate_size  # noqa: E731

LAYER_LEAVES: dict[str, Leaf] = {
    "input_layernorm": _norm("input_layernorm.weight", _d),
    "q_proj": _proj("self_attn.q_proj.weight", _d, lambda c: c.q_size),
    "k_proj": _proj("self_attn.k_proj.weight", _d, lambda c: c.kv_size),
    "v_proj": _proj("self_attn.v_proj.weight", _d, lambda c: c.kv_size),
    "o_proj": _proj("self_attn.o_proj.weight", lambda c: c.q_size, _d),
    "q_norm": _norm("self_attn.q_norm.weight", lambda c: c.head_dim),
    "k_norm": _norm("self_attn.k_norm.weight", lambda c: c.head_dim),
    "post_attention_layernorm": _norm("post_attention_layernorm.weight", _d),
    "gate_proj": _proj("mlp.gate_proj.weight", _d, _i),
    "up_proj": _proj("mlp.up_proj.weight", _d, _i),
    "down_proj": _proj("mlp.down_proj.weight", _i, _d),
}
# The leaves outside the layer stack. HF keeps embed_tokens and norm under the model prefix ('model.' in a
# Qwen3ForCausalLM checkpoint), lm_head at the top; lm_head exists only for untied embeddings.
TOP_LEAVES: dict[str, Leaf] = {
    "embed_tokens": Leaf("embed_tokens.weight", lambda c: (c.vocab_size, c.hidden_size), False, "normal"),
    "norm": _norm("norm.weight", _d),
    "lm_head": _proj("lm_head.weight", _d, lambda c: c.vocab_size),
}
LAYER_KEYS = tuple(LAYER_LEAVES)
MLP_KEYS = ("gate_proj", "up_proj", "down_proj")
MLP_LEAVES: dict[str, Leaf] = {name: LAYER_LEAVES[name] for name in MLP_KEYS}
# A sparse layer's leaves. The experts keep HF's [out, in] layout (contraction innermost, as the grouped GEMM takes
# them): gate_up stacks each expert's gate_proj over its up_proj ([E, 2F, D]); loading assembles them from the
# per-expert tensors `experts.{e}.{gate,up,down}_proj.weight` (or transformers' fused `experts.gate_up_proj`).
_e = lambda c: c.num_experts  # noqa: E731
_f = lambda c: c.moe_intermediate_size  # noqa: E731
EXPERT_LEAVES: dict[str, Leaf] = {
    "router": _proj("mlp.gate.weight", _d, _e),
    "gate_up": Leaf("mlp.experts.gate_up_proj", lambda c: (_e(c), 2 * _f(c), _d(c)), False, "normal"),
    "down": Leaf("mlp.experts.down_proj", lambda c: (_e(c), _d(c), _f(c)), False, "normal"),
}


def layer_leaves(config: Qwen3Config) -> dict[str, Leaf]:
    """The leaves stacked over all L layers: every layer leaf for a dense model; attention and norms for MoE."""
    if not config.is_moe:
        return LAYER_LEAVES
    return {name: leaf for name, leaf in LAYER_LEAVES.items() if name not in MLP_KEYS}


def layer_stacks(config: Qwen3Config) -> dict[str, tuple[dict[str, Leaf], tuple[int, ...]]]:
    """Each stack of per-layer leaves in the params pytree: name -> (its leaves, the layer indices it holds, in
    order). A dense model has one, `layers`; an MoE model `layers`, `experts` and, with dense layers, `dense_mlp`."""
    every = tuple(range(config.num_hidden_layers))
    stacks = {"layers": (layer_leaves(config), every)}
    if config.is_moe:
        sparse = tuple(i for i in every if config.sparse_layers[i])
        dense = tuple(i for i in every if not config.sparse_layers[i])
        stacks["experts"] = (EXPERT_LEAVES, sparse)
        if dense:
            stacks["dense_mlp"] = (MLP_LEAVES, dense)
    return stacks


def leaf_of(path: tuple[str, ...]) -> Leaf:
    """The table entry of a params path: ('layers', 'q_proj'), ('experts', 'router') or ('embed_tokens',)."""
    tables = {"layers": LAYER_LEAVES, "dense_mlp": MLP_LEAVES, "experts": EXPERT_LEAVES}
    return tables[path[0]][path[1]] if path[0] in tables else TOP_LEAVES[path[0]]
