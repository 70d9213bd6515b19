"""Where a jitted call's GPU time goes: one call traced with `jax.profiler`, its kernels summed by name and kind.

    from scripts.kernel_times import profile_call
    summary = profile_call(lambda: fn(*args), "/tmp/trace")   # after fn was compiled and warmed up

Kinds are read from the kernel names: `gemm` (cuBLAS / cuBLASLt, incl. `nvjet_*`, and the Mosaic GPU grouped
GEMMs of `jaxllm.grouped_gemm`), `attention` (cuDNN), `pallas` (this project's Pallas (Triton) kernels), `other`
(XLA's fusions, copies, ...). Per GPU line it also says how long no kernel ran on that line between its first
kernel's start and its last one's end (waiting for the host's launches or syncs, or for work on another stream)
and what the kernels past the `top` add up to.
Reads the trace with `jax.profiler.ProfileData` (no TensorBoard needed).
"""
from __future__ import annotations

import glob
import re
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterable

KINDS = (("gemm", re.compile(r"gemm|cublas|matmul|xmma|cutlass|nvjet|mosaic_gpu", re.I)),
         ("attention", re.compile(r"cudnn|fmha|flash|attention|sdpa", re.I)),
         ("pallas", re.compile(r"swiglu_quantize|quantize_rows|residual_norm_quantize|head_norm_rope|gather_rows|"
                               r"combine_rows|scatter_rows|merge_quantize|top_k_rows|router_top_k|pallas", re.I)))


def kind_of(kernel: str) -> str:
    """`gemm`, `attention`, `pallas` or `other` for a kernel name."""
    return next((kind for kind, pattern in KINDS if pattern.search(kernel)), "other")


def line_summary(events: Iterable[tuple[str, float, float]], top: int = 25) -> dict[str, Any]:
    """One GPU line's events (name, start ns, duration ns): the kernels' summed time (`total_ms`), the line's
    `span_ms` (first start to last end) and `idle_ms` (the span less the time any kernel ran), totals by kind, the
    `top` kernels by total time (ms, calls) and the `rest` (kernels, calls, ms) past them."""
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    intervals = []
    for name, start, duration in events:
        by_name[name][0] += duration / 1e6
        by_name[name][1] += 1
        intervals.append((start, start + duration))
    intervals.sort()
    busy, reach = 0.0, float("-inf")  # the union of the intervals, swept in start order
    for start, end in intervals:
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    span = reach - intervals[0][0] if intervals else 0.0  # to the latest end, not the last start's end
    kinds: dict[str, float] = defaultdict(float)
    for name, (ms, _) in by_name.items():
        kinds[kind_of(name)] += ms
    ranked = sorted(by_name.items(), key=lambda item: -item[1][0])
    return {"total_ms": sum(ms for ms, _ in by_name.values()),
            "events": sum(calls for _, calls in by_name.values()),
            "span_ms": span / 1e6, "idle_ms": (span - busy) / 1e6,
            "by_kind_ms": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
            "top": [{"kernel": name[:160], "ms": ms, "calls": calls} for name, (ms, calls) in ranked[:top]],
            "rest": {"kernels": len(ranked[top:]), "calls": sum(c for _, (_, c) in ranked[top:]),
                     "ms": sum(ms for _, (ms, _) in ranked[top:])}}


def summarise(trace_dir: str | Path, top: int = 25) -> dict[str, Any]:
    """`line_summary` of each GPU line (stream) with events in the newest trace under `trace_dir`."""
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
            events = [(event.name, event.start_ns, event.duration_ns) for event in line.events]
            if events:
                lines[f"{plane.name} / {line.name}"] = line_summary(events, top)
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
        print(f"--- {title} {line}: {s['total_ms']:.1f} ms in {s.get('events', '?')} events ({kinds}); span "
              f"{s['span_ms']:.1f} ms, idle between kernels {s['idle_ms']:.1f} ms")
        for row in s["top"]:
            print(f"    {row['ms']:9.2f} ms {row['calls']:6d}x  {row['kernel']}")
        rest = s["rest"]
        if rest["kernels"]:
            print(f"    {rest['ms']:9.2f} ms {rest['calls']:6d}x  ({rest['kernels']} more kernels)")
