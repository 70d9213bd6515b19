"""The token template: a layout compiled against a tokenizer into a pure-jnp function state (or obs) -> ids.

Every column is pre-tokenized once: a choice becomes a padded table of token ids per string, a
number becomes digit tokens computed with integer arithmetic. At run time each column yields its
tokens, their positions inside the column and its length; one exclusive cumsum over all lengths
gives every column's offset, and one scatter writes all tokens into the right-padded output.

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

from render.layout import Choice, Const, Format, Layout, Number, Section, UnsupportedLayout, present_key
from render.text import texts_from_values

PAD_ID = 151643  # <|endoftext|>
# how column values become ids: "jnp" (XLA ops, every platform), "pallas" (one kernel, render.pallas_assembly:
# Triton on CUDA, Pallas's interpreter elsewhere, for tests), "auto" (pallas on CUDA, jnp elsewhere)
ASSEMBLIES = ("auto", "jnp", "pallas")


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


# ---------------------------------------------------------------------------------------- columns

@dataclass(frozen=True)
class _ChoiceTokens:
    ids: np.ndarray  # int32 [n, width], padded
    lens: np.ndarray  # int32 [n]

    @property
    def width(self) -> int:
        return self.ids.shape[1]

    def __call__(self, v):
        ids = jnp.asarray(self.ids)[v]
        rel = jnp.broadcast_to(jnp.arange(self.width, dtype=jnp.int32), ids.shape)
        return ids, rel, jnp.asarray(self.lens)[v]


@dataclass(frozen=True)
class _NumberTokens:
    number: Number
    digit_ids: np.ndarray  # int32 [10]
    dot_id: int
    label_ids: tuple[int, ...]  # tokens of number.label

    @property
    def width(self) -> int:
        n = self.number
        return len(self.label_ids) + n.int_digits + (1 + n.decimals if n.decimals else 0)

    def __call__(self, v):
        n = self.number
        empty = v < 0
        v = jnp.maximum(v, 0)
        scale = 10**n.decimals
        whole, frac = v // scale, v % scale
        ndig = jnp.ones_like(whole) + sum((whole >= 10**k).astype(jnp.int32) for k in range(1, n.int_digits))
        i = jnp.arange(n.int_digits, dtype=jnp.int32)
        pow10 = jnp.asarray([10**e for e in range(n.int_digits)], jnp.int32)
        exponent = jnp.clip(ndig[:, None] - 1 - i[None, :], 0, n.int_digits - 1)
        digits = (whole[:, None] // pow10[exponent]) % 10
        ids = [jnp.asarray(self.digit_ids)[digits]]
        # digit slots past the number's own digits are unused: give them a position past the column's length,
        # so they are never written (else they would land on the '.' and the scatter's order would decide)
        rel = [jnp.where(i[None, :] < ndig[:, None], i[None, :], self.width)]
        length = ndig
        if n.decimals:
            j = jnp.arange(n.decimals, dtype=jnp.int32)
            fdig = (frac[:, None] // jnp.asarray([10 ** (n.decimals - 1 - k) for k in range(n.decimals)])) % 10
            ids += [jnp.full((v.shape[0], 1), self.dot_id, jnp.int32), jnp.asarray(self.digit_ids)[fdig]]
            rel += [ndig[:, None], ndig[:, None] + 1 + j[None, :]]
            length = ndig + 1 + n.decimals
        ids, rel = jnp.concatenate(ids, axis=1), jnp.concatenate(rel, axis=1)
        if self.label_ids:
            nl = len(self.label_ids)
            label = jnp.broadcast_to(jnp.asarray(self.label_ids, jnp.int32), (v.shape[0], nl))
            ids = jnp.concatenate([label, ids], axis=1)
            rel = jnp.concatenate([jnp.broadcast_to(jnp.arange(nl, dtype=jnp.int32), label.shape), rel + nl], axis=1)
            length = length + nl
        return ids, rel, jnp.where(empty, 0, length)


def _compile_column(tokenizer, column, pad_id: int):
    if isinstance(column, Choice):
        encoded = _encode(tokenizer, list(column.strings))
        width = max(1, max(len(e) for e in encoded))
        ids = np.full((len(encoded), width), pad_id, np.int32)
        for k, e in enumerate(encoded):
            ids[k, : len(e)] = e
        return _ChoiceTokens(ids, np.array([len(e) for e in encoded], np.int32))
    digits = _encode(tokenizer, [str(d) for d in range(10)] + ["."])
    if any(len(d) != 1 for d in digits):
        raise UnsafeBoundaryError("this tokenizer does not give every digit and '.' a single token")
    label = tuple(_encode(tokenizer, [column.label])[0]) if column.label else ()
    return _NumberTokens(column, np.array([d[0] for d in digits[:10]], np.int32), digits[10][0], label)


# --------------------------------------------------------------------------------------- template

@functools.lru_cache(maxsize=None)
def _batched_values(fmt: Format, to_view):
    return jax.jit(jax.vmap(lambda x: fmt.values(to_view(x))))


def format_values_numpy(fmt: Format, x, batched: bool, source: str = "state") -> dict[str, np.ndarray]:
    """Column values of a state or observation (or a batch: `batched`) as numpy, in one jitted vmapped call."""
    from render.sources import view_function

    if not batched:
        x = jax.tree_util.tree_map(lambda a: jnp.asarray(a)[None], x)
    to_view = view_function(fmt.env_name, source)
    return {k: np.asarray(v) for k, v in _batched_values(fmt, to_view)(x).items()}


@dataclass(frozen=True, eq=False)
class Template:
    """Prompt template of one env, format and system prompt (build it with `build_template`).

    source: what `__call__` and `text` read: "state" (a raw craftax EnvState) or "obs" (the env's symbolic
        observation vector, float [O]); both become the same view, so the ids of one format agree
        (docs/RENDER.md lists what an observation shows differently).
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
    _sections: tuple = field(repr=False)  # per section: (Section, tuple of compiled columns)
    assembly: str = "auto"  # see ASSEMBLIES
    source: str = "state"  # see render.sources.SOURCES
    dropped: tuple = ()  # names of sections whose tokens are left out of the ids (rl's prompt variants; XLA assembly)

    @functools.cached_property
    def _pallas_assemble(self):
        from render.pallas_assembly import make_pallas_assembler

        return make_pallas_assembler(self._sections, self.max_len, self.pad_id)

    def __call__(self, state):
        """ids int32 [max_len] (right-padded with pad_id) and length int32 for ONE unbatched state (or
        observation vector, for `source="obs"`)."""
        values = self._values(state)
        if self.assembly == "jnp" or self.dropped:
            return self._jnp_assemble(values)
        if self.assembly == "pallas":
            return self._pallas_assemble(values)
        # "auto": the one-kernel assembly where Triton compiles it (CUDA), XLA ops elsewhere
        if jax.default_backend() != "gpu":
            return self._jnp_assemble(values)
        try:
            pallas = self._pallas_assemble
        except (ImportError, UnsupportedLayout):  # a JAX without Pallas's Triton backend; a layout it can't do
            return self._jnp_assemble(values)
        return jax.lax.platform_dependent(values, cuda=pallas, default=self._jnp_assemble)

    def _values(self, state) -> dict:
        """The format's column values of ONE unbatched state (or observation), plus the chat tail's."""
        from render.sources import check_input, view_function

        check_input(state, self.env_name, self.source, batched=False)
        if self.source == "state" and state.player_position.ndim != 1:
            raise ValueError("Template takes one unbatched state; use jax.vmap(tpl)(batched_state) for a batch")
        values = self.fmt.values(view_function(self.env_name, self.source)(state))
        values["chat_tail"] = jnp.zeros((1, 1), jnp.int32)
        return values

    def tokens_and_positions(self, state):
        """What the jnp assembly scatters, for ONE unbatched state: every candidate token (int32 [C]), its
        position in the output (max_len for a token not written) and the length. The written positions are
        exactly 0..length-1, each once (tested): a position written twice would leave the result to the
        scatter's order, which a GPU does not fix."""
        return self._jnp_tokens_and_positions(self._values(state))

    def _jnp_assemble(self, values):
        """Column values -> (ids, length) with XLA ops."""
        tokens, positions, length = self._jnp_tokens_and_positions(values)
        out = jnp.full((self.max_len,), self.pad_id, jnp.int32)
        return out.at[positions].set(tokens, mode="drop"), length

    def _jnp_tokens_and_positions(self, values):
        """Column values -> (tokens, positions, length), see `tokens_and_positions`."""
        per_col = []  # (section index, column index, ids, rel, len)
        lens = []
        for section, columns in self._sections:
            vals = values[section.name]
            present = values.get(present_key(section.name)) if section.optional_rows else None
            sec_lens = []
            for c, col in enumerate(columns):
                ids, rel, ln = col(vals[:, c])
                if present is not None:
                    ln = jnp.where(present, ln, 0)
                if section.name in self.dropped:
                    ln = jnp.zeros_like(ln)
                per_col.append((ids, rel, ln))
                sec_lens.append(ln)
            lens.append(jnp.stack(sec_lens, axis=1).reshape(-1))  # [rows * cols], row-major = text order
        flat_lens = jnp.concatenate(lens)
        offsets = jnp.cumsum(flat_lens) - flat_lens
        tokens, positions = [], []
        base = 0
        k = 0
        for section, columns in self._sections:
            ncols = len(columns)
            for c in range(ncols):
                ids, rel, ln = per_col[k]
                k += 1
                start = offsets[base + c + ncols * jnp.arange(section.rows)]
                pos = jnp.where(rel < ln[:, None], start[:, None] + rel, self.max_len)
                tokens.append(ids.reshape(-1))
                positions.append(pos.reshape(-1))
            base += section.rows * ncols
        return (jnp.concatenate(tokens).astype(jnp.int32), jnp.concatenate(positions),
                flat_lens.sum().astype(jnp.int32))

    def observation_text(self, state):
        """The observation text of a state or observation (a list of strings for a batch)."""
        from render.sources import check_input, input_is_batched

        check_input(state, self.env_name, self.source)
        batched = input_is_batched(state, self.source)
        texts = texts_from_values(self.fmt.layout, format_values_numpy(self.fmt, state, batched, self.source))
        return texts if batched else texts[0]

    def text(self, state):
        """The full prompt string (head + observation + tail); a list of strings for a batched input."""
        obs = self.observation_text(state)
        if isinstance(obs, list):
            return [self.head + o + self.tail for o in obs]
        return self.head + obs + self.tail


def compile_template(tokenizer, fmt: Format, system: str, env_name: str, pad_id: int = PAD_ID,
                     assembly: str = "auto", source: str = "state") -> Template:
    """Compile `fmt` with `tokenizer` under the chat framing of `system`; checks every boundary."""
    from render.chat import chat_frame
    from render.sources import SOURCES

    if assembly not in ASSEMBLIES:
        raise ValueError(f"assembly must be one of {', '.join(map(repr, ASSEMBLIES))}, got {assembly!r}")
    if source not in SOURCES:
        raise ValueError(f"source must be one of {', '.join(map(repr, SOURCES))}, got {source!r}")
    head, tail = chat_frame(tokenizer, system)
    layout = Layout(fmt.layout.sections + (Section("chat_tail", (Const(tail),)),))
    check_boundaries(tokenizer, layout, head)
    sections = []
    max_len = 0
    for section in layout.sections:
        cols = tuple(_compile_column(tokenizer, col, pad_id) for col in section.columns)
        sections.append((section, cols))
        max_len += section.rows_shown * sum(c.width for c in cols)
    prefix_ids = _encode(tokenizer, [head])[0]
    return Template(env_name, fmt, head, tail, list(prefix_ids), int(max_len), pad_id, tuple(sections), assembly,
                    source)
