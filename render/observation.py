"""Symbolic observation vector -> the formats' `View`, in pure jnp (the offline path: datasets hold observations).

The vectors are craftax's own (`craftax.craftax.renderer.render_craftax_symbolic` and
`craftax.craftax_classic.renderer.render_craftax_symbolic`); their layout is decoded here field by field:

Craftax-Symbolic-v1 (8,268 floats): a [9, 11, 83] window, row-major (37 block one-hot, 5 item one-hot, 40 mob
bits = class * 8 + type, 1 lit flag; block, item and mob are zero where unlit), then 51 values: sqrt(count) / 10
for wood, stone, coal, iron, diamond, sapphire, ruby, sapling, torches, arrows; books / 2, pickaxe / 4,
sword / 4, sword and bow enchantment, bow; sqrt(potion) / 10 x 6; health, food, drink, energy, mana, xp,
dexterity, strength, intelligence / 10; direction one-hot (1..4); armour / 2 x 4; armour enchantment x 4;
light level, sleeping, resting, fireball, iceball, floor / 10, ladder open, boss vulnerable.

Craftax-Classic-Symbolic-v1 (1,345 floats): a [7, 9, 21] window (17 block one-hot, 4 mob bits: zombie, cow,
skeleton, arrow), then wood, stone, coal, iron, diamond, sapling and the 6 tool counts / 10; health, food,
drink, energy / 10 (both groups computed in float16 upstream); direction one-hot; light level, sleeping.

Every number is recovered exactly from a float32 vector except Craftax's health, which the vector stores as
health / 10: docs/RENDER.md lists what an observation shows differently from its state.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from render.envs import ENVS, check_env_name

OBS_SIZES = {name: env.obs_size for name, env in ENVS.items()}  # render.envs.ENVS holds them
_BIG = 1e7  # decoded numbers are clipped to +-this before the cast to int32 (inf/nan in a vector stay harmless)


def env_for_obs_size(size: int) -> str:
    """The env whose symbolic observation has `size` floats; ValueError if none has."""
    for env_name, n in OBS_SIZES.items():
        if n == size:
            return env_name
    known = ", ".join(f"{e}: {n}" for e, n in OBS_SIZES.items())
    raise ValueError(f"an observation of {size} floats fits no env (symbolic observation sizes: {known})")


def check_obs(obs, env_name: str, batched: bool | None = None) -> None:
    """Raise ValueError unless `obs` is `env_name`'s symbolic observation vector ([O], or [B, O] when batched;
    either when `batched` is None)."""
    check_env_name(env_name)
    if not hasattr(obs, "shape"):
        raise ValueError(f"{env_name} observations are float arrays, got a {type(obs).__name__} (a template built "
                         f"with source='obs' reads observation vectors; build one with source='state' for env states)")
    shape = tuple(obs.shape)
    size = OBS_SIZES[env_name]
    ndims = {True: (2,), False: (1,), None: (1, 2)}[batched]
    if len(shape) not in ndims or shape[-1] != size:
        hint = ""
        if shape:
            try:
                hint = f"; {shape[-1]} floats is the observation of {env_for_obs_size(shape[-1])}"
            except ValueError:
                pass
        want = {(1,): f"[{size}]", (2,): f"[batch, {size}]", (1, 2): f"[{size}] or [batch, {size}]"}[ndims]
        extra = " (one observation; use jax.vmap(tpl)(obs) for a batch)" if batched is False and len(shape) == 2 else ""
        raise ValueError(f"{env_name} observations are float vectors of shape {want}, got shape {shape}{extra}{hint}")
    dtype = np.dtype(getattr(obs, "dtype", np.float32))
    if not np.issubdtype(dtype, np.floating):
        raise ValueError(f"observations are float vectors, got dtype {dtype}")


def _int(x) -> jnp.ndarray:
    return jnp.round(jnp.clip(x, -_BIG, _BIG)).astype(jnp.int32)


def _flag(x) -> jnp.ndarray:
    return x > 0.5


def _direction(one_hot) -> jnp.ndarray:
    """int32 1..4 from craftax's one_hot(direction - 1, 4); 0 when no bit is set (direction 0)."""
    return jnp.sum(jnp.where(one_hot > 0.5, jnp.arange(1, 5), 0)).astype(jnp.int32)


def _first_set(bits, none: int) -> jnp.ndarray:
    """int32 [T]: index of the first set bit per row of `bits` [T, C] (the smallest code), `none` if no bit."""
    on = bits > 0.5
    return jnp.where(on.any(-1), jnp.argmax(on, axis=-1), none).astype(jnp.int32)


def craftax_view(obs):
    """The Craftax formats' `View` of ONE Craftax-Symbolic-v1 observation vector (float [8268])."""
    from craftax.craftax.craftax_state import Inventory

    from render.formats_craftax import COLS, NO_MOB, ROWS, View

    obs = jnp.asarray(obs, jnp.float32)
    tiles = obs[: ROWS * COLS * 83].reshape(ROWS * COLS, 83)
    flat = obs[ROWS * COLS * 83:]
    root = lambda x: _int(jnp.square(x * 10.0))  # sqrt(n) / 10 -> n
    counts = {name: root(flat[i]) for i, name in enumerate(
        ("wood", "stone", "coal", "iron", "diamond", "sapphire", "ruby", "sapling", "torches", "arrows"))}
    inventory = Inventory(
        **counts, books=_int(flat[10] * 2.0), pickaxe=_int(flat[11] * 4.0), sword=_int(flat[12] * 4.0),
        bow=_int(flat[15]), potions=root(flat[16:22]), armour=_int(flat[35:39] * 2.0),
    )
    stats = ("player_food", "player_drink", "player_energy", "player_mana", "player_xp", "player_dexterity",
             "player_strength", "player_intelligence")
    special = flat[43:51]
    return View(
        block=jnp.argmax(tiles[:, :37], axis=-1).astype(jnp.int32),
        item=jnp.argmax(tiles[:, 37:42], axis=-1).astype(jnp.int32),
        mob=_first_set(tiles[:, 42:82], NO_MOB),
        lit=_flag(tiles[:, 82]),
        inventory=inventory,
        sword_enchantment=_int(flat[13]), bow_enchantment=_int(flat[14]),
        armour_enchantments=_int(flat[39:43]),
        player_health=flat[22] * 10.0,  # stored as health / 10 (docs/RENDER.md: the one quantised field)
        **{name: _int(flat[23 + i] * 10.0) for i, name in enumerate(stats)},
        player_direction=_direction(flat[31:35]),
        light_level=special[0], is_sleeping=_flag(special[1]), is_resting=_flag(special[2]),
        learned_spells=_flag(special[3:5]), player_level=_int(special[5] * 10.0),
        ladder_open=_flag(special[6]), boss_vulnerable=_flag(special[7]),
    )


def classic_view(obs):
    """The Classic formats' `View` of ONE Craftax-Classic-Symbolic-v1 observation vector (float [1345])."""
    from craftax.craftax_classic.envs.craftax_state import Inventory

    from render.formats_classic import COLS, NO_MOB, ROWS, View

    obs = jnp.asarray(obs, jnp.float32)
    tiles = obs[: ROWS * COLS * 21].reshape(ROWS * COLS, 21)
    flat = obs[ROWS * COLS * 21:]
    tenths = lambda x: _int(x * 10.0)  # float16(n) / 10 -> n (exact up to 2,048, and counts show at most 999)
    names = ("wood", "stone", "coal", "iron", "diamond", "sapling", "wood_pickaxe", "stone_pickaxe",
             "iron_pickaxe", "wood_sword", "stone_sword", "iron_sword")
    return View(
        block=jnp.argmax(tiles[:, :17], axis=-1).astype(jnp.int32),
        mob=_first_set(tiles[:, 17:21], NO_MOB),
        inventory=Inventory(**{name: tenths(flat[i]) for i, name in enumerate(names)}),
        player_health=tenths(flat[12]), player_food=tenths(flat[13]), player_drink=tenths(flat[14]),
        player_energy=tenths(flat[15]), player_direction=_direction(flat[16:20]),
        light_level=flat[20], is_sleeping=_flag(flat[21]),
    )


VIEWS = {name: globals()[env.obs_view] for name, env in ENVS.items()}  # as render.envs.ENVS names them
