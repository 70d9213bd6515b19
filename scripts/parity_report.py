"""Hidden-state parity of the Flax encoder against HF transformers (and optionally a vLLM server).

    python -m scripts.parity_report --model CHECKPOINT_DIR [--dtypes float32,bfloat16] [--vllm-url URL]
    python -m scripts.parity_report --model tiny --smoke      # random tiny HF checkpoint, CPU, seconds

For every hidden-state index (HF ``output_hidden_states`` numbering: 0 = embeddings, L = after the final
norm) it prints the largest per-token relative L2 error ||flax - hf|| / ||hf|| and the smallest per-token
cosine over all real tokens of real Craftax prompts (``render`` templates of craftax states), in each
dtype. With two dtypes it adds the HF-bf16-vs-HF-f32 gap, the floor that bf16 rounding alone sets.
With ``--vllm-url`` it adds a row comparing the server's ``/v1/embeddings`` vector with Flax's last-token
final hidden state (what ``scripts/start_vllm.sh`` configures vLLM to return).

This module is also the library of the parity suite (tests/parity/) and of scripts/gpu_parity_4b.py:
``craftax_prompts``, ``write_random_checkpoint``, ``hf_hidden_states``, ``flax_hidden_states``,
``compare_hidden_states``, ``vector_errors``.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ENV_DEFAULT = "Craftax-Symbolic-v1"


# ------------------------------------------------------------------------------------ prompts
def craftax_states(env_name: str, num_states: int, seed: int = 0, steps: int = 0, num_envs: int = 8) -> Any:
    """``num_states`` raw craftax states stacked on a leading axis.

    steps == 0: reset states of ``num_states`` different worlds (cheapest to compile). steps > 0: a jitted
    random-policy rollout of ``num_envs`` envs (no auto-reset) for ``steps`` steps, states taken at evenly
    spaced steps; more varied (inventories, mobs, damage) but a longer compile.
    """
    import jax
    from craftax.craftax_env import make_craftax_env_from_name

    env = make_craftax_env_from_name(env_name, auto_reset=False)
    params = env.default_params
    key = jax.random.PRNGKey(seed)
    if steps <= 0:
        _, states = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))(jax.random.split(key, num_states), params)
        return states
    per_env = -(-num_states // num_envs)
    if per_env > steps:
        raise ValueError(f"need steps >= {per_env} to take {num_states} states from {num_envs} envs")
    every = steps // per_env
    num_actions = env.action_space(params).n

    def rollout(key):
        reset_key, scan_key = jax.random.split(key)
        _, state = jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(reset_key, num_envs), params)

        def step(state, key):
            action_key, step_key = jax.random.split(key)
            actions = jax.random.randint(action_key, (num_envs,), 0, num_actions)
            _, state, _, _, _ = jax.vmap(env.step, in_axes=(0, 0, 0, None))(
                jax.random.split(step_key, num_envs), state, actions, params)
            return state, state

        _, trajectory = jax.lax.scan(step, state, jax.random.split(scan_key, steps))
        picked = jax.tree.map(lambda x: x[every - 1::every][:per_env], trajectory)  # [per_env, num_envs, ...]
        return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:])[:num_states], picked)

    return jax.jit(rollout)(key)


@dataclass
class PromptSet:
    """Real Craftax prompts: the template's constant head plus each state's rest (right-padded)."""

    prefix_ids: list[int]
    rest_ids: np.ndarray  # int32 [N, max_len]
    lengths: np.ndarray  # int32 [N]
    states: Any = field(repr=False)
    template: Any = field(repr=False)

    def whole(self) -> list[list[int]]:
        """Each full prompt as one unpadded id list (what an HTTP server gets)."""
        return [self.prefix_ids + self.rest_ids[i, :n].tolist() for i, n in enumerate(self.lengths)]


def craftax_prompts(tokenizer: Any, num_prompts: int, env_name: str = ENV_DEFAULT, fmt: str = "compact",
                    seed: int = 0, steps: int = 0) -> PromptSet:
    """``num_prompts`` prompts from ``render.build_template`` over ``craftax_states``."""
    import jax

    from render import build_template

    template = build_template(tokenizer, env_name, fmt=fmt)
    states = craftax_states(env_name, num_prompts, seed=seed, steps=steps)
    ids, lengths = jax.jit(jax.vmap(template))(states)
    return PromptSet(list(template.prefix_ids), np.asarray(ids, np.int32), np.asarray(lengths, np.int32),
                     states, template)


# ------------------------------------------------------------------------------------ checkpoints
def hf_config_dict(config: Any) -> dict:
    """A HF ``config.json`` dict (Qwen3ForCausalLM) for a ``jaxllm.Qwen3Config``."""
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim, "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "tie_word_embeddings": config.tie_word_embeddings,
        "max_position_embeddings": config.max_position_embeddings, "attention_bias": False,
        "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": False, "torch_dtype": "bfloat16",
    }


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
    c = config
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (c.hidden_size,), p + "post_attention_layernorm.weight": (c.hidden_size,),
            p + "self_attn.q_proj.weight": (c.num_attention_heads * c.head_dim, c.hidden_size),
            p + "self_attn.k_proj.weight": (c.num_key_value_heads * c.head_dim, c.hidden_size),
            p + "self_attn.v_proj.weight": (c.num_key_value_heads * c.head_dim, c.hidden_size),
            p + "self_attn.o_proj.weight": (c.hidden_size, c.num_attention_heads * c.head_dim),
            p + "self_attn.q_norm.weight": (c.head_dim,), p + "self_attn.k_norm.weight": (c.head_dim,),
            p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
        })
    shapes["model.norm.weight"] = (c.hidden_size,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)

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
        t = 1.0 + 0.1 * t if key.endswith("norm.weight") else 0.02 * t
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


def flax_hidden_states(model: Any) -> HiddenFn:
    """A HiddenFn running ``jaxllm.Model.hidden_states``."""

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


# ------------------------------------------------------------------------------------ CLI
def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m scripts.parity_report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True,
                        help="HF Qwen3 checkpoint dir, or a jaxllm preset name ('tiny') for a random checkpoint")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    parser.add_argument("--env", default=ENV_DEFAULT, choices=["Craftax-Symbolic-v1", "Craftax-Classic-Symbolic-v1"])
    parser.add_argument("--fmt", default="compact", choices=["compact", "full"])
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--steps", type=int, default=64, help="random-policy steps before sampling states (0: resets)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="torch device for HF (default: cuda if available)")
    parser.add_argument("--ckpt-dtype", default="float32", choices=["float32", "bfloat16"],
                        help="dtype of the random checkpoint written for a preset --model")
    parser.add_argument("--workdir", default=None, help="where to write that checkpoint (default: a temp dir)")
    parser.add_argument("--vllm-url", default=None, help="also compare against this vLLM-compatible server")
    parser.add_argument("--smoke", action="store_true", help="2 prompts from reset states (fast CPU check)")
    parser.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = parser.parse_args(argv)
    if args.smoke:
        args.num_prompts, args.steps = 2, 0
    return args


def main(argv: list[str] | None = None) -> dict:
    args = _parse_args(argv)
    import torch

    from jaxllm import PRESETS, Qwen3Config, load_model, load_tokenizer

    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d not in ("float32", "bfloat16", "fp8"):
            raise SystemExit(f"--dtypes: unknown dtype {d!r}; use float32, bfloat16 and/or fp8")
    if "fp8" in dtypes:  # HF has no fp8: the fp8 model is compared with HF float32 (and the float32 model)
        dtypes = ["float32"] + [d for d in dtypes if d != "float32"]
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    tmp = None
    ckpt = Path(args.model)
    if not ckpt.is_dir():
        if args.model not in PRESETS:
            raise SystemExit(f"--model {args.model!r} is neither a checkpoint directory nor a preset {sorted(PRESETS)}")
        if args.workdir is None:
            tmp = tempfile.TemporaryDirectory(prefix="parity-ckpt-")
        started = time.perf_counter()
        ckpt = write_random_checkpoint(args.workdir or tmp.name, PRESETS[args.model], dtype=args.ckpt_dtype,
                                       seed=args.seed, device=device)
        print(f"wrote a random {args.model} checkpoint ({args.ckpt_dtype}) to {ckpt} in "
              f"{time.perf_counter() - started:.0f} s", flush=True)
    config = Qwen3Config.from_json(ckpt / "config.json")
    tokenizer = load_tokenizer(ckpt if (ckpt / "tokenizer.json").exists() else None)
    prompts = craftax_prompts(tokenizer, args.num_prompts, env_name=args.env, fmt=args.fmt, seed=args.seed,
                              steps=args.steps)
    whole = prompts.whole()
    print(f"{len(whole)} {args.env} prompts ({args.fmt}), {min(map(len, whole))}-{max(map(len, whole))} tokens; "
          f"checkpoint {args.model}: {config.num_hidden_layers} layers, hidden {config.hidden_size}", flush=True)

    hf: dict[str, list] = {}
    columns: dict[str, IndexStats] = {}
    flax_final: dict[str, np.ndarray] = {}
    for dtype in dtypes:
        started = time.perf_counter()
        if dtype == "fp8":
            model = load_model(ckpt, dtype="fp8")
            flax = collect_hidden_states(flax_hidden_states(model), whole, args.batch_size)
            columns["jaxllm fp8 vs HF f32"] = compare_hidden_states(flax, hf["float32"])
            flax_final[dtype] = np.stack([p[-1][-1] for p in flax])
            del model, flax
            gc.collect()
            print(f"fp8 done in {time.perf_counter() - started:.0f} s", flush=True)
            continue
        run_hf = hf_hidden_states(ckpt, dtype, device)
        hf[dtype] = collect_hidden_states(run_hf, whole, args.batch_size)
        del run_hf  # free the torch model before JAX loads its copy
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        model = load_model(ckpt, dtype=dtype)
        flax = collect_hidden_states(flax_hidden_states(model), whole, args.batch_size)
        columns[f"flax vs HF {dtype}"] = compare_hidden_states(flax, hf[dtype])
        flax_final[dtype] = np.stack([p[-1][-1] for p in flax])
        del model, flax
        gc.collect()
        print(f"{dtype}: HF and Flax done in {time.perf_counter() - started:.0f} s", flush=True)
    if "float32" in hf and "bfloat16" in hf:
        columns["HF bf16 vs HF f32"] = compare_hidden_states(hf["bfloat16"], hf["float32"])
    print(format_table(columns))
    result: dict[str, Any] = {name: {"max_rel": s.max_rel.tolist(), "min_cos": s.min_cos.tolist()}
                              for name, s in columns.items()}
    result["table"] = format_table(columns)
    result["setup"] = {"model": args.model, "env": args.env, "fmt": args.fmt, "num_prompts": len(whole),
                       "prompt_tokens": [min(map(len, whole)), max(map(len, whole))], "device": device,
                       "hf_device_name": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"}

    if args.vllm_url:
        from jaxllm.http.client import VLLMClient

        with VLLMClient(args.vllm_url) as client:
            served = client.embed(whole)
        for dtype, vectors in flax_final.items():
            rel, cos = vector_errors(vectors, served)
            print(f"vLLM ({args.vllm_url}) vs flax {dtype}, last-token final state: max rel L2 {rel.max():.2e}, "
                  f"min cos {cos.min():.6f}, served norm {np.linalg.norm(served, axis=-1).mean():.3g}")
            result[f"vllm vs flax {dtype}"] = {"max_rel": float(rel.max()), "min_cos": float(cos.min())}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    if tmp is not None:
        tmp.cleanup()
    return result


if __name__ == "__main__":
    main()
