"""The token template: a layout compiled against a tokenizer into a pure-jnp function state -> ids.

Every column is pre-tokenized once: a choice becomes a padded table of token ids per string, a
number becomes digit tokens computed with integer arithmetic. At run time each piece (a column of
one row) has a value and, from it, a length; one prefix sum over the lengths gives every piece's span
in the output; a small scatter of piece starts and a running max tell each output position its
piece, and the position computes its token from that piece's value (a table lookup for a choice,
integer arithmetic for a number's digits). No per-token scatter and no sort.

The concatenation of per-piece tokenizations equals the tokenization of the concatenated text only
if no BPE merge (or pre-tokenizer split) crosses a piece boundary. `check_boundaries` verifies this
with the tokenizer for every pair of strings that can meet at a boundary and refuses otherwise.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from render.layout import Choice, Const, Format, Layout, Section, present_key
from render.text import texts_from_values

PAD_ID = 151643  # <|endoftext|>


class UnsafeBoundaryError(ValueError):
    """A piece boundary that the tokenizer may merge across: the template would give wrong ids."""


def _encode(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    if not texts:
        return []
    return tokenizer(list(texts), add_special_tokens=False)["input_ids"]


# ------------------------------------------------------------------------------------- boundaries

@dataclass(frozen=True)
class _Slot:
    name: str
    texts: tuple[str, ...]  # the non-empty strings this slot can show
    can_be_empty: bool  # the column itself can show "" (its row being present)
    row_start: int  # index of the first slot of this slot's row
    row_optional: bool = False  # the whole row may be absent
    row_never_empty: bool = False  # the row always shows at least one non-empty column


def _slots(layout: Layout, head: str) -> list[_Slot]:
    """The layout as a sequence of slots in text order (multi-row sections unrolled twice, which
    covers the row-to-row boundary), preceded by the chat head."""
    slots = [_Slot("chat head", (head,), False, 0)]
    for section in layout.sections:
        for _ in range(2 if section.rows > 1 else 1):
            row_start = len(slots)
            for c, col in enumerate(section.columns):
                if isinstance(col, Choice):
                    texts = tuple(s for s in dict.fromkeys(col.strings) if s)
                    empty = "" in col.strings
                else:
                    texts, empty = col.examples(), col.optional
                slots.append(_Slot(
                    f"{section.name}[column {c}]", texts, empty, row_start,
                    section.optional_rows, section.never_empty,
                ))
    return slots


def _possible_ends(slots: list[_Slot]) -> list[dict[str, str]]:
    """ends[j]: every non-empty string that can be the last text shown up to and including slot j
    (mapped to the name of its slot)."""
    ends: list[dict[str, str]] = []
    for j, slot in enumerate(slots):
        here = {t: slot.name for t in slot.texts}
        all_empty_so_far = slot.can_be_empty
        k = j - 1
        while all_empty_so_far and k >= slot.row_start:  # earlier columns of the same row
            here.update({t: slots[k].name for t in slots[k].texts if t not in here})
            all_empty_so_far = slots[k].can_be_empty
            k -= 1
        is_row_end = j + 1 == len(slots) or slots[j + 1].row_start != slot.row_start
        row_can_vanish = (all_empty_so_far and not (slot.row_never_empty and is_row_end)) or (
            slot.row_optional and is_row_end
        )
        if row_can_vanish and slot.row_start > 0:
            for t, name in ends[slot.row_start - 1].items():
                here.setdefault(t, name)
        ends.append(here)
    return ends


def check_boundaries(tokenizer, layout: Layout, head: str) -> int:
    """Raise UnsafeBoundaryError naming the pieces if any two strings that can meet at a piece
    boundary tokenize differently together than apart. Returns the number of pairs checked."""
    slots = _slots(layout, head)
    ends = _possible_ends(slots)
    pairs: dict[tuple[str, str], tuple[str, str]] = {}
    for i in range(1, len(slots)):
        for lt, lname in ends[i - 1].items():
            for rt in slots[i].texts:
                pairs.setdefault((lt, rt), (lname, slots[i].name))
    keys = list(pairs)
    singles = sorted({t for pair in keys for t in pair})
    single_ids = dict(zip(singles, _encode(tokenizer, singles)))
    joined = _encode(tokenizer, [a + b for a, b in keys])
    for (a, b), ids in zip(keys, joined):
        if ids != single_ids[a] + single_ids[b]:
            lname, rname = pairs[(a, b)]
            raise UnsafeBoundaryError(
                f"unsafe token boundary between {lname} and {rname}: {a[-40:]!r} + {b[:40]!r} tokenizes "
                f"as {ids[-8:]} together but {single_ids[a][-4:]} + {single_ids[b][:4]} apart. Move the "
                "boundary so it falls right after a newline or right before a space-led word, or merge "
                "the two pieces into one string."
            )
    return len(keys)


# ----------------------------------------------------------------------------------------- pieces

CHOICE, NUMBER = 0, 1
# Columns of `_Pieces.info`, one row per piece.
KIND, BASE, WIDTH, LEN_BASE, LABEL_LEN, INT_DIGITS, DECIMALS = range(7)


@dataclass(frozen=True)
class _Pieces:
    """Every piece of a layout (a column of one row, in text order) compiled against a tokenizer.

    A choice piece shows table row `value` of its column: tokens `table[base + value * width :][:len]`
    with len = `lens[len_base + value]`. A number piece shows its label (`table[base:][:label_len]`),
    then digits computed with integer arithmetic: the integer part without leading zeros, then '.'
    and `decimals` digits; the value -1 shows nothing.
    """

    info: np.ndarray  # int32 [pieces, 7]: the columns above
    table: np.ndarray  # int32 [*]: every choice row (padded to its column's width) and every label
    lens: np.ndarray  # int32 [*]: token count of every choice string
    digit_ids: np.ndarray  # int32 [10]
    dot_id: int
    max_len: int  # the most tokens all pieces can show together

    def per_piece(self, values):
        """What every piece shows for `values` (int32 [pieces]): (length, first table index or label start,
        integer part, fraction, digit count), each int32 [pieces]."""
        info = jnp.asarray(self.info)
        kind, dec = info[:, KIND], info[:, DECIMALS]
        v = jnp.maximum(values, 0)
        whole, frac = v // _pow10(dec), v % _pow10(dec)
        ndig = _digit_count(whole)
        number_len = jnp.where(values < 0, 0, info[:, LABEL_LEN] + ndig + jnp.where(dec > 0, 1 + dec, 0))
        choice_len = jnp.asarray(self.lens)[info[:, LEN_BASE] + v]
        length = jnp.where(kind == NUMBER, number_len, choice_len)
        base = info[:, BASE] + jnp.where(kind == NUMBER, 0, v * info[:, WIDTH])
        return length, base, whole, frac, ndig

    def tokens(self, piece, offset, base, whole, frac, ndig):
        """Token `offset` of each `piece` (int arrays of one shape), from `per_piece`'s arrays."""
        info = jnp.asarray(self.info)[piece]  # [..., 7]
        base, whole, frac, ndig = base[piece], whole[piece], frac[piece], ndig[piece]
        table = jnp.asarray(self.table)
        from_table = table[base + offset]  # a choice's token, or a number's label token
        d = offset - info[..., LABEL_LEN]  # position inside the number
        int_digit = (whole // _pow10(jnp.clip(ndig - 1 - d, 0, 9))) % 10
        frac_digit = (frac // _pow10(jnp.clip(info[..., DECIMALS] - (d - ndig), 0, 9))) % 10
        digits = jnp.asarray(self.digit_ids)
        number = jnp.where(d < ndig, digits[int_digit], jnp.where(d == ndig, self.dot_id, digits[frac_digit]))
        return jnp.where((info[..., KIND] == NUMBER) & (d >= 0), number, from_table)


def _pow10(e):
    return jnp.asarray([10**k for k in range(10)], jnp.int32)[e]


def _digit_count(whole):
    """Decimal digits of non-negative int32 values (1 for 0)."""
    return 1 + sum((whole >= 10**k).astype(jnp.int32) for k in range(1, 9))


def _compile_pieces(tokenizer, layout: Layout) -> _Pieces:
    """Tokenize every column once and describe every piece (text order) by one row of `info`."""
    digits = _encode(tokenizer, [str(d) for d in range(10)] + ["."])
    if any(len(d) != 1 for d in digits):
        raise UnsafeBoundaryError("this tokenizer does not give every digit and '.' a single token")
    table: list[int] = []
    lens: list[int] = []
    column_info = []  # per section: one info row per column
    max_len = 0
    for section in layout.sections:
        rows = []
        for col in section.columns:
            if isinstance(col, Choice):
                encoded = _encode(tokenizer, list(col.strings))
                width = max(1, max(len(e) for e in encoded))
                rows.append([CHOICE, len(table), width, len(lens), 0, 0, 0])
                for e in encoded:
                    table.extend(e + [PAD_ID] * (width - len(e)))
                lens.extend(len(e) for e in encoded)
                max_len += section.rows * width
            else:
                label = _encode(tokenizer, [col.label])[0] if col.label else []
                rows.append([NUMBER, len(table), 0, 0, len(label), col.int_digits, col.decimals])
                table.extend(label)
                max_len += section.rows * (len(label) + col.int_digits + (1 + col.decimals if col.decimals else 0))
        column_info.append([rows] * section.rows)
    info = np.asarray([row for section in column_info for columns in section for row in columns], np.int32)
    return _Pieces(info, np.asarray(table + [PAD_ID], np.int32), np.asarray(lens + [0], np.int32),
                   np.asarray([d[0] for d in digits[:10]], np.int32), digits[10][0], max_len)


# --------------------------------------------------------------------------------------- template

@functools.lru_cache(maxsize=None)
def _batched_values(fmt: Format):
    return jax.jit(jax.vmap(fmt.values))


def format_values_numpy(fmt: Format, state, batched: bool) -> dict[str, np.ndarray]:
    """Column values of a state (or batch) as numpy, computed in one jitted vmapped call."""
    if not batched:
        state = jax.tree_util.tree_map(lambda x: jnp.asarray(x)[None], state)
    return {k: np.asarray(v) for k, v in _batched_values(fmt)(state).items()}


@dataclass(frozen=True, eq=False)
class Template:
    """Prompt template of one env, format and system prompt (build it with `build_template`).

    prefix_ids: the constant prompt head (chat framing + system prompt + user turn start).
    max_len: static length of `ids` returned by `__call__` (observation + closing chat tokens).
    pad_id: right padding id.
    """

    env_name: str
    fmt: Format
    head: str
    tail: str
    prefix_ids: list[int]
    max_len: int
    pad_id: int
    fmt_sections: tuple  # the format's sections plus the chat tail, in text order
    _pieces: _Pieces = field(repr=False)

    def __call__(self, state):
        """ids int32 [max_len] (right-padded with pad_id) and length int32 for ONE unbatched state."""
        from render.envs import check_state

        check_state(state, self.env_name)
        if state.player_position.ndim != 1:
            raise ValueError("Template takes one unbatched state; use jax.vmap(tpl)(batched_state) for a batch")
        values = self.fmt.values(state)
        values["chat_tail"] = jnp.zeros((1, 1), jnp.int32)
        piece_values, present = [], []
        for section in self.fmt_sections:
            vals = values[section.name]  # [rows, columns]
            piece_values.append(vals.reshape(-1))  # row-major = text order
            shown = values.get(present_key(section.name)) if section.optional_rows else None
            present.append(jnp.ones(vals.size, bool) if shown is None else jnp.repeat(shown, vals.shape[1]))
        length, base, whole, frac, ndig = self._pieces.per_piece(jnp.concatenate(piece_values))
        length = jnp.where(jnp.concatenate(present), length, 0)
        ends = jnp.cumsum(length)
        starts = ends - length
        # Output position p shows the last non-empty piece starting at or before p: mark each such
        # piece's start with its index, then a running max.
        n = int(length.shape[0])
        mark = jnp.full((self.max_len,), -1, jnp.int32)
        mark = mark.at[jnp.where(length > 0, starts, self.max_len)].max(jnp.arange(n, dtype=jnp.int32), mode="drop")
        piece = jnp.maximum(jax.lax.cummax(mark), 0)
        pos = jnp.arange(self.max_len, dtype=jnp.int32)
        tokens = self._pieces.tokens(piece, pos - starts[piece], base, whole, frac, ndig)
        out = jnp.where(pos < ends[-1], tokens, self.pad_id)
        return out.astype(jnp.int32), ends[-1].astype(jnp.int32)

    def observation_text(self, state):
        from render.envs import check_state, is_batched

        check_state(state, self.env_name)
        batched = is_batched(state)
        texts = texts_from_values(self.fmt.layout, format_values_numpy(self.fmt, state, batched))
        return texts if batched else texts[0]

    def text(self, state):
        """The full prompt string (head + observation + tail); a list of strings for a batched state."""
        obs = self.observation_text(state)
        if isinstance(obs, list):
            return [self.head + o + self.tail for o in obs]
        return self.head + obs + self.tail


def compile_template(tokenizer, fmt: Format, system: str, env_name: str, pad_id: int = PAD_ID) -> Template:
    """Compile `fmt` with `tokenizer` under the chat framing of `system`; checks every boundary."""
    from render.chat import chat_frame

    head, tail = chat_frame(tokenizer, system)
    layout = Layout(fmt.layout.sections + (Section("chat_tail", (Const(tail),)),))
    check_boundaries(tokenizer, layout, head)
    pieces = _compile_pieces(tokenizer, layout)
    prefix_ids = _encode(tokenizer, [head])[0]
    return Template(env_name, fmt, head, tail, list(prefix_ids), pieces.max_len, pad_id, layout.sections,
                    pieces)
