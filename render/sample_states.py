"""Diverse batches of raw craftax states, for the render tests, K measurement and the benchmark.

Half of each batch is plain random play (Craftax in god mode with a per-env bias towards DESCEND,
so the player reaches every floor); the other half starts from such states and is edited on
purpose to reach what random play rarely shows: every mob class and type and projectiles on screen
(and dead mob slots on and off screen), large and zero inventories (up to 3-digit counts), tools,
armour, enchantments, learned spells, sleeping/resting, fractional health, darkness patterns.

Everything is one jitted function per (env, batch size, steps): `sample_states(env_name, n, seed)`. Also
`typical_states` (plain random play, what an early agent sees) and `reset_states` (fresh worlds).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from render.envs import CRAFTAX, make_raw_env


def _env(env_name: str):
    """The env and the params random play uses: Craftax in god mode (the player survives to reach every floor)."""
    env, params = make_raw_env(env_name)
    return env, params.replace(god_mode=True) if env_name == CRAFTAX else params


def _random_play(env, params, key, steps: int, num_actions: int, descend_action: int | None):
    """One env: reset, then `steps` random actions (DESCEND favoured with an env-specific probability)."""
    k_reset, k_bias, k_run = jax.random.split(key, 3)
    _, state = env.reset(k_reset, params)
    p_descend = jax.random.uniform(k_bias, (), maxval=0.25) if descend_action is not None else 0.0

    def step(state, k):
        k_act, k_desc, k_step = jax.random.split(k, 3)
        action = jax.random.randint(k_act, (), 0, num_actions)
        if descend_action is not None:
            action = jnp.where(jax.random.uniform(k_desc) < p_descend, descend_action, action)
        _, state, _, _, _ = env.step(k_step, state, action, params)
        return state, None

    state, _ = jax.lax.scan(step, state, jax.random.split(k_run, steps))
    return state


def _place_mobs(key, mobs, player_pos, view_rows, view_cols, type_count, level=None):
    """Put each slot of `mobs` (at `level` if given) on a random tile of the view (live or dead)
    or far away, with random type ids in [0, type_count)."""
    k_off, k_mask, k_type, k_far = jax.random.split(key, 4)
    shape = mobs.mask.shape if level is None else mobs.mask.shape[1:]
    n = shape[0]
    offset = jnp.stack([
        jax.random.randint(k_off, (n,), -(view_rows // 2), view_rows // 2 + 1),
        jax.random.randint(jax.random.fold_in(k_off, 1), (n,), -(view_cols // 2), view_cols // 2 + 1),
    ], axis=-1)
    far = jax.random.uniform(k_far, (n,)) < 0.2  # some slots off screen (e.g. at 0, 0)
    pos = jnp.where(far[:, None], 0, player_pos[None, :] + offset).astype(jnp.int32)
    mask = jax.random.uniform(k_mask, (n,)) < 0.7
    fields = {"position": pos, "mask": mask}
    if hasattr(mobs, "type_id"):
        fields["type_id"] = jax.random.randint(k_type, (n,), 0, type_count).astype(mobs.type_id.dtype)
    if level is None:
        return mobs.replace(**fields)
    return mobs.replace(**{k: getattr(mobs, k).at[level].set(v) for k, v in fields.items()})


def _counts(key, shape, dtype=jnp.int32):
    """Mostly small counts, some zero, some large (3 digits)."""
    k1, k2, k3 = jax.random.split(key, 3)
    small = jax.random.randint(k1, shape, 0, 10)
    large = jax.random.randint(k2, shape, 10, 1000)
    kind = jax.random.randint(k3, shape, 0, 3)
    return jnp.where(kind == 0, 0, jnp.where(kind == 1, small, large)).astype(dtype)


def _edit_craftax(key, s):
    ks = iter(jax.random.split(key, 40))
    lvl = s.player_level
    inv = s.inventory
    inv = inv.replace(
        wood=_counts(next(ks), ()), stone=_counts(next(ks), ()), coal=_counts(next(ks), ()),
        iron=_counts(next(ks), ()), diamond=_counts(next(ks), ()), sapling=_counts(next(ks), ()),
        arrows=_counts(next(ks), ()), torches=_counts(next(ks), ()), ruby=_counts(next(ks), ()),
        sapphire=_counts(next(ks), ()), books=_counts(next(ks), ()),
        potions=_counts(next(ks), (6,)),
        pickaxe=jax.random.randint(next(ks), (), 0, 5), sword=jax.random.randint(next(ks), (), 0, 5),
        bow=jax.random.randint(next(ks), (), 0, 2), armour=jax.random.randint(next(ks), (4,), 0, 3),
    )
    light = s.light_map[lvl]
    dark = jax.random.uniform(next(ks), light.shape) < jax.random.uniform(next(ks), ())
    s = s.replace(
        inventory=inv,
        sword_enchantment=jax.random.randint(next(ks), (), 0, 3),
        bow_enchantment=jax.random.randint(next(ks), (), 0, 3),
        armour_enchantments=jax.random.randint(next(ks), (4,), 0, 3),
        learned_spells=jax.random.bernoulli(next(ks), 0.5, (2,)),
        is_sleeping=jax.random.bernoulli(next(ks), 0.3),
        is_resting=jax.random.bernoulli(next(ks), 0.3),
        player_health=jax.random.uniform(next(ks), (), minval=-1.0, maxval=12.0),
        player_xp=_counts(next(ks), ()),
        player_mana=jax.random.randint(next(ks), (), 0, 12),
        light_level=jax.random.uniform(next(ks), ()),
        light_map=s.light_map.at[lvl].set(jnp.where(dark, 0.0, jnp.maximum(light, 0.5))),
        monsters_killed=s.monsters_killed.at[lvl].set(jax.random.randint(next(ks), (), 0, 12)),
        boss_timesteps_to_spawn_this_round=jax.random.randint(next(ks), (), -1, 2),
    )
    pos = s.player_position
    return s.replace(
        melee_mobs=_place_mobs(next(ks), s.melee_mobs, pos, 9, 11, 8, lvl),
        passive_mobs=_place_mobs(next(ks), s.passive_mobs, pos, 9, 11, 3, lvl),
        ranged_mobs=_place_mobs(next(ks), s.ranged_mobs, pos, 9, 11, 8, lvl),
        mob_projectiles=_place_mobs(next(ks), s.mob_projectiles, pos, 9, 11, 8, lvl),
        player_projectiles=_place_mobs(next(ks), s.player_projectiles, pos, 9, 11, 8, lvl),
    )


def _edit_classic(key, s):
    ks = iter(jax.random.split(key, 32))
    inv = s.inventory
    tools = {name: jax.random.randint(next(ks), (), 0, 2) for name in
             ("wood_pickaxe", "stone_pickaxe", "iron_pickaxe", "wood_sword", "stone_sword", "iron_sword")}
    inv = inv.replace(
        wood=_counts(next(ks), ()), stone=_counts(next(ks), ()), coal=_counts(next(ks), ()),
        iron=_counts(next(ks), ()), diamond=_counts(next(ks), ()), sapling=_counts(next(ks), ()), **tools,
    )
    pos = s.player_position
    return s.replace(
        inventory=inv,
        is_sleeping=jax.random.bernoulli(next(ks), 0.3),
        player_health=jax.random.randint(next(ks), (), 0, 10),
        player_food=jax.random.randint(next(ks), (), 0, 10),
        light_level=jax.random.uniform(next(ks), ()),
        zombies=_place_mobs(next(ks), s.zombies, pos, 7, 9, 1),
        cows=_place_mobs(next(ks), s.cows, pos, 7, 9, 1),
        skeletons=_place_mobs(next(ks), s.skeletons, pos, 7, 9, 1),
        arrows=_place_mobs(next(ks), s.arrows, pos, 7, 9, 1),
    )


@functools.lru_cache(maxsize=None)
def _sampler(env_name: str, n: int, steps: int):
    env, params = _env(env_name)
    num_actions = env.action_space(params).n
    descend = 18 if env_name == CRAFTAX else None
    edit = _edit_craftax if env_name == CRAFTAX else _edit_classic

    def sample(key):
        k_play, k_edit = jax.random.split(key)
        states = jax.vmap(lambda k: _random_play(env, params, k, steps, num_actions, descend))(
            jax.random.split(k_play, n)
        )
        edited = jax.vmap(edit)(jax.random.split(k_edit, n), states)
        take_edit = jnp.arange(n) >= n // 2  # second half edited
        pick = lambda a, b: jnp.where(take_edit.reshape((n,) + (1,) * (a.ndim - 1)), b, a)
        return jax.tree_util.tree_map(pick, states, edited)

    return jax.jit(sample)


def sample_states(env_name: str, n: int, seed: int, steps: int = 48):
    """A batch of `n` raw EnvStates of `env_name` (leading axis n): first half random play, second
    half edited for coverage (see module docstring). Deterministic in `seed`, which may be traced (inside an outer
    jit, e.g. to compile the sampler with other compiler options)."""
    return _sampler(env_name, n, steps)(jax.random.PRNGKey(seed))


def reset_states(env_name: str, n: int, seed: int):
    """`n` fresh worlds of `env_name` (reset states, default params; env i's key is split(PRNGKey(seed), n)[i]): the
    cheapest batch to compile."""
    env, params = make_raw_env(env_name)
    _, states = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))(jax.random.split(jax.random.PRNGKey(seed), n), params)
    return states


@functools.lru_cache(maxsize=None)
def _typical_sampler(env_name: str, n: int, max_steps: int):
    env, params = make_raw_env(env_name)  # no god mode: the player stays where random play takes it (mostly floor 0)
    num_actions = env.action_space(params).n

    def one(key):
        k_reset, k_keep, k_run = jax.random.split(key, 3)
        _, state = env.reset(k_reset, params)
        keep_at = jax.random.randint(k_keep, (), 0, max_steps)

        def step(carry, inp):
            state, kept, alive = carry
            t, k = inp
            k_act, k_step = jax.random.split(k)
            _, state, _, done, _ = env.step(k_step, state, jax.random.randint(k_act, (), 0, num_actions), params)
            alive = alive & ~done
            take = alive & (t <= keep_at)  # the state at keep_at, or the last one before the player died
            kept = jax.tree_util.tree_map(lambda a, b: jnp.where(take, a, b), state, kept)
            return (state, kept, alive), None

        steps = (jnp.arange(max_steps), jax.random.split(k_run, max_steps))
        (_, kept, _), _ = jax.lax.scan(step, (state, state, jnp.array(True)), steps)
        return kept

    return jax.jit(jax.vmap(one))


def typical_states(env_name: str, n: int, seed: int, max_steps: int = 500):
    """`n` states of plain random play from reset (default env params, no edits), each taken after a random
    number of steps in [1, max_steps] (or just before the player died): what an early PPO agent sees, for the
    typical-state token statistics (`sample_states` is the deliberately hard set)."""
    return _typical_sampler(env_name, n, max_steps)(jax.random.split(jax.random.PRNGKey(seed), n))
