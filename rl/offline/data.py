"""Offline datasets: reading and checking trajectory files, per-stream targets, and the compact layout.

`scan(data_dir)` reads every `.npz` header (no array data) and checks it: a missing or mis-shaped key is a
`TrajectoryError` naming the file and the key. Files are grouped into *streams*: all files of one recording
(`recording` metadata: same run, source, env and env count) form one time-major stream, placed by their
`first_sample`, so returns-to-go and the hidden-skip schedule run exactly across file boundaries, and a missing
file is a gap. A file without `recording` (the reference pipeline's) is a stream of its own: `file_envs` envs,
time-major.

`plan(files, ...)` then computes, for every sample (row = the files' samples in file order), its return-to-go
(the file's own `return_to_go` where present), the row whose hidden state it reads under `hidden_skip_n`, and
how many returns are truncated. `Layout` holds the compact, lossless observation encoding chosen from the data
(0/1 columns as bits, the rest as float16 when that is exact, else float32), and `build_shard` turns a set of
files into the arrays training samples from (`decode_obs` undoes the layout on the device).
"""
from __future__ import annotations

import json
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from rl.files import npz_headers
from rl.offline.targets import hold_source, returns_to_go, truncated_mask
from rl.trajectories import LABELLING_KEY, RECORDING_KEY, TrajectoryError, trajectory_env

REQUIRED = ("obs", "action", "reward", "done")
STREAM_KEYS = ("env", "num_envs", "run_dir", "source", "encoder", "seed", "checkpoint", "num_steps")


@dataclass(frozen=True)
class FileInfo:
    """One trajectory file as read from its headers."""

    path: Path
    samples: int
    obs_size: int
    hidden_shape: tuple[int, ...] | None  # per sample: (D,) or (K, H); None without hidden_state
    has_rtg: bool
    stream: str  # the stream it belongs to (JSON of its recording's identity, or its own path)
    num_envs: int  # envs of that stream (time-major order)
    first: int  # stream index of its first sample
    env: str
    labelling: dict | None
    hidden_key: str = "hidden_state"  # the array of the chosen layer (rl.layers.hidden_key_of; --hidden-layer)

    @property
    def hidden_dim(self) -> int | None:
        return None if self.hidden_shape is None else int(self.hidden_shape[-1])


def _headers(path: Path) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """{key: (shape, dtype)} of every array in an .npz, read from the .npy headers only."""
    return npz_headers(path)


@contextmanager
def _reading(path: Path):
    """Reading `path`'s arrays: what goes wrong (a damaged member, e.g. a bad CRC in a file that is still a valid
    zip) is a TrajectoryError naming the file."""
    try:
        yield
    except TrajectoryError:
        raise
    except (OSError, zipfile.BadZipFile, ValueError, EOFError, KeyError) as e:
        raise TrajectoryError(f"{path}: unreadable as .npz ({type(e).__name__}: {e}); record or label it again, "
                              f"or remove it from the dataset") from None


def _read_json(path: Path, key: str) -> dict | None:
    from rl.trajectories import read_meta

    with _reading(path), np.load(path, allow_pickle=False) as npz:
        return read_meta(npz, key)


def read_info(path: Path, file_envs: int = 128, hidden_layer: int | None = None) -> FileInfo:
    """The checked headers of one file; TrajectoryError naming the file and the key that is wrong. `hidden_layer`:
    the labelled hidden-state index to read (None: the first, `hidden_state`)."""
    path = Path(path)

    def bad(why: str) -> TrajectoryError:
        return TrajectoryError(f"{path}: {why}")

    try:
        heads = _headers(path)
    except (OSError, zipfile.BadZipFile, ValueError, EOFError) as e:
        raise bad(f"unreadable as .npz ({type(e).__name__}: {e})") from None
    for key in REQUIRED:
        if key not in heads:
            raise bad(f"missing key {key!r} (has: {', '.join(sorted(heads)) or 'nothing'})")
    shape, dtype = heads["obs"]
    if len(shape) != 2 or dtype.kind != "f":
        raise bad(f"key 'obs' is {dtype} {list(shape)}, expected float [samples, observation size]")
    n = shape[0]
    expect = {"action": "iu", "reward": "fiu", "done": "biu", "log_prob": "f", "return_to_go": "f"}
    for key, kinds in expect.items():
        if key in heads:
            s, d = heads[key]
            if s != (n,) or d.kind not in kinds:
                raise bad(f"key {key!r} is {d} {list(s)}, expected [{n}] ({'integer' if kinds == 'iu' else 'number'})")
    if "next_obs" in heads and heads["next_obs"][0] != shape:
        raise bad(f"key 'next_obs' is {list(heads['next_obs'][0])}, expected {list(shape)} like 'obs'")
    try:
        recording = _read_json(path, RECORDING_KEY)
        labelling = _read_json(path, LABELLING_KEY)
    except TrajectoryError as e:
        raise (e if str(e).startswith(f"{path}:") else bad(str(e))) from None
    key = "hidden_state"
    if hidden_layer is not None and "hidden_state" in heads:
        from rl.layers import hidden_key_of

        try:
            key = hidden_key_of(labelling, hidden_layer)
        except ValueError as e:
            raise bad(str(e)) from None
    hidden = None
    if key in heads:
        s, d = heads[key]
        if len(s) not in (2, 3) or s[0] != n or d.kind != "f":
            raise bad(f"key {key!r} is {d} {list(s)}, expected float [{n}, D] or [{n}, K, H]")
        hidden = tuple(int(x) for x in s[1:])
    try:
        env = trajectory_env({"obs": np.empty((0, shape[1]), np.float32)}, {RECORDING_KEY: recording or {}})
    except TrajectoryError as e:
        raise bad(str(e)) from None
    if recording and "num_envs" in recording and "first_sample" in recording:
        stream = json.dumps({k: recording.get(k) for k in STREAM_KEYS}, sort_keys=True)
        num_envs, first = int(recording["num_envs"]), int(recording["first_sample"])
    else:
        stream, num_envs, first = str(path), int(file_envs), 0
    return FileInfo(path, int(n), int(shape[1]), hidden, "return_to_go" in heads, stream, num_envs, first, env,
                    labelling, key)


def scan(data: str | Path | Sequence[Path], *, file_envs: int = 128, need_hidden: bool = False,
         hidden_layer: int | None = None) -> list[FileInfo]:
    """Every `.npz` of a directory (or the given files), checked and sorted by stream and position.

    All files must agree on the env, the observation size and (with `need_hidden`) carry hidden states of one
    size and one `labelling`; TrajectoryError (one line, naming the file) otherwise."""
    if isinstance(data, (str, Path)):
        d = Path(data)
        if not d.is_dir():
            raise TrajectoryError(f"--data {d}: not a directory")
        paths = sorted(d.glob("*.npz"))
        if not paths:
            raise TrajectoryError(f"--data {d}: no .npz files there")
    else:
        paths = [Path(p) for p in data]
    infos = [read_info(p, file_envs, hidden_layer if need_hidden else None) for p in paths]
    ref = infos[0]
    for f in infos:
        if f.env != ref.env or f.obs_size != ref.obs_size:
            raise TrajectoryError(f"{f.path}: its observations are {f.env} ({f.obs_size} floats) but {ref.path.name}'s "
                                  f"are {ref.env} ({ref.obs_size}); one dataset holds one env")
        if need_hidden:
            if f.hidden_shape is None:
                raise TrajectoryError(f"{f.path}: missing key 'hidden_state' (label the files with python -m rl.label,"
                                      f" or train with --hidden none)")
            if f.hidden_dim != ref.hidden_dim:
                raise TrajectoryError(f"{f.path}: key 'hidden_state' has size {f.hidden_dim}, but "
                                      f"{ref.path.name}'s has {ref.hidden_dim}")
            if f.labelling != ref.labelling:
                raise TrajectoryError(f"{f.path}: labelled with other settings than {ref.path.name} "
                                      f"({f.labelling} vs {ref.labelling}); relabel one of them")
    return sorted(infos, key=lambda f: (f.stream, f.first, str(f.path)))


def _load(path: Path, key: str) -> np.ndarray:
    with _reading(path), np.load(path, allow_pickle=False) as npz:
        return npz[key]


def load_hidden(path: Path, key: str = "hidden_state") -> np.ndarray:
    """float16 [N, D] of a file's `key` ([N, K, H] is averaged over K first, in float32)."""
    h = _load(path, key)
    if h.ndim == 3:
        h = h.astype(np.float32).mean(1)
    return h.astype(np.float16)


# ------------------------------------------------------------------------------------------------ per-sample targets

@dataclass
class Plan:
    """Per row (the files' samples in file order): targets and the hidden-state source row."""

    files: list[FileInfo]
    offsets: np.ndarray  # int64 [F + 1]: rows of file i are offsets[i]:offsets[i + 1]
    rtg: np.ndarray  # float32 [N]
    action: np.ndarray  # int32 [N]
    source: np.ndarray  # int64 [N]: the row whose hidden state this row reads (hidden_skip_n)
    truncated: int  # rows whose return is cut short (no episode end follows before a gap or the data's end)
    streams: int = 0
    gaps: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return int(self.offsets[-1])

    def file_rows(self, index: Sequence[int]) -> np.ndarray:
        return np.concatenate([np.arange(self.offsets[i], self.offsets[i + 1]) for i in index]) if len(index) else \
            np.zeros(0, np.int64)


def plan(files: list[FileInfo], gamma: float, hidden_skip_n: int) -> Plan:
    """Returns-to-go, actions and hidden-state sources of every row; each stream is laid out as its [T, B] grid
    (holes where files are missing) so nothing reaches across a gap, an episode end or a stream's end."""
    offsets = np.concatenate([[0], np.cumsum([f.samples for f in files])]).astype(np.int64)
    n = int(offsets[-1])
    rtg = np.zeros(n, np.float32)
    source = np.zeros(n, np.int64)
    action = np.zeros(n, np.int32)
    truncated = gaps = 0
    by_stream: dict[str, list[int]] = {}
    for i, f in enumerate(files):
        by_stream.setdefault(f.stream, []).append(i)
    for idx in by_stream.values():
        B = files[idx[0]].num_envs
        g0 = min(files[i].first for i in idx)
        g1 = max(files[i].first + files[i].samples for i in idx)
        t0 = g0 // B
        T = -(-g1 // B) - t0
        rowmap = np.full(T * B, -1, np.int64)
        reward = np.zeros(T * B, np.float32)
        done = np.zeros(T * B, bool)
        own_rtg = []
        for i in idx:
            f = files[i]
            pos = np.arange(f.first, f.first + f.samples) - t0 * B
            if (rowmap[pos] >= 0).any():
                raise TrajectoryError(f"{f.path}: its samples {f.first}..{f.first + f.samples - 1} overlap another "
                                      f"file of the same recording; remove one of them")
            rowmap[pos] = np.arange(offsets[i], offsets[i + 1])
            with _reading(f.path), np.load(f.path, allow_pickle=False) as npz:
                reward[pos] = npz["reward"].astype(np.float32)
                done[pos] = npz["done"].astype(bool)
                action[offsets[i]:offsets[i + 1]] = npz["action"].astype(np.int32)
                if f.has_rtg:
                    own_rtg.append((i, npz["return_to_go"].astype(np.float32)))
        rowmap, reward, done = rowmap.reshape(T, B), reward.reshape(T, B), done.reshape(T, B)
        valid = rowmap >= 0
        gaps += int(_count_holes(valid.reshape(-1), g0 - t0 * B, g1 - t0 * B))
        g = returns_to_go(reward, done, gamma, valid)
        cut = truncated_mask(done, valid)
        rtg[rowmap[valid]] = g[valid]
        flagged = np.zeros(n, bool)
        flagged[rowmap[cut]] = True
        for i, own in own_rtg:  # the reference's own return_to_go where present
            rtg[offsets[i]:offsets[i + 1]] = own
            flagged[offsets[i]:offsets[i + 1]] = False
        truncated += int(flagged.sum())
        src_t = hold_source(done, hidden_skip_n, valid)
        b = np.broadcast_to(np.arange(B), (T, B))
        source[rowmap[valid]] = rowmap[src_t[valid], b[valid]]
    return Plan(files, offsets, rtg, action, source, truncated, len(by_stream), gaps)


def _count_holes(valid: np.ndarray, lo: int, hi: int) -> int:
    """Runs of missing samples strictly inside [lo, hi)."""
    v = valid[lo:hi]
    starts = np.flatnonzero(~v[1:] & v[:-1])
    return len(starts)


# ------------------------------------------------------------------------------------------------ compact layout

@dataclass(frozen=True)
class Layout:
    """Lossless compact observation encoding: `binary` columns (only 0 and 1 in the data) stored as bits, the
    others as `rest_dtype` (float16 when every value survives the round trip, else float32)."""

    obs_size: int
    binary: tuple[int, ...]
    rest: tuple[int, ...]
    rest_dtype: str

    @property
    def bytes_per_sample(self) -> int:
        return -(-len(self.binary) // 8) + len(self.rest) * np.dtype(self.rest_dtype).itemsize

    def encode(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(bits uint8 [N, ceil(nb / 8)], rest [N, nr]) of float obs [N, O]."""
        b = np.asarray(self.binary, np.int64)
        r = np.asarray(self.rest, np.int64)
        bits = np.packbits(obs[:, b].astype(np.uint8), axis=1) if len(b) else np.zeros((len(obs), 0), np.uint8)
        return bits, obs[:, r].astype(self.rest_dtype)

    def to_json(self) -> dict:
        return {"obs_size": self.obs_size, "binary": list(self.binary), "rest": list(self.rest),
                "rest_dtype": self.rest_dtype}


class LayoutScan:
    """Accumulates, over the files' observations, which columns are 0/1 and whether float16 holds the rest."""

    def __init__(self, obs_size: int):
        self.binary = np.ones(obs_size, bool)
        self.half_ok = np.ones(obs_size, bool)

    def add(self, obs: np.ndarray) -> None:
        self.binary &= ((obs == 0) | (obs == 1)).all(0)
        self.half_ok &= (obs.astype(np.float16).astype(obs.dtype) == obs).all(0)

    def layout(self) -> Layout:
        b = tuple(int(i) for i in np.flatnonzero(self.binary))
        r = tuple(int(i) for i in np.flatnonzero(~self.binary))
        half = bool(self.half_ok[list(r)].all()) if r else True
        return Layout(len(self.binary), b, r, "float16" if half else "float32")


class HiddenStats:
    """Per-dimension mean and std of hidden states (float64 sums), over the training rows."""

    def __init__(self, dim: int):
        self.n = 0
        self.s = np.zeros(dim)
        self.ss = np.zeros(dim)

    def add(self, h: np.ndarray) -> None:
        h = h.astype(np.float64)
        self.n += len(h)
        self.s += h.sum(0)
        self.ss += (h * h).sum(0)

    def result(self) -> dict[str, np.ndarray]:
        mean = self.s / max(self.n, 1)
        var = np.maximum(self.ss / max(self.n, 1) - mean * mean, 0.0)
        return {"mean": mean.astype(np.float32), "std": np.maximum(np.sqrt(var), 1e-6).astype(np.float32)}


def scan_values(pl: Plan, train_files: Sequence[int], use_hidden: bool) -> tuple[Layout, dict | None]:
    """One pass over every file's observations (the layout) and the training files' hidden states (stats)."""
    ls = LayoutScan(pl.files[0].obs_size)
    hs = HiddenStats(pl.files[0].hidden_dim) if use_hidden else None
    train = set(train_files)
    for i, f in enumerate(pl.files):
        ls.add(_load(f.path, "obs"))
        if hs is not None and i in train:
            hs.add(load_hidden(f.path, f.hidden_key))
    return ls.layout(), (hs.result() if hs is not None else None)


# ------------------------------------------------------------------------------------------------ shards

def build_shard(pl: Plan, layout: Layout, index: Sequence[int], use_hidden: bool) -> dict[str, np.ndarray]:
    """The host arrays of files `index` (rows in file order): obs bits and rest, action, rtg and, with
    `use_hidden`, each row's held hidden state (float16, read from whichever file holds its source row)."""
    bits, rest = [], []
    for i in index:
        b, r = layout.encode(_load(pl.files[i].path, "obs"))
        bits.append(b)
        rest.append(r)
    rows = pl.file_rows(index)
    out = {"bits": np.concatenate(bits), "rest": np.concatenate(rest), "action": pl.action[rows],
           "rtg": pl.rtg[rows]}
    if use_hidden:
        src = pl.source[rows]
        fidx = np.searchsorted(pl.offsets, src, side="right") - 1
        hidden = np.zeros((len(rows), pl.files[0].hidden_dim), np.float16)
        for i in np.unique(fidx):
            sel = fidx == i
            hidden[sel] = load_hidden(pl.files[i].path, pl.files[i].hidden_key)[src[sel] - pl.offsets[i]]
        out["hidden"] = hidden
    return out


def decode_obs(bits, rest, layout: Layout):
    """float32 [b, O] observations of a batch of compact rows (jnp; exact inverse of `Layout.encode`)."""
    import jax.numpy as jnp

    parts = []
    if layout.binary:
        parts.append(jnp.unpackbits(bits, axis=-1, count=len(layout.binary)).astype(jnp.float32))
    if layout.rest:
        parts.append(rest.astype(jnp.float32))
    flat = jnp.concatenate(parts, axis=-1)
    order = np.argsort(np.asarray(layout.binary + layout.rest, np.int64))
    return flat[:, order]


def split_files(files: list[FileInfo], val_fraction: float) -> tuple[list[int], list[int]]:
    """(train, validation) file indices: about `val_fraction` of the files, evenly spread over the list, are
    held out (none when there is a single file or the fraction is 0)."""
    n = len(files)
    k = int(round(val_fraction * n)) if n > 1 else 0
    k = min(max(k, 1 if val_fraction > 0 and n > 1 else 0), n - 1)
    val = set(sorted(int(x) for x in np.unique(np.linspace(0, n - 1, k + 2)[1:-1].round()))) if k else set()
    return [i for i in range(n) if i not in val], sorted(val)


def nbytes(shard: dict[str, Any]) -> int:
    return int(sum(np.asarray(a).nbytes for a in shard.values()))
