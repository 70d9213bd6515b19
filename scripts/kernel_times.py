"""Where a jitted call's GPU time goes: one call traced with `jax.profiler`, its kernels summed by name and kind.

    from scripts.kernel_times import profile_call
    summary = profile_call(lambda: fn(*args), "/tmp/trace")   # after fn was compiled and warmed up

Kinds are read from the kernel names: `gemm` (cuBLAS / cuBLASLt, incl. `nvjet_*`), `attention` (cuDNN), `pallas` (this project's
Pallas kernels), `other` (XLA's fusions, copies, ...). Reads the trace with `jax.profiler.ProfileData` (no
TensorBoard needed).
"""
from __future__ import annotations

import glob
import re
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

KINDS = (("gemm", re.compile(r"gemm|cublas|matmul|xmma|cutlass|nvjet", re.I)),
         ("attention", re.compile(r"cudnn|fmha|flash|attention|sdpa", re.I)),
         ("pallas", re.compile(r"swiglu_quantize|quantize_rows|residual_norm_quantize|head_norm_rope|pallas", re.I)))


def kind_of(kernel: str) -> str:
    """`gemm`, `attention`, `pallas` or `other` for a kernel name."""
    return next((kind for kind, pattern in KINDS if pattern.search(kernel)), "other")


def summarise(trace_dir: str | Path, top: int = 25) -> dict[str, Any]:
    """Kernel time of the newest trace under `trace_dir`: per GPU line (stream), totals by kind and the `top`
    kernels by total time (ms, calls). Lines with no events are left out."""
    from jax.profiler import ProfileData

    files = sorted(glob.glob(str(Path(trace_dir) / "**" / "*.xplane.pb"), recursive=True))
    if not files:
        raise FileNotFoundError(f"no *.xplane.pb under {trace_dir}")
    data = ProfileData.from_file(files[-1])
    lines = {}
    for plane in data.planes:
        if "gpu" not in plane.name.lower():
            continue
        for line in plane.lines:
            by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
            for event in line.events:
                by_name[event.name][0] += event.duration_ns / 1e6
                by_name[event.name][1] += 1
            if not by_name:
                continue
            kinds: dict[str, float] = defaultdict(float)
            for name, (ms, _) in by_name.items():
                kinds[kind_of(name)] += ms
            ranked = sorted(by_name.items(), key=lambda item: -item[1][0])[:top]
            lines[f"{plane.name} / {line.name}"] = {
                "total_ms": sum(ms for ms, _ in by_name.values()),
                "events": sum(calls for _, calls in by_name.values()),
                "by_kind_ms": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
                "top": [{"kernel": name[:160], "ms": ms, "calls": calls} for name, (ms, calls) in ranked]}
    return lines


def profile_call(fn: Callable[[], Any], trace_dir: str | Path, top: int = 25) -> dict[str, Any]:
    """Trace one call of `fn` (it should be compiled already) and `summarise` it."""
    import jax

    with jax.profiler.trace(str(trace_dir)):
        jax.block_until_ready(fn())
    return summarise(trace_dir, top)


def print_summary(summary: dict[str, Any], title: str = "") -> None:
    """The summary as text: per line its total, kinds and top kernels."""
    for line, s in summary.items():
        kinds = ", ".join(f"{k} {v:.1f}" for k, v in s["by_kind_ms"].items())
        print(f"--- {title} {line}: {s['total_ms']:.1f} ms in {s.get('events', '?')} events ({kinds})")
        for row in s["top"]:
            print(f"    {row['ms']:9.2f} ms {row['calls']:6d}x  {row['kernel']}")
