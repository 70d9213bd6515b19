"""A small builder for one-row sections: constant text interleaved with value columns."""
from __future__ import annotations

from typing import Callable

import jax.numpy as jnp

from render.layout import Column, Const, Section


class RowBuilder:
    """Collects columns and, for each non-constant one, a function state -> int32 scalar."""

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

    def values(self, state) -> jnp.ndarray:
        """int32 [1, columns]: the column values of `state` (0 for constants)."""
        vals = [jnp.zeros((), jnp.int32) if g is None else jnp.asarray(g(state), jnp.int32) for g in self._getters]
        return jnp.stack(vals)[None, :]
