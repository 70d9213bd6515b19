"""The pair kinds: one declarative table of counterfactual edits of a raw craftax `EnvState`.

Every kind turns a base state into a pair (low, high) that differs only in the `fields` it names, so the
symbolic observation (craftax's own `get_obs`) and the rendered text of both states agree with the game state.
`expected_sign` is the sign V(high) - V(low) should have for a sensible critic. An edit also says whether it
could be built on that base state (`ok`): a mob needs a free walkable tile in view, a floor a level below, ...;
pairs that cannot be built are skipped and counted, never faked. Kinds whose field does not exist in an env
(ladders and floors in Craftax-Classic) are not built for it.

To add a kind: one `PairKind(name, sign, fields, builder)` row in `KINDS`, where builder(env_name) returns an
edit `(key, state) -> (low, high, ok)` (pure, unbatched, jittable) or None where the kind does not apply.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp

from render.envs import CLASSIC, CRAFTAX

Edit = Callable[[jax.Array, object], tuple[object, object, jax.Array]]

STATUS_LOW, STATUS_HIGH = 2, 9  # health / food / drink / energy
INVENTORY_HIGH = 5  # inventory 0 vs this
FAR = 4  # tiles between the player and a "far" mob


@dataclass(frozen=True)
class PairKind:
    """One row of the table: `builder(env_name)` -> edit or None (the kind does not exist in that env)."""

    name: str
    expected_sign: int  # the sign V(high) - V(low) should have
    fields: tuple[str, ...]  # the EnvState fields the edit may change (dotted for inventory.*)
    builder: Callable[[str], Edit | None]
    doc: str = ""


# ------------------------------------------------------------------------------------------- env geometry

def _blocks(env_name: str):
    if env_name == CLASSIC:
        from craftax.craftax_classic.constants import BlockType
    else:
        from craftax.craftax.constants import BlockType
    return BlockType


def _view(env_name: str) -> tuple[int, int]:
    return (7, 9) if env_name == CLASSIC else (9, 11)


def _walkable(env_name: str) -> jnp.ndarray:
    b = _blocks(env_name)
    names = ["GRASS", "SAND", "PATH"] + (["FIRE_GRASS", "ICE_GRASS", "GRAVEL"] if env_name == CRAFTAX else [])
    return jnp.asarray([getattr(b, n).value for n in names], jnp.int32)


def _level(env_name, s, grid):
    """`grid` ([L, ...] in Craftax) at the player's floor; Classic grids have no floor axis."""
    return grid if env_name == CLASSIC else grid[s.player_level]


def _set_level(env_name, s, grid, value):
    return value if env_name == CLASSIC else grid.at[s.player_level].set(value)


def _free_tiles(env_name: str, s) -> jnp.ndarray:
    """bool [H, W]: walkable, no mob, not the player, and (Craftax) lit: where a mob or item may be put."""
    block = _level(env_name, s, s.map)
    free = jnp.isin(block, _walkable(env_name)) & ~_level(env_name, s, s.mob_map)
    free = free.at[s.player_position[0], s.player_position[1]].set(False)
    if env_name == CRAFTAX:
        free &= _level(env_name, s, s.light_map) > 0.05
        free &= _level(env_name, s, s.item_map) == 0
    return free


def _at(grid, pos):
    """grid[pos] with False off the grid."""
    inside = jnp.all((pos >= 0) & (pos < jnp.asarray(grid.shape)))
    safe = jnp.clip(pos, 0, jnp.asarray(grid.shape) - 1)
    return inside & grid[safe[0], safe[1]]


def _in_view(env_name, offset) -> jnp.ndarray:
    rows, cols = _view(env_name)
    return (jnp.abs(offset[0]) <= rows // 2) & (jnp.abs(offset[1]) <= cols // 2)


DIRECTIONS = jnp.asarray([[0, 1], [0, -1], [1, 0], [-1, 0]], jnp.int32)


# ------------------------------------------------------------------------------------------------ edits

def status_edit(field: str) -> Callable[[str], Edit]:
    """player_<field> STATUS_LOW vs STATUS_HIGH."""
    def build(env_name):
        def edit(key, s):
            x = getattr(s, field)
            lo, hi = (jnp.asarray(v, jnp.asarray(x).dtype) for v in (STATUS_LOW, STATUS_HIGH))
            return s.replace(**{field: lo}), s.replace(**{field: hi}), jnp.array(True)
        return edit
    return build


def inventory_edit(item: str) -> Callable[[str], Edit]:
    """inventory.<item> 0 vs INVENTORY_HIGH."""
    def build(env_name):
        def edit(key, s):
            dtype = jnp.asarray(getattr(s.inventory, item)).dtype
            put = lambda v: s.replace(inventory=s.inventory.replace(**{item: jnp.asarray(v, dtype)}))
            return put(0), put(INVENTORY_HIGH), jnp.array(True)
        return edit
    return build


# mob kinds: (Classic group, Craftax group, Craftax type id, health, direction field or None)
MOBS = {
    "zombie": ("zombies", "melee_mobs", 0, 5, None),
    "skeleton": ("skeletons", "ranged_mobs", 0, 3, None),
    "arrow": ("arrows", "mob_projectiles", 0, 1, ("arrow_directions", "mob_projectile_directions")),
}


def mob_fields(mob: str) -> tuple[str, ...]:
    classic, craftax, _, _, direction = MOBS[mob]
    fields = (classic, craftax) + (direction if direction else ("mob_map",))
    return fields


def mob_edit(mob: str, low: str) -> Callable[[str], Edit]:
    """Every mob of the class removed from the player's floor, then one put on its last slot: `high` adjacent
    to the player, `low` either absent ("absent") or FAR tiles away in the same direction ("far"). Arrows fly
    at the player. ok: a direction whose adjacent and far tiles are free and in view."""
    classic_group, craftax_group, type_id, health, direction = MOBS[mob]

    def build(env_name):
        group = classic_group if env_name == CLASSIC else craftax_group
        dir_field = None if direction is None else direction[0 if env_name == CLASSIC else 1]
        occupies = direction is None  # projectiles do not mark mob_map

        def edit(key, s):
            mobs = getattr(s, group)
            pos, mask = _level(env_name, s, mobs.position), _level(env_name, s, mobs.mask)
            mob_map = _level(env_name, s, s.mob_map)
            if occupies:  # free the tiles of the removed mobs
                live = jnp.zeros(mob_map.shape, jnp.int32).at[pos[:, 0], pos[:, 1]].add(mask.astype(jnp.int32),
                                                                                         mode="drop")
                mob_map = mob_map & (live == 0)
            cleared = s.replace(mob_map=_set_level(env_name, s, s.mob_map, mob_map))
            free = _free_tiles(env_name, cleared)
            order = DIRECTIONS[jax.random.permutation(key, 4)]
            p = s.player_position
            good = jax.vmap(lambda d: _at(free, p + d) & _at(free, p + FAR * d) & _in_view(env_name, FAR * d))(order)
            d = order[jnp.argmax(good)]
            ok = good.any()
            slot = mask.shape[0] - 1

            def put(where, alive):
                level = lambda grid, v: _set_level(env_name, s, grid, v)
                m = mobs.replace(
                    position=level(mobs.position, pos.at[slot].set(where.astype(pos.dtype))),
                    mask=level(mobs.mask, jnp.zeros_like(mask).at[slot].set(alive)),
                    health=level(mobs.health, _level(env_name, s, mobs.health).at[slot].set(health)),
                    attack_cooldown=level(mobs.attack_cooldown,
                                          _level(env_name, s, mobs.attack_cooldown).at[slot].set(0)),
                )
                if env_name == CRAFTAX:
                    m = m.replace(type_id=level(mobs.type_id, _level(env_name, s, mobs.type_id).at[slot].set(type_id)))
                out = cleared.replace(**{group: m})
                if occupies:
                    out = out.replace(mob_map=level(s.mob_map, mob_map.at[where[0], where[1]].set(
                        mob_map[where[0], where[1]] | alive)))
                if dir_field is not None:
                    dirs = getattr(s, dir_field)
                    out = out.replace(**{dir_field: level(dirs, _level(env_name, s, dirs).at[slot].set(
                        (-d).astype(dirs.dtype)))})
                return out

            high = put(p + d, True)
            low_state = put(p + d, False) if low == "absent" else put(p + FAR * d, True)
            return low_state, high, ok
        return edit
    return build


def block_edit(block: str) -> Callable[[str], Edit]:
    """A free tile within 2 tiles of the player: low as it is (grass, sand or path), high a `block`."""
    def build(env_name):
        value = getattr(_blocks(env_name), block).value
        return _tile_edit(env_name, lambda s, t: s.replace(map=_set_level(
            env_name, s, s.map, _level(env_name, s, s.map).at[t[0], t[1]].set(value))))
    return build


def ladder_edit(env_name: str) -> Edit | None:
    """Craftax only: a free tile within 2 tiles of the player without (low) / with (high) a down ladder."""
    if env_name != CRAFTAX:
        return None
    from craftax.craftax.constants import ItemType

    return _tile_edit(env_name, lambda s, t: s.replace(item_map=_set_level(
        env_name, s, s.item_map, _level(env_name, s, s.item_map).at[t[0], t[1]].set(ItemType.LADDER_DOWN.value))))


def _tile_edit(env_name: str, change) -> Edit:
    near = jnp.asarray([(r, c) for r in range(-2, 3) for c in range(-2, 3) if (r, c) != (0, 0)], jnp.int32)

    def edit(key, s):
        free = _free_tiles(env_name, s)
        order = near[jax.random.permutation(key, near.shape[0])]
        good = jax.vmap(lambda o: _at(free, s.player_position + o))(order)
        t = s.player_position + order[jnp.argmax(good)]
        return s, change(s, t), good.any()
    return edit


def darkness_edit(env_name: str) -> Edit:
    """Full daylight (low) vs night (high): Classic's light_level 1 vs 0; Craftax's also every tile of the
    player's floor lit vs dark (its light map, what the observation masks with)."""
    def edit(key, s):
        lvl = jnp.asarray(s.light_level)
        low, high = s.replace(light_level=jnp.ones_like(lvl)), s.replace(light_level=jnp.zeros_like(lvl))
        if env_name == CRAFTAX:
            lm = _level(env_name, s, s.light_map)
            low = low.replace(light_map=_set_level(env_name, s, s.light_map, jnp.ones_like(lm)))
            high = high.replace(light_map=_set_level(env_name, s, s.light_map, jnp.zeros_like(lm)))
        return low, high, jnp.array(True)
    return edit


def floor_edit(env_name: str) -> Edit | None:
    """Craftax only: the player one floor deeper, where descending puts them (that floor's up ladder, as
    craftax's own descend does). ok where there is a floor below and its ladder tile holds no mob."""
    if env_name != CRAFTAX:
        return None

    def edit(key, s):
        ok = s.player_level + 1 < s.map.shape[0]
        level = jnp.where(ok, s.player_level + 1, s.player_level).astype(jnp.asarray(s.player_level).dtype)
        pos = s.up_ladders[level].astype(s.player_position.dtype)
        deeper = s.replace(player_level=level, player_position=pos)
        return s, deeper, ok & ~s.mob_map[level, pos[0], pos[1]]
    return edit


def _status(name):
    return PairKind(name, +1, ("player_" + name,), status_edit("player_" + name), f"{name} {STATUS_LOW} vs {STATUS_HIGH}")


def _item(name):
    return PairKind(name, +1, ("inventory",), inventory_edit(name), f"{name} 0 vs {INVENTORY_HIGH}")


def _mob(name, low):
    label = f"{name}_adjacent" if low == "absent" else f"{name}_adjacent_vs_far"
    doc = f"{name} absent vs adjacent" if low == "absent" else f"{name} {FAR} tiles away vs adjacent"
    return PairKind(label, -1, mob_fields(name), mob_edit(name, low), doc)


KINDS: tuple[PairKind, ...] = (
    *(_status(n) for n in ("health", "food", "drink", "energy")),
    *(_item(n) for n in ("wood", "stone", "coal", "iron", "diamond", "sapling")),
    *(_mob(m, low) for m in MOBS for low in ("absent", "far")),
    PairKind("table_in_view", +1, ("map",), block_edit("CRAFTING_TABLE"), "no table vs a table 1-2 tiles away"),
    PairKind("water_in_view", +1, ("map",), block_edit("WATER"), "no water vs water 1-2 tiles away"),
    PairKind("ladder_in_view", +1, ("item_map",), ladder_edit, "no ladder vs a down ladder 1-2 tiles away"),
    PairKind("darkness", -1, ("light_level", "light_map"), darkness_edit, "day vs night"),
    PairKind("floor", +1, ("player_level", "player_position"), floor_edit, "this floor vs the one below"),
)
KIND_NAMES = tuple(k.name for k in KINDS)


def kind(name: str) -> PairKind:
    """The table row named `name`; ValueError naming the kinds if there is none."""
    for k in KINDS:
        if k.name == name:
            return k
    raise ValueError(f"unknown pair kind {name!r}; choose from {', '.join(KIND_NAMES)}")


def build_pairs(edit: Edit, states, seed: int):
    """(low [N], high [N], ok bool [N]) of `edit` on the batch `states` (one vmapped call; not jitted here)."""
    n = states.player_position.shape[0]
    keys = jax.random.split(jax.random.PRNGKey(seed), n)
    return jax.vmap(edit)(keys, states)
