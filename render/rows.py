"""A small builder for one-row sections: constant text interleaved with value columns."""
from __future__ import annotations

from typing import Callable

import jax.numpy as jnp

from render.layout import Column, Const, Format, Layout, Section, present_key


class RowBuilder:
    """Collects columns and, for each non-constant one, a function view -> int32 scalar."""

    def __init__(self, name: str, never_empty: bool = False):
        self.name = name
        self.never_empty = never_empty
        self._columns: list[Column] = []
        self._getters: list[Callable | None] = []

    def text(self, text: str) -> "RowBuilder":
        self._columns.append(Const(text))
        self._getters.append(None)
        return self

    def value(self, column: Column, getter: Callable) -> "RowBuilder":
        self._columns.append(column)
        self._getters.append(getter)
        return self

    def section(self) -> Section:
        return Section(self.name, tuple(self._columns), rows=1, never_empty=self.never_empty)

    def values(self, view) -> jnp.ndarray:
        """int32 [1, columns]: the column values of `view` (0 for constants)."""
        vals = [jnp.zeros((), jnp.int32) if g is None else jnp.asarray(g(view), jnp.int32) for g in self._getters]
        return jnp.stack(vals)[None, :]


def compact_format(env_name: str, map_section: Section, inventory: RowBuilder, status: RowBuilder,
                   map_rows: Callable) -> Format:
    """The `compact` format shared by both envs: `Map:`, the selected tiles, `Inventory:` and a status row.

    map_rows(view) -> (int32 [rows, 3] tile rows for `map_section`, bool [rows] which rows are present).
    """
    layout = Layout((
        Section("header", (Const("Map:\n"),)),
        map_section,
        Section("items_label", (Const("Inventory:"),)),
        inventory.section(),
        status.section(),
    ))

    def values(view):
        rows, present = map_rows(view)
        zero = jnp.zeros((1, 1), jnp.int32)
        return {
            "header": zero, "map": rows, present_key("map"): present, "items_label": zero,
            "items": inventory.values(view), "status": status.values(view),
        }

    return Format(env_name, "compact", layout, values)
