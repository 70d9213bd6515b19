"""Benchmark the render token template next to one env step, and measure token lengths.

For each env and format: the templates of B states (default 1,024) in one jitted vmapped call,
versus one step of the same batch with the trainer's wrappers (`rl.envs.BatchedEnv`: optimistic
resets, the observation included, as the policy reads it), both in steady state (compile excluded,
block_until_ready, median of --iters), in one jitted loop and per call. Then
token-length statistics (mean, p99, max) of the observation part over the test states
(`render.sample_states`, seeds 0-3, deliberately hard) and over typical states (`render.typical_states`:
plain random play from reset, seeds 0-1), and the distribution of the number of informative tiles that
the compact format's K cap is chosen from.

    python scripts/bench_template.py --out bench_template.json          # GPU, full size
    python scripts/bench_template.py --smoke                            # CPU check, small shapes
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from render import build_template  # noqa: E402
from render.template import ASSEMBLIES  # noqa: E402
from render.envs import CLASSIC, CRAFTAX  # noqa: E402
from render.sample_states import sample_states, typical_states  # noqa: E402
from render.sources import view_function  # noqa: E402

ENVS = (CRAFTAX, CLASSIC)
FORMATS = ("compact", "full")


def timed(fn, *args, iters: int) -> float:
    """Median seconds of fn(*args) after one warm-up call (which includes compilation)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


NOT_KERNELS = ("parameter", "constant", "tuple", "get-tuple-element", "bitcast", "copy-start", "copy-done")


def kernel_count(text: str) -> int:
    """Operations that launch work in a compiled program's entry computation (`text`: its HLO; fusions, scatters,
    library calls...): a proxy for GPU kernel launches, which dominate a small template's time."""
    entry = text[text.index("ENTRY"):]
    entry = entry[: entry.index("\n}")]
    ops = [re.search(r"([a-z][a-z0-9\-]*)\(", line.split("=", 1)[1]) for line in entry.splitlines()[1:] if "=" in line]
    ops = [m.group(1) for m in ops if m]
    return sum(op not in NOT_KERNELS for op in ops)


def per_iteration_in_loop(body, carry, steps: int, iters: int) -> float:
    """Seconds per iteration of `body(i, carry) -> carry` run `steps` times inside ONE jitted fori_loop: the
    device cost as the trainer's scan pays it, without the per-call host dispatch (which, for a call of
    ~100 state arrays, measured ~0.3 ms on an H200 and would dominate a sub-millisecond template)."""
    run = jax.jit(lambda c: jax.lax.fori_loop(0, steps, body, c))
    return timed(run, carry, iters=iters) / steps


def template_in_loop(tpl, states, steps: int, iters: int) -> float:
    """The template inside a loop; each iteration's input depends on the previous output, so XLA can neither
    hoist it out of the loop nor drop the ids. The ids are handed on (loop carry), as the trainer hands them to
    the LLM; the next states move by min(first id, 0) = 0."""
    def body(i, carry):
        s, _, _ = carry
        ids, lens = jax.vmap(tpl)(s)
        nudge = jnp.minimum(ids[:, 0], 0) + jnp.minimum(lens, 0)
        s = s.replace(player_position=s.player_position + nudge[:, None].astype(s.player_position.dtype))
        return s, ids, lens

    batch = states.player_position.shape[0]
    carry = (states, jnp.zeros((batch, tpl.max_len), jnp.int32), jnp.zeros((batch,), jnp.int32))
    return per_iteration_in_loop(body, carry, steps, iters)


def batched_env_step(env_name: str, num_envs: int):
    """The trainer's batched env step (`rl.envs.BatchedEnv`: optimistic resets) with all-zero actions,
    as step(key, state) -> (obs, state), and a first (obs, state)."""
    from rl.envs import BatchedEnv

    env = BatchedEnv(env_name, num_envs)
    first = jax.jit(env.reset)(jax.random.PRNGKey(0))
    actions = jnp.zeros((num_envs,), jnp.int32)
    return (lambda key, s: env.step(key, s, actions)[:2]), first


def _loop_key(i):
    """The env step's key at loop iteration i."""
    return jax.random.fold_in(jax.random.PRNGKey(1), i)


def env_step_in_loop(step, first, steps: int, iters: int) -> float:
    """One batched env step (from `batched_env_step`) inside a loop, its observation carried (the policy reads it,
    so the compiler can't drop its computation)."""
    return per_iteration_in_loop(lambda i, c: step(_loop_key(i), c[1]), first, steps, iters)


def env_step_with_template_in_loop(step, first, tpl, steps: int, iters: int) -> float:
    """One batched env step followed by the templates of its new states, inside a loop, obs and ids carried:
    the loop body of an in-scan rollout step. Minus `env_step_in_loop`, it is what adding the template to the
    step costs, with whatever the compiler shares or overlaps between the two."""
    batch = first[1].env_state.player_position.shape[0]

    def body(i, carry):
        obs, s = step(_loop_key(i), carry[1])
        ids, lens = jax.vmap(tpl)(s.env_state)
        return obs, s, ids, lens

    carry = (*first, jnp.zeros((batch, tpl.max_len), jnp.int32), jnp.zeros((batch,), jnp.int32))
    return per_iteration_in_loop(body, carry, steps, iters)


def loop_overhead(batch: int, steps: int, iters: int) -> float:
    """Seconds per iteration of a loop whose body is one trivial elementwise op on int32 [batch]: the loop's own
    cost per iteration (its condition and bookkeeping), which every loop measure above includes and which a
    rollout's scan pays once per step whatever its body holds."""
    return per_iteration_in_loop(lambda i, x: x + 1, jnp.zeros((batch,), jnp.int32), steps, iters)


def env_step_time(step, first, iters: int) -> float:
    """Seconds of one batched env step (from `batched_env_step`, obs and state) in its own jitted call."""
    return timed(jax.jit(step), jax.random.PRNGKey(0), first[1], iters=iters)


def length_stats(tpl, chunks) -> dict:
    batched = jax.jit(jax.vmap(tpl))  # traced and compiled once for all chunks (one shape)
    lens = np.concatenate([np.asarray(batched(c)[1]) for c in chunks])
    return {
        "states": int(lens.size), "mean": float(lens.mean()), "p99": float(np.percentile(lens, 99)),
        "max": int(lens.max()), "max_len": tpl.max_len, "prefix": len(tpl.prefix_ids),
    }


def informative_tiles(env_name: str, chunks) -> dict:
    """How many tiles the compact format would list without its K cap (to choose K)."""
    if env_name == CRAFTAX:
        from render.formats_craftax import COMPACT_BACKGROUND, COMPACT_MAX_TILES, NO_MOB, local_tiles

        def count(s):
            t = local_tiles(s)
            bg = jnp.zeros(64, bool).at[jnp.array([b.value for b in COMPACT_BACKGROUND])].set(True)
            return jnp.sum(t["lit"] & ((t["mob"] < NO_MOB) | (t["item"] > 0) | ~bg[t["block"]]))
    else:
        from render.formats_classic import COMPACT_BACKGROUND, COMPACT_MAX_TILES, NO_MOB, local_tiles

        def count(s):
            t = local_tiles(s)
            bg = jnp.zeros(64, bool).at[jnp.array([b.value for b in COMPACT_BACKGROUND])].set(True)
            return jnp.sum((t["mob"] < NO_MOB) | ~bg[t["block"]])

    batched = jax.jit(jax.vmap(count))  # traced and compiled once for all chunks (one shape)
    n = np.concatenate([np.asarray(batched(c)) for c in chunks])
    return {
        "K": COMPACT_MAX_TILES, "mean": float(n.mean()), "p50": float(np.percentile(n, 50)),
        "p99": float(np.percentile(n, 99)), "max": int(n.max()),
        "fraction_fitting_K": float((n <= COMPACT_MAX_TILES).mean()),
    }


def print_loop_rows(results: dict, title: str, template_key: str, step_key: str, ratio_key: str,
                    net: bool = False) -> None:
    """One line per env and format: a loop measure of the template next to the env step's, and their ratio."""
    print(title)
    for env_name, env_res in results["envs"].items():
        for fmt, r in env_res["formats"].items():
            line = (f"{env_name:28} {fmt:14} template {r[template_key] * 1e3:8.3f} ms  env step "
                    f"{env_res[step_key] * 1e3:8.3f} ms  ratio {r[ratio_key]:7.2%}")
            if net:
                line += f"  net of the loop's own {env_res['loop_overhead_s'] * 1e3:.3f} ms: {r['ratio_in_loop_net']:7.2%}"
            print(line)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-envs", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--stat-states", type=int, default=512, help="states per seed for length stats (4 seeds); 0 skips the statistics "
                        "(they do not depend on the device: docs/RENDER.md has them from a CPU run)")
    parser.add_argument("--envs", nargs="+", default=list(ENVS), choices=ENVS)
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    parser.add_argument("--loop-steps", type=int, default=40,
                        help="env steps per timed loop (templates: 4x); a loop's fixed cost is spread over its steps "
                             "(the runs in docs/BENCHMARKS.md up to runs A and B used 10)")
    parser.add_argument("--profile", action="store_true", help="also print the template's per-kernel GPU time")
    parser.add_argument("--assembly", nargs="+", default=["auto"], choices=list(ASSEMBLIES),
                        help="template assemblies to time (build_template's `assembly`; one other than 'auto' is "
                             "reported as FMT+NAME). Each one other than 'jnp' is checked equal to the jnp assembly "
                             "(on CPU 'auto' is the jnp assembly, so that check is trivial there)")
    parser.add_argument("--added-measure", action="store_true",
                        help="also time env step + template in one loop body (one more env-step compile per format and "
                             "assembly; its results did not reproduce between processes, docs/BENCHMARKS.md)")
    parser.add_argument("--hlo-dir", type=Path, help="write each template's compiled program (HLO text) here")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes for a CPU check")
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    args = parser.parse_args(argv)
    if args.smoke:
        args.num_envs, args.iters, args.stat_states, args.loop_steps = 32, 2, 32, 2

    from jaxllm import load_tokenizer

    tokenizer = load_tokenizer()
    device = jax.devices()[0]
    results = {
        "device": f"{device.platform}: {device.device_kind}", "host": platform.node(),
        "date": time.strftime("%Y-%m-%d"), "num_envs": args.num_envs, "smoke": args.smoke, "envs": {},
    }
    for env_name in args.envs:
        step, first = batched_env_step(env_name, args.num_envs)
        step_s = env_step_time(step, first, args.iters)
        loop_iters = max(3, args.iters // 4)
        step_loop_s = env_step_in_loop(step, first, args.loop_steps, loop_iters)
        overhead_s = loop_overhead(args.num_envs, 4 * args.loop_steps, loop_iters)
        states = sample_states(env_name, args.num_envs, 100)
        chunks = [sample_states(env_name, args.stat_states, seed) for seed in range(4)] if args.stat_states else []
        typical = [typical_states(env_name, args.stat_states, seed) for seed in range(2)] if args.stat_states else []
        env_res = {"env_step_s": step_s, "env_step": "rl.envs.BatchedEnv.step (optimistic resets)",
                   "env_step_in_loop_s": step_loop_s,
                   "loop_overhead_s": overhead_s,
                   "formats": {},
                   "informative_tiles": informative_tiles(env_name, chunks) if chunks else None}
        for fmt, assembly in [(f, a) for f in args.formats for a in args.assembly]:
            tpl = build_template(tokenizer, env_name, fmt, assembly=assembly)
            if assembly != "auto":
                fmt = f"{fmt}+{assembly}"
            fn = jax.jit(jax.vmap(tpl))
            t = timed(fn, states, iters=args.iters)
            if assembly != "jnp":  # the kernel's compiled (GPU) form is not in the CPU test suite: check it here
                reference = jax.jit(jax.vmap(dataclasses.replace(tpl, assembly="jnp")))(states)
                same = all(bool((a == b).all()) for a, b in zip(fn(states), reference))
                print(f"{env_name} {fmt}: ids and lengths equal to the jnp assembly on {args.num_envs} states: {same}")
                if not same:
                    raise SystemExit(f"{fmt}: the {assembly} assembly disagrees with the jnp assembly")
            tl = template_in_loop(tpl, states, 4 * args.loop_steps, loop_iters)
            hlo = fn.lower(states).compile().as_text()
            env_res["formats"][fmt] = {
                "template_s": t, "ratio_to_env_step": t / step_s, "kernels": kernel_count(hlo),
                "values_s": timed(jax.jit(jax.vmap(lambda s: tpl.fmt.values(view_function(env_name, "state")(s)))),
                                  states, iters=args.iters),
                "template_in_loop_s": tl, "ratio_in_loop": tl / step_loop_s,
                "ratio_in_loop_net": (tl - overhead_s) / (step_loop_s - overhead_s),
                "tokens": length_stats(tpl, chunks) if chunks else None,
                "tokens_typical": length_stats(tpl, typical) if typical else None,
            }
            if args.added_measure:
                both = env_step_with_template_in_loop(step, first, tpl, args.loop_steps, loop_iters)
                env_res["formats"][fmt].update(env_step_with_template_in_loop_s=both,
                                               template_added_to_env_step_s=both - step_loop_s,
                                               ratio_added=(both - step_loop_s) / step_loop_s)
            if args.hlo_dir:
                args.hlo_dir.mkdir(parents=True, exist_ok=True)
                (args.hlo_dir / f"{env_name}_{fmt}.hlo.txt").write_text(hlo)
            if args.profile:
                from scripts.kernel_profile import kernel_table, print_kernel_table

                table = kernel_table(fn, states, iters=args.iters)
                print(f"\n{env_name} {fmt}: template kernels (one call of {args.num_envs} states)")
                print_kernel_table(table)
                env_res["formats"][fmt]["kernel_table"] = table
        results["envs"][env_name] = env_res

    print(f"\ndevice {results['device']}, {args.num_envs} states per call, median of {args.iters}")
    print_loop_rows(results, "in one jitted loop (the trainer's view: no per-call dispatch; ids carried, env step "
                    "with its obs):", "template_in_loop_s", "env_step_in_loop_s", "ratio_in_loop", net=True)
    if args.added_measure:
        print_loop_rows(results, "added to the env step (env step + template in one loop body, minus the env step "
                        "alone):", "template_added_to_env_step_s", "env_step_in_loop_s", "ratio_added")
    print("one jitted call each (includes host dispatch of the state pytree):")
    print(f"{'env':28} {'format':14} {'kernels':>7} {'template ms':>11} {'env step ms':>11} {'ratio':>7} "
          f"{'values ms':>9} {'mean tok':>8} {'p99':>6} {'max':>5} {'max_len':>7} {'prefix':>6}")
    for env_name, env_res in results["envs"].items():
        for fmt, r in env_res["formats"].items():
            tk = r["tokens"] or dict(mean=float("nan"), p99=float("nan"), max=-1, max_len=-1, prefix=-1)
            print(f"{env_name:28} {fmt:14} {r['kernels']:7d} {r['template_s'] * 1e3:11.3f} {env_res['env_step_s'] * 1e3:11.3f} "
                  f"{r['ratio_to_env_step']:7.2%} {r['values_s'] * 1e3:9.3f} {tk['mean']:8.1f} {tk['p99']:6.0f} {tk['max']:5d} "
                  f"{tk['max_len']:7d} {tk['prefix']:6d}")
        for fmt, r in env_res["formats"].items():
            if r["tokens_typical"]:
                tk = r["tokens_typical"]
                print(f"{env_name:28} {fmt:14} typical states (random play from reset, {tk['states']}): "
                      f"mean {tk['mean']:.1f}, p99 {tk['p99']:.0f}, max {tk['max']}")
        it = env_res["informative_tiles"]
        if it is None:
            continue
        print(f"{env_name:28} informative tiles: mean {it['mean']:.1f}, p50 {it['p50']:.0f}, p99 {it['p99']:.0f}, "
              f"max {it['max']}; K={it['K']} fits {it['fraction_fitting_K']:.2%} (env step: {env_res['env_step']})")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
