"""Per-kernel device time of a jitted call, read from a `jax.profiler` trace (no TensorBoard needed).

    from scripts.kernel_profile import kernel_table, print_kernel_table
    print_kernel_table(kernel_table(jax.jit(f), x, iters=5))

Used by `scripts/bench_template.py --profile` to see which kernels a small template spends its time in. On a
machine without a GPU there is no device plane and the table is empty.
"""
from __future__ import annotations

import collections
import glob
import tempfile

import jax
from jax.profiler import ProfileData


def kernel_table(fn, *args, iters: int = 5) -> list[tuple[str, int, float]]:
    """(kernel name, launches per call, microseconds per call) for every kernel on the first GPU's streams
    while `fn(*args)` runs `iters` times after a warm-up call; sorted by time, largest first."""
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            for _ in range(iters):
                jax.block_until_ready(fn(*args))
        data = ProfileData.from_file(glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)[0])
    launches: collections.Counter = collections.Counter()
    nanos: collections.Counter = collections.Counter()
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU:0"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):  # kernel and memcpy events live on the stream lines
                continue
            for event in line.events:
                launches[event.name] += 1
                nanos[event.name] += event.duration_ns
    rows = [(name, launches[name] // iters, nanos[name] / iters / 1e3) for name in nanos]
    return sorted(rows, key=lambda r: -r[2])


def print_kernel_table(rows: list[tuple[str, int, float]], top: int = 25) -> None:
    """Print the `top` kernels and the total."""
    total = sum(r[2] for r in rows)
    print(f"{'kernel':60s} {'launches':>8s} {'us/call':>9s} {'share':>6s}")
    for name, n, us in rows[:top]:
        print(f"{name[:60]:60s} {n:8d} {us:9.1f} {us / max(total, 1e-9):6.1%}")
    print(f"{'total (' + str(len(rows)) + ' distinct kernels)':60s} {sum(r[1] for r in rows):8d} {total:9.1f}")
