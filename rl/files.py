"""Small file helpers every tool shares: the one atomic write and the one .npy header reader.

`atomic_write` writes beside the target under a temporary name (never matched by '*.npz' or '*.json'), then
renames it over the target, so a reader never sees a half-written file and a crash leaves the old file intact.
"""
from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Callable

import numpy as np


def temporary_name(path: Path, tag: str = "tmp") -> Path:
    """A name beside `path` for a file being written (a dot file: never matched by '*.npz')."""
    path = Path(path)
    return path.with_name(f".{path.name}.{tag}-{os.getpid()}")


def atomic_write(path: str | Path, content: str | bytes | Callable[[Path], None], *, sync: bool = False) -> Path:
    """Write `content` (text, bytes, or a function that writes the file at the path it is given) to `path`
    atomically: a temporary name beside it, then `os.replace`. `sync`: fsync before the rename (data files)."""
    path = Path(path)
    tmp = temporary_name(path)
    try:
        if callable(content):
            content(tmp)
        elif isinstance(content, bytes):
            tmp.write_bytes(content)
        else:
            tmp.write_text(content)
        if sync:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def npz_headers(path: str | Path, keys=None) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """{key: (shape, dtype)} of the arrays of an .npz (all, or those in `keys`), read from the .npy headers only
    (nothing is decompressed or loaded). Raises what zipfile / numpy raise for a damaged file."""
    out = {}
    with zipfile.ZipFile(path) as z:
        for name in z.namelist():
            if not name.endswith(".npy") or (keys is not None and name[:-4] not in keys):
                continue
            with z.open(name) as f:
                major, _ = np.lib.format.read_magic(f)
                read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
                shape, _, dtype = read(f)
            out[name[:-4]] = (tuple(shape), np.dtype(dtype))
    return out
