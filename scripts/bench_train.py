"""Trainer speed (issue 4 Speed section): steady-state SPS of `none` and `inscan`, LLM time share, compile time.

    python scripts/bench_train.py --out bench_train.json                 # GPU: every config (split with --only)
    python scripts/bench_train.py --only none-1024 inscan-128-k8         # a subset
    python scripts/bench_train.py --smoke                                # CPU check at tiny shapes
    python scripts/bench_train.py --table --out table.json               # GPU: issue 23's table in one call
    python scripts/bench_train.py --only inscan-128-k8 --profile DIR     # + GPU vs wall time of an update's env part

`--table` runs the table of issue 23 (none-128, inscan-128-k8/k32 in bucketed/bf16, packed/bf16 and packed/fp8,
and the layer-16 row) as worker processes of at most two rows each: each loads its LLM once and compiles its rows
(the update and the encoder call timed alone) while the others compile theirs, then the workers time their rows
one after another (--sync-dir), so no two rows share the card while they are timed. `--xla-defaults` compiles the
rows without the project's XLA options (Triton GEMMs on; jaxllm.compile), for a comparison in the same call:

    python scripts/bench_train.py --only inscan-128-k8 --llm-variants packed/bfloat16 --out on.json --xla-defaults

For each config: the first update is timed (compile + run), then `--updates` updates are timed with
block_until_ready (SPS = env steps / seconds). For `inscan` the batched encoder call of the same envs is timed
alone; S_llm = prompts/s of that call; the bound is 1 / (1/SPS_none + 1/(skip_n * S_llm)), with SPS_none measured
in this run for the same env and env count (run the matching `none-*` config in the same call). The LLM time share
is measured as rl.train measures it (rl/llm_share.py: an update without and one with LLM windows, back to back;
before issue 26 it was that call alone x windows / update time, capped at 1). The LLM is the
Qwen3-4B shape with random bf16 weights (`--model qwen3-4b`), initialised on the device.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402

from rl.config import TrainConfig  # noqa: E402
from rl.llm_share import LLMShare  # noqa: E402
from rl.sharding import resolve_device_count  # noqa: E402
from rl.trainer import Trainer  # noqa: E402

SYM = "Craftax-Symbolic-v1"
CONFIGS = {
    "none-1024": dict(encoder="none", num_envs=1024),
    "none-1024-per-env": dict(encoder="none", num_envs=1024, shuffle="per_env"),
    "none-128-autoreset": dict(encoder="none", num_envs=128, reset_ratio=1),
    "none-128": dict(encoder="none", num_envs=128),
    "inscan-128-k1": dict(encoder="inscan", num_envs=128, skip_n=1),
    "inscan-128-k8": dict(encoder="inscan", num_envs=128, skip_n=8),
    "inscan-128-k32": dict(encoder="inscan", num_envs=128, skip_n=32),
    "inscan-128-k128": dict(encoder="inscan", num_envs=128, skip_n=128, num_steps=128),
    # windows that do not fit a 64-step rollout (issue 15): they carry across rollouts
    "inscan-128-k25": dict(encoder="inscan", num_envs=128, skip_n=25),
    "inscan-128-k100": dict(encoder="inscan", num_envs=128, skip_n=100),
    "inscan-128-kfar": dict(encoder="inscan", num_envs=128, skip_n=10**6),  # encoded at the start only
    "inscan-128-k0": dict(encoder="inscan", num_envs=128, skip_n=0),  # encode once: no window clock at all
    "inscan-1024-k32": dict(encoder="inscan", num_envs=1024, skip_n=32),
    "inscan-1024-k128": dict(encoder="inscan", num_envs=1024, skip_n=128, num_steps=128),
    "inscan-128-k8-full": dict(encoder="inscan", num_envs=128, skip_n=8, obs_format="full"),
    "inscan-128-k8-l16": dict(encoder="inscan", num_envs=128, skip_n=8, llm_layer=16),  # layers after 16 not computed
}
# --table: (worker label, configs, LLM variant, extra XLA_FLAGS); one worker process each, at most two rows per
# worker: a worker compiles its rows one after another, and the timing starts when the slowest worker is done
TABLE = (
    ("none", ["none-128"], "packed/bfloat16", ""),
    ("bucketed-bf16", ["inscan-128-k8", "inscan-128-k32"], "bucketed/bfloat16", ""),
    ("packed-bf16", ["inscan-128-k8", "inscan-128-k32"], "packed/bfloat16", ""),
    ("packed-bf16-l16", ["inscan-128-k8-l16"], "packed/bfloat16", ""),
    ("packed-fp8", ["inscan-128-k8", "inscan-128-k32"], "packed/fp8", ""),
)
SMOKE = dict(num_envs=8, num_steps=8, num_minibatches=2, update_epochs=1, width=32)


_LLM_CACHE: dict = {}


def _llm_for(cfg: TrainConfig):
    """The in-scan LLM of `cfg`, loaded once per (model, dtype, env, format, prompt) in this process (the layer and the
    pooling are the encoder's, not the loaded model's: rows that differ only there share one copy)."""
    from rl.llm import load_llm

    key = (cfg.model, cfg.llm_dtype, cfg.env, cfg.obs_format, cfg.system_prompt)
    if key not in _LLM_CACHE:
        _LLM_CACHE[key] = load_llm(cfg)
    return _LLM_CACHE[key]


def config_of(overrides: dict, args) -> TrainConfig:
    """The TrainConfig of one bench config (`--smoke` shrinks it; the LR schedule spans 1,000 updates)."""
    cfg = TrainConfig(**dict(dict(env=args.env, model=args.model, llm_dtype=args.llm_dtype, devices=args.devices),
                             **overrides))
    if args.smoke and cfg.llm_dtype != "fp8":
        cfg = dataclasses.replace(cfg, llm_dtype="float32")
    if args.smoke:
        cfg = dataclasses.replace(cfg, **SMOKE, skip_n=min(cfg.skip_n, 4),
                                  reset_ratio=min(cfg.reset_ratio, 8))
    if args.per_device:  # the config's env count is per device
        cfg = dataclasses.replace(cfg, num_envs=cfg.num_envs * resolve_device_count(cfg.devices))
    return dataclasses.replace(cfg, total_timesteps=cfg.batch_size * 1000)


def prepare(name: str, overrides: dict, args) -> dict:
    """Build the trainer of one config and run its first update (compile + run, timed)."""
    cfg = config_of(overrides, args)
    llm = _llm_for(cfg) if cfg.encoder == "inscan" else None
    trainer = Trainer.from_config(cfg, llm)
    args_llm = trainer.place_llm_args(llm.jit_args if llm else (None, None))  # replicated over the mesh
    runner = trainer.init_state(args_llm)
    jax.block_until_ready(runner)
    t0 = time.perf_counter()
    runner, _ = trainer.update(runner, args_llm)
    jax.block_until_ready(runner)
    first = time.perf_counter() - t0
    print(f"{name}: {cfg.num_envs} envs on {trainer.num_devices} device(s), first update {first:.1f} s", flush=True)
    if llm is not None:  # compile the encoder call `measure` times alone now (with --table: while others compile)
        jax.block_until_ready(trainer.encoder.encode_states(*args_llm, runner.env_state.env_state))
    return dict(name=name, cfg=cfg, llm=llm, trainer=trainer, args_llm=args_llm, runner=runner, first=first)


def measure(prep: dict, args) -> dict:
    """Steady-state SPS of a prepared config over `args.updates` updates (and its LLM call alone)."""
    cfg, llm, trainer, args_llm, runner = (prep[k] for k in ("cfg", "llm", "trainer", "args_llm", "runner"))
    t0 = time.perf_counter()
    zero = []
    for _ in range(args.updates):
        runner, m = trainer.update(runner, args_llm)
        zero.append(m.get("hidden_zero_frac"))
    jax.block_until_ready(runner)
    seconds = (time.perf_counter() - t0) / args.updates
    if zero[0] is not None:
        prep.setdefault("metrics", {})["hidden_zero_frac"] = float(sum(float(z) for z in zero) / len(zero))
    row = dict(config=prep["name"], env=cfg.env, encoder=cfg.encoder, num_envs=cfg.num_envs, num_steps=cfg.num_steps,
               skip_n=cfg.skip_n, obs_format=cfg.obs_format, model=cfg.model if llm else None,
               llm_encode=cfg.llm_encode if llm else None, llm_dtype=cfg.llm_dtype if llm else None,
               devices=trainer.num_devices,
               first_update_s=prep["first"], update_s=seconds, sps=cfg.batch_size / seconds)
    if llm is not None:
        enc = trainer.encoder.encode_states
        jax.block_until_ready(enc(*args_llm, runner.env_state.env_state))
        t0 = time.perf_counter()
        for _ in range(3):
            out = enc(*args_llm, runner.env_state.env_state)
        jax.block_until_ready(out)
        call = (time.perf_counter() - t0) / 3
        share = LLMShare(lambda clock: trainer.update_from_clock(runner, args_llm, clock), cfg.num_steps, cfg.skip_n)
        if share.windows:  # as rl.train measures it: an update without and one with LLM windows, back to back
            share.measure()
        row.update(prompt_rest_len=llm.template.max_len, prefix_len=len(llm.template.prefix_ids),
                   llm_prompts_per_s=cfg.num_envs / call, llm_time_share=share.value,
                   reset_hidden=cfg.hidden_on_reset,
                   pool_prompts_per_window=cfg.num_envs // cfg.reset_ratio if cfg.hidden_on_reset == "pool" else 0)
        if "hidden_zero_frac" in prep.get("metrics", {}):
            row["hidden_zero_frac"] = prep["metrics"]["hidden_zero_frac"]
    if args.profile:
        row.update(profile_update(prep, args.profile))
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:  # cumulative over the configs run so far in this process (an upper bound)
        row["peak_device_gib_so_far"] = stats["peak_bytes_in_use"] / 2**30
    prep["runner"] = runner
    return row


def profile_update(prep: dict, trace_dir: Path) -> dict:
    """GPU time against wall time of one update without LLM windows (the env, policy and PPO part; for `none`
    rows the plain update): is it bound by the kernels or by the time between them?"""
    from scripts.kernel_times import print_summary, profile_call

    cfg, trainer, args_llm, runner = (prep[k] for k in ("cfg", "trainer", "args_llm", "runner"))
    if prep["llm"] is not None:
        call = lambda: trainer.update_from_clock(runner, args_llm, cfg.num_steps + 1)  # noqa: E731
    else:
        call = lambda: trainer.update(runner, args_llm)  # noqa: E731
    jax.block_until_ready(call())
    t0 = time.perf_counter()
    for _ in range(3):
        jax.block_until_ready(call())
    wall = (time.perf_counter() - t0) / 3
    summary = profile_call(call, trace_dir / prep["name"].replace(" ", "_").replace("/", "-"), top=12)
    print_summary(summary, f"{prep['name']}, update without LLM windows (wall {wall * 1e3:.1f} ms)")
    busy = max((s["total_ms"] for s in summary.values()), default=0.0)
    return dict(no_window_update_s=wall, no_window_gpu_ms=busy,
                no_window_gpu_events=max((s["events"] for s in summary.values()), default=0))


def wait_for_turn(sync_dir: Path, rank: int, world: int) -> None:
    """Barrier over `world` processes (everyone compiled), then wait until ranks < `rank` finished timing."""
    (sync_dir / f"ready.{rank}").touch()
    while len(list(sync_dir.glob("ready.*"))) < world or (rank > 0 and not (sync_dir / f"done.{rank - 1}").exists()):
        time.sleep(0.2)


def release_turn(sync_dir: Path, rank: int) -> None:
    """This process is done (or failed): it no longer holds the others up at the barrier or in the queue."""
    for name in (f"ready.{rank}", f"done.{rank}"):
        (sync_dir / name).touch()


def add_sync_arguments(p: argparse.ArgumentParser, users: str) -> None:
    """--sync-dir/--sync-rank/--sync-world: several bench processes compile in parallel, then time in turn."""
    p.add_argument("--sync-dir", type=Path, default=None,
                   help=f"with --sync-rank/--sync-world: compile in parallel with other bench processes, then time "
                        f"one process after another in rank order ({users})")
    p.add_argument("--sync-rank", type=int, default=0)
    p.add_argument("--sync-world", type=int, default=1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", choices=sorted(CONFIGS), default=None)
    p.add_argument("--env", default=None, help="default: Craftax-Symbolic-v1 (Classic with --smoke)")
    p.add_argument("--model", default=None, help="default: qwen3-4b (tiny with --smoke)")
    p.add_argument("--llm-dtype", default="bfloat16")
    p.add_argument("--llm-variants", nargs="+", default=None, metavar="ENCODE/DTYPE",
                   help="run every inscan config once per LLM variant, e.g. bucketed/bfloat16 packed/bfloat16 "
                        "packed/fp8 (--llm-encode / --llm-dtype of rl.train); default: packed/<--llm-dtype>")
    p.add_argument("--updates", type=int, default=3)
    p.add_argument("--devices", type=int, default=1,
                   help="devices to spread the envs over (default 1: the single-GPU numbers; 0 = all visible)")
    p.add_argument("--per-device", action="store_true", help="a config's env count is per device (scaling runs)")
    add_sync_arguments(p, "scripts/bench_scaling.py and bench_reference.py use this")
    p.add_argument("--smoke", action="store_true", help="tiny shapes and the tiny model, for a CPU check")
    p.add_argument("--table", action="store_true", help="issue 23's table: one worker process per LLM variant")
    p.add_argument("--xla-defaults", action="store_true",
                   help="compile the rows with XLA's default options (Triton GEMMs on) instead of the project's "
                        "(jaxllm.compile); run it beside the same rows without it to compare")
    p.add_argument("--six-pass-sizes", action="store_true",
                   help="compile a packed encode's six pass sizes used before 2026-11-29 (bench_encoder."
                        "six_pass_sizes) instead of the default three; run it beside the same rows without it")
    p.add_argument("--profile", type=Path, default=None, metavar="DIR",
                   help="also trace one update without LLM windows per row into DIR and print its GPU time against "
                        "its wall time (scripts/kernel_times.py)")
    p.add_argument("--worker-label", default=None, help=argparse.SUPPRESS)  # set by --table for its workers
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    if args.table:
        return run_table(args)
    args.model = args.model or ("tiny" if args.smoke else "qwen3-4b")
    args.env = args.env or ("Craftax-Classic-Symbolic-v1" if args.smoke else SYM)
    names = args.only or list(CONFIGS)
    variants = [v.split("/") for v in (args.llm_variants or [f"packed/{args.llm_dtype}"])]
    jobs = []  # (row name, config overrides)
    for name in names:
        if CONFIGS[name]["encoder"] != "inscan":
            jobs.append((name, CONFIGS[name]))
            continue
        for encode, dtype in variants:
            label = name if args.llm_variants is None else f"{name} {encode}/{dtype}"
            jobs.append((label, dict(CONFIGS[name], llm_encode=encode, llm_dtype=dtype)))
    def write(rows):  # after every config, so a run cut short keeps what it measured
        if args.out:
            args.out.write_text(json.dumps(dict(device=str(jax.devices()[0]), date=time.strftime("%Y-%m-%d"),
                                                rows=rows), indent=2))

    if args.xla_defaults:  # the rows without the project's XLA options
        import rl.encoder_kinds

        # this process only: XLA's defaults (the encoder kind picks the trainer's options)
        rl.encoder_kinds.compiler_options = lambda *a, **k: {}
        jobs = [(f"{name} [XLA defaults]", overrides) for name, overrides in jobs]
    if args.six_pass_sizes:  # this process only: the six pass sizes of before (looked up when traced)
        import jaxllm.encoder
        from scripts.bench_encoder import six_pass_sizes

        jaxllm.encoder.pass_capacities = six_pass_sizes
        jobs = [(f"{name} [six pass sizes]", overrides) for name, overrides in jobs]
    rows = []
    if args.sync_dir:  # compile everything first, then time in turn
        try:
            preps = [prepare(name, overrides, args) for name, overrides in jobs]
            wait_for_turn(args.sync_dir, args.sync_rank, args.sync_world)
            for prep in preps:  # each row printed and written as soon as it is measured (a cut-short run keeps it)
                rows.append(measure(prep, args))
                print(json.dumps(rows[-1]), flush=True)
                write(rows)
        finally:  # also when this process failed: the others must not wait for it
            release_turn(args.sync_dir, args.sync_rank)
    else:
        for name, overrides in jobs:
            rows.append(measure(prepare(name, overrides, args), args))
            print(json.dumps(rows[-1]), flush=True)
            write(rows)
    print_rows(rows)
    write(rows)  # with the bounds
    return 0


def print_rows(rows: list[dict]) -> None:
    """The rows as a table, each inscan row with its bound (from the `none` row of its env and env count)."""
    none_sps = {(r["env"], r["num_envs"]): r["sps"] for r in rows if r["config"] in ("none-1024", "none-128")}
    print(f"\ndevice: {jax.devices()[0]}")
    print(f"{'config':34s} {'GPUs':>4s} {'SPS':>10s} {'1st update s':>12s} {'LLM share':>9s} {'prompts/s':>10s} "
          f"{'bound':>9s} {'ratio':>6s} {'vs none':>7s} {'zero h':>6s}")
    for r in rows:
        bound = ratio = None
        base = none_sps.get((r["env"], r["num_envs"]))
        if r["encoder"] == "inscan" and base:
            bound = 1 / (1 / base + (1 / (r["skip_n"] * r["llm_prompts_per_s"]) if r["skip_n"] else 0.0))
            ratio = r["sps"] / bound
            r.update(bound_sps=bound, ratio_to_bound=ratio)
        f = lambda x, fmt: format(x, fmt) if x is not None else "-"
        print(f"{r['config']:34s} {r['devices']:4d} {r['sps']:10,.0f} {r['first_update_s']:12.1f} {f(r.get('llm_time_share'), '9.2f')} "
              f"{f(r.get('llm_prompts_per_s'), '10,.0f')} {f(bound, '9,.0f')} {f(ratio, '6.2f')} "
              f"{f(r['sps'] / base if base else None, '7.3f')} {f(r.get('hidden_zero_frac'), '6.3f')}")
        if base:
            r["ratio_to_none"] = r["sps"] / base


def run_table(args) -> int:
    """Issue 23's table: the TABLE workers started together (each compiles its rows), timed one after another."""
    import os
    import subprocess
    import tempfile

    sync = Path(tempfile.mkdtemp(prefix="bench_train_sync_"))
    out_dir = Path(tempfile.mkdtemp(prefix="bench_train_rows_"))
    procs = []
    for rank, (label, names, variant, flags) in enumerate(TABLE):
        cmd = [sys.executable, __file__, "--only", *names, "--llm-variants", variant, "--updates", str(args.updates),
               "--sync-dir", str(sync), "--sync-rank", str(rank), "--sync-world", str(len(TABLE)),
               "--worker-label", label, "--out", str(out_dir / f"{rank}.json")]
        cmd += ["--smoke"] if args.smoke else []
        cmd += ["--model", args.model] if args.model else []
        env = dict(os.environ)
        if flags:
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flags}".strip()
        print(f"worker {rank} ({label}): {' '.join(names)} as {variant}{' with ' + flags if flags else ''}", flush=True)
        procs.append(subprocess.Popen(cmd, env=env))
    codes = [p.wait() for p in procs]
    rows = []
    for rank in range(len(TABLE)):
        path = out_dir / f"{rank}.json"
        if path.exists():
            rows += json.loads(path.read_text())["rows"]
    print_rows(rows)
    if args.out:
        args.out.write_text(json.dumps(dict(device=str(jax.devices()[0]), date=time.strftime("%Y-%m-%d"), rows=rows,
                                            worker_exit_codes=codes), indent=2))
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
