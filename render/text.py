"""Observation text from column values, vectorised over a batch with numpy.

The values come from the format's jnp function (one jitted, vmapped device call per batch), then
strings are looked up per column with numpy fancy indexing and joined per state.
"""
from __future__ import annotations

import numpy as np

from render.layout import Choice, Layout, present_key


def _column_strings(column, values: np.ndarray) -> np.ndarray:
    """Object array of the strings that `column` shows for integer `values` (any shape)."""
    if isinstance(column, Choice):
        table = np.array(column.strings, dtype=object)
        if values.size and (values.min() < 0 or values.max() >= len(table)):
            raise ValueError(f"choice index out of range [0, {len(table)}) for {column.strings[:3]}...")
        return table[values]
    flat = [column.format(v) for v in values.reshape(-1).tolist()]
    return np.array(flat, dtype=object).reshape(values.shape)


def texts_from_values(layout: Layout, values) -> list[str]:
    """The observation text of every state in a batch of column values (leading axis = batch)."""
    pieces = []  # object arrays [B, n] in text order
    batch = None
    for section in layout.sections:
        vals = np.asarray(values[section.name])
        batch = vals.shape[0]
        cols = [_column_strings(col, vals[:, :, c]) for c, col in enumerate(section.columns)]
        block = np.stack(cols, axis=-1)  # [B, rows, cols]
        if section.optional_rows:
            present = np.asarray(values[present_key(section.name)]).astype(bool)
            block = np.where(present[:, :, None], block, "")
        pieces.append(block.reshape(batch, -1))
    table = np.concatenate(pieces, axis=1)
    return ["".join(row) for row in table.tolist()]
