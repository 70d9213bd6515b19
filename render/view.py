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
    """
    codes = jnp.full((rows * cols,), none_code, dtype=jnp.int32)
    centre = jnp.array([rows // 2, cols // 2], dtype=jnp.int32)
    for pos, mask, code in mob_groups:
        local = pos - position[None, :] + centre
        on_screen = jnp.all((local >= 0) & (local < jnp.array([rows, cols])), axis=-1) & mask
        flat = jnp.where(on_screen, local[:, 0] * cols + local[:, 1], rows * cols)
        codes = codes.at[flat].min(code.astype(jnp.int32), mode="drop")
    return codes


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


def compact_rows(informative: jnp.ndarray, order: np.ndarray, k: int):
    """Pick up to `k` informative tiles, nearest first.

    Returns (tile index per row int32 [k], present per row bool [k], number of informative tiles).
    Stable compaction by cumsum + scatter (no sort at run time: `order` is static).
    """
    inf = informative[order]
    rank = jnp.cumsum(inf.astype(jnp.int32)) - 1
    slot = jnp.where(inf & (rank < k), rank, k)
    tiles = jnp.zeros((k,), jnp.int32).at[slot].set(jnp.asarray(order), mode="drop")
    total = jnp.sum(inf.astype(jnp.int32))
    present = jnp.arange(k) < total
    return tiles, present, total
