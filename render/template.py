"""The token template: a layout compiled against a tokenizer into a pure-jnp function state -> ids.

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

from render.layout import Choice, Const, Format, Layout, Number, Section, present_key
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


# ------------------------------------------------------------------------------------------ plan

@dataclass(frozen=True, eq=False)
class _Plan:
    """Every (section, row, column) slot of a layout in text order, split into two vectorised groups.

    Choice slots look their tokens up in one table of all choice strings; number slots compute digit
    tokens with integer arithmetic. Run time is then a handful of whole-array operations whatever the
    number of columns (a per-column loop would launch hundreds of tiny GPU kernels).
    """

    num_slots: int
    present_of_slot: np.ndarray  # int32 [S]: index into the flat present vector (0 = always present)
    # choice group
    choice_slot: np.ndarray  # int32 [C]: slot index of each choice slot
    choice_base: np.ndarray  # int32 [C]: first row of the slot's strings in `table_ids`
    choice_count: np.ndarray  # int32 [C]: number of strings of the slot's column
    table_ids: np.ndarray  # int32 [N, W]: all choice strings, padded
    table_lens: np.ndarray  # int32 [N]
    # number group
    number_slot: np.ndarray  # int32 [M]
    number_optional: np.ndarray  # bool [M]: value -1 shows nothing
    number_decimals: np.ndarray  # int32 [M]
    label_ids: np.ndarray  # int32 [M, L]: the label tokens, padded
    label_lens: np.ndarray  # int32 [M]
    int_digits: int  # the most integer digits of any number column
    max_decimals: int
    digit_ids: np.ndarray  # int32 [10]
    dot_id: int
    order: np.ndarray  # int32 [S]: position of slot s in concat(choice group, number group)


def _plan(tokenizer, layout: Layout, pad_id: int) -> tuple[_Plan, int]:
    """Pre-tokenize every column of `layout`; returns the plan and max_len (the longest possible text)."""
    digits = _encode(tokenizer, [str(d) for d in range(10)] + ["."])
    if any(len(d) != 1 for d in digits):
        raise UnsafeBoundaryError("this tokenizer does not give every digit and '.' a single token")
    texts: list[str] = []  # the table: each Choice column's strings once, contiguous
    column_base: dict[tuple[int, int], int] = {}  # (section, column) -> its first table row
    choice, number, present_of_slot = [], [], []
    present_base = 1  # flat present vector: [always-present, section rows...]
    for si, section in enumerate(layout.sections):
        for row in range(section.rows):
            for ci, col in enumerate(section.columns):
                slot = len(present_of_slot)
                present_of_slot.append(present_base + row if section.optional_rows else 0)
                if isinstance(col, Choice):
                    if (si, ci) not in column_base:
                        column_base[(si, ci)] = len(texts)
                        texts.extend(col.strings)
                    choice.append((slot, column_base[(si, ci)], len(col.strings)))
                else:
                    number.append((slot, col))
        if section.optional_rows:
            present_base += section.rows
    encoded = _encode(tokenizer, texts)
    width = max([1] + [len(e) for e in encoded])
    table_ids = np.full((len(encoded), width), pad_id, np.int32)
    for r, e in enumerate(encoded):
        table_ids[r, : len(e)] = e
    table_lens = np.array([len(e) for e in encoded], np.int32)

    labels = _encode(tokenizer, [col.label for _, col in number]) if number else []
    label_w = max([1] + [len(e) for e in labels])
    label_ids = np.full((len(number), label_w), pad_id, np.int32)
    for m, e in enumerate(labels):
        label_ids[m, : len(e)] = e
    int_digits = max([1] + [col.int_digits for _, col in number])
    max_decimals = max([0] + [col.decimals for _, col in number])

    # max_len: every slot at its widest
    widths = [int(table_lens[base:base + n].max()) for _, base, n in choice]
    widths += [len(lab) + col.int_digits + (1 + col.decimals if col.decimals else 0) for lab, (_, col) in
               zip(labels, number)]
    max_len = int(sum(widths))
    slots = [c[0] for c in choice] + [n[0] for n in number]
    order = np.empty(len(slots), np.int32)
    order[np.array(slots, np.int64)] = np.arange(len(slots), dtype=np.int32)
    plan = _Plan(
        num_slots=len(slots), present_of_slot=np.array(present_of_slot, np.int32),
        choice_slot=np.array([c[0] for c in choice], np.int32), choice_base=np.array([c[1] for c in choice], np.int32),
        choice_count=np.array([c[2] for c in choice], np.int32), table_ids=table_ids, table_lens=table_lens,
        number_slot=np.array([n[0] for n in number], np.int32),
        number_optional=np.array([col.optional for _, col in number], bool),
        number_decimals=np.array([col.decimals for _, col in number], np.int32),
        label_ids=label_ids, label_lens=np.array([len(e) for e in labels], np.int32),
        int_digits=int_digits, max_decimals=max_decimals,
        digit_ids=np.array([d[0] for d in digits[:10]], np.int32), dot_id=digits[10][0], order=order,
    )
    return plan, max_len


def _choice_tokens(plan: _Plan, values: jnp.ndarray):
    """tokens [C, W], their offsets inside each slot [C, W], and slot lengths [C] of the choice slots."""
    v = jnp.clip(values[plan.choice_slot], 0, plan.choice_count - 1)
    row = jnp.asarray(plan.choice_base) + v
    ids = jnp.asarray(plan.table_ids)[row]
    rel = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
    return ids, rel, jnp.asarray(plan.table_lens)[row]


def _number_tokens(plan: _Plan, values: jnp.ndarray):
    """tokens, offsets inside each slot and slot lengths of the number slots: label, digits, '.', decimals."""
    v = values[plan.number_slot]
    empty = jnp.asarray(plan.number_optional) & (v < 0)
    v = jnp.maximum(v, 0)
    dec = jnp.asarray(plan.number_decimals)
    scale = jnp.asarray(10 ** plan.number_decimals.astype(np.int64), jnp.int32)
    whole, frac = v // scale, v % scale
    nd = plan.int_digits
    ndig = 1 + sum((whole >= 10**k).astype(jnp.int32) for k in range(1, nd))  # no leading zeros
    i = jnp.arange(nd, dtype=jnp.int32)
    exponent = jnp.clip(ndig[:, None] - 1 - i[None, :], 0, nd - 1)
    digits = (whole[:, None] // jnp.asarray([10**e for e in range(nd)], jnp.int32)[exponent]) % 10
    lab = jnp.asarray(plan.label_lens)
    parts_ids = [jnp.asarray(plan.label_ids), jnp.asarray(plan.digit_ids)[digits]]
    lw = plan.label_ids.shape[1]
    parts_rel = [
        jnp.broadcast_to(jnp.where(jnp.arange(lw) < lab[:, None], jnp.arange(lw), -1), (v.shape[0], lw)),
        jnp.where(i[None, :] < ndig[:, None], lab[:, None] + i[None, :], -1),
    ]
    length = lab + ndig
    if plan.max_decimals:
        k = jnp.arange(plan.max_decimals, dtype=jnp.int32)
        pow_f = 10 ** jnp.maximum(dec[:, None] - 1 - k[None, :], 0)
        fdig = (frac[:, None] // pow_f) % 10
        has = dec > 0
        parts_ids += [jnp.full((v.shape[0], 1), plan.dot_id, jnp.int32), jnp.asarray(plan.digit_ids)[fdig]]
        parts_rel += [jnp.where(has, lab + ndig, -1)[:, None],
                      jnp.where(k[None, :] < dec[:, None], (lab + ndig + 1)[:, None] + k[None, :], -1)]
        length = length + jnp.where(has, 1 + dec, 0)
    return (jnp.concatenate(parts_ids, axis=1), jnp.concatenate(parts_rel, axis=1),
            jnp.where(empty, 0, length))


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
    _plan: _Plan = field(repr=False)

    def __call__(self, state):
        """ids int32 [max_len] (right-padded with pad_id) and length int32 for ONE unbatched state."""
        from render.envs import check_state

        check_state(state, self.env_name)
        if state.player_position.ndim != 1:
            raise ValueError("Template takes one unbatched state; use jax.vmap(tpl)(batched_state) for a batch")
        values = self.fmt.values(state)
        plan = self._plan
        flat_values, flat_present = [], [jnp.ones((1,), bool)]
        for section in self.fmt.layout.sections:  # text order: sections, rows, columns
            flat_values.append(jnp.asarray(values[section.name], jnp.int32).reshape(-1))
            if section.optional_rows:
                flat_present.append(jnp.asarray(values[present_key(section.name)], bool).reshape(-1))
        flat_values.append(jnp.zeros((1,), jnp.int32))  # the chat tail
        flat_values = jnp.concatenate(flat_values)
        present = jnp.concatenate(flat_present)[plan.present_of_slot]
        c_ids, c_rel, c_len = _choice_tokens(plan, flat_values)
        n_ids, n_rel, n_len = _number_tokens(plan, flat_values)
        lens = jnp.where(present, jnp.concatenate([c_len, n_len])[plan.order], 0)  # [S], text order
        offsets = jnp.cumsum(lens) - lens
        c_pos = jnp.where((c_rel < c_len[:, None]) & present[plan.choice_slot][:, None],
                          offsets[plan.choice_slot][:, None] + c_rel, self.max_len)
        n_pos = jnp.where((n_rel >= 0) & (n_len[:, None] > 0) & present[plan.number_slot][:, None],
                          offsets[plan.number_slot][:, None] + n_rel, self.max_len)
        out = jnp.full((self.max_len,), self.pad_id, jnp.int32)
        out = out.at[jnp.concatenate([c_pos.reshape(-1), n_pos.reshape(-1)])].set(
            jnp.concatenate([c_ids.reshape(-1), n_ids.reshape(-1)]), mode="drop")
        return out, lens.sum().astype(jnp.int32)

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
    plan, max_len = _plan(tokenizer, layout, pad_id)
    prefix_ids = _encode(tokenizer, [head])[0]
    return Template(env_name, fmt, head, tail, list(prefix_ids), max_len, pad_id, plan)
