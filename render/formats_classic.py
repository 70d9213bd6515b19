"""Text formats of Craftax-Classic-Symbolic-v1: `full` (craftax's text style) and `compact`.

Craftax-Classic has no upstream text renderer; `full` follows `render_craftax_text`'s style with
Classic's content (no items, light map, floors, potions or armour; tools are separate counts).
Each format's values function reads a `View` (what a state or an observation shows), never the env state.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from craftax.craftax_classic.constants import OBS_DIM, Action, BlockType

from render.layout import Choice, Const, Format, Layout, Number, Section
from render.rows import RowBuilder, compact_format
from render.view import (
    count,
    first_k,
    fixed_point,
    gather_window,
    mob_codes,
    nearest_first,
    optional_count,
    window_offsets,
)

ENV_NAME = "Craftax-Classic-Symbolic-v1"
ROWS, COLS = OBS_DIM  # 7 rows (-3..3), 9 columns (-4..4)
OFFSETS = window_offsets(ROWS, COLS)
NEAREST = nearest_first(OFFSETS)
MOB_NAMES_LIST = ["Zombie", "Cow", "Skeleton", "Arrow"]  # codes 0..3: zombies, cows, skeletons, arrows
NO_MOB = len(MOB_NAMES_LIST)
MATERIALS = ["Wood", "Stone", "Coal", "Iron", "Diamond", "Sapling"]
TOOLS = ["Wood Pickaxe", "Stone Pickaxe", "Iron Pickaxe", "Wood Sword", "Stone Sword", "Iron Sword"]
STATS = ["Food", "Drink", "Energy"]  # after Health
DIRECTIONS = [Action(i).name.lower() for i in range(5)]
COUNT_DIGITS = 3
LIGHT = Number(1, 2)


def _material(s, name: str):
    return getattr(s.inventory, name.lower())


def _tool(s, name: str):
    return getattr(s.inventory, name.lower().replace(" ", "_"))


def _stat(s, name: str):
    return getattr(s, "player_" + name.lower())


def local_tiles(state) -> dict[str, jnp.ndarray]:
    """The window around the player: block and mob code per tile ([63], row-major)."""
    pos = state.player_position
    block = gather_window(state.map, pos, OFFSETS, BlockType.OUT_OF_BOUNDS.value)
    groups = [
        (m.position, m.mask, jnp.full(m.mask.shape, k, jnp.int32))
        for k, m in enumerate([state.zombies, state.cows, state.skeletons, state.arrows])
    ]
    return {"block": block.astype(jnp.int32), "mob": mob_codes(groups, pos, ROWS, COLS, NO_MOB)}


class View(NamedTuple):
    """Everything the Classic formats show, for ONE unbatched state: the intermediate view that both an env state
    (`view_from_state`) and a symbolic observation (`render.observation.classic_view`) are read into. Scalar
    fields keep craftax's `EnvState` names and units; tiles are the window, row-major (`OFFSETS`)."""

    block: jnp.ndarray  # int32 [63] block type
    mob: jnp.ndarray  # int32 [63] smallest mob code on the tile (0 zombie, 1 cow, 2 skeleton, 3 arrow), NO_MOB if none
    inventory: Any  # craftax_classic Inventory: 6 material counts, 6 tool counts
    player_health: jnp.ndarray
    player_food: jnp.ndarray
    player_drink: jnp.ndarray
    player_energy: jnp.ndarray
    player_direction: jnp.ndarray  # 1 left, 2 right, 3 up, 4 down
    light_level: jnp.ndarray  # float32
    is_sleeping: jnp.ndarray


def view_from_state(state) -> View:
    """The `View` of one unbatched raw Craftax-Classic `EnvState`."""
    t = local_tiles(state)
    return View(block=t["block"], mob=t["mob"], inventory=state.inventory, player_health=state.player_health,
                player_food=state.player_food, player_drink=state.player_drink, player_energy=state.player_energy,
                player_direction=state.player_direction, light_level=state.light_level,
                is_sleeping=state.is_sleeping)


def _bool(x):
    return jnp.asarray(x).astype(jnp.int32)


def _full_format() -> Format:
    coords = tuple(f"{c}, {r}:" for r, c in OFFSETS)  # "col, row" like craftax's text
    mob = Choice(tuple(f" {n} on" for n in MOB_NAMES_LIST) + ("",))
    block = Choice(tuple(f" {b.name.lower()}" for b in BlockType))
    n_tiles = ROWS * COLS
    map_section = Section("map", (Choice(coords), mob, block, Choice(("\n", "\n\n"))), rows=n_tiles)

    inv = RowBuilder("inventory").text("Inventory:\n")
    for i, name in enumerate(MATERIALS):
        inv.text(("" if i == 0 else "\n") + f"{name}: ").value(
            Number(COUNT_DIGITS), lambda s, n=name: count(_material(s, n), COUNT_DIGITS)
        )
    inv.text("\n")
    for name in TOOLS:
        inv.value(Choice(("", f"{name}\n")), lambda s, n=name: _bool(_tool(s, n) > 0))
    inv.text("Health: ").value(Number(COUNT_DIGITS), lambda s: count(s.player_health, COUNT_DIGITS))
    for name in STATS:
        inv.text(f"\n{name}: ").value(Number(COUNT_DIGITS), lambda s, n=name: count(_stat(s, n), COUNT_DIGITS))
    inv.text("\nDirection:").value(Choice(tuple(" " + d for d in DIRECTIONS)), lambda s: jnp.clip(s.player_direction, 0, 4))
    inv.text("\nLight: ").value(LIGHT, lambda s: fixed_point(s.light_level, 2, 1))
    inv.text("\nIs Sleeping:").value(Choice((" False\n", " True\n")), lambda s: _bool(s.is_sleeping))

    layout = Layout((Section("header", (Const("Map:\n"),)), map_section, inv.section()))

    def values(view: View):
        term = (jnp.arange(n_tiles) == n_tiles - 1).astype(jnp.int32)
        tiles = jnp.stack([jnp.arange(n_tiles, dtype=jnp.int32), view.mob, view.block, term], axis=-1)
        return {"header": jnp.zeros((1, 1), jnp.int32), "map": tiles, "inventory": inv.values(view)}

    return Format(ENV_NAME, "full", layout, values)


COMPACT_BACKGROUND = (BlockType.GRASS, BlockType.SAND, BlockType.PATH)
COMPACT_MAX_TILES = 40  # K: the most tiles listed (nearest first); >= 99% of test states fit (docs/RENDER.md)
COMPACT_BLOCK_NAMES = {BlockType.OUT_OF_BOUNDS: "edge"}


def _compact_format() -> Format:
    k = COMPACT_MAX_TILES
    coords = tuple(f"{r}, {c}:" for r, c in OFFSETS)  # "row, col"
    mobs = [n.lower() for n in MOB_NAMES_LIST]
    blocks = [COMPACT_BLOCK_NAMES.get(b, b.name.lower().replace("_", " ")) for b in BlockType]
    things = tuple(" " + n for n in mobs + blocks)  # index: mob code, then NO_MOB + block
    map_section = Section("map", (Choice(coords), Choice(things), Const("\n")), rows=len(NEAREST),
                          optional_rows=True, max_rows_shown=k)

    inv = RowBuilder("items", never_empty=True)
    for name in MATERIALS:
        inv.value(
            Number(COUNT_DIGITS, optional=True, label=f" {name.lower()}="),
            lambda s, n=name: optional_count(_material(s, n), COUNT_DIGITS),
        )
    for name in TOOLS:
        inv.value(Choice(("", f" {name.lower()}")), lambda s, n=name: _bool(_tool(s, n) > 0))
    inv.value(Choice(("", " nothing")), lambda s: _bool(_inventory_empty(s)))

    st = RowBuilder("status").text("\nStatus: health=").value(Number(COUNT_DIGITS), lambda s: count(s.player_health, COUNT_DIGITS))
    for name in STATS:
        st.text(f" {name.lower()}=").value(Number(COUNT_DIGITS), lambda s, n=name: count(_stat(s, n), COUNT_DIGITS))
    st.text(" light=").value(LIGHT, lambda s: fixed_point(s.light_level, 2, 1))
    st.text(" facing").value(Choice(tuple("=" + d for d in DIRECTIONS)), lambda s: jnp.clip(s.player_direction, 0, 4))
    st.value(Choice(("", " sleeping")), lambda s: _bool(s.is_sleeping))
    st.text("\n")

    background = np.zeros(len(BlockType), dtype=bool)
    background[[b.value for b in COMPACT_BACKGROUND]] = True

    def map_rows(view: View):
        has_mob = view.mob < NO_MOB
        thing = jnp.where(has_mob, view.mob, NO_MOB + view.block)
        informative = has_mob | ~jnp.asarray(background)[view.block]
        tiles = jnp.asarray(NEAREST)  # one row per window tile, nearest first; the first k informative ones show
        return jnp.stack([tiles, thing[tiles], jnp.zeros_like(tiles)], axis=-1), first_k(informative[tiles], k)

    return compact_format(ENV_NAME, map_section, inv, st, map_rows)


def _inventory_empty(s):
    counts = jnp.stack([jnp.asarray(_material(s, n), jnp.int32) for n in MATERIALS])
    tools = jnp.stack([jnp.asarray(_tool(s, n), jnp.int32) for n in TOOLS])
    return ~jnp.any(counts > 0) & ~jnp.any(tools > 0)


def formats() -> dict[str, Format]:
    return {"full": _full_format(), "compact": _compact_format()}
