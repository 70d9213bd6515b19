"""Pure-jnp reading of the player's local view and the one quantisation of numbers.

Everything a format shows is computed here or in the format modules from these helpers, under jit,
for one unbatched state. The text renderer and the token template both call the same format
function, so a number is rounded exactly once.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def window_offsets(rows: int, cols: int) -> np.ndarray:
    """int32 [rows * cols, 2]: (row, col) offsets from the player, row-major, player at the centre."""
    r, c = np.meshgrid(np.arange(rows) - rows // 2, np.arange(cols) - cols // 2, indexing="ij")
    return np.stack([r.reshape(-1), c.reshape(-1)], axis=-1).astype(np.int32)


def nearest_first(offsets: np.ndarray) -> np.ndarray:
    """Static order of window tiles by Euclidean distance to the player (ties: row, then col)."""
    r, c = offsets[:, 0], offsets[:, 1]
    return np.lexsort((c, r, r * r + c * c)).astype(np.int32)


def gather_window(grid: jnp.ndarray, position: jnp.ndarray, offsets: np.ndarray, fill):
    """Values of a 2-D `grid` at `position + offsets` ([T]); `fill` where the tile is off the map."""
    pos = position[None, :] + offsets
    inside = jnp.all((pos >= 0) & (pos < jnp.array(grid.shape)), axis=-1)
    safe = jnp.clip(pos, 0, jnp.array(grid.shape) - 1)
    return jnp.where(inside, grid[safe[:, 0], safe[:, 1]], fill)


def mob_codes(mob_groups, position: jnp.ndarray, rows: int, cols: int, none_code: int) -> jnp.ndarray:
    """int32 [rows * cols]: the smallest code of the live mobs on each window tile, `none_code` if none.

    mob_groups: sequence of (positions [N, 2], mask [N], codes [N]). Unlike craftax's
    `render_craftax_text` (which writes 0 for dead or off-screen slots too, so they can erase a visible
    mob, and wraps negative positions), only live on-screen mobs are written. "Smallest code" matches
    upstream's argmax over its one-hot when two mobs share a tile.

    A [tiles, mobs] comparison and a min, not a scatter: XLA fuses it with its neighbours, where each
    scatter would be a GPU kernel of its own (one per mob group).
    """
    pos = jnp.concatenate([p for p, _, _ in mob_groups])
    mask = jnp.concatenate([m for _, m, _ in mob_groups])
    code = jnp.concatenate([c.astype(jnp.int32) for _, _, c in mob_groups])
    local = pos - position[None, :] + jnp.array([rows // 2, cols // 2], dtype=pos.dtype)
    on_screen = jnp.all((local >= 0) & (local < jnp.array([rows, cols])), axis=-1) & mask
    flat = jnp.where(on_screen, local[:, 0] * cols + local[:, 1], -1)
    here = flat[None, :] == jnp.arange(rows * cols)[:, None]
    return jnp.min(jnp.where(here, code[None, :], none_code), axis=1).astype(jnp.int32)


def fixed_point(x, decimals: int, int_digits: int) -> jnp.ndarray:
    """int32 round(x * 10**decimals), clipped to what `Number(int_digits, decimals)` can show."""
    scaled = jnp.round(jnp.asarray(x, jnp.float32) * (10**decimals)).astype(jnp.int32)
    return jnp.clip(scaled, 0, 10 ** (int_digits + decimals) - 1)


def count(x, int_digits: int) -> jnp.ndarray:
    """int32 count clipped to [0, 10**int_digits - 1]."""
    return jnp.clip(jnp.asarray(x, jnp.int32), 0, 10**int_digits - 1)


def optional_count(x, int_digits: int) -> jnp.ndarray:
    """Like `count`, but -1 (shown as nothing) where the count is zero."""
    c = count(x, int_digits)
    return jnp.where(c > 0, c, -1)


def first_k(flags: jnp.ndarray, k: int) -> jnp.ndarray:
    """`flags` with all but its first `k` True entries cleared (the compact map's cap on listed tiles)."""
    return flags & (jnp.cumsum(flags.astype(jnp.int32)) <= k)
