"""Two models' packed encoders in one process, timed in alternating rounds: the prompts/s ratio of the first over
the second, with its spread.

Issue 33 asks Qwen3-30B-A3B to encode >= 1.0x the prompts/s of Qwen3-4B in the same dtype and run. One row of
`bench_encoder.py --ragged` moves by a few ms between runs of the same setting in one process (the 30B's fp8 rows
differed by 5.6 ms on an H200), as much as the gap being measured, and the two models ran in separate processes.
Here both models' weights, prefix caches and compiled calls live in one process; each round times every model
(`--iters` synchronised calls each, their median), the order flipping every round so a drift in the card's clock
falls on both; the ratio is the median of the per-round ratios, reported with their min and max. `--variants`
(bench_encoder's --dtypes variants of --dtype) adds the first model compiled with each variant's module settings,
timed in the same rounds, each with its own ratio: an A/B of a kernel change against the same yardstick.
`--variants-on both` compiles the second model with them too, and each variant's ratio is then that of the two
models with the same settings (for a change that both models run, such as the attention's). The result's
`timed_windows` (the wall-clock start and end of each row's timings) let `scripts/gpu_clocks.py` read the card's
clock and power inside them.

    python scripts/bench_ratio.py --models qwen3-30b-a3b qwen3-4b --dtype fp8 --rounds 6 --out ratio.json
    python scripts/bench_ratio.py --dtype fp8 --variants fp8-moe-silu-exp   # + the 30B as it was, same rounds
    python scripts/bench_ratio.py --dtype fp8 --variants fp8-xla-merge --variants-on both   # both models as were
    python scripts/bench_ratio.py --smoke                     # their tiny stand-ins on a CPU
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_encoder import (SMOKE_CONFIG, SMOKE_MOE_CONFIG, VARIANTS, template_prompts, time_calls,  # noqa: E402
                           variant_settings)

from jaxllm.config import PRESETS  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs=2, default=["qwen3-30b-a3b", "qwen3-4b"], choices=sorted(PRESETS),
                   help="the two model shapes (random weights made on the device); the ratio is the first's "
                        "prompts/s over the second's")
    p.add_argument("--dtype", default="fp8", choices=["bfloat16", "fp8"])
    p.add_argument("--variants", nargs="+", default=[], choices=sorted(VARIANTS),
                   help="also the first model with each of these bench_encoder variants of --dtype (its module "
                        "settings while it compiles), timed in the same rounds")
    p.add_argument("--variants-on", choices=["first", "both"], default="first",
                   help="which models --variants applies to: the first only (compared with the second as it is) "
                        "or both (each variant's ratio between the two models with its settings)")
    p.add_argument("--rounds", type=int, default=6, help="alternating rounds (each times every model)")
    p.add_argument("--iters", type=int, default=10, help="synchronised calls per model per round (their median)")
    p.add_argument("--batch", type=int, default=None, help="prompts per call (default 128; smoke 4)")
    p.add_argument("--env", default="Craftax-Symbolic-v1", help="the env whose typical states give the prompts")
    p.add_argument("--smoke", action="store_true", help="each model's tiny stand-in (dense or MoE), float32 base")
    p.add_argument("--out", type=Path, default=None, help="also write the result as JSON here")
    args = p.parse_args(argv)
    args.batch = args.batch or (4 if args.smoke else 128)
    if args.rounds < 1 or args.iters < 1:
        p.error("--rounds and --iters must be at least 1")
    if args.models[0] == args.models[1]:
        p.error(f"--models names {args.models[0]} twice; to compare a setting of one model, use --variants")
    for variant in args.variants:
        if variant.split("-")[0] != args.dtype:
            p.error(f"--variants {variant} is a variant of {variant.split('-')[0]}, not of --dtype {args.dtype}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxllm import default_capacity, encode_packed, init_params, prefill
    from jaxllm.compile import compiler_options, jit
    from jaxllm.fp8 import quantize_params

    args = parse_args(argv)
    t0 = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - t0:6.1f} s] {msg}", flush=True)  # noqa: E731
    # --smoke: each model's tiny stand-in (dense or MoE as it is), under its own name
    configs = {name: ((SMOKE_MOE_CONFIG if PRESETS[name].is_moe else SMOKE_CONFIG) if args.smoke else PRESETS[name])
               for name in args.models}
    ids, lengths, prefix_ids = template_prompts(args.env, args.batch)
    capacity = default_capacity(args.batch, ids.shape[1])
    real_tokens, lengths = int(lengths.sum()), jnp.asarray(lengths)  # on the device once, not in every timed call
    base_dtype = jnp.float32 if args.smoke else jnp.bfloat16
    fp8 = args.dtype == "fp8"
    log(f"{args.env}: {args.batch} prompts, {real_tokens} real tokens, prefix {len(prefix_ids)}, "
        f"capacity {capacity}; {args.dtype}")
    calls = {}
    for name, config in configs.items():
        # made on the device; an MoE's experts quantised as they are made (its bf16 copy never all at once)
        params = init_params(config, base_dtype, 0, fp8_experts=fp8 and config.is_moe)
        params = jax.block_until_ready(quantize_params(params) if fp8 else params)
        model_ids, model_prefix = (jnp.asarray(x % config.vocab_size) for x in (ids, prefix_ids))  # smoke vocab
        cache = jax.block_until_ready(jit(prefill, compiler_options=compiler_options(), static_argnums=1)(
            params, config, model_prefix))
        # the model as it is, then with each variant's settings while its call compiles (the first model only,
        # unless --variants-on both)
        for variant in [None] + (args.variants if name == args.models[0] or args.variants_on == "both" else []):
            row = name if variant is None else f"{name} {variant}"
            with variant_settings(variant):
                fn = jit(lambda p, c, i, n, config=config: encode_packed(p, config, i, n, prefix=c,
                                                                         capacity=capacity),
                         compiler_options=compiler_options())
                start = time.perf_counter()
                try:
                    vec = np.asarray(fn(params, cache, model_ids, lengths))
                except Exception as err:  # a variant that fails (e.g. a kernel that does not fit): reported, left out
                    if variant is None:
                        raise
                    log(f"{row}: failed, left out ({type(err).__name__}: {str(err)[:300]})")
                    continue
            log(f"{row}: compiled and called once in {time.perf_counter() - start:.1f} s, finite "
                f"{bool(np.isfinite(vec).all())}")
            calls[row] = (lambda fn=fn, p=params, c=cache, i=model_ids: fn(p, c, i, lengths))
    names = list(calls)
    ms: dict[str, list[float]] = {name: [] for name in names}
    windows: dict[str, list[list[float]]] = {name: [] for name in names}  # wall-clock [start, end] of each timing
    yardstick = args.models[1]
    # each first-model row against the yardstick row with its settings where there is one (--variants-on both)
    against = {name: f"{yardstick}{name[len(args.models[0]):]}" for name in names
               if name.split(" ")[0] == args.models[0]}
    against = {name: other if other in calls else yardstick for name, other in against.items()}
    ratios: dict[str, list[float]] = {name: [] for name in against}
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            start = time.time()
            ms[name].append(time_calls(calls[name], jax.block_until_ready, args.iters) * 1e3)
            windows[name].append([start, time.time()])
        for name in ratios:  # prompts/s of each first-model row over its yardstick row's
            ratios[name].append(ms[against[name]][-1] / ms[name][-1])
        log(f"round {r + 1}: " + ", ".join(f"{n} {ms[n][-1]:.1f} ms" for n in names) + "; ratios "
            + ", ".join(f"{v[-1]:.4f}" for v in ratios.values()))
    result = {
        "dtype": args.dtype, "batch": args.batch, "capacity": capacity, "rounds": args.rounds, "iters": args.iters,
        "device": str(jax.devices()[0].device_kind), "date": time.strftime("%Y-%m-%d"), "yardstick": yardstick,
        "ms": ms, "timed_windows": windows, "median_ms": {n: statistics.median(v) for n, v in ms.items()},
        "prompts_per_s": {n: args.batch / statistics.median(v) * 1e3 for n, v in ms.items()},
        "ratios": {n: {"median": statistics.median(v), "min": min(v), "max": max(v), "against": against[n]}
                   for n, v in ratios.items()},
    }
    first = result["ratios"][args.models[0]]
    result |= {"ratio": first["median"], "ratio_min": first["min"], "ratio_max": first["max"]}
    for name, ratio in result["ratios"].items():
        log(f"{name} / {against[name]} prompts/s: median {ratio['median']:.4f} (rounds {ratio['min']:.4f}-"
            f"{ratio['max']:.4f}); median {result['median_ms'][name]:.1f} ms vs "
            f"{result['median_ms'][against[name]]:.1f}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
