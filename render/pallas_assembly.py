"""The template's assembly step (column values -> right-padded token ids) as ONE Pallas kernel.

The jnp assembly in `render.template` runs everywhere but costs ~10 XLA kernels on a GPU (table gathers,
concatenations of every column's tokens and positions, one scatter). Here one kernel program per state does the
same work: on an H200 the whole Craftax template for 1,024 states takes 55.6 instead of 75.0 us of kernel time
(compact, 13 instead of 24 kernels) and 54.9 instead of 94.4 us (full, 8 instead of 24; docs/BENCHMARKS.md, run F).

Every (section, row, column) slot of the layout is one lane of a vector, in text order. What a lane needs to
know about its column (choice or number, where its strings' ids and lengths sit in the one flat table, width,
digits, label) is static, so it is stored in that table too and loaded as a few vectors. The program then
- loads every lane's value (one masked load per section) and its row's presence flag;
- computes every lane's token count (a table lookup for a choice, the digit count for a number);
- takes one cumulative sum over the lanes for the offsets;
- computes every lane's ids [lanes, width] (table gathers, digits by integer arithmetic);
- writes them with ONE masked store, then the padding behind the text's end.

About 30 memory operations per program whatever the layout, so Triton compiles it quickly (per-column code
had hundreds, and the compile time grew faster than linearly with them).

Same inputs, same outputs, bit for bit: `tests/test_render_template.py::test_pallas_assembly_equals_jnp_assembly`
compares it with the jnp assembly in Pallas's interpret mode (CPU). On a GPU it lowers through Triton.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from render.layout import Choice, UnsupportedLayout, present_key

# per-lane fields stored in the flat table, one vector of `lanes` entries each
FIELDS = ("is_number", "ids_at", "lens_at", "width", "count", "skip", "label_at", "label_len", "int_digits",
          "decimals", "optional", "row", "col")
LANE_WIDTHS = (4, 8)  # tokens per lane, the one giving the smallest [lanes, width] tensors is used; a wider choice
# takes several lanes (`skip`: tokens before this lane's share), a number (label included) must fit one lane


def _pow2(n: int) -> int:
    """The smallest power of two >= n (Triton's tensor sizes are powers of two)."""
    return 1 << max(0, int(n) - 1).bit_length()


@dataclass(frozen=True)
class _Section:
    name: str  # key of its values
    rows: int
    cols: int
    first_lane: int
    num_lanes: int
    optional_rows: bool


@dataclass(frozen=True)
class _Plan:
    table: np.ndarray  # int32: ids and lengths of every choice, labels, digits, then the per-lane fields
    sections: tuple[_Section, ...]
    lanes: int  # used lanes (slots of the layout)
    lanes_pow2: int
    lane_width: int  # tokens per lane (a power of two, one of LANE_WIDTHS)
    fields_at: int
    digits_at: int
    dot_id: int
    max_int_digits: int
    max_decimals: int


def _plan(sections, lane_width: int) -> _Plan:
    """The flat table and the static lane layout of a template's compiled sections, `lane_width` tokens a lane."""
    parts: list[np.ndarray] = []
    size = 0

    def add(a) -> int:
        nonlocal size
        at = size
        parts.append(np.asarray(a, np.int32).reshape(-1))
        size += parts[-1].size
        return at

    lanes: list[dict] = []
    plan_sections = []
    digit_ids, dot_id = np.zeros(10, np.int32), 0
    for section, compiled in sections:
        first_lane = len(lanes)
        per_row = []  # the lanes of one row
        for c, (column, comp) in enumerate(zip(section.columns, compiled)):
            lane = dict.fromkeys(FIELDS, 0)
            lane.update(width=1, count=1, col=c)
            if isinstance(column, Choice):
                lane.update(ids_at=add(comp.ids), lens_at=add(comp.lens), width=comp.width, count=len(comp.lens))
                per_row += [dict(lane, skip=skip) for skip in range(0, comp.width, lane_width)]
            else:
                if comp.width > lane_width:
                    raise UnsupportedLayout(
                        f"a number column of {comp.width} tokens (label included) is wider than a lane ({lane_width}); "
                        f"use assembly='jnp' or a shorter label")
                digit_ids, dot_id = comp.digit_ids, comp.dot_id
                n = comp.number
                label = list(comp.label_ids)
                lane.update(is_number=1, label_at=add(label or [0]), label_len=len(label), int_digits=n.int_digits,
                            decimals=n.decimals, optional=int(n.optional))
                per_row.append(lane)
        for r in range(section.rows):
            lanes += [dict(lane, row=r) for lane in per_row]
        plan_sections.append(_Section(section.name, section.rows, len(section.columns), first_lane,
                                      len(lanes) - first_lane, section.optional_rows))
    digits_at = add(digit_ids)
    lanes_pow2 = _pow2(len(lanes))
    padding = dict.fromkeys(FIELDS, 0)
    padding.update(width=1, count=1)
    lanes_padded = lanes + [padding] * (lanes_pow2 - len(lanes))
    fields_at = add(np.array([[lane[f] for lane in lanes_padded] for f in FIELDS]))
    numbers = [lane for lane in lanes if lane["is_number"]]
    return _Plan(np.concatenate(parts), tuple(plan_sections), len(lanes), lanes_pow2, lane_width,
                 fields_at, digits_at, int(dot_id), max([1] + [ln["int_digits"] for ln in numbers]),
                 max([0] + [ln["decimals"] for ln in numbers]))


def _power_of_10(exponent, max_exponent: int):
    """10**exponent for an int vector with values in [0, max_exponent]."""
    out = jnp.ones_like(exponent)
    for e in range(1, max_exponent + 1):
        out = jnp.where(exponent == e, 10**e, out)
    return out


def _digits(x, count: int):
    """The `count` lowest decimal digits of non-negative x (index e = digit of 10**e); constant divisors,
    which compile to multiply-and-shift."""
    return [lax.rem(lax.div(x, jnp.int32(10**e)), jnp.int32(10)) for e in range(count)]


def _kernel(plan: _Plan, max_len: int, pad_id: int, table_ref, *refs):
    """One program = one state: lanes = the layout's slots in text order."""
    *value_refs, ids_ref, len_ref = refs
    lane = jnp.arange(plan.lanes_pow2, dtype=jnp.int32)
    f = {name: table_ref[plan.fields_at + i * plan.lanes_pow2 + lane] for i, name in enumerate(FIELDS)}

    # every lane's value, and whether its row is shown
    value = jnp.zeros_like(lane)
    shown = lane < plan.lanes
    refs_iter = iter(value_refs)
    for s in plan.sections:
        vals_ref = next(refs_iter)
        mine = (lane >= s.first_lane) & (lane < s.first_lane + s.num_lanes)
        row = jnp.clip(f["row"], 0, s.rows - 1)
        value = jnp.where(mine, plgpu.load(vals_ref.at[row, jnp.clip(f["col"], 0, s.cols - 1)], mask=mine, other=0),
                          value)
        if s.optional_rows:
            present = plgpu.load(next(refs_iter).at[row], mask=mine, other=1)
            shown = shown & ~(mine & (present == 0))

    # token counts
    is_number = f["is_number"] != 0
    choice = jnp.clip(value, 0, f["count"] - 1)
    choice_len = jnp.clip(table_ref[f["lens_at"] + choice] - f["skip"], 0, plan.lane_width)
    number = jnp.maximum(value, 0)
    scale = _power_of_10(f["decimals"], plan.max_decimals)
    whole, frac = lax.div(number, scale), lax.rem(number, scale)
    ndig = jnp.ones_like(whole)
    for k in range(1, plan.max_int_digits):
        ndig = ndig + ((whole >= 10**k) & (k < f["int_digits"])).astype(jnp.int32)
    number_len = f["label_len"] + ndig + jnp.where(f["decimals"] > 0, 1 + f["decimals"], 0)
    number_len = jnp.where((f["optional"] != 0) & (value < 0), 0, number_len)
    length = jnp.where(shown, jnp.where(is_number, number_len, choice_len), 0)
    start = jnp.cumsum(length) - length
    total = jnp.sum(length)

    # token ids [lanes, width]
    t = jnp.arange(plan.lane_width, dtype=jnp.int32)[None, :]
    col = lambda x: x[:, None]
    ids = table_ref[col(f["ids_at"] + choice * f["width"]) + jnp.minimum(t + col(f["skip"]), col(f["width"]) - 1)]
    k = t - col(f["label_len"])  # position among the digits
    n2 = col(ndig)
    digit = jnp.zeros(k.shape, jnp.int32)
    for e, d in enumerate(_digits(whole, plan.max_int_digits)):
        digit = jnp.where(n2 - 1 - k == e, col(d), digit)
    for e, d in enumerate(_digits(frac, plan.max_decimals)):
        digit = jnp.where((k > n2) & (col(f["decimals"]) + n2 - k == e), col(d), digit)
    number_ids = table_ref[plan.digits_at + digit]
    number_ids = jnp.where((col(f["decimals"]) > 0) & (k == n2), plan.dot_id, number_ids)
    label = table_ref[col(f["label_at"]) + jnp.minimum(t, jnp.maximum(col(f["label_len"]) - 1, 0))]
    number_ids = jnp.where(k < 0, label, number_ids)
    ids = jnp.where(col(is_number), number_ids, ids)

    write = (t < col(length)) & (col(start) + t < max_len)  # the second test only guards a format's broken promise
    # masked-off lanes point past the end: Triton skips them, the interpreter drops them
    plgpu.store(ids_ref.at[jnp.where(write, col(start) + t, max_len)], ids, mask=write)
    p = jnp.arange(_pow2(max_len), dtype=jnp.int32)
    pad = (p >= total) & (p < max_len)
    plgpu.store(ids_ref.at[jnp.where(pad, p, max_len)], jnp.full(p.shape, pad_id, jnp.int32), mask=pad)
    len_ref[...] = jnp.full((1,), total, jnp.int32)


def _varying_axes(arrays):
    """The manual-axis type of a value computed from all `arrays`: under `jax.shard_map`, the mesh axes the
    kernel's outputs vary over (pallas_call needs it spelled out); empty outside shard_map. Read from the type of
    a traced sum that nothing uses (so it is dropped)."""
    probe = jnp.zeros((), jnp.int32)
    for a in arrays:
        probe = probe + a.reshape(-1)[0]
    return jax.typeof(probe).mat


def _smallest_plan(sections) -> _Plan:
    """The plan of the lane width (`LANE_WIDTHS`) with the fewest [lanes, width] elements (the kernel's work);
    on a tie, the wider lanes. UnsupportedLayout if no width fits every number."""
    plans, errors = [], []
    for width in LANE_WIDTHS:
        try:
            plans.append(_plan(sections, width))
        except UnsupportedLayout as err:
            errors.append(err)
    if not plans:
        raise errors[-1]
    return min(plans, key=lambda p: (p.lanes_pow2 * p.lane_width, -p.lane_width))


def make_pallas_assembler(sections, max_len: int, pad_id: int, lane_width: int | None = None):
    """Pure function values -> (ids int32 [max_len], length int32) for ONE state, as one Pallas kernel.

    `sections`: the template's compiled sections (`Template._sections`); `values`: the format's column
    values plus "chat_tail" (as `Template.__call__` builds them). Vmap it for a batch (one program per state).
    Compiled by Triton on a GPU, run by Pallas's interpreter on other platforms. `lane_width` (tokens per lane,
    one of LANE_WIDTHS) defaults to the one giving the smallest tensors; UnsupportedLayout if a number can't fit.
    """
    plan = _smallest_plan(sections) if lane_width is None else _plan(sections, lane_width)
    keys = []
    for s in plan.sections:
        keys += [s.name] + ([present_key(s.name)] if s.optional_rows else [])
    elements = plan.lanes_pow2 * plan.lane_width
    warps = int(min(16, max(1, elements // 512)))  # ~16 elements of each [lanes, width] tensor per thread

    def call(interpret: bool, mat):
        return pl.pallas_call(
            lambda *refs: _kernel(plan, max_len, pad_id, *refs),
            out_shape=(jax.ShapeDtypeStruct((max_len,), jnp.int32, manual_axis_type=mat),
                       jax.ShapeDtypeStruct((1,), jnp.int32, manual_axis_type=mat)),
            interpret=interpret,
            compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
            name="render_template_assembly",
        )

    def assemble(values):
        args = [jnp.asarray(plan.table)] + [jnp.asarray(values[k]).astype(jnp.int32) for k in keys]
        mat = _varying_axes(args)
        ids, length = lax.platform_dependent(*args, cuda=call(False, mat), default=call(True, mat))
        return ids, length[0]

    return assemble
