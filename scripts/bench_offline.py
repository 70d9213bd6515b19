"""Time offline AWR training at the reference pipeline's sizes: 100k updates at batch 256 with the whole dataset
resident on one device (issue 24: <= 2 minutes on one H100), and the device memory per million samples.

Synthetic data of the reference's shapes, generated on the device in chunks (no host copy): observations of
8,268 columns in `rl.offline`'s compact layout (0/1 columns as bits, `--float-columns` columns as float16),
hidden states float16 [N, 2,560], 43 actions, random returns. The update is `rl.offline.update.make_train_chunk`
itself (the one `python -m rl.offline train` runs), `--updates-per-dispatch` updates per jitted lax.scan call.

    python scripts/bench_offline.py                                  # GPU: 4.8M samples resident, 100k updates
    python scripts/bench_offline.py --samples 1000000 --updates 20000
    python scripts/bench_offline.py --smoke                          # tiny shapes, any CPU (CI)

Prints one JSON object (also written to --out): seconds for the updates (compilation excluded), updates/s,
bytes per sample and per million samples (from the arrays, and the device's own count where it reports one),
and an estimate of the matmul FLOPs per update with the rate achieved.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from rl.offline.data import Layout  # noqa: E402
from rl.offline.networks import AWRNetwork  # noqa: E402
from rl.offline.update import init_state, make_train_chunk  # noqa: E402


def _in_use() -> int | None:
    try:
        return int((jax.local_devices()[0].memory_stats() or {})["bytes_in_use"])
    except Exception:  # noqa: BLE001 - CPU and other backends without memory stats
        return None


def synthetic_shard(n: int, layout: Layout, hidden: int, actions: int, seed: int, chunk: int = 262_144) -> dict:
    """Device arrays of n rows, filled chunk by chunk in place (peak memory = the arrays + one chunk)."""
    nb = -(-len(layout.binary) // 8)
    shapes = {"bits": ((n, nb), jnp.uint8), "rest": ((n, len(layout.rest)), jnp.float16),
              "action": ((n,), jnp.int32), "rtg": ((n,), jnp.float32)}
    if hidden:
        shapes["hidden"] = ((n, hidden), jnp.float16)
    shard = {k: jnp.zeros(s, d) for k, (s, d) in shapes.items()}

    @partial(jax.jit, donate_argnums=0, static_argnames="rows")
    def fill(shard, start, key, rows):
        ks = jax.random.split(key, 5)
        part = {"bits": jax.random.bits(ks[0], (rows, nb), jnp.uint8),
                "rest": jax.random.randint(ks[1], (rows, len(layout.rest)), 0, 10).astype(jnp.float16) / 10,
                "action": jax.random.randint(ks[2], (rows,), 0, actions),
                "rtg": jax.random.normal(ks[3], (rows,)) * 3}
        if hidden:
            part["hidden"] = jax.random.normal(ks[4], (rows, hidden)).astype(jnp.float16)
        return {k: jax.lax.dynamic_update_slice_in_dim(shard[k], part[k], start, 0) for k in shard}

    key = jax.random.PRNGKey(seed)
    for start in range(0, n, chunk):
        rows = min(chunk, n - start)
        shard = fill(shard, jnp.int32(start), jax.random.fold_in(key, start), rows=rows)
    return jax.block_until_ready(shard)


def matmul_flops(obs: int, hidden: int, width: int, actions: int, batch: int) -> float:
    """Forward + backward matmul FLOPs of one AWR update (2 towers; backward = 2 x forward)."""
    tower = lambda out: (obs * width + hidden * width + 2 * width * width + width * width + width * out) if hidden \
        else (obs * width + 2 * width * width + width * out)
    return 3 * 2 * batch * (tower(actions) + tower(1))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=4_800_000, help="rows resident on the device")
    p.add_argument("--obs", type=int, default=8268, help="observation size (Craftax symbolic)")
    p.add_argument("--float-columns", type=int, default=64,
                   help="observation columns that are not 0/1 (stored float16; the rest as bits)")
    p.add_argument("--hidden", type=int, default=2560, help="hidden-state size (0 = unaugmented network)")
    p.add_argument("--actions", type=int, default=43)
    p.add_argument("--updates", type=int, default=100_000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--updates-per-dispatch", type=int, default=1000, dest="per_dispatch")
    p.add_argument("--mode", default="real", choices=("real", "zero", "shuffle", "none"))
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU, seconds)")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    a = p.parse_args(argv)
    if a.smoke:
        a.samples, a.obs, a.float_columns, a.hidden, a.actions = 4096, 96, 8, 32, 5
        a.updates, a.width, a.per_dispatch, a.batch = 200, 32, 100, 32
    if a.mode == "none":
        a.hidden = 0
    layout = Layout(a.obs, tuple(range(a.obs - a.float_columns)), tuple(range(a.obs - a.float_columns, a.obs)),
                    "float16")
    before = _in_use()
    t0 = time.perf_counter()
    shard = synthetic_shard(a.samples, layout, a.hidden, a.actions, seed=0)
    fill_s = time.perf_counter() - t0
    after = _in_use()
    array_bytes = int(sum(x.nbytes for x in shard.values()))

    net = AWRNetwork(a.actions, a.width)
    opt = optax.adam(3e-4)
    state = init_state(net, opt, a.obs, a.hidden or None, 0)
    stats = {"mean": jnp.zeros(a.hidden), "std": jnp.ones(a.hidden)} if a.hidden else None
    chunk = make_train_chunk(net.apply, opt, layout, mode=a.mode if a.hidden else "none", batch_size=a.batch,
                             beta=10.0, weight_clip=20.0, value_coef=0.5, seed=0)
    rows = jnp.int32(a.samples)
    params, opt_state = state["params"], state["opt_state"]
    t0 = time.perf_counter()
    params, opt_state, m = chunk(params, opt_state, shard, rows, stats, jnp.int32(0), length=a.per_dispatch)
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t0
    full, rest = divmod(a.updates, a.per_dispatch)
    if rest:
        p.error(f"--updates {a.updates} must be a multiple of --updates-per-dispatch {a.per_dispatch}")
    t0 = time.perf_counter()
    for k in range(full):
        params, opt_state, m = chunk(params, opt_state, shard, rows, stats, jnp.int32((k + 1) * a.per_dispatch),
                                     length=a.per_dispatch)
    m = jax.device_get(m)
    seconds = time.perf_counter() - t0
    flops = matmul_flops(a.obs, a.hidden, a.width, a.actions, a.batch)
    res = {
        "device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
        "samples": a.samples, "obs": a.obs, "float_columns": a.float_columns, "hidden": a.hidden,
        "actions": a.actions, "batch": a.batch, "width": a.width, "updates": a.updates,
        "updates_per_dispatch": a.per_dispatch, "mode": a.mode,
        "seconds": seconds, "updates_per_s": a.updates / seconds, "compile_and_first_dispatch_s": compile_s,
        "fill_s": fill_s, "bytes_per_sample": array_bytes / a.samples,
        "gb_per_million_samples_arrays": array_bytes / a.samples * 1e6 / 1e9,
        "gb_per_million_samples_device": (after - before) / a.samples * 1e6 / 1e9 if None not in (before, after)
        else None,
        "matmul_gflop_per_update": flops / 1e9, "matmul_tflop_per_s": flops * a.updates / seconds / 1e12,
        "final_loss": float(m["loss"]),
    }
    print(json.dumps(res, indent=2))
    if a.out:
        a.out.write_text(json.dumps(res, indent=2) + "\n")
    return res


if __name__ == "__main__":
    main()
