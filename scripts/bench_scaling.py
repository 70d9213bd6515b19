"""Multi-GPU scaling (issue 6): the same configs on 1, 2, 4 ... GPUs of one machine, envs per GPU fixed.

    python scripts/bench_scaling.py --gpus 1 2 4 --out scaling.json
    python scripts/bench_scaling.py --gpus 1 2 --only none-1024 --smoke      # CPU check (fake devices)

One `scripts/bench_train.py --per-device --devices N` process per GPU count, with CUDA_VISIBLE_DEVICES set to
the first N GPUs. The processes compile at the same time (compilation is CPU work and takes most of the wall
time), wait for each other, then time their configs one process after another, so that no timed section
shares a GPU with another process's work. Each process may use a fraction of GPU memory (--mem-fraction).
Speed-up = SPS on N GPUs / SPS on the first listed GPU count (1 by default) of the same config.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def wait_all(procs, timeout: float) -> list[int]:
    """Wait for every process; as soon as one fails (it would never signal its turn) or `timeout` seconds
    pass, kill the rest. Returns the GPU counts of the processes that failed or were killed."""
    start = time.monotonic()
    while True:
        codes = {n: proc.poll() for n, proc, _ in procs}
        bad = [n for n, c in codes.items() if c not in (None, 0)]
        if bad or time.monotonic() - start > timeout:
            for n, proc, _ in procs:
                if proc.poll() is None:
                    proc.kill()
                    bad.append(n)
            return bad
        if all(c == 0 for c in codes.values()):
            return []
        time.sleep(1.0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--only", nargs="+", default=["inscan-128-k8", "inscan-128-k32", "none-1024", "none-1024-per-env"],
                   help="bench_train configs; their env counts are per GPU")
    p.add_argument("--updates", type=int, default=2)
    p.add_argument("--mem-fraction", type=float, default=None,
                   help="XLA_PYTHON_CLIENT_MEM_FRACTION per process (default 0.9 / number of processes)")
    p.add_argument("--timeout", type=float, default=540.0, help="seconds before every process is stopped")
    p.add_argument("--log-dir", type=Path, default=None, help="keep each process's log here")
    p.add_argument("--smoke", action="store_true", help="CPU check: fake devices, tiny shapes")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        procs = []
        for rank, n in enumerate(args.gpus):
            env = dict(os.environ, PYTHONUNBUFFERED="1",
                       XLA_PYTHON_CLIENT_MEM_FRACTION=str(args.mem_fraction or round(0.9 / len(args.gpus), 3)))
            if args.smoke:
                env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}".strip()
            else:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(n))
            cmd = [sys.executable, str(ROOT / "scripts" / "bench_train.py"), "--per-device", "--devices", str(n),
                   "--updates", str(args.updates), "--only", *args.only, "--out", str(tmp / f"gpus{n}.json"),
                   "--sync-dir", str(tmp), "--sync-rank", str(rank), "--sync-world", str(len(args.gpus))]
            if args.smoke:
                cmd.append("--smoke")
            log = open(tmp / f"gpus{n}.log", "w")
            procs.append((n, subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        failed = wait_all(procs, args.timeout)
        for _, _, log in procs:
            log.close()
        if args.log_dir:
            args.log_dir.mkdir(parents=True, exist_ok=True)
            for n in args.gpus:
                (args.log_dir / f"gpus{n}.log").write_text((tmp / f"gpus{n}.log").read_text())
                if (tmp / f"gpus{n}.json").exists():  # the rows measured so far, also when a process was cut short
                    (args.log_dir / f"gpus{n}.json").write_text((tmp / f"gpus{n}.json").read_text())
        if failed:
            for n in failed:
                print(f"--- {n} GPU(s) failed or timed out; its log:\n" + (tmp / f"gpus{n}.log").read_text()[-6000:])
            return 1
        results = {n: json.loads((tmp / f"gpus{n}.json").read_text()) for n in args.gpus}

    base = {r["config"]: r["sps"] for r in results[args.gpus[0]]["rows"]}
    rows = []
    print(f"\ndevice: {results[args.gpus[-1]]['device']} (GPU count as listed)")
    print(f"{'config (envs per GPU)':24s} {'GPUs':>4s} {'envs':>6s} {'SPS':>10s} {f'vs {args.gpus[0]}':>8s} {'1st update s':>12s}")
    for n in args.gpus:
        for r in results[n]["rows"]:
            r["speedup"] = r["sps"] / base[r["config"]]
            rows.append(r)
    for r in sorted(rows, key=lambda r: (args.only.index(r["config"]), r["devices"])):
        print(f"{r['config']:24s} {r['devices']:4d} {r['num_envs']:6d} {r['sps']:10,.0f} {r['speedup']:8.2f} "
              f"{r['first_update_s']:12.1f}")
    if args.out:
        args.out.write_text(json.dumps(dict(device=results[args.gpus[-1]]["device"],
                                            date=results[args.gpus[-1]]["date"], rows=rows), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
