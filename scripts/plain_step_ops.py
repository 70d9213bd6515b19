"""What one plain-PPO env step and one update execute, counted on the jaxpr (CPU is enough): a launch-count proxy.

    python scripts/plain_step_ops.py                                   # Craftax-Symbolic, ours per step + per update
    python scripts/plain_step_ops.py --reference-dir .reference/Craftax_Baselines   # + the upstream ppo.py's update

Each primitive is counted once per execution: a scan's body times its length (a `cond` counts every branch, an
upper bound). "inner loops" are the scans left inside one env step and the iterations they run; on a GPU each
iteration adds a loop-counter kernel and copies of its carry beside the body's kernels (docs/BENCHMARKS.md, issue 35).
The split of a step (Craftax's own step, drawing the fresh worlds of the optimistic resets, the policy) says where a
step's kernels come from; the `rl.config.SpeedConfig` rows say what each setting leaves in the step's loop.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from rl.config import TrainConfig  # noqa: E402
from rl.llm import LLMArgs  # noqa: E402
from rl.trainer import Trainer  # noqa: E402

_SUBS = ("jaxpr", "call_jaxpr", "body_jaxpr", "cond_jaxpr")


def executions(jaxpr: Any, mult: int = 1, acc: collections.Counter | None = None,
               loops: list | None = None) -> tuple[collections.Counter, list]:
    """(primitive -> executions, [(scan length, executions of that scan)]) of a jaxpr, scans times their length."""
    acc = collections.Counter() if acc is None else acc
    loops = [] if loops is None else loops
    for eqn in jaxpr.eqns:
        p = eqn.params
        if eqn.primitive.name == "scan":
            looping = p.get("unroll", 1) < p["length"]
            if looping:
                loops.append((p["length"], mult))
            executions(p["jaxpr"].jaxpr, mult * p["length"], acc, loops)
            continue
        subs = [getattr(p[k], "jaxpr", p[k]) for k in _SUBS if p.get(k) is not None]
        subs += [b.jaxpr for b in p.get("branches", ())]
        if subs:
            for sub in subs:
                executions(sub, mult, acc, loops)
        else:
            acc[eqn.primitive.name] += mult
    return acc, loops


def summary(fn: Callable, *args) -> dict:
    """Executions, inner loops and their iterations of `fn(*args)`."""
    acc, loops = executions(jax.make_jaxpr(fn)(*args).jaxpr)
    return dict(executions=sum(acc.values()), loops=sum(m for _, m in loops),
                loop_iterations=sum(n * m for n, m in loops))


def step_rows(env: str, num_envs: int, reset_ratio: int) -> dict[str, dict]:
    """One env step (policy + env + resets) per SpeedConfig setting, and its parts under the defaults."""
    cfg = TrainConfig(encoder="none", env=env, num_envs=num_envs, reset_ratio=reset_ratio,
                      total_timesteps=num_envs * 64 * 10)
    rows = {}
    for name, speed in (("default", {}), ("env_unroll 12", dict(env_unroll=12)), ("lazy_reset", dict(lazy_reset=True)),
                        ("batch_resets (in the loop)", dict(batch_resets=True))):
        tr = Trainer.from_config(cfg.replace(**speed))
        state = tr.init_state()
        carry = state.rollout_carry(jax.random.PRNGKey(1))
        idx = jnp.arange(num_envs)
        if speed.get("batch_resets"):
            fresh = jax.tree.map(lambda x: x[0], tr.fresh_worlds(carry.key, 1, idx))
            rows[name] = summary(lambda c, f: tr._act(state.params, c, idx, fresh=f), carry, fresh)
        else:
            rows[name] = summary(lambda c: tr._act(state.params, c, idx), carry)
        if not speed:
            key, act = jax.random.PRNGKey(2), jnp.zeros(num_envs, jnp.int32)
            rows["part: Craftax step"] = summary(lambda s: tr.env._step_batch(
                jax.random.split(key, num_envs), s, act), state.env_state.env_state)
            rows["part: fresh worlds"] = summary(lambda k: tr.env.reset_pool(k, idx), key)
            rows["part: policy"] = summary(lambda o: tr.apply(state.params, o, None)[0].sample(seed=key), state.obs)
            rows["update (ours)"] = summary(lambda s: tr.update(s, LLMArgs()), state)
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", default="Craftax-Symbolic-v1")
    p.add_argument("--num-envs", type=int, default=32, help="counts do not depend on it")
    p.add_argument("--reset-ratio", type=int, default=16)
    p.add_argument("--reference-dir", type=Path, default=None, help="a Craftax_Baselines checkout: + ppo.py's update")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    rows = step_rows(args.env, args.num_envs, args.reset_ratio)
    if args.reference_dir is not None:
        import bench_reference

        ppo = bench_reference.import_reference(args.reference_dir)
        cfg = TrainConfig(encoder="none", env=args.env, num_envs=args.num_envs, reset_ratio=args.reset_ratio)
        rows["update (ppo.py, incl. its init and reset)"] = summary(
            ppo.make_train(bench_reference.reference_config(cfg, 1)), jax.random.PRNGKey(0))
    print(f"{args.env}, {args.num_envs} envs, reset ratio {args.reset_ratio}")
    print(f"{'':44s} {'executions':>11s} {'loops':>6s} {'iterations':>10s}")
    for name, r in rows.items():
        print(f"{name:44s} {r['executions']:11,d} {r['loops']:6,d} {r['loop_iterations']:10,d}")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
