"""Throughput of the jaxllm encoder at the Qwen3-4B shape behind a cached prompt prefix.

Measures, in one run on one device: the card's best bf16 GEMM rate at the model's projection shapes (the ceiling
the encoder rows are compared with), `jaxllm.encode`
(random init directly on the device, bf16, batch B, rest-of-prompt T behind a P-token PrefixCache), and HF
transformers (torch, sdpa) doing the same work with a prefix KV cache. Steady state: compile and warm-up excluded,
every call synchronised. HF runs first in a subprocess, so the two frameworks never share GPU memory.

    python scripts/bench_encoder.py --out bench.json          # GPU: the issue's setting
    python scripts/bench_encoder.py --smoke                   # tiny CPU run of the same code paths
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxllm.config import PRESETS, Qwen3Config  # noqa: E402  (imports jax, but touches no device)

SMOKE_CONFIG = Qwen3Config(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16)
SMOKE_MOE_CONFIG = Qwen3Config(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                               num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)


# --dtypes variants: a base dtype (the name's first word) with some of jaxllm's module settings changed (what
# `variant_patches` sets), each timed against the defaults in the same process
VARIANTS = {
    "fp8-xla-swiglu": "the MLP's SwiGLU quantisation left to XLA instead of the Pallas kernel",
    "fp8-xla-norms": "the residual add + RMSNorm + quantisation and the q/k norm + RoPE left to XLA",
    "fp8-moe-xla-norms": "an MoE model's two residual steps around each sparse block left to XLA",
    "fp8-moe-xla-topk": "the MoE router's softmax, lax.top_k and division in XLA instead of the fused router kernel "
                        "(moe.FUSED_ROUTER = False, and XLA's top-k instead of the top-k kernel)",
    "fp8-moe-fused-combine": "the MoE block's combine inside the residual kernel after it "
                             "(layer_ops.FUSED_MOE_COMBINE) instead of its own kernel",
    "fp8-moe-swiglu-kernel": "the fp8 experts' gate+up scales and SwiGLU in their own kernel after the grouped GEMM "
                             "instead of its epilogue (moe.FP8_SWIGLU = 'kernel')",
    "fp8-moe-down-scales-combine": "down's scales applied in the combine instead of down's epilogue "
                                   "(moe.FP8_DOWN_SCALES = 'combine')",
    "fp8-moe-gather": "the token rows gathered into the experts' layout (16-row block loads) instead of scattered "
                      "(moe.ROW_COPY = 'gather')",
    "bfloat16-moe-gather": "as fp8-moe-gather, in bf16",
    "fp8-moe-gather-row-by-row": "gathered as before 2026-11-29: 4 rows x 4 warps a program, copied row by row",
    "fp8-moe-unpipelined": "down's expert GEMM with each tile's pipeline on its own, as before 2026-11-29's twelfth "
                           "session (moe.PIPELINED_DOWN = False)",
    "bfloat16-moe-unpipelined": "as fp8-moe-unpipelined, in bf16",
    "fp8-moe-silu-exp": "the expert gate+up kernel's SiLU with CUDA's expf and a full division, as before "
                        "2026-11-29's fourteenth session, instead of one ex2.approx (grouped_gemm.SILU = 'exp')",
    "bfloat16-moe-silu-exp": "as fp8-moe-silu-exp, in bf16",
    "fp8-moe-epi64": "the fp8 expert GEMMs' epilogues store 64-row pieces, as before 2026-11-29's fourteenth "
                     "session, instead of 128 (TileConfig.epi_m)",
    "fp8-moe-xla-router": "the MoE router's softmax, top-k kernel and division as before 2026-11-29's sixteenth "
                          "session (moe.FUSED_ROUTER = False) instead of one Pallas kernel",
    "bfloat16-moe-xla-router": "as fp8-moe-xla-router, in bf16",
    "fp8-moe-key-sort": "the dispatch sorts one combined int32 key as before 2026-11-29's sixteenth session "
                        "(moe.PAIR_SORT = False) instead of 16-bit expert keys with the slots as payload",
    "bfloat16-moe-key-sort": "as fp8-moe-key-sort, in bf16",
    "fp8-moe-routing-before": "fp8-moe-xla-router and fp8-moe-key-sort together",
    "fp8-moe-spread-hidden-rows": "fp8-moe-spread-routing and fp8-moe-hidden-rows together",
    "fp8-moe-hidden-rows": "the fp8 experts' hidden rows quantised with one scale per row by their own pass after "
                           "gate+up's epilogue, as before 2026-11-29's eighteenth session (moe.FP8_HIDDEN = 'rows'), "
                           "instead of one scale per 128-wide block inside the epilogue",
    "fp8-moe-spread-routing": "the experts each token's router chose moved by the token's index (mod E), so the "
                              "rows spread evenly over the experts as a trained router's do, instead of the random "
                              "model's routing, which sends nearly every token to the same experts",
    "bfloat16-moe-spread-routing": "as fp8-moe-spread-routing, in bf16",
    "fp8-moe-no-prefetch": "the expert GEMMs without warming L2 with each expert's weights a wave of tiles ahead, "
                           "as before 2026-11-30 (grouped_gemm.PREFETCH = 'none')",
    "fp8-moe-spread-no-prefetch": "fp8-moe-spread-routing and fp8-moe-no-prefetch together",
    "bfloat16-moe-spread-prefetch": "fp8-moe-spread-routing in bf16, with the bf16 expert GEMMs warming L2 with "
                                    "each expert's weights a wave ahead too (grouped_gemm.PREFETCH = 'leader')",
    "fp8-moe-scattered-routing": "as fp8-moe-spread-routing, each token's experts moved by a random draw "
                                 "instead: spread but uneven, so each expert's last tile is part padding, as a "
                                 "trained router's would be",
    "bfloat16-moe-scattered-routing": "as fp8-moe-scattered-routing, in bf16",
    "fp8-moe-blocks-64": "the fp8 experts' hidden rows in 64-wide blocks (a compute warpgroup's columns: no abs-max "
                         "exchange in gate+up's epilogue; down in 64-deep k-steps, moe.FP8_HIDDEN_BLOCK = 64) "
                         "instead of 128",
    "fp8-moe-blocks-split-rows": "gate+up quantising its 128-wide blocks with its compute warpgroups splitting the "
                                 "tile's rows (moe.TILED_FP8_SWIGLU_BLOCKS_CONFIG = TILED_FP8_SWIGLU_SPLIT_ROWS_CONFIG) "
                                 "instead of the columns with their rows' abs-max exchanged",
    "fp8-moe-down-split-rows": "down's expert GEMM with its compute warpgroups splitting each tile's rows (64 x 256 "
                               "each: grouped_gemm.split_rows of moe.TILED_FP8_DOWN_SCALED_CONFIG) instead of its "
                               "columns (128 x 128 each)",
    "bfloat16-moe-down-split-rows": "as fp8-moe-down-split-rows, in bf16 (moe.TILED_CONFIGS' down)",
    "fp8-xla-merge": "packed attention's two cuDNN halves merged by XLA, then quantised for o_proj by their own "
                     "kernel, as before 2026-11-29's fifteenth session (packed_attention.FUSED_MERGE_QUANTIZE = False)",
}


def variant_patches(variant: str) -> list[tuple[Any, str, Any]]:
    """(module, attribute, value): the settings `variant` (a --dtypes name) changes from its base dtype's."""
    import jax
    import jax.numpy as jnp

    from jaxllm import fp8, grouped_gemm, layer_ops, moe, moe_rows, packed_attention
    from jaxllm import model as model_module

    top_k_rows, residual_norm = moe.top_k_rows, model_module.residual_norm

    def moe_residual_steps_in_xla(h, delta, weight, eps, quantized, keep_value=False):
        """The steps before (16-bit rows kept) and after (a plain delta) an MoE block in XLA."""
        if keep_value or not isinstance(delta, fp8.Fp8Product):
            return layer_ops.residual_norm_reference(h, delta, weight, eps, quantized, keep_value)
        return residual_norm(h, delta, weight, eps, quantized, keep_value)

    route = moe.route

    def spread_route(x, router, top_k, norm_topk_prob):
        """`moe.route` with token t's experts moved t places on (mod E): still top_k distinct experts with their
        weights, but spread evenly over the experts. The random model sends nearly every token to the same experts
        from its second layer on (scripts/moe_routing_report.py); a trained router's load is near even."""
        weights, experts = route(x, router, top_k, norm_topk_prob)
        shift = jnp.arange(experts.shape[0], dtype=experts.dtype) % router.shape[-1]
        return weights, (experts + shift[:, None]) % router.shape[-1]

    def scattered_route(x, router, top_k, norm_topk_prob):
        """As `spread_route`, with token t's experts moved by a random draw (mod E, a fixed key) instead of t: the
        load is spread but not in whole tiles, as a trained router's is, so each expert's rows end in a part-filled
        tile (the padding that the even spread never has: ~64 rows an expert on average)."""
        weights, experts = route(x, router, top_k, norm_topk_prob)
        shift = jax.random.randint(jax.random.key(0), experts.shape[:1], 0, router.shape[-1], experts.dtype)
        return weights, (experts + shift[:, None]) % router.shape[-1]

    gather = [(moe, "ROW_COPY", "gather")]
    no_prefetch = [(grouped_gemm, "PREFETCH", "none")]
    xla_router = [(moe, "FUSED_ROUTER", False)]
    key_sort = [(moe, "PAIR_SORT", False)]
    unpipelined = [(moe, "PIPELINED_DOWN", False)]
    silu_exp = [(grouped_gemm, "SILU", "exp")]
    patches = {
        "fp8-xla-swiglu": [(fp8, "swiglu_quantize", fp8.swiglu_quantize_reference)],
        "fp8-xla-norms": [(layer_ops, "_one_pass_kernels", lambda y: False)],
        "fp8-moe-xla-norms": [(model_module, "residual_norm", moe_residual_steps_in_xla)],
        "fp8-moe-xla-topk": xla_router + [(moe, "top_k_rows", lambda v, k: top_k_rows(v, k, "xla"))],
        "fp8-moe-fused-combine": [(layer_ops, "FUSED_MOE_COMBINE", True)],
        "fp8-moe-swiglu-kernel": [(moe, "FP8_SWIGLU", "kernel")],
        "fp8-moe-down-scales-combine": [(moe, "FP8_DOWN_SCALES", "combine")],
        "fp8-moe-gather": gather,
        "bfloat16-moe-gather": gather,
        "fp8-moe-gather-row-by-row": gather + [(moe_rows, "pallas_gather_tuning",
                                                lambda row_bytes: {"rows": 4, "num_warps": 4})],
        "fp8-moe-unpipelined": unpipelined,
        "bfloat16-moe-unpipelined": unpipelined,
        "fp8-moe-silu-exp": silu_exp,
        "bfloat16-moe-silu-exp": silu_exp,
        "fp8-xla-merge": [(packed_attention, "FUSED_MERGE_QUANTIZE", False)],
        "fp8-moe-xla-router": xla_router,
        "bfloat16-moe-xla-router": xla_router,
        "fp8-moe-key-sort": key_sort,
        "bfloat16-moe-key-sort": key_sort,
        "fp8-moe-routing-before": xla_router + key_sort,
        "fp8-moe-hidden-rows": [(moe, "FP8_HIDDEN", "rows")],
        "fp8-moe-spread-hidden-rows": [(moe, "FP8_HIDDEN", "rows"), (moe, "route", spread_route)],
        "fp8-moe-spread-routing": [(moe, "route", spread_route)],
        "bfloat16-moe-spread-routing": [(moe, "route", spread_route)],
        "fp8-moe-no-prefetch": no_prefetch,
        "fp8-moe-spread-no-prefetch": no_prefetch + [(moe, "route", spread_route)],
        "bfloat16-moe-spread-prefetch": [(grouped_gemm, "PREFETCH", "leader"), (moe, "route", spread_route)],
        "fp8-moe-scattered-routing": [(moe, "route", scattered_route)],
        "bfloat16-moe-scattered-routing": [(moe, "route", scattered_route)],
        "fp8-moe-blocks-64": [(moe, "FP8_HIDDEN_BLOCK", 64)],
        "fp8-moe-blocks-split-rows": [(moe, "TILED_FP8_SWIGLU_BLOCKS_CONFIG", moe.TILED_FP8_SWIGLU_SPLIT_ROWS_CONFIG)],
        "fp8-moe-down-split-rows": [(moe, "TILED_FP8_DOWN_SCALED_CONFIG",
                                     grouped_gemm.split_rows(moe.TILED_FP8_DOWN_SCALED_CONFIG))],
        "bfloat16-moe-down-split-rows": [(moe, "TILED_CONFIGS", ((moe.TILED_CONFIGS[0][0],
                                                                  grouped_gemm.split_rows(moe.TILED_CONFIGS[0][1])),
                                                                 *moe.TILED_CONFIGS[1:]))],
        "fp8-moe-epi64": [(moe, name, getattr(moe, name)._replace(epi_m=64))
                          for name in ("TILED_FP8_SWIGLU_CONFIG", "TILED_FP8_DOWN_SCALED_CONFIG")],
    }
    if variant not in patches and variant not in ("bfloat16", "fp8", "float32"):
        raise ValueError(f"--dtypes {variant!r}: not a dtype and not in variant_patches' table")
    return patches.get(variant, [])


@contextlib.contextmanager
def variant_settings(variant: str | None) -> Iterator[None]:
    """jaxllm's module settings as `variant` (a --dtypes name; None: as they are) has them, for the block's
    duration (what is traced and compiled inside it keeps them)."""
    with contextlib.ExitStack() as patches:
        for module, name, value in variant_patches(variant) if variant else []:
            patches.enter_context(mock.patch.object(module, name, value))
        yield


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model and shapes, float32, for a CPU check")
    p.add_argument("--model", default="qwen3-4b", choices=["qwen3-4b", "qwen3-30b-a3b"],
                   help="the model shape (random weights made on the device); --smoke: a tiny dense or MoE model")
    p.add_argument("--batch", type=int, default=None, help="prompts per call (default 128; smoke 4)")
    p.add_argument("--prefix", type=int, default=None, help="cached prefix tokens, 0 = none (default 1024; smoke 32)")
    p.add_argument("--seq", type=int, nargs="+", default=None, help="rest-of-prompt lengths (default 128 256 512)")
    p.add_argument("--iters", type=int, default=None, help="timed calls per setting (default 10; smoke 2)")
    p.add_argument("--attention", nargs="+", default=["auto"], choices=["auto", "cudnn", "cudnn_split", "xla", "xla_split"],
                   help="jaxllm attention implementations to time (auto: the default, cudnn_split on GPU bf16, else xla); with "
                        "several, each one's vectors are also compared with the first one's")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    p.add_argument("--ragged", action="store_true",
                   help="instead of rectangular T: B prompts of the template's real lengths (typical play states of "
                        "--env, compact format, real tokenizer, real prefix), encoded rectangular / bucketed / "
                        "packed in each --dtypes, against the card's best GEMM rate at the model's projection shapes")
    p.add_argument("--env", default="Craftax-Symbolic-v1", help="--ragged: the env whose states give the lengths")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "fp8"],
                   choices=["bfloat16", "fp8", "float32", *VARIANTS],
                   help="--ragged: model dtypes to time, or variants of one (the module settings they change, "
                        "the rest as their dtype): " + "; ".join(f"{name}: {doc}" for name, doc in VARIANTS.items()))
    p.add_argument("--packed-attention", default=None, choices=["xla", "cudnn"],
                   help="--ragged: packed attention implementation (default: jaxllm's choice for the device)")
    p.add_argument("--methods", nargs="+", default=["packed", "bucketed"],
                   choices=["rect", "bucketed", "packed", "packed-six", "packed-one-pass"],
                   help="--ragged: encode paths to time (packed-six: packed with the six pass sizes used before "
                        "2026-11-29, six_pass_sizes, against the default three; packed-one-pass: packed "
                        "at the smallest multiple of 1,024 tokens that holds every real token, so one pass where the "
                        "packing allows: the same tokens in fewer launches)")
    p.add_argument("--capacity", type=int, default=0,
                   help="--ragged: tokens of the largest packed pass (0: jaxllm.default_capacity, 36,864 at 128 "
                        "prompts, which packs 128 Craftax prompts in one pass; the trainer's --llm-capacity)")
    p.add_argument("--profile", metavar="DIR", default=None,
                   help="--ragged: trace one more call of each row into DIR/<row> and print where its GPU time goes "
                        "(scripts/kernel_times.py)")
    p.add_argument("--profile-top", type=int, default=25,
                   help="--profile: how many kernels to list by total time (the rest summed on one line)")
    p.add_argument("--hlo-dir", type=Path, default=None,
                   help="write each row's optimised HLO (the compiled program, as text) to DIR/DTYPE-METHOD.hlo.txt")
    p.add_argument("--xla-option", nargs="+", default=[], metavar="NAME=VALUE",
                   help="--ragged: XLA compiler options added to the project's for every row (true/false/ints "
                        "parsed), to measure one before making it a default")
    p.add_argument("--no-gemm-ceiling", action="store_true",
                   help="--ragged: skip timing the card's GEMM ceilings (slow to autotune); rows get no vs_gemm_ceiling")
    p.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    p.add_argument("--hf-worker", type=Path, default=None, help=argparse.SUPPRESS)  # internal: HF-only subprocess
    args = p.parse_args(argv)
    args.xla_option = dict(_option(text, p) for text in args.xla_option)
    args.batch = args.batch or (4 if args.smoke else 128)
    args.prefix = (32 if args.smoke else 1024) if args.prefix is None else args.prefix
    args.seq = args.seq or ([8, 16] if args.smoke else [128, 256, 512])
    args.iters = args.iters or (2 if args.smoke else 10)
    return args


def _option(text: str, parser: argparse.ArgumentParser) -> tuple[str, Any]:
    """NAME=VALUE -> (NAME, bool / int / str VALUE)."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        parser.error(f"--xla-option takes NAME=VALUE, got {text!r}")
    parsed = {"true": True, "false": False}.get(value.lower(), value)
    return name, int(parsed) if isinstance(parsed, str) and parsed.lstrip("-").isdigit() else parsed


def model_config(args: argparse.Namespace) -> Qwen3Config:
    if args.smoke:
        return SMOKE_MOE_CONFIG if PRESETS[args.model].is_moe else SMOKE_CONFIG
    return PRESETS[args.model]


def flops_per_token(c: Qwen3Config, prefix: int, t: int) -> float:
    """Useful forward FLOPs per rest token, no LM head: projections + MLP, plus causal attention
    (QK^T and PV over the P prefix keys and, on average, (T+1)/2 rest keys)."""
    d, q, kv, i, n = c.hidden_size, c.q_size, c.kv_size, c.intermediate_size, c.num_hidden_layers
    sparse = sum(c.sparse_layers)
    # an MoE layer: the router and its k active experts (3 matrices of D x moe_intermediate_size each)
    ffn = (n - sparse) * 3 * d * i + sparse * (d * c.num_experts + c.num_experts_per_tok * 3 * d * c.moe_intermediate_size)
    dense = 2 * (n * (d * q + 2 * d * kv + q * d) + ffn)
    attention = 4 * (prefix + (t + 1) / 2) * q * n
    return dense + attention


def time_calls(fn: Callable[[], Any], sync: Callable[[Any], Any], iters: int, warmup: int = 2) -> float:
    """Median seconds per call, each call synchronised."""
    for _ in range(warmup):
        sync(fn())
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        sync(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_matmul(args: argparse.Namespace) -> dict[str, Any]:
    """The encoder rows' ceiling: the card's best bf16 GEMM rate at the model's own projection shapes with as many
    rows as the largest call's tokens (`bench_gemms`), measured in this run (a square 8192^3 product flatters
    or understates it depending on the card)."""
    tokens = args.batch * max(args.seq)
    gemms = bench_gemms(model_config(args), tokens, ["bfloat16"], args.iters)["bfloat16"]
    best = max(gemms["tflops_by_shape"], key=gemms["tflops_by_shape"].get)
    return {"shape": f"[{tokens}, in] x {best}", "dtype": "bfloat16", "tflops": gemms["best_tflops"],
            "tflops_by_shape": gemms["tflops_by_shape"]}


def bench_jax(args: argparse.Namespace, matmul_tflops: float) -> list[dict[str, Any]]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxllm import encode, init_params, prefill
    from jaxllm.compile import compiler_options, jit

    config = model_config(args)
    dtype = jnp.float32 if args.smoke else jnp.bfloat16
    params = jax.block_until_ready(init_params(config, dtype, 0))  # created on the device, never on the host
    rng = np.random.default_rng(0)
    cache = None
    if args.prefix:
        prefix_ids = jnp.asarray(rng.integers(0, config.vocab_size, args.prefix), jnp.int32)
        cache = jax.block_until_ready(jit(prefill, compiler_options=compiler_options(), static_argnums=1)(
            params, config, prefix_ids))
    encode_jit = jit(encode, compiler_options=compiler_options(),
                     static_argnames=("config", "layer", "pooling", "attention_impl"))
    rows = []
    for t in args.seq:
        ids = jnp.asarray(rng.integers(0, config.vocab_size, (args.batch, t)), jnp.int32)
        lengths = jnp.full((args.batch,), t, jnp.int32)
        first = None
        for impl in args.attention:
            row = {"framework": "jaxllm", "attention": impl, "batch": args.batch, "prefix": args.prefix, "seq": t}

            def call():
                return encode_jit(params, config, ids, lengths, layer=-1, pooling="last", prefix=cache,
                                  attention_impl=None if impl == "auto" else impl)
            try:
                vec = np.asarray(call())
                seconds = time_calls(call, jax.block_until_ready, args.iters)
            except Exception as e:  # e.g. cuDNN refusing a shape: report it, keep measuring the rest
                rows.append(row | {"error": f"{type(e).__name__}: {str(e)[:300]}"})
                continue
            if first is None:
                first = (impl, vec)
            else:  # same vectors from every implementation (bf16 noise only)
                row[f"max_rel_diff_vs_{first[0]}"] = float(np.abs(vec - first[1]).max() / np.abs(first[1]).max())
            tokens = args.batch * t / seconds
            tflops = tokens * flops_per_token(config, args.prefix, t) / 1e12
            rows.append(row | {"ms": seconds * 1e3, "tokens_per_s": tokens, "tflops": tflops,
                               "vs_matmul": tflops / matmul_tflops, "finite": bool(np.isfinite(vec).all())})
    return rows


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def bench_gemms(config: Qwen3Config, tokens: int, dtypes: list[str], iters: int) -> dict[str, Any]:
    """The card's GEMM rate at the model's own projection shapes ([tokens, in] x [in, out]), per dtype: bf16 x bf16,
    and fp8 x fp8 (e4m3, both operands contracted on their minor axis, bfloat16 out: cuBLASLt's fp8 GEMM as the
    encoder calls it). The best
    shape's rate is the ceiling an encoder row of that dtype is compared with."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from jaxllm.compile import compiler_options, jit

    d, i = config.hidden_size, config.intermediate_size
    shapes = {"gate_proj": (d, i), "down_proj": (i, d)}  # the two largest (2/3 of a layer's matmul FLOPs)
    out: dict[str, Any] = {"tokens": tokens}
    for dtype in sorted({"fp8" if dt.startswith("fp8") else "bfloat16" for dt in dtypes}):
        rates = {}
        for name, (k_in, n_out) in shapes.items():
            kx, kw = jax.random.split(jax.random.key(len(rates)))
            x = jax.random.normal(kx, (tokens, k_in), jnp.float32)
            w = jax.random.normal(kw, (n_out, k_in), jnp.float32)  # [out, in]
            if dtype == "fp8":  # compiled as the encoder's fp8 programs are (cuBLASLt, jaxllm.compile)
                x, w = x.astype(jnp.float8_e4m3fn), w.astype(jnp.float8_e4m3fn)
                fn = jit(lambda a, b: lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                                      preferred_element_type=jnp.bfloat16),
                         compiler_options=compiler_options())
            else:
                x, w = x.astype(jnp.bfloat16), w.T.astype(jnp.bfloat16)
                fn = jax.jit(jnp.matmul)
            seconds = time_calls(lambda: fn(x, w), jax.block_until_ready, max(iters, 10))
            rates[name] = 2 * tokens * k_in * n_out / seconds / 1e12
        out[dtype] = {"tflops_by_shape": rates, "best_tflops": max(rates.values())}
    return out


def template_prompts(env: str, batch: int, seed: int = 0):
    """Token ids [B, max_len], lengths [B] and the prefix ids of the real template (compact format, real
    tokenizer) on typical play states of `env` (render.sample_states.typical_states)."""
    import jax
    import numpy as np

    from jaxllm import load_tokenizer
    from render import build_template
    from render.sample_states import typical_states

    template = build_template(load_tokenizer(None), env, fmt="compact")
    ids, lengths = jax.jit(jax.vmap(template))(typical_states(env, batch, seed))
    return np.asarray(ids), np.asarray(lengths), np.asarray(template.prefix_ids, np.int32)


def bench_ragged(args: argparse.Namespace) -> dict[str, Any]:
    """Rectangular vs bucketed vs packed encoding of prompts of the template's real lengths, per dtype."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxllm import default_capacity, encode, encode_bucketed, encode_packed, init_params, prefill
    from jaxllm.compile import compiler_options, jit
    from jaxllm.fp8 import quantize_params

    config = model_config(args)
    t0 = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - t0:6.1f} s] {msg}", flush=True)
    ids, lengths, prefix_ids = (x % config.vocab_size for x in template_prompts(args.env, args.batch))  # smoke vocab
    t = ids.shape[1]
    capacity = args.capacity or default_capacity(args.batch, t)
    if capacity < t:
        raise SystemExit(f"--capacity {capacity} cannot hold the longest prompt ({t} tokens); use at least {t}")
    real = int(lengths.sum())
    one_pass = max(_round_to(real, 1024), t)  # packed-one-pass's capacity
    capacities = {"packed": capacity, "packed-six": capacity, "packed-one-pass": one_pass}
    six_sizes = six_pass_sizes(capacity, t)  # packed-six's sizes
    log(f"{args.env}: B={args.batch}, prefix {len(prefix_ids)} tokens, max_len {t}, real tokens {real} "
          f"(mean {lengths.mean():.0f}, max {lengths.max()}), packed capacity {capacity}")
    base_dtype = jnp.float32 if args.smoke else jnp.bfloat16
    # an MoE's bf16 and fp8 copies do not fit side by side (Qwen3-30B-A3B: 57 + 29 GiB): each dtype's own init
    base = None if config.is_moe else jax.block_until_ready(init_params(config, base_dtype, 0))
    ids, lengths = jnp.asarray(ids), jnp.asarray(lengths)
    useful = real * flops_per_token(config, len(prefix_ids), float(lengths.mean()))
    rows, reference = [], {}
    for dtype in args.dtypes:
        with variant_settings(dtype):  # undone even when a model fails
            if config.is_moe:
                params = init_params(config, base_dtype, 0, fp8_experts=dtype.startswith("fp8"))
                params = jax.block_until_ready(quantize_params(params) if dtype.startswith("fp8") else params)
            else:
                params = base if not dtype.startswith("fp8") else jax.block_until_ready(quantize_params(base))
            cache = jax.block_until_ready(jit(prefill, compiler_options=compiler_options(), static_argnums=1)(
                params, config, jnp.asarray(prefix_ids)))
            opts = compiler_options() | args.xla_option  # the trainer's: Triton GEMMs off on a GPU (jaxllm.compile)
            packed_at = lambda cap: jit(  # noqa: E731
                lambda p, c, i, n: encode_packed(p, config, i, n, prefix=c, capacity=cap,
                                                 attention_impl=args.packed_attention), compiler_options=opts)
            calls = {
                "rect": jit(lambda p, c, i, n: encode(p, config, i, n, prefix=c), compiler_options=opts),
                "bucketed": jit(lambda p, c, i, n: encode_bucketed(p, config, i, n, prefix=c, chunk=64),
                                compiler_options=opts),
                "packed": packed_at(capacities["packed"]),
                "packed-six": jit(lambda p, c, i, n: encode_packed(p, config, i, n, prefix=c,
                                                                   pass_sizes=six_sizes,
                                                                   attention_impl=args.packed_attention),
                                  compiler_options=opts),
                "packed-one-pass": packed_at(capacities["packed-one-pass"]),
            }
            for method in args.methods:
                row = {"dtype": dtype, "method": method, "batch": args.batch, "real_tokens": real,
                       "computed_tokens": args.batch * t if method == "rect" else None}
                if method.startswith("packed"):
                    row["passes"] = packed_passes(lengths, capacities[method], t,
                                                  sizes=six_sizes if method == "packed-six" else None)
                    row["computed_tokens"] = sum(row["passes"])
                log(f"{dtype} {method}: compiling and timing")
                try:
                    t_compile = time.perf_counter()
                    vec = np.asarray(calls[method](params, cache, ids, lengths))
                    row["first_call_s"] = time.perf_counter() - t_compile  # compile + one call
                    seconds = time_calls(lambda p=params, c=cache: calls[method](p, c, ids, lengths), jax.block_until_ready,
                                         args.iters)
                except Exception as e:  # report and keep measuring the rest
                    rows.append(row | {"error": f"{type(e).__name__}: {str(e)[:400]}"})
                    log(rows[-1])
                    continue
                if args.profile:
                    from scripts.kernel_times import print_summary, profile_call

                    summary = profile_call(lambda p=params, c=cache: calls[method](p, c, ids, lengths),
                                           Path(args.profile) / f"{dtype}-{method}", args.profile_top)
                    print_summary(summary, f"{dtype} {method}")
                    row["kernel_ms_by_kind"] = {line: s["by_kind_ms"] for line, s in summary.items()}
                    row["kernel_idle_ms"] = {line: round(s["idle_ms"], 3) for line, s in summary.items()}
                hlo = None
                if args.hlo_dir or (dtype.startswith("fp8") and method == "packed"):
                    hlo = calls[method].lower(params, cache, ids, lengths).compile().as_text()
                if args.hlo_dir:
                    args.hlo_dir.mkdir(parents=True, exist_ok=True)
                    (args.hlo_dir / f"{dtype}-{method}.hlo.txt").write_text(hlo)
                if dtype.startswith("fp8") and method == "packed":  # did the fp8 matmuls become cuBLASLt fp8 GEMMs?
                    row["cublaslt_fp8_gemm_calls_in_hlo"] = hlo.count("__cublas$lt$matmul$f8")
                reference.setdefault(dtype, vec)
                ref = reference.get("bfloat16", next(iter(reference.values())))  # the bf16 row, else the first
                cos = (vec * ref).sum(-1) / np.linalg.norm(vec, axis=-1) / np.linalg.norm(ref, axis=-1)
                rows.append(row | {"ms": seconds * 1e3, "prompts_per_s": args.batch / seconds,
                                   "real_tokens_per_s": real / seconds, "useful_tflops": useful / seconds / 1e12,
                                   "min_cosine_vs_reference": float(cos.min()), "finite": bool(np.isfinite(vec).all())})
                log({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rows[-1].items()})
            params = cache = None  # free them before the next dtype
    if args.no_gemm_ceiling:
        return {"capacity": capacity, "prefix": len(prefix_ids), "max_len": t, "rows": rows}
    # the GEMM ceilings last (their autotuning is slow): every row above is compared with its dtype's
    gemms = bench_gemms(config, _round_to(capacity, 1024), args.dtypes, args.iters)
    log(f"GEMM ceilings at M={gemms['tokens']}: " + ", ".join(
        f"{k} {v['best_tflops']:.0f} TFLOP/s" for k, v in gemms.items() if k != "tokens"))
    for row in rows:
        if "useful_tflops" in row:
            row["vs_gemm_ceiling"] = row["useful_tflops"] / gemms["fp8" if row["dtype"].startswith("fp8") else "bfloat16"][
                "best_tflops"]
            log(f"{row['dtype']:>9} {row['method']:<9} {row['ms']:8.1f} ms  {row['prompts_per_s']:6.1f} prompts/s  "
                f"{row['useful_tflops']:6.1f} TFLOP/s = {row['vs_gemm_ceiling']:.2f} of the GEMM ceiling")
    return {"gemms": gemms, "capacity": capacity, "prefix": len(prefix_ids), "max_len": t, "rows": rows}


def packed_passes(lengths, capacity: int, max_len: int, *, sizes=None) -> list[int]:
    """The pass sizes `encode_packed` runs for these prompt lengths, planned as on a GPU (cuDNN's segment grid) by
    the encoder's own planning code (`sizes`: its `pass_sizes`; None: `jaxllm.pass_capacities`)."""
    import numpy as np

    from jaxllm.encoder import _plan_pass, pass_capacities, pass_size_index, segment_grid

    lengths = np.asarray(lengths, np.int32)
    sizes = pass_capacities(capacity, max_len) if sizes is None else tuple(sorted(sizes))
    remaining, passes = lengths > 0, []
    while remaining.any():
        size = sizes[int(pass_size_index(sizes, int(lengths[remaining].sum())))]
        taken, _, _ = _plan_pass(lengths, remaining, size, segment_grid(size, max_len, len(lengths)))
        remaining, passes = remaining & ~np.asarray(taken), passes + [size]
    return passes


def six_pass_sizes(capacity: int, max_len: int) -> tuple[int, ...]:
    """The packed pass sizes before 2026-11-29 (for comparisons): `capacity`, up to three halvings of it that hold
    one longest prompt, and 1.5x each halving below capacity / 2 of at least 2,048 tokens (at 36,864: 4,608,
    6,912, 9,216, 13,824, 18,432 and 36,864). With steps of at most 2x, `jaxllm.encoder.pass_size_index` takes the
    smallest that holds the rest, as the encoder did then."""
    halvings = [int(capacity)]
    while len(halvings) < 4 and halvings[-1] // 2 >= max_len:
        half = halvings[-1] // 2
        halvings.append(_round_to(half, 64) if half >= 64 else half)
    between = [_round_to(3 * h // 2, 64) for h in halvings[2:] if h >= 2048]
    return tuple(sorted(set(halvings + between)))


def _round_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def bench_hf(args: argparse.Namespace) -> list[dict[str, Any]]:
    """HF transformers Qwen3Model (sdpa) encoding the rest of each prompt behind a prefix KV cache."""
    import torch
    import transformers

    config = model_config(args)
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "rope_theta"}
    hf_config = transformers.Qwen3Config(**fields, rope_parameters={"rope_type": "default",
                                                                     "rope_theta": config.rope_theta})
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen3Model._from_config(hf_config, dtype=dtype, attn_implementation="sdpa").eval()
    sync = (lambda _: torch.cuda.synchronize()) if device == "cuda" else (lambda _: None)
    gen = torch.Generator().manual_seed(0)
    rows = []
    # transformers renamed `past_key_values` to `cache` (5.x); use whichever this version has.
    cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def returned_cache(out):
        return getattr(out, "cache", None) or out.past_key_values

    with torch.inference_mode():
        prefix_kv = None
        if args.prefix:
            prefix_ids = torch.randint(0, config.vocab_size, (1, args.prefix), generator=gen).to(device)
            out = model(prefix_ids, use_cache=True)
            prefix_kv = [(layer.keys, layer.values) for layer in returned_cache(out).layers]

        def fresh_cache():
            """A cache holding the prefix as batch-expanded views (no copy), like jaxllm's shared prefix."""
            if prefix_kv is None:
                return None
            cache = transformers.DynamicCache(config=hf_config)
            for layer, (k, v) in zip(cache.layers, prefix_kv):
                layer.lazy_initialization(k, v)
                layer.keys = k.expand(args.batch, -1, -1, -1)
                layer.values = v.expand(args.batch, -1, -1, -1)
            return cache

        for t in args.seq:
            ids = torch.randint(0, config.vocab_size, (args.batch, t), generator=gen).to(device)
            row = {"framework": "hf-transformers", "attention": "sdpa", "batch": args.batch,
                   "prefix": args.prefix, "seq": t}
            times = []
            for i in range(args.iters + 2):
                cache = fresh_cache()
                sync(None)
                start = time.perf_counter()
                out = model(ids, use_cache=cache is not None, **{cache_kwarg: cache})
                sync(out)
                if i >= 2:
                    times.append(time.perf_counter() - start)
                if cache is not None:  # the prefix really was attended to
                    assert returned_cache(out).get_seq_length() == args.prefix + t
                del out, cache
            seconds = statistics.median(times)
            tokens = args.batch * t / seconds
            rows.append(row | {"ms": seconds * 1e3, "tokens_per_s": tokens,
                               "tflops": tokens * flops_per_token(config, args.prefix, t) / 1e12})
    return rows


def run_hf_subprocess(args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "hf.json"
        cmd = [sys.executable, __file__, "--hf-worker", str(out), "--batch", str(args.batch), "--prefix",
               str(args.prefix), "--iters", str(args.iters), "--seq", *map(str, args.seq)]
        if args.smoke:
            cmd.append("--smoke")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            return [{"framework": "hf-transformers", "error": proc.stderr.strip()[-1000:]}]
        return json.loads(out.read_text())


def device_name() -> str:
    import jax

    dev = jax.devices()[0]
    return f"{dev.platform}: {getattr(dev, 'device_kind', str(dev))} x{jax.device_count()} ({platform.node()})"


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{result['device']}  {result['date']}")
    mm = result["matmul"]
    print(f"GEMM ceiling ({mm['dtype']}, best model shape {mm['shape']}): {mm['tflops']:.1f} TFLOP/s")
    hf = {r["seq"]: r for r in result["rows"] if r["framework"] == "hf-transformers" and "ms" in r}
    head = f"{'framework':<16}{'attention':<12}{'B':>5}{'P':>6}{'T':>5}{'ms/call':>10}{'tokens/s':>11}{'TFLOP/s':>9}" \
           f"{'x matmul':>9}{'x HF':>7}"
    print(head)
    print("-" * len(head))
    for r in result["rows"]:
        if "error" in r:
            print(f"{r['framework']:<16}{r.get('attention', ''):<12} T={r.get('seq')}: ERROR {r['error'][:200]}")
            continue
        vs_mm = r["tflops"] / mm["tflops"]
        vs_hf = r["tokens_per_s"] / hf[r["seq"]]["tokens_per_s"] if r["seq"] in hf else float("nan")
        diff = "".join(f"  {k}={v:.1e}" for k, v in r.items() if k.startswith("max_rel_diff"))
        print(f"{r['framework']:<16}{r['attention']:<12}{r['batch']:>5}{r['prefix']:>6}{r['seq']:>5}{r['ms']:>10.2f}"
              f"{r['tokens_per_s']:>11.0f}{r['tflops']:>9.1f}{vs_mm:>9.3f}{vs_hf:>7.2f}{diff}"
              f"{'' if r.get('finite', True) else '  NON-FINITE OUTPUT'}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.hf_worker:
        args.hf_worker.write_text(json.dumps(bench_hf(args)))
        return {}
    if args.ragged:
        result = {"device": device_name(), "date": datetime.date.today().isoformat(), "smoke": args.smoke,
                  "ragged": bench_ragged(args)}
        if args.out:
            args.out.write_text(json.dumps(result, indent=2))
        return result
    hf_rows = [] if args.no_hf else run_hf_subprocess(args)  # before JAX claims the GPU's memory
    matmul = bench_matmul(args)
    rows = bench_jax(args, matmul["tflops"])
    for r in rows:
        match = [h for h in hf_rows if h.get("seq") == r["seq"] and "tokens_per_s" in h]
        if match and "tokens_per_s" in r:
            r["vs_hf"] = r["tokens_per_s"] / match[0]["tokens_per_s"]
    result = {"device": device_name(), "date": datetime.date.today().isoformat(), "smoke": args.smoke,
              "config": dataclasses.asdict(model_config(args)), "matmul": matmul, "rows": rows + hf_rows,
              "flops_per_token_note": "useful causal FLOPs, no LM head (REFERENCE section 5 formula)"}
    print_table(result)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
