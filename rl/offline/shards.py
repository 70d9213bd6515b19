"""Where the training rows live: all on the device (`ResidentShards`), or streamed in shards by a prefetching
host reader (`StreamedShards`) when they do not fit. Both answer `for_update(u) -> (device shard, rows)`."""
from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rl.offline import data as D


def device_limit_bytes() -> float:
    """Memory of the first device (its allocator's limit on a GPU; half the host's RAM on a CPU)."""
    dev = jax.local_devices()[0]
    try:
        stats = dev.memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without memory stats
        stats = {}
    if "bytes_limit" in stats:
        return float(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2


def pad_rows(host: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
    """Every array padded with zero rows to `rows` (shards of one shape share one compiled update)."""
    out = {}
    for k, a in host.items():
        pad = np.zeros((rows - len(a),) + a.shape[1:], a.dtype)
        out[k] = np.concatenate([a, pad]) if len(pad) else a
    return out


def _bytes_per_row(host: dict[str, np.ndarray]) -> int:
    return int(sum(a.dtype.itemsize * int(np.prod(a.shape[1:])) for a in host.values()))


class ResidentShards:
    """All training rows on the device at once, sampled there."""

    count = 1
    updates_per_shard = 0  # never switches

    def __init__(self, prep, uses_hidden: bool):
        host = D.build_shard(prep.plan, prep.layout, prep.train, uses_hidden)
        self.bytes_per_row = _bytes_per_row(host)
        self.rows = jnp.int32(len(host["rtg"]))
        self.shard = jax.device_put(host)

    def for_update(self, u: int) -> tuple[Any, jax.Array]:
        return self.shard, self.rows

    def close(self) -> None:
        pass


class StreamedShards:
    """Training files in groups of about `shard_samples` rows; each group is on the device for
    `updates_per_shard` updates (about one pass over its rows), in a per-epoch random order of the groups that
    depends only on the seed and the update number (so --resume picks the same shard). A background thread
    reads, encodes and uploads the next shard while the current one trains."""

    def __init__(self, prep, uses_hidden: bool, shard_samples: int, batch_size: int, seed: int):
        self.prep, self.uses_hidden, self.seed = prep, uses_hidden, seed
        groups, cur, size = [], [], 0
        for i in prep.train:
            cur.append(i)
            size += prep.plan.files[i].samples
            if size >= shard_samples:
                groups.append(cur)
                cur, size = [], 0
        if cur:
            groups.append(cur)
        self.groups = groups
        self.count = len(groups)
        self.capacity = max(sum(prep.plan.files[i].samples for i in g) for g in groups)
        self.updates_per_shard = max(1, self.capacity // batch_size)
        self.bytes_per_row = prep.layout.bytes_per_sample + 12 + (2 * prep.hidden_size if uses_hidden else 0)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="offline-shards")
        self._current: tuple[int, Any] | None = None
        self._next: tuple[int, Future] | None = None

    def group_at(self, position: int) -> int:
        epoch, k = divmod(position, self.count)
        return int(np.random.default_rng([self.seed, epoch]).permutation(self.count)[k])

    def _load(self, group: int):
        host = D.build_shard(self.prep.plan, self.prep.layout, self.groups[group], self.uses_hidden)
        rows = len(host["rtg"])
        return jax.device_put(pad_rows(host, self.capacity)), jnp.int32(rows)

    def for_update(self, u: int) -> tuple[Any, jax.Array]:
        group = self.group_at(u // self.updates_per_shard)
        if self._current is None or self._current[0] != group:
            if self._next is not None and self._next[0] == group:
                loaded = self._next[1].result()
            else:
                loaded = self._load(group)
            self._current = (group, loaded)
            following = self.group_at(u // self.updates_per_shard + 1)
            self._next = None if following == group else (following, self._pool.submit(self._load, following))
        return self._current[1]

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
