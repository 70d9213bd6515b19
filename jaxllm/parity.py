"""Parity tools: random HF Qwen3 checkpoints, the hidden states of HF transformers and of jaxllm for the same ids,
and their per-index comparison. Used by tests/parity/, `scripts/parity_report.py` and `scripts/fp8_fidelity.py`;
real Craftax prompts for them come from `render.sample_prompts`.

torch, safetensors and HF transformers (the `test` extra) are imported inside the functions that need them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np


# ------------------------------------------------------------------------------------ checkpoints
def hf_config_dict(config: Any) -> dict:
    """A HF ``config.json`` dict (Qwen3ForCausalLM, or Qwen3MoeForCausalLM for an MoE) for a ``jaxllm.Qwen3Config``."""
    moe = {} if not config.is_moe else {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok, "moe_intermediate_size": config.moe_intermediate_size,
        "norm_topk_prob": config.norm_topk_prob, "decoder_sparse_step": config.decoder_sparse_step,
        "mlp_only_layers": list(config.mlp_only_layers)}
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim, "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "tie_word_embeddings": config.tie_word_embeddings,
        "max_position_embeddings": config.max_position_embeddings, "attention_bias": False,
        "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": False, "torch_dtype": "bfloat16",
    } | moe


def hf_shapes(config: Any) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """Every tensor of a Qwen3ForCausalLM checkpoint of ``config``: {HF key: HF shape}, and the keys that init
    fills with ones (norm weights), from ``jaxllm.params``'s leaf table."""
    from jaxllm.params import EXPERT_LEAVES, MLP_LEAVES, TOP_LEAVES, layer_leaves

    def hf_shape(leaf):
        shape = leaf.shape(config)
        return tuple(reversed(shape)) if leaf.transpose else shape

    leaves = {f"model.{TOP_LEAVES['embed_tokens'].hf_name}": TOP_LEAVES["embed_tokens"]}
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(config.num_hidden_layers):
        leaves.update({f"model.layers.{i}.{leaf.hf_name}": leaf for leaf in layer_leaves(config).values()})
        if not config.is_moe:
            continue
        if not config.sparse_layers[i]:
            leaves.update({f"model.layers.{i}.{leaf.hf_name}": leaf for leaf in MLP_LEAVES.values()})
            continue
        leaves[f"model.layers.{i}.{EXPERT_LEAVES['router'].hf_name}"] = EXPERT_LEAVES["router"]
        f, d = config.moe_intermediate_size, config.hidden_size  # the hub's layout: one tensor per expert
        for e in range(config.num_experts):
            prefix = f"model.layers.{i}.mlp.experts.{e}."
            shapes.update({f"{prefix}gate_proj.weight": (f, d), f"{prefix}up_proj.weight": (f, d),
                           f"{prefix}down_proj.weight": (d, f)})
    leaves[f"model.{TOP_LEAVES['norm'].hf_name}"] = TOP_LEAVES["norm"]
    if not config.tie_word_embeddings:
        leaves[TOP_LEAVES["lm_head"].hf_name] = TOP_LEAVES["lm_head"]
    return ({key: hf_shape(leaf) for key, leaf in leaves.items()} | shapes,
            {k for k, leaf in leaves.items() if leaf.init == "ones"})


def write_random_checkpoint(out_dir: str | Path, config: Any, dtype: str = "bfloat16", seed: int = 0,
                            device: str = "cpu", shard_bytes: int = 2 << 30) -> Path:
    """Write a random Qwen3ForCausalLM checkpoint (HF layout, safetensors shards + index) for ``config``.

    Matrices ~ N(0, 0.02); norm weights ~ 1 + N(0, 0.1) so that a port that ignores a norm weight fails.
    Tensors are generated with torch on ``device`` (use "cuda" for the 4B shape) one at a time.
    """
    import torch
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch_dtype = getattr(torch, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes, ones = hf_shapes(config)
    weight_map: dict[str, str] = {}
    shard: dict[str, Any] = {}
    shard_size, shard_names = 0, []

    def flush() -> None:
        nonlocal shard, shard_size
        if shard:
            name = f"model-{len(shard_names) + 1:05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            shard_names.append(name)
            weight_map.update({key: name for key in shard})
            shard, shard_size = {}, 0

    for key, shape in shapes.items():
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        t = 1.0 + 0.1 * t if key in ones else 0.02 * t
        t = t.to(torch_dtype).cpu().contiguous()
        nbytes = t.numel() * t.element_size()
        if shard and shard_size + nbytes > shard_bytes:
            flush()
        shard[key] = t
        shard_size += nbytes
    flush()
    total = sum(int(np.prod(s)) for s in shapes.values()) * torch.finfo(torch_dtype).bits // 8
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    hf = hf_config_dict(config)
    hf["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(hf, indent=1))
    return out


# ------------------------------------------------------------------------------------ hidden states
def _pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    ids = np.full((len(prompts), int(lengths.max())), pad_id, np.int32)
    for row, prompt in enumerate(prompts):
        ids[row, :len(prompt)] = prompt
    return ids, lengths


HiddenFn = Callable[[np.ndarray], list[np.ndarray]]
"""right-padded ids int32 [B, T] -> L+1 float32 arrays [B, T, D] (HF output_hidden_states)."""


def hf_hidden_states(ckpt_dir: str | Path, dtype: str, device: str = "cpu") -> HiddenFn:
    """A HiddenFn running HF transformers' Qwen3Model (torch, sdpa attention) loaded from ``ckpt_dir``."""
    import torch
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model, info = AutoModel.from_pretrained(str(ckpt_dir), dtype=getattr(torch, dtype), output_loading_info=True)
    if info["missing_keys"] or info["mismatched_keys"]:
        raise ValueError(f"{ckpt_dir}: HF left weights at random init: missing {sorted(info['missing_keys'])[:5]}, "
                         f"mismatched {info['mismatched_keys'][:5]}")
    model = model.to(device).eval()

    @torch.no_grad()
    def run(ids: np.ndarray) -> list[np.ndarray]:
        out = model(input_ids=torch.as_tensor(ids, dtype=torch.long, device=device), output_hidden_states=True)
        return [h.float().cpu().numpy() for h in out.hidden_states]

    run.model = model  # type: ignore[attr-defined]  (so callers can free it)
    return run


def jax_hidden_states(model: Any) -> HiddenFn:
    """A HiddenFn running ``jaxllm.Model.hidden_states`` (our pure-JAX Qwen3)."""

    def run(ids: np.ndarray) -> list[np.ndarray]:
        return [np.asarray(h, np.float32) for h in model.hidden_states(ids)]

    return run


@dataclass
class IndexStats:
    """Per hidden-state index: worst per-token relative L2 error and cosine over all real tokens."""

    max_rel: np.ndarray
    min_cos: np.ndarray
    tokens: int = 0

    @classmethod
    def empty(cls, num_indices: int) -> "IndexStats":
        return cls(np.zeros(num_indices), np.ones(num_indices))

    def update(self, index: int, got: np.ndarray, want: np.ndarray) -> None:
        rel, cos = vector_errors(got, want)
        self.max_rel[index] = max(self.max_rel[index], float(rel.max()))
        self.min_cos[index] = min(self.min_cos[index], float(cos.min()))


def vector_errors(got: np.ndarray, want: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row-wise relative L2 error ||got - want|| / ||want|| and cosine similarity of [N, D] arrays (float64)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    diff = np.linalg.norm(got - want, axis=-1)
    norm_want, norm_got = np.linalg.norm(want, axis=-1), np.linalg.norm(got, axis=-1)
    rel = diff / np.maximum(norm_want, 1e-30)
    cos = (got * want).sum(-1) / np.maximum(norm_got * norm_want, 1e-30)
    return rel, cos


def collect_hidden_states(run: HiddenFn, prompts: Sequence[Sequence[int]], batch_size: int = 4,
                          pad_id: int = 151643) -> list[list[np.ndarray]]:
    """Per prompt, the L+1 hidden states of its real tokens ([T_i, D] each), in batches."""
    out = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        ids, lengths = _pad(chunk, pad_id)
        states = run(ids)
        out.extend([[h[row, :n] for h in states] for row, n in enumerate(lengths)])
    return out


def compare_hidden_states(got: Iterable[list[np.ndarray]], want: Iterable[list[np.ndarray]]) -> IndexStats:
    """IndexStats of ``got`` against the reference ``want`` (outputs of ``collect_hidden_states``)."""
    stats = None
    for got_prompt, want_prompt in zip(got, want, strict=True):
        if stats is None:
            stats = IndexStats.empty(len(want_prompt))
        if len(got_prompt) != len(want_prompt):
            raise ValueError(f"{len(got_prompt)} hidden states vs {len(want_prompt)} in the reference")
        for index, (g, w) in enumerate(zip(got_prompt, want_prompt)):
            stats.update(index, g, w)
        stats.tokens += want_prompt[0].shape[0]
    if stats is None:
        raise ValueError("no prompts to compare")
    return stats


def format_table(columns: dict[str, IndexStats]) -> str:
    """A markdown table: one row per hidden-state index, rel-error and cosine columns per comparison."""
    names = list(columns)
    num = len(next(iter(columns.values())).max_rel)
    head = "| index | " + " | ".join(f"{n}: max rel L2 | {n}: min cos" for n in names) + " |"
    rule = "|---|" + "---|---|" * len(names)
    rows = []
    for i in range(num):
        label = f"{i}" + (" (emb)" if i == 0 else " (final norm)" if i == num - 1 else "")
        cells = " | ".join(f"{columns[n].max_rel[i]:.2e} | {columns[n].min_cos[i]:.7f}" for n in names)
        rows.append(f"| {label} | {cells} |")
    return "\n".join([head, rule, *rows])
