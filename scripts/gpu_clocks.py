"""The GPU's SM clock, power and throttle reasons while a benchmark runs, summarised per timed window.

    python scripts/gpu_clocks.py --out DIR -- python3 -u scripts/bench_ratio.py ... --out DIR/ratio.json

While the command runs, `nvidia-smi` samples the first GPU every `--interval-ms` into DIR/clocks.csv. Then the
command's JSON result (the path after its own `--out`) is read for `timed_windows` ({row: [[start, end], ...]},
wall-clock seconds: what `scripts/bench_ratio.py` records around each row's timed calls), and for each row this
prints the mean and lowest SM clock, the mean and highest power, the highest temperature and the throttle reasons
of the samples inside its windows (DIR/clocks_summary.json has the same). A card at its power cap shows
`sw_power_cap` and a clock under its top one: then a form that draws more power slows every kernel a little, the
ones it does not change too (docs/BENCHMARKS.md, twenty-second session).
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
from pathlib import Path
from typing import Any, NamedTuple

QUERY = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"
# nvidia-smi's clocks_throttle_reasons bits (nvmlClocksThrottleReasons)
THROTTLE_REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
                    0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
                    0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting"}


class Sample(NamedTuple):
    time: float  # wall-clock seconds (the sampling machine's local time, as time.time())
    sm_mhz: float
    power_w: float
    temperature_c: float
    reasons: int  # THROTTLE_REASONS bits


def parse_samples(lines: list[str]) -> list[Sample]:
    """Samples from `nvidia-smi --query-gpu=QUERY --format=csv,noheader,nounits` lines (blank or unreadable lines,
    such as a last one cut off when the sampler stopped, are skipped)."""
    samples = []
    for line in lines:
        fields = [field.strip() for field in line.split(",")]
        if len(fields) != 5:
            continue
        try:
            moment = datetime.datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            samples.append(Sample(moment, float(fields[1]), float(fields[2]), float(fields[3]), int(fields[4], 16)))
        except ValueError:
            continue
    return samples


def throttle_names(mask: int) -> list[str]:
    """The names of the throttle reasons set in mask (unknown bits as hex)."""
    names = [name for bit, name in THROTTLE_REASONS.items() if mask & bit]
    rest = mask & ~sum(THROTTLE_REASONS)
    return names + ([hex(rest)] if rest else [])


def summarise(samples: list[Sample], windows: dict[str, list[list[float]]]) -> dict[str, dict[str, Any]]:
    """For each row, the samples inside any of its [start, end] windows: their count, SM clock (mean, min), power
    (mean, max), top temperature and the throttle reasons any of them had; {"samples": 0} for a row with none."""
    summary = {}
    for row, spans in windows.items():
        inside = [s for s in samples if any(start <= s.time <= end for start, end in spans)]
        if not inside:
            summary[row] = {"samples": 0}
            continue
        reasons = 0
        for s in inside:
            reasons |= s.reasons
        summary[row] = {"samples": len(inside),
                        "sm_mhz_mean": statistics.fmean(s.sm_mhz for s in inside),
                        "sm_mhz_min": min(s.sm_mhz for s in inside),
                        "power_w_mean": statistics.fmean(s.power_w for s in inside),
                        "power_w_max": max(s.power_w for s in inside),
                        "temperature_c_max": max(s.temperature_c for s in inside),
                        "throttle_reasons": throttle_names(reasons)}
    return summary


def result_path(command: list[str]) -> Path:
    """The JSON result the command writes: the argument after its `--out`."""
    if "--out" not in command[:-1]:
        raise SystemExit("gpu_clocks.py: the command must write its result with --out FILE (bench_ratio.py's "
                         "result carries the timed windows)")
    return Path(command[command.index("--out") + 1])


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for clocks.csv and clocks_summary.json")
    p.add_argument("--interval-ms", type=int, default=100, help="nvidia-smi's sampling period")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the benchmark, after --")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the benchmark to run after --")
    result = result_path(command)
    args.out.mkdir(parents=True, exist_ok=True)
    csv = args.out / "clocks.csv"
    sampler = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-i", "0",
                                "-lms", str(args.interval_ms), "-f", str(csv)])
    try:
        code = subprocess.run(command).returncode
    finally:
        sampler.terminate()
        sampler.wait()
    if code:
        raise SystemExit(f"gpu_clocks.py: the command exited with {code}; samples kept in {csv}")
    windows = json.loads(result.read_text()).get("timed_windows")
    if not windows:
        raise SystemExit(f"gpu_clocks.py: {result} has no timed_windows (bench_ratio.py writes them)")
    summary = summarise(parse_samples(csv.read_text().splitlines()), windows)
    for row, s in summary.items():
        if not s["samples"]:
            print(f"{row}: no samples inside its windows")
            continue
        print(f"{row}: SM {s['sm_mhz_mean']:.0f} MHz (min {s['sm_mhz_min']:.0f}), {s['power_w_mean']:.0f} W (max "
              f"{s['power_w_max']:.0f}), <= {s['temperature_c_max']:.0f} C, throttle: "
              f"{', '.join(s['throttle_reasons']) or 'none'} ({s['samples']} samples)")
    (args.out / "clocks_summary.json").write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
