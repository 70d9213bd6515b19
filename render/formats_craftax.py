"""Text formats of Craftax-Symbolic-v1 (full Craftax): `full` (upstream-compatible) and `compact`.

Each format's values function reads a `View` (what a state or an observation shows), never the env state.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from craftax.craftax.constants import (
    MONSTERS_KILLED_TO_CLEAR_LEVEL,
    OBS_DIM,
    Action,
    BlockType,
    ItemType,
)
from craftax.craftax.util.game_logic_utils import is_boss_vulnerable

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

ENV_NAME = "Craftax-Symbolic-v1"
ROWS, COLS = OBS_DIM  # 9 rows (-4..4), 11 columns (-5..5)
OFFSETS = window_offsets(ROWS, COLS)  # row-major: craftax's own text order
NEAREST = nearest_first(OFFSETS)
NO_MOB = 40  # mob code meaning "no mob" (codes are class * 8 + type_id, 5 classes)
UNLIT = len(BlockType)  # block index meaning "not lit" (shown as Darkness)
LIGHT_THRESHOLD = 0.05  # craftax: a tile is visible when its light map value is > 0.05

# Mob names by code, as craftax's `render_craftax_text` prints them (codes 11-15 do not occur).
MOB_NAMES = {
    0: "Zombie", 1: "Gnome Warrior", 2: "Orc Soldier", 3: "Lizard", 4: "Knight", 5: "Troll",
    6: "Pigman", 7: "Frost Troll", 8: "Cow", 9: "Bat", 10: "Snail", 16: "Skeleton",
    17: "Gnome Archer", 18: "Orc Mage", 19: "Kobold", 20: "Archer", 21: "Deep Thing",
    22: "Fire Elemental", 23: "Ice Elemental", 24: "Arrow", 25: "Dagger", 26: "Fireball",
    27: "Iceball", 28: "Arrow", 29: "Slimeball", 30: "Fireball", 31: "Iceball",
}
for _code in range(24, 32):
    MOB_NAMES[_code + 8] = MOB_NAMES[_code] + " (Player)"
MOB_NAMES_LIST = [MOB_NAMES.get(i, "Unknown") for i in range(NO_MOB)]

MATERIALS = ["Wood", "Stone", "Iron", "Diamond"]  # tool level 1..4
ENCHANTMENTS = ["No", "Fire", "Ice"]  # enchantment 0..2
ARMOUR_MATERIALS = ["Iron", "Diamond"]  # armour level 1..2
ARMOUR_PIECES = ["Helmet", "Chestplate", "Leggings", "Boots"]
POTIONS = ["Red", "Green", "Blue", "Pink", "Cyan", "Yellow"]
INVENTORY = [  # (label, getter): the counts in craftax's text order
    ("Wood", lambda s: s.inventory.wood),
    ("Stone", lambda s: s.inventory.stone),
    ("Coal", lambda s: s.inventory.coal),
    ("Iron", lambda s: s.inventory.iron),
    ("Diamond", lambda s: s.inventory.diamond),
    ("Sapphire", lambda s: s.inventory.sapphire),
    ("Ruby", lambda s: s.inventory.ruby),
    ("Sapling", lambda s: s.inventory.sapling),
    ("Torch", lambda s: s.inventory.torches),
    ("Arrow", lambda s: s.inventory.arrows),
    ("Book", lambda s: s.inventory.books),
]
STAT_FIELDS = ("player_food", "player_drink", "player_energy", "player_mana", "player_xp", "player_dexterity",
               "player_strength", "player_intelligence")  # integer stats after Health, in craftax's text order
STATS = [(("XP" if f == "player_xp" else f[len("player_"):].capitalize()), lambda s, f=f: getattr(s, f))
         for f in STAT_FIELDS]
DIRECTIONS = [Action(i).name.lower() for i in range(5)]  # player_direction 1..4: left right up down
COUNT_DIGITS = 3  # inventory counts and stats are clipped to 999
HEALTH = Number(2, 1)  # health printed with one decimal
LIGHT = Number(1, 2)  # light level printed with two decimals


def local_tiles(state) -> dict[str, jnp.ndarray]:
    """The window around the player: block, item, mob code and lit flag per tile ([99], row-major)."""
    level = state.player_level
    pos = state.player_position
    block = gather_window(state.map[level], pos, OFFSETS, BlockType.OUT_OF_BOUNDS.value)
    item = gather_window(state.item_map[level], pos, OFFSETS, ItemType.NONE.value)
    light = gather_window(state.light_map[level], pos, OFFSETS, 0.0)
    groups = []
    for k, mobs in enumerate(
        [state.melee_mobs, state.passive_mobs, state.ranged_mobs, state.mob_projectiles, state.player_projectiles]
    ):
        groups.append((mobs.position[level], mobs.mask[level], k * 8 + mobs.type_id[level]))
    mob = mob_codes(groups, pos, ROWS, COLS, NO_MOB)
    return {"block": block.astype(jnp.int32), "item": item.astype(jnp.int32), "mob": mob, "lit": light > LIGHT_THRESHOLD}


class View(NamedTuple):
    """Everything the Craftax formats show, for ONE unbatched state: the intermediate view that both an env state
    (`view_from_state`) and a symbolic observation (`render.observation.craftax_view`) are read into. Scalar
    fields keep craftax's `EnvState` names and units; tiles are the window, row-major (`OFFSETS`)."""

    block: jnp.ndarray  # int32 [99] block type (only meaningful where lit)
    item: jnp.ndarray  # int32 [99] item type
    mob: jnp.ndarray  # int32 [99] smallest mob code on the tile (class * 8 + type), NO_MOB if none
    lit: jnp.ndarray  # bool [99] light > LIGHT_THRESHOLD
    inventory: Any  # craftax Inventory: counts, pickaxe/sword/bow levels, armour [4], potions [6]
    sword_enchantment: jnp.ndarray
    bow_enchantment: jnp.ndarray
    armour_enchantments: jnp.ndarray  # [4]
    player_health: jnp.ndarray  # float32
    player_food: jnp.ndarray
    player_drink: jnp.ndarray
    player_energy: jnp.ndarray
    player_mana: jnp.ndarray
    player_xp: jnp.ndarray
    player_dexterity: jnp.ndarray
    player_strength: jnp.ndarray
    player_intelligence: jnp.ndarray
    player_direction: jnp.ndarray  # 1 left, 2 right, 3 up, 4 down
    light_level: jnp.ndarray  # float32
    is_sleeping: jnp.ndarray
    is_resting: jnp.ndarray
    learned_spells: jnp.ndarray  # bool [2]: fireball, iceball
    player_level: jnp.ndarray  # floor
    ladder_open: jnp.ndarray  # bool: monsters killed on this floor >= MONSTERS_KILLED_TO_CLEAR_LEVEL
    boss_vulnerable: jnp.ndarray  # bool


def view_from_state(state) -> View:
    """The `View` of one unbatched raw Craftax `EnvState`."""
    t = local_tiles(state)
    return View(
        block=t["block"], item=t["item"], mob=t["mob"], lit=t["lit"], inventory=state.inventory,
        sword_enchantment=state.sword_enchantment, bow_enchantment=state.bow_enchantment,
        armour_enchantments=state.armour_enchantments, player_health=state.player_health,
        **{name: getattr(state, name) for name in STAT_FIELDS},
        player_direction=state.player_direction, light_level=state.light_level, is_sleeping=state.is_sleeping,
        is_resting=state.is_resting, learned_spells=state.learned_spells, player_level=state.player_level,
        ladder_open=state.monsters_killed[state.player_level] >= MONSTERS_KILLED_TO_CLEAR_LEVEL,
        boss_vulnerable=is_boss_vulnerable(state),
    )


def _tool_level(level, enchantment):
    """Index into a (material x enchantment) choice: 0 = not owned, else 1 + (level-1)*3 + enchantment."""
    level = jnp.asarray(level, jnp.int32)
    return jnp.where(level > 0, 1 + (level - 1) * 3 + jnp.clip(enchantment, 0, 2), 0)


def _bool(x):
    return jnp.asarray(x).astype(jnp.int32)


# ---------------------------------------------------------------------------------------------- full

def _full_format() -> Format:
    coords = tuple(f"{c}, {r}:" for r, c in OFFSETS)  # craftax prints "col, row"
    mob = Choice(tuple(f" {n} on" for n in MOB_NAMES_LIST) + ("",))
    item = Choice(("",) + tuple(f" {t.name.lower()} on" for t in list(ItemType)[1:]))
    block = Choice(tuple(f" {b.name.lower()}" for b in BlockType) + (" Darkness",))
    map_section = Section(
        "map", (Choice(coords), mob, item, block, Choice(("\n", "\n\n"))), rows=ROWS * COLS
    )

    inv = RowBuilder("inventory").text("Inventory:\n")
    for i, (label, get) in enumerate(INVENTORY):
        inv.text(("" if i == 0 else "\n") + f"{label}: ").value(Number(COUNT_DIGITS), lambda s, g=get: count(g(s), COUNT_DIGITS))
    inv.text("\n")
    inv.value(Choice(("",) + tuple(f"{m} Pickaxe\n" for m in MATERIALS)), lambda s: jnp.clip(s.inventory.pickaxe, 0, 4))
    inv.value(
        Choice(("",) + tuple(f"{m} Sword with {e} enchantment\n" for m in MATERIALS for e in ENCHANTMENTS)),
        lambda s: _tool_level(jnp.clip(s.inventory.sword, 0, 4), s.sword_enchantment),
    )
    inv.value(
        Choice(("",) + tuple(f"Bow with {e} enchantment\n" for e in ENCHANTMENTS)),
        lambda s: jnp.where(s.inventory.bow > 0, 1 + jnp.clip(s.bow_enchantment, 0, 2), 0),
    )
    for i, colour in enumerate(POTIONS):
        inv.text(("" if i == 0 else "\n") + f"{colour} potion: ").value(
            Number(COUNT_DIGITS), lambda s, i=i: count(s.inventory.potions[i], COUNT_DIGITS)
        )
    inv.text("\n")
    for i, piece in enumerate(ARMOUR_PIECES):
        inv.value(
            Choice(("",) + tuple(f"{m} {piece} with {e} enchantment\n" for m in ARMOUR_MATERIALS for e in ENCHANTMENTS)),
            lambda s, i=i: _tool_level(jnp.clip(s.inventory.armour[i], 0, 2), s.armour_enchantments[i]),
        )
    inv.text("Health: ").value(HEALTH, lambda s: fixed_point(s.player_health, 1, 2))
    for label, get in STATS:
        inv.text(f"\n{label}: ").value(Number(COUNT_DIGITS), lambda s, g=get: count(g(s), COUNT_DIGITS))
    inv.text("\nDirection:").value(Choice(tuple(" " + d for d in DIRECTIONS)), lambda s: jnp.clip(s.player_direction, 0, 4))
    inv.text("\nLight: ").value(LIGHT, lambda s: fixed_point(s.light_level, 2, 1))
    tf = Choice((" False", " True"))
    inv.text("\nIs Sleeping:").value(tf, lambda s: _bool(s.is_sleeping))
    inv.text("\nIs Resting:").value(tf, lambda s: _bool(s.is_resting))
    inv.text("\nLearned Fireball:").value(tf, lambda s: _bool(s.learned_spells[0]))
    inv.text("\nLearned Iceball:").value(tf, lambda s: _bool(s.learned_spells[1]))
    inv.text("\nFloor: ").value(Number(1), lambda s: jnp.clip(s.player_level, 0, 9))
    inv.text("\nLadder Open:").value(
        tf, lambda s: _bool(s.ladder_open)
    )
    inv.text("\nIs Boss Vulnerable:").value(Choice((" False\n", " True\n")), lambda s: _bool(s.boss_vulnerable))

    layout = Layout((Section("header", (Const("Map:\n"),)), map_section, inv.section()))
    n_tiles = ROWS * COLS

    def values(view: View):
        lit = view.lit
        mob = jnp.where(lit, view.mob, NO_MOB)
        item = jnp.where(lit, view.item, 0)
        block = jnp.where(lit, view.block, UNLIT)
        term = (jnp.arange(n_tiles) == n_tiles - 1).astype(jnp.int32)
        tiles = jnp.stack([jnp.arange(n_tiles, dtype=jnp.int32), mob, item, block, term], axis=-1)
        return {"header": jnp.zeros((1, 1), jnp.int32), "map": tiles, "inventory": inv.values(view)}

    return Format(ENV_NAME, "full", layout, values)


# ------------------------------------------------------------------------------------------- compact

# Ground tiles the compact map leaves out (the system prompt says so): walkable floors of every level.
COMPACT_BACKGROUND = (
    BlockType.GRASS, BlockType.SAND, BlockType.PATH, BlockType.FIRE_GRASS, BlockType.ICE_GRASS,
)
COMPACT_MAX_TILES = 84  # K: the most tiles listed (nearest first); >= 99% of test states fit (docs/RENDER.md)

COMPACT_BLOCK_NAMES = {
    BlockType.OUT_OF_BOUNDS: "edge",
    BlockType.ENCHANTMENT_TABLE_FIRE: "fire enchantment table",
    BlockType.ENCHANTMENT_TABLE_ICE: "ice enchantment table",
    BlockType.NECROMANCER_VULNERABLE: "vulnerable necromancer",
    BlockType.GRAVE2: "grave",
    BlockType.GRAVE3: "grave",
}
COMPACT_ITEM_NAMES = {
    ItemType.TORCH: "torch", ItemType.LADDER_DOWN: "ladder down", ItemType.LADDER_UP: "ladder up",
    ItemType.LADDER_DOWN_BLOCKED: "blocked ladder down",
}


def _compact_things() -> tuple[str, ...]:
    """What a listed tile shows: index = mob code (0..39), then 40 + item, then 45 + block."""
    mobs = [n.lower().replace(" (player)", "").strip() for n in MOB_NAMES_LIST]
    mobs = [("my " + n) if i >= 32 else n for i, n in enumerate(mobs)]
    items = ["nothing"] + [COMPACT_ITEM_NAMES[t] for t in list(ItemType)[1:]]
    blocks = [COMPACT_BLOCK_NAMES.get(b, b.name.lower().replace("_", " ")) for b in BlockType]
    return tuple(" " + n for n in mobs + items + blocks)


def _compact_format() -> Format:
    k = COMPACT_MAX_TILES
    coords = tuple(f"{r}, {c}:" for r, c in OFFSETS)  # compact prints "row, col"
    things = _compact_things()
    item_base, block_base = NO_MOB, NO_MOB + len(ItemType)
    map_section = Section("map", (Choice(coords), Choice(things), Const("\n")), rows=len(NEAREST),
                          optional_rows=True, max_rows_shown=k)

    inv = RowBuilder("items", never_empty=True)
    for label, get in INVENTORY:
        name = label.lower()
        inv.value(Number(COUNT_DIGITS, optional=True, label=f" {name}="), lambda s, g=get: optional_count(g(s), COUNT_DIGITS))
    for i, colour in enumerate(POTIONS):
        inv.value(
            Number(COUNT_DIGITS, optional=True, label=f" {colour.lower()} potion="),
            lambda s, i=i: optional_count(s.inventory.potions[i], COUNT_DIGITS),
        )
    inv.value(Choice(("",) + tuple(f" {m.lower()} pickaxe" for m in MATERIALS)), lambda s: jnp.clip(s.inventory.pickaxe, 0, 4))
    ench = {"No": "", "Fire": " of fire", "Ice": " of ice"}
    inv.value(
        Choice(("",) + tuple(f" {m.lower()} sword{ench[e]}" for m in MATERIALS for e in ENCHANTMENTS)),
        lambda s: _tool_level(jnp.clip(s.inventory.sword, 0, 4), s.sword_enchantment),
    )
    inv.value(
        Choice(("",) + tuple(f" bow{ench[e]}" for e in ENCHANTMENTS)),
        lambda s: jnp.where(s.inventory.bow > 0, 1 + jnp.clip(s.bow_enchantment, 0, 2), 0),
    )
    for i, piece in enumerate(ARMOUR_PIECES):
        inv.value(
            Choice(("",) + tuple(f" {m.lower()} {piece.lower()}{ench[e]}" for m in ARMOUR_MATERIALS for e in ENCHANTMENTS)),
            lambda s, i=i: _tool_level(jnp.clip(s.inventory.armour[i], 0, 2), s.armour_enchantments[i]),
        )
    inv.value(Choice(("", " nothing")), lambda s: _bool(_inventory_empty(s)))

    st = RowBuilder("status").text("\nStatus: health=").value(HEALTH, lambda s: fixed_point(s.player_health, 1, 2))
    for label, get in STATS:
        st.text(f" {label.lower()}=").value(Number(COUNT_DIGITS), lambda s, g=get: count(g(s), COUNT_DIGITS))
    st.text(" floor=").value(Number(1), lambda s: jnp.clip(s.player_level, 0, 9))
    st.text(" light=").value(LIGHT, lambda s: fixed_point(s.light_level, 2, 1))
    st.text(" dark tiles=").value(Number(2), lambda s: count(jnp.sum(~s.lit), 2))
    st.text(" facing").value(Choice(tuple("=" + d for d in DIRECTIONS)), lambda s: jnp.clip(s.player_direction, 0, 4))
    st.value(Choice(("", " sleeping")), lambda s: _bool(s.is_sleeping))
    st.value(Choice(("", " resting")), lambda s: _bool(s.is_resting))
    st.value(Choice(("", " knows fireball")), lambda s: _bool(s.learned_spells[0]))
    st.value(Choice(("", " knows iceball")), lambda s: _bool(s.learned_spells[1]))
    st.value(
        Choice(("", " ladder open")),
        lambda s: _bool(s.ladder_open),
    )
    st.value(Choice(("", " boss vulnerable")), lambda s: _bool(s.boss_vulnerable))
    st.text("\n")

    background = np.zeros(len(BlockType), dtype=bool)
    background[[b.value for b in COMPACT_BACKGROUND]] = True

    def map_rows(view: View):
        thing = jnp.where(
            view.mob < NO_MOB, view.mob, jnp.where(view.item > 0, item_base + view.item, block_base + view.block)
        )
        informative = view.lit & ((view.mob < NO_MOB) | (view.item > 0) | ~jnp.asarray(background)[view.block])
        tiles = jnp.asarray(NEAREST)  # one row per window tile, nearest first; the first k informative ones show
        return jnp.stack([tiles, thing[tiles], jnp.zeros_like(tiles)], axis=-1), first_k(informative[tiles], k)

    return compact_format(ENV_NAME, map_section, inv, st, map_rows)


def _inventory_empty(s):
    inv = s.inventory
    counts = jnp.stack([jnp.asarray(g(s), jnp.int32) for _, g in INVENTORY])
    tools = jnp.stack([inv.pickaxe, inv.sword, inv.bow]).astype(jnp.int32)
    return ~jnp.any(counts > 0) & ~jnp.any(inv.potions > 0) & ~jnp.any(tools > 0) & ~jnp.any(inv.armour > 0)


def formats() -> dict[str, Format]:
    return {"full": _full_format(), "compact": _compact_format()}
