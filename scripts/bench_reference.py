"""This trainer (`--encoder none`) against the upstream Craftax_Baselines `ppo.py`, side by side in one process.

    python scripts/bench_reference.py --reference-dir /path/to/Craftax_Baselines --out bench_reference.json
    python scripts/bench_reference.py --reference-dir ... --only none-1024 --profile    # + per-kernel GPU tables
    python scripts/bench_reference.py --smoke --reference-dir ...                        # CPU check, tiny shapes

The upstream code is never part of this repository: pass a checkout of
https://github.com/MichaelTMatthews/Craftax_Baselines (e.g. `git clone --depth 1 <url> .reference/Craftax_Baselines`,
an ignored folder). Its `wandb` import is stubbed (nothing is logged) and its `make_train(config)` is called with
this trainer's hyperparameters and env counts (REFERENCE §2): the same env, batch, epochs, minibatches, LR schedule,
network width and reset scheme (`reset_ratio` 16 = optimistic resets; the `-autoreset` configs use the upstream
auto-reset wrapper, and `reset_ratio` 1 here: a fresh world per env every step).

For each config, in one process on one card:
  * reference: `jax.jit(make_train(config))` with NUM_UPDATES = `--updates`; its first call is timed (compile + run),
    then `--repeats` calls (SPS = env steps of the call / seconds; the call also resets its envs and inits the
    network once, as upstream does);
  * ours: the first update is timed (compile + run, `scripts/bench_train.py`'s `prepare`), then `--updates`
    updates `--repeats` times, two ways: `dispatch` (updates queued back to back, one block at the end:
    bench_train's `measure`; `rl.train` reads update k's metrics after dispatching update k + 1) and
    `host_loop` (every update's metrics read on the host before the next update is dispatched).
The best of the repeats is reported for each (timings alternate between the two trainers).
`--profile` adds, per config, the device time per kernel and the launch count of one of our updates and one
reference call (`scripts/kernel_profile.py`), and our rollout alone, so the gap can be placed.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402

import bench_train  # noqa: E402
from rl.config import TrainConfig  # noqa: E402

UPSTREAM = "https://github.com/MichaelTMatthews/Craftax_Baselines"
CONFIGS = {name: bench_train.CONFIGS[name] for name in ("none-1024", "none-128-autoreset")}


def missing_reference_message(path: Path | None) -> str:
    where = f"{path} is not a Craftax_Baselines checkout (no ppo.py)" if path else "no --reference-dir given"
    return (f"{where}. Get one into an ignored folder, e.g.\n"
            f"    git clone --depth 1 {UPSTREAM} .reference/Craftax_Baselines\n"
            f"and pass --reference-dir .reference/Craftax_Baselines (or --skip-reference to time this trainer alone)")


def import_reference(path: Path):
    """The upstream `ppo` module from a checkout at `path`, with `wandb` stubbed (it is imported, never used)."""
    if not (path / "ppo.py").is_file():
        raise SystemExit(missing_reference_message(path))
    sys.modules.setdefault("wandb", types.ModuleType("wandb"))
    sys.path.insert(0, str(path.resolve()))
    try:
        return importlib.import_module("ppo")
    finally:
        sys.path.remove(str(path.resolve()))


def reference_config(cfg: TrainConfig, updates: int) -> dict:
    """Upstream `make_train`'s config dict for the hyperparameters and env count of `cfg`, `updates` updates."""
    return dict(
        ENV_NAME=cfg.env, NUM_ENVS=cfg.num_envs, NUM_STEPS=cfg.num_steps,
        TOTAL_TIMESTEPS=updates * cfg.batch_size, LR=cfg.lr, ANNEAL_LR=cfg.anneal_lr, MAX_GRAD_NORM=cfg.max_grad_norm,
        UPDATE_EPOCHS=cfg.update_epochs, NUM_MINIBATCHES=cfg.num_minibatches, GAMMA=cfg.gamma,
        GAE_LAMBDA=cfg.gae_lambda, CLIP_EPS=cfg.clip_eps, ENT_COEF=cfg.ent_coef, VF_COEF=cfg.vf_coef,
        LAYER_SIZE=cfg.width, ACTIVATION="tanh",
        USE_OPTIMISTIC_RESETS=cfg.reset_ratio > 1, OPTIMISTIC_RESET_RATIO=cfg.reset_ratio,
        TRAIN_ICM=False, USE_E3B=False, DEBUG=False, USE_WANDB=False, NUM_REPEATS=1,
    )


def prepare_reference(ppo, cfg: TrainConfig, args) -> dict:
    """The reference's jitted `train` for `cfg`, compiled and run once (timed)."""
    train = jax.jit(ppo.make_train(reference_config(cfg, args.updates)))
    rng = jax.random.PRNGKey(cfg.seed)
    t0 = time.perf_counter()
    jax.block_until_ready(train(rng))
    first = time.perf_counter() - t0
    print(f"  reference: first call (compile + {args.updates} updates) {first:.1f} s", flush=True)
    return dict(train=train, rng=rng, first=first, steps=args.updates * cfg.batch_size, best=None)


def time_reference(ref: dict) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(ref["train"](ref["rng"]))
    return time.perf_counter() - t0


def time_ours_host_loop(prep: dict, updates: int) -> float:
    """Seconds for `updates` updates with each update's metrics read on the host before the next is dispatched
    (how `rl.train` ran before issue 15; it now dispatches the next update first, as `dispatch` times)."""
    trainer, runner, args_llm = prep["trainer"], prep["runner"], prep["args_llm"]
    t0 = time.perf_counter()
    for _ in range(updates):
        runner, m = trainer.step(runner, args_llm)
        float(m["total_loss"])
    jax.block_until_ready(runner)
    prep["runner"] = runner
    return time.perf_counter() - t0


def profile(prep: dict, ref: dict | None, out: dict) -> None:
    """Device time per kernel of one of our updates and one reference call (launch counts and the kernel time
    against the wall time say whether a program is launch-bound), and the wall time of our rollout alone."""
    from kernel_profile import kernel_table, print_kernel_table
    from rl.trainer import RolloutCarry

    trainer, runner, args_llm = prep["trainer"], prep["runner"], prep["args_llm"]
    roll = jax.jit(lambda r, k: trainer.rollout(r.params, RolloutCarry(r.env_state, r.obs, r.hidden, k, r.window),
                                                args_llm)[1:3])
    key = jax.random.PRNGKey(1)
    jax.block_until_ready(roll(runner, key))
    t0 = time.perf_counter()
    for _ in range(3):
        res = roll(runner, key)
    jax.block_until_ready(res)
    out["ours_rollout_s"] = (time.perf_counter() - t0) / 3
    print(f"  ours: rollout alone {out['ours_rollout_s'] * 1e3:.1f} ms", flush=True)
    programs = [("ours_update", trainer.update, (runner, args_llm), 1)]
    if ref:
        programs.append(("reference_call", ref["train"], (ref["rng"],), prep["updates"]))
    for who, fn, fn_args, per in programs:
        rows = kernel_table(fn, *fn_args, iters=1)
        print(f"\n  {who}: device time per kernel (per call of {per} update(s))")
        print_kernel_table(rows, top=25)
        out[f"{who}_kernels"] = [dict(name=n, launches=k, us=us) for n, k, us in rows[:60]]
        out[f"{who}_kernel_us_total"] = sum(r[2] for r in rows)
        out[f"{who}_launches_total"] = sum(r[1] for r in rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reference-dir", type=Path, default=None, help="a checkout of " + UPSTREAM)
    p.add_argument("--skip-reference", action="store_true", help="time this trainer alone")
    p.add_argument("--only", nargs="+", choices=sorted(CONFIGS), default=None)
    p.add_argument("--env", default=None, help="default: Craftax-Symbolic-v1 (Classic with --smoke)")
    p.add_argument("--updates", type=int, default=10, help="updates per timed reference call / per timed loop of ours")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--profile", action="store_true", help="per-kernel device time tables (GPU)")
    bench_train.add_sync_arguments(p, "e.g. beside scripts/bench_train.py")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, Classic, for a CPU check")
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    args.env = args.env or ("Craftax-Classic-Symbolic-v1" if args.smoke else bench_train.SYM)
    ppo = None
    if not args.skip_reference:
        if args.reference_dir is None:
            raise SystemExit(missing_reference_message(None))
        ppo = import_reference(args.reference_dir)
    # bench_train.prepare's arguments (plain PPO: no LLM)
    bt_args = argparse.Namespace(env=args.env, model="tiny", llm_dtype="float32", devices=1, per_device=False,
                                 smoke=args.smoke, updates=args.updates, profile=None)
    rows = []

    def write():
        if args.out:
            args.out.write_text(json.dumps(dict(device=str(jax.devices()[0]), date=time.strftime("%Y-%m-%d"),
                                                jax=jax.__version__, rows=rows), indent=2))

    try:
        preps = []
        for name in args.only or list(CONFIGS):  # every program compiled (and its first call timed) before any timing
            print(f"{name}:", flush=True)
            prep = bench_train.prepare(name, CONFIGS[name], bt_args)
            prep["updates"] = args.updates
            prep["ref"] = prepare_reference(ppo, prep["cfg"], args) if ppo else None
            preps.append(prep)
        if args.sync_dir:
            bench_train.wait_for_turn(args.sync_dir, args.sync_rank, args.sync_world)
        for prep in preps:
            cfg, ref = prep["cfg"], prep["ref"]
            best = dict(reference=float("inf"), dispatch=float("inf"), host_loop=float("inf"))
            for _ in range(args.repeats):
                if ref:
                    best["reference"] = min(best["reference"], time_reference(ref))
                dispatch = bench_train.measure(prep, bt_args)["update_s"] * args.updates
                best["dispatch"] = min(best["dispatch"], dispatch)
                best["host_loop"] = min(best["host_loop"], time_ours_host_loop(prep, args.updates))
            steps = args.updates * cfg.batch_size
            row = dict(config=prep["name"], env=cfg.env, num_envs=cfg.num_envs, num_steps=cfg.num_steps,
                       reset_ratio=cfg.reset_ratio, updates_per_timing=args.updates,
                       ours_first_update_s=prep["first"], ours_sps_dispatch=steps / best["dispatch"],
                       ours_sps_host_loop=steps / best["host_loop"])
            if ref:
                row.update(reference_first_call_s=ref["first"], reference_sps=steps / best["reference"],
                           ratio_dispatch=best["reference"] / best["dispatch"],
                           ratio_host_loop=best["reference"] / best["host_loop"])
            rows.append(row)
            print(json.dumps(row), flush=True)
            write()  # before the profile: a run cut short keeps the timings
            if args.profile:
                profile(prep, ref, row)
                write()
    finally:  # also when this process failed: the others must not wait for it
        if args.sync_dir:
            bench_train.release_turn(args.sync_dir, args.sync_rank)
    print(f"\ndevice: {jax.devices()[0]}, jax {jax.__version__}, {time.strftime('%Y-%m-%d')}")
    print(f"{'config':20s} {'ref SPS':>10s} {'ours SPS':>10s} {'ratio':>6s} {'ours host-loop':>14s} {'ratio':>6s} "
          f"{'ref 1st call s':>14s} {'ours 1st update s':>17s}")
    f = lambda r, k, fmt: format(r[k], fmt) if k in r else "-".rjust(int(fmt.split(",")[0].split(".")[0]))
    for r in rows:
        print(f"{r['config']:20s} {f(r, 'reference_sps', '10,.0f')} {r['ours_sps_dispatch']:10,.0f} "
              f"{f(r, 'ratio_dispatch', '6.3f')} {r['ours_sps_host_loop']:14,.0f} {f(r, 'ratio_host_loop', '6.3f')} "
              f"{f(r, 'reference_first_call_s', '14.1f')} {r['ours_first_update_s']:17.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
