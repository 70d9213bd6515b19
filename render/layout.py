"""The description of an observation text: sections of rows of columns, each column a choice or a number.

A `Layout` is pure data. Both consumers read it:

- `render.text` turns integer column values into strings (numpy, batched), for people, logs and HTTP;
- `render.template` turns the same values into token ids (jnp, jittable), for the in-scan LLM.

The values themselves come from one function per format (`Format.values`, pure jnp), so the two
consumers cannot disagree on what a state shows, only on tokenization, which the template compiler
checks and the tests verify against the real tokenizer.

Text order: sections in order; inside a section, rows in order; inside a row, columns in order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Union

import numpy as np


class UnsupportedLayout(ValueError):
    """A layout that an assembly of the template cannot build (`render.pallas_assembly`); assembly='auto' then
    uses the XLA ops."""


@dataclass(frozen=True)
class Choice:
    """A column that shows one of a fixed list of strings, picked by an integer index (a constant has one)."""

    strings: tuple[str, ...]

    def __post_init__(self):
        if not self.strings:
            raise ValueError("Choice needs at least one string")


def Const(text: str) -> Choice:
    """A column that always shows `text`."""
    return Choice((text,))


@dataclass(frozen=True)
class Number:
    """A column that shows a non-negative integer in decimal, optionally as a fixed-point number.

    The column value is the integer `round(x * 10**decimals)`, already clipped by the format to
    `[0, 10**(int_digits + decimals) - 1]`; it is printed as the integer part (no leading zeros,
    at most `int_digits` digits), then, if `decimals > 0`, a dot and exactly `decimals` digits.
    """

    int_digits: int
    decimals: int = 0
    optional: bool = False  # if True, the value -1 shows nothing (not even the label)
    label: str = ""  # text shown right before the digits (e.g. " wood="), part of this column


    @property
    def max_value(self) -> int:
        return 10 ** (self.int_digits + self.decimals) - 1

    def format(self, value: int) -> str:
        """The text of one column value (the single definition used by the text renderer)."""
        value = int(value)
        if self.optional and value == -1:
            return ""
        if not 0 <= value <= self.max_value:
            raise ValueError(f"value {value} outside [0, {self.max_value}] of {self}")
        if self.decimals == 0:
            return f"{self.label}{value}"
        scale = 10**self.decimals
        return f"{self.label}{value // scale}.{value % scale:0{self.decimals}d}"

    def examples(self) -> tuple[str, ...]:
        """Representative texts for the boundary check (every digit count, smallest and largest digits)."""
        values = {0, self.max_value}
        for k in range(self.int_digits + self.decimals):
            values.add(10**k)
            values.add(min(10 ** (k + 1) - 1, self.max_value))
        return tuple(sorted({self.format(v) for v in values}))


Column = Union[Choice, Number]


@dataclass(frozen=True)
class Section:
    """`rows` rows that all have the same `columns`.

    optional_rows: the format also returns a 0/1 `present` flag per row; absent rows show nothing
        (used for the compact map's variable set of tiles: a row per window tile, the informative ones present).
    max_rows_shown: with optional_rows, at most this many rows are present (the format guarantees it, e.g. with
        `render.view.first_k`); the template's `max_len` then counts only this many rows.
    never_empty: every row shows at least one non-empty column (the format guarantees it, e.g.
        with a "nothing" choice); the boundary check then knows the row can't vanish as a whole.
    """

    name: str
    columns: tuple[Column, ...]
    rows: int = 1
    optional_rows: bool = False
    never_empty: bool = False
    max_rows_shown: int | None = None

    def __post_init__(self):
        if self.max_rows_shown is not None and not (self.optional_rows and 0 < self.max_rows_shown <= self.rows):
            raise ValueError(f"section {self.name!r}: max_rows_shown={self.max_rows_shown} needs optional_rows=True "
                             f"and 1 <= max_rows_shown <= rows ({self.rows})")

    @property
    def rows_shown(self) -> int:
        """The most rows that can show text."""
        return self.rows if self.max_rows_shown is None else self.max_rows_shown


@dataclass(frozen=True)
class Layout:
    sections: tuple[Section, ...]

    def __post_init__(self):
        names = [s.name for s in self.sections]
        if len(set(names)) != len(names):
            raise ValueError(f"section names must be unique, got {names}")


Values = Mapping[str, "np.ndarray"]  # name -> int32 [..., rows, cols]; name + "/present" -> [..., rows]


@dataclass(frozen=True)
class Format:
    """A text format of one env: its layout and the pure-jnp function from a view to column values.

    The view is the env's `View` (`render.formats_craftax.View`, `render.formats_classic.View`): what one state
    or one symbolic observation shows (`render.sources.view_function`)."""

    env_name: str
    name: str
    layout: Layout
    values: Callable  # unbatched View -> dict[str, jnp.ndarray]


def present_key(section_name: str) -> str:
    return section_name + "/present"
