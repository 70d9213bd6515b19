"""The template's assembly step (column values -> right-padded token ids) as ONE Pallas kernel.

The jnp assembly in `render.template` is correct everywhere but costs ~10 XLA kernels on a GPU (table
gathers, concatenations of every column's tokens and positions, one scatter), ~30-40 us of kernel time
plus launch gaps for 1,024 states (docs/BENCHMARKS.md). Here one kernel program per state does the same
work in registers, section by section: first every column's token count per row (a table lookup, or the
digit count), hence the row and column offsets; then, column by column, the token ids (looked up in one flat
table, or digits by integer arithmetic) and their masked store into the output row. The padding goes last,
behind the text's end.

Same inputs, same outputs, bit for bit: `tests/test_render_pallas.py` compares it with the jnp assembly in
Pallas's interpret mode (CPU). Compiled for GPU it lowers through Triton.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from render.layout import Choice, Number, present_key


def _pow2(n: int) -> int:
    """The smallest power of two >= n (Triton's block sizes are powers of two)."""
    return 1 << max(0, int(n) - 1).bit_length()


@dataclass(frozen=True)
class _ChoiceMeta:
    ids_at: int  # offset of the [n, width] id table in the flat table
    lens_at: int  # offset of the [n] length table
    width: int
    count: int  # n, the number of strings


@dataclass(frozen=True)
class _NumberMeta:
    number: Number
    label_ids: tuple[int, ...]
    width: int


@dataclass(frozen=True)
class _SectionMeta:
    name: str
    rows: int
    optional_rows: bool
    columns: tuple  # of _ChoiceMeta | _NumberMeta


def _flatten(sections) -> tuple[np.ndarray, tuple[_SectionMeta, ...], int, int]:
    """One flat int32 table (every choice's ids and lengths, then the 10 digits and the dot) and the static
    description of every section; returns (table, sections, digits_at, dot_id)."""
    parts: list[np.ndarray] = []
    size = 0

    def add(a: np.ndarray) -> int:
        nonlocal size
        at = size
        parts.append(np.asarray(a, np.int32).reshape(-1))
        size += parts[-1].size
        return at

    metas = []
    digit_ids = dot_id = None
    for section, compiled in sections:
        cols = []
        for column, comp in zip(section.columns, compiled):
            if isinstance(column, Choice):
                cols.append(_ChoiceMeta(add(comp.ids), add(comp.lens), comp.width, len(comp.lens)))
            else:
                digit_ids, dot_id = comp.digit_ids, comp.dot_id
                cols.append(_NumberMeta(comp.number, tuple(int(i) for i in comp.label_ids), comp.width))
        metas.append(_SectionMeta(section.name, section.rows, section.optional_rows, tuple(cols)))
    digits_at = add(np.zeros(10) if digit_ids is None else digit_ids)
    return np.concatenate(parts), tuple(metas), digits_at, int(dot_id or 0)


def _select(index, values, dtype=jnp.int32):
    """values[index] for a short static tuple of ints, as a chain of selects (no gather)."""
    out = jnp.zeros(index.shape, dtype)
    for k, v in enumerate(values):
        out = jnp.where(index == k, v, out)
    return out


def _digits(x, count: int):
    """The `count` lowest decimal digits of non-negative x [R] (index e = digit of 10**e): divisions by
    constants only, which compile to multiply-and-shift (a division by a varying power of 10 would not)."""
    return [lax.rem(lax.div(x, jnp.int32(10**e)), jnp.int32(10)) for e in range(count)]


def _number_parts(n: Number, v):
    """(whole part, fractional part, number of integer digits, empty?) of number column values v [R]."""
    empty = v < 0 if n.optional else None
    v = jnp.maximum(v, 0)
    scale = jnp.int32(10**n.decimals)
    whole, frac = lax.div(v, scale), lax.rem(v, scale)
    ndig = jnp.ones_like(whole)
    for k in range(1, n.int_digits):
        ndig = ndig + (whole >= 10**k).astype(jnp.int32)
    return whole, frac, ndig, empty


def _number_length(meta: _NumberMeta, v):
    """Token count [R] of number column values v [R] (label, digits, dot, decimals; 0 when empty)."""
    n = meta.number
    _, _, ndig, empty = _number_parts(n, v)
    length = len(meta.label_ids) + ndig + ((1 + n.decimals) if n.decimals else 0)
    return length if empty is None else jnp.where(empty, 0, length)


def _number_ids(meta: _NumberMeta, v, t, table_ref, digits_at: int, dot_id: int):
    """Token ids [R, W] at text positions t [1, W] of number column values v [R]."""
    n = meta.number
    nl = len(meta.label_ids)
    whole, frac, ndig, _ = _number_parts(n, v)
    k = t - nl  # position among the digits
    ndig2 = ndig[:, None]
    int_exp = ndig2 - 1 - k  # the power of 10 shown at k (while k < ndig)
    digit = jnp.zeros(int_exp.shape, jnp.int32)
    for e, d in enumerate(_digits(whole, n.int_digits)):
        digit = jnp.where(int_exp == e, d[:, None], digit)
    if n.decimals:
        frac_exp = n.decimals + ndig2 - k  # k = ndig is the dot, then 10**(decimals-1) ... 10**0
        for e, d in enumerate(_digits(frac, n.decimals)):
            digit = jnp.where((k > ndig2) & (frac_exp == e), d[:, None], digit)
    ids = table_ref[digits_at + digit]
    if n.decimals:
        ids = jnp.where(k == ndig2, dot_id, ids)
    if nl:
        ids = jnp.where(t < nl, _select(t, meta.label_ids), ids)
    return ids


def _column_values(vals_ref, rows, c: int, col):
    """Values [R] of column c; a choice index is clamped into its table (the formats never leave it, but an
    unchecked load outside the table would read another column's entries, or fault, on a GPU)."""
    v = vals_ref[rows, c]
    return jnp.clip(v, 0, col.count - 1) if isinstance(col, _ChoiceMeta) else v


def make_pallas_assembler(sections, max_len: int, pad_id: int, *, interpret: bool = False):
    """Pure function values -> (ids int32 [max_len], length int32) for ONE state, as one Pallas kernel.

    `sections`: the template's compiled sections (`Template._sections`); `values`: the format's column
    values plus "chat_tail" (as `Template.__call__` builds them). Vmap it for a batch (one program per state).
    `interpret=True` runs the kernel in Pallas's interpreter (any backend; used by the CPU tests).
    """
    table_np, metas, digits_at, dot_id = _flatten(sections)
    inputs = []  # the keys of `values` the kernel reads, in argument order
    for m in metas:
        inputs.append(m.name)
        if m.optional_rows:
            inputs.append(present_key(m.name))
    out_pad = _pow2(max_len)

    def kernel(table_ref, *refs):
        value_refs = dict(zip(inputs, refs[: len(inputs)]))
        ids_ref, len_ref = refs[len(inputs):]
        base = jnp.int32(0)
        for m in metas:
            rp = _pow2(m.rows)
            r = jnp.arange(rp, dtype=jnp.int32)
            row_ok = r < m.rows
            rr = jnp.minimum(r, m.rows - 1)
            if m.optional_rows:
                row_ok = row_ok & (value_refs[present_key(m.name)][rr] != 0)
            vals_ref = value_refs[m.name]
            # pass 1: every column's token count per row (short [R] vectors), hence the offsets
            lens = []
            for c, col in enumerate(m.columns):
                v = _column_values(vals_ref, rr, c, col)
                ln = table_ref[col.lens_at + v] if isinstance(col, _ChoiceMeta) else _number_length(col, v)
                lens.append(jnp.where(row_ok, ln, 0))
            row_len = lens[0]
            for ln in lens[1:]:
                row_len = row_len + ln
            col_start = base + jnp.cumsum(row_len) - row_len
            # pass 2: one column at a time, its ids [R, W] and their masked store
            for c, (col, ln) in enumerate(zip(m.columns, lens)):
                t = jnp.arange(_pow2(col.width), dtype=jnp.int32)[None, :]
                v = _column_values(vals_ref, rr, c, col)
                if isinstance(col, _ChoiceMeta):
                    ids = table_ref[col.ids_at + v[:, None] * col.width + jnp.minimum(t, col.width - 1)]
                else:
                    ids = _number_ids(col, v, t, table_ref, digits_at, dot_id)
                write = t < ln[:, None]
                # masked-off lanes point past the end: Triton skips them, the interpreter drops them
                plgpu.store(ids_ref.at[jnp.where(write, col_start[:, None] + t, max_len)], ids, mask=write)
                col_start = col_start + ln
            base = base + jnp.sum(row_len)
        p = jnp.arange(out_pad, dtype=jnp.int32)
        pad = (p >= base) & (p < max_len)
        plgpu.store(ids_ref.at[jnp.where(pad, p, max_len)], jnp.full((out_pad,), pad_id, jnp.int32), mask=pad)
        len_ref[...] = jnp.full((1,), base, jnp.int32)

    call = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((max_len,), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32)),
        interpret=interpret,
        # small tensors (the largest is [128, 8]): one warp per state wastes no lanes on replication
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        name="render_template_assembly",
    )

    def assemble(values):
        args = [jnp.asarray(values[k]).astype(jnp.int32) for k in inputs]
        ids, length = call(jnp.asarray(table_np), *args)
        return ids, length[0]

    return assemble
