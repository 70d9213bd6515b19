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

`--rl-train` adds what a user gets: `python -m rl.train` itself (the same env count and hyperparameters, as a
subprocess writing metrics.jsonl into `--train-dir`), its SPS the median of its own records over the updates after
`--train-skip` (`scripts/rl_train_runs.py`), and its ratio to the reference. `--variants NAME=FLAGS ...` adds rl.train
runs with extra flags (e.g. `lazy=--lazy-reset true`: the `rl.config.SpeedConfig` candidates) beside the default.
Every rl.train program is compiled first, in the background (`--warm-workers` at a time, one persistent compilation
cache) while this process compiles its own (`--compile-threads`); then everything is timed one after another:

    python scripts/bench_reference.py --reference-dir .reference/Craftax_Baselines --rl-train --updates 5 \
        --variants "lazy=--lazy-reset true" "unroll=--env-unroll 12" --out ref.json
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402

import bench_train  # noqa: E402
import rl_train_runs  # noqa: E402
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reference-dir", type=Path, default=None, help="a checkout of " + UPSTREAM)
    p.add_argument("--skip-reference", action="store_true", help="time this trainer alone")
    p.add_argument("--only", nargs="+", choices=sorted(CONFIGS), default=None)
    p.add_argument("--env", default=None, help="default: Craftax-Symbolic-v1 (Classic with --smoke)")
    p.add_argument("--updates", type=int, default=10, help="updates per timed reference call / per timed loop of ours")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--profile", action="store_true", help="per-kernel device time tables (GPU)")
    p.add_argument("--compile-threads", type=int, default=1,
                   help="compile the reference and our harness programs in this many threads at once")
    run = p.add_argument_group("rl.train itself (the user's command, as subprocesses)")
    run.add_argument("--rl-train", action="store_true", help="also time `python -m rl.train` from its metrics.jsonl")
    run.add_argument("--variants", nargs="*", default=[], metavar="NAME=FLAGS",
                     help="rl.train runs with extra flags beside the default, e.g. 'lazy=--lazy-reset true'; "
                          "'NAME@none-1024=FLAGS' for some configs only")
    run.add_argument("--train-updates", type=int, default=12, help="updates of each timed rl.train run")
    run.add_argument("--train-skip", type=int, default=3, help="records of updates <= this are warm-up (not counted)")
    run.add_argument("--train-timeout", type=float, default=240.0, help="seconds per rl.train process")
    run.add_argument("--warm-workers", type=int, default=4, help="rl.train warm-up (compile) processes at once")
    run.add_argument("--train-dir", type=Path, default=None,
                     help="run directories, logs and the compilation cache of the rl.train runs (default: a temp dir)")
    bench_train.add_sync_arguments(p, "e.g. beside scripts/bench_train.py")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, Classic, for a CPU check")
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")


def train_jobs(names: list[str], bt_args, variants: list) -> list[rl_train_runs.TrainJob]:
    """One rl.train job per (config, variant that applies to it): the config's flags (its TrainConfig as the harness
    builds it) + the variant's (`rl_train_runs.Variant`)."""
    return [rl_train_runs.TrainJob(name, v.name, tuple(rl_train_runs.config_flags(
        bench_train.config_of(CONFIGS[name], bt_args))) + v.flags)
        for name in names for v in variants if v.applies_to(name)]


def prepare_all(names: list[str], ppo, bt_args, args) -> list[dict]:
    """Every config's harness trainer and reference program, compiled and run once (`--compile-threads` at a time)."""
    def ours(name):
        print(f"{name}:", flush=True)
        prep = bench_train.prepare(name, CONFIGS[name], bt_args)
        prep["updates"] = args.updates
        return prep

    with ThreadPoolExecutor(max_workers=max(1, args.compile_threads)) as pool:
        preps = [pool.submit(ours, name) for name in names]
        refs = [pool.submit(prepare_reference, ppo, bench_train.config_of(CONFIGS[name], bt_args), args) if ppo
                else None for name in names]
        preps = [f.result() for f in preps]
        for prep, ref in zip(preps, refs):
            prep["ref"] = ref.result() if ref is not None else None
    return preps


def time_rl_train(prep: dict, jobs: list, args, workdir: Path, cache: Path, row: dict) -> None:
    """The timed rl.train runs of one config into `row`: `rl_train` {variant: steady state}, the default's SPS and
    its ratio to the reference, and each variant's ratio to the default."""
    runs = row.setdefault("rl_train", {})
    for job in (j for j in jobs if j.config == prep["name"]):
        res = rl_train_runs.time_job(job, workdir, cache, args.train_updates, args.train_skip, args.train_timeout)
        runs[job.variant] = res
        shown = f"{res['sps']:,.0f} SPS (median of {res['updates']})" if res.get("sps") else f"failed: {res}"
        print(f"  rl.train {job.variant}: {shown}", flush=True)
    default = runs.get("default", {}).get("sps")
    if default:
        row["rl_train_sps"] = default
        if "reference_sps" in row:
            row["ratio_rl_train"] = default / row["reference_sps"]
    for res in runs.values():
        if default and res.get("sps"):
            res["ratio_to_default"] = res["sps"] / default
        if res.get("sps") and "reference_sps" in row:
            res["ratio_to_reference"] = res["sps"] / row["reference_sps"]


def print_tables(rows: list[dict]) -> None:
    print(f"\ndevice: {jax.devices()[0]}, jax {jax.__version__}, {time.strftime('%Y-%m-%d')}")
    print(f"{'config':20s} {'ref SPS':>10s} {'harness':>10s} {'ratio':>6s} {'host loop':>10s} {'ratio':>6s} "
          f"{'rl.train':>10s} {'ratio':>6s} {'ref 1st s':>9s} {'ours 1st s':>10s}")
    f = lambda r, k, fmt: format(r[k], fmt) if r.get(k) is not None else "-".rjust(int(fmt.split(",")[0].split(".")[0]))
    for r in rows:
        print(f"{r['config']:20s} {f(r, 'reference_sps', '10,.0f')} {r['ours_sps_dispatch']:10,.0f} "
              f"{f(r, 'ratio_dispatch', '6.3f')} {r['ours_sps_host_loop']:10,.0f} {f(r, 'ratio_host_loop', '6.3f')} "
              f"{f(r, 'rl_train_sps', '10,.0f')} {f(r, 'ratio_rl_train', '6.3f')} "
              f"{f(r, 'reference_first_call_s', '9.1f')} {r['ours_first_update_s']:10.1f}")
    variants = [(r["config"], name, res) for r in rows for name, res in r.get("rl_train", {}).items()]
    if variants:
        print(f"\n{'rl.train (records)':34s} {'SPS':>10s} {'/default':>8s} {'/ppo.py':>8s} {'s/update':>9s} "
              f"{'1st update s':>12s}")
        for config, name, res in variants:
            label = f"{config} {name}"
            print(f"{label:34s} {f(res, 'sps', '10,.0f')} {f(res, 'ratio_to_default', '8.3f')} "
                  f"{f(res, 'ratio_to_reference', '8.3f')} {f(res, 'seconds', '9.3f')} {f(res, 'first_update_s', '12.1f')}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
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
    names = args.only or list(CONFIGS)
    rows: list[dict] = []
    meta: dict = {}

    def write():
        if args.out:
            args.out.write_text(json.dumps(dict(device=str(jax.devices()[0]), date=time.strftime("%Y-%m-%d"),
                                                jax=jax.__version__, rows=rows, **meta), indent=2, default=str))

    jobs, warm, workdir = [], None, None
    if args.rl_train:
        workdir = args.train_dir or Path(tempfile.mkdtemp(prefix="bench_rl_train_"))
        workdir.mkdir(parents=True, exist_ok=True)
        jobs = train_jobs(names, bt_args, rl_train_runs.parse_variants(args.variants))
        meta["rl_train_commands"] = {j.name: rl_train_runs.command(j, Path("RUN_DIR"), args.train_updates,
                                                                   Path("CACHE")) for j in jobs}
        slowest_first = sorted(jobs, key=lambda j: "--env-unroll" not in j.flags)  # unrolled scans compile longest
        warm = rl_train_runs.Warmup(slowest_first, workdir, workdir / "compile_cache", args.warm_workers,
                                    args.train_timeout)
    try:
        preps = prepare_all(names, ppo, bt_args, args)  # every program compiled (first call timed) before any timing
        if warm is not None:
            meta["rl_train_warmup"] = warm.wait()
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
            write()  # before the rest: a run cut short keeps the timings
            if jobs:
                time_rl_train(prep, jobs, args, workdir, workdir / "compile_cache", row)
                write()
            if args.profile:
                profile(prep, ref, row)
                write()
    finally:  # also when this process failed: the others must not wait for it
        if args.sync_dir:
            bench_train.release_turn(args.sync_dir, args.sync_rank)
    print_tables(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
