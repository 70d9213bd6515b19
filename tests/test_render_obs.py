"""render from observations (`build_template(..., source="obs")`): craftax's own symbolic observation vectors of
diverse states give the state path's ids, except for the differences docs/RENDER.md lists, each tested here.

The observations are made by craftax's `render_craftax_symbolic` (the env's own observation function), never by
this project's code; the reference is the state template on the same states (tests/test_render_template.py
checks that one against the tokenizer and upstream's text).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from craftax.craftax.renderer import render_craftax_symbolic as craftax_obs
from craftax.craftax_classic.renderer import render_craftax_symbolic as classic_obs

from render import build_template, render_text
from render.envs import CLASSIC, CRAFTAX
from render.observation import OBS_SIZES, env_for_obs_size

ENVS = (CRAFTAX, CLASSIC)
FORMATS = ("compact", "full")
RUNTIME_BOUND = {"xla_backend_optimization_level": 3}  # as tests/conftest.py: programs run on thousands of states
UPSTREAM_OBS = {CRAFTAX: jax.jit(jax.vmap(craftax_obs), compiler_options=RUNTIME_BOUND),
                CLASSIC: jax.jit(jax.vmap(classic_obs), compiler_options=RUNTIME_BOUND)}
CLASSIC_EXACT_MAX = 772  # Classic numbers are float16(n) / 10 in the vector: exact up to here (docs/RENDER.md)
CLASSIC_NUMBERS = ("wood", "stone", "coal", "iron", "diamond", "sapling", "wood_pickaxe", "stone_pickaxe",
                   "iron_pickaxe", "wood_sword", "stone_sword", "iron_sword")


@pytest.fixture(scope="session")
def obs_templates(tokenizer):
    return {(env, fmt): build_template(tokenizer, env, fmt, source="obs") for env in ENVS for fmt in FORMATS}


@pytest.fixture(scope="session")
def obs_batched(obs_templates):
    return {key: jax.jit(jax.vmap(tpl), compiler_options=RUNTIME_BOUND) for key, tpl in obs_templates.items()}


def _in_exact_range(states, env):
    """Classic states with every number the vector stores in float16 clipped to CLASSIC_EXACT_MAX."""
    if env != CLASSIC:
        return states
    clip = lambda x: jnp.minimum(x, CLASSIC_EXACT_MAX).astype(x.dtype)
    inv = states.inventory.replace(**{n: clip(getattr(states.inventory, n)) for n in CLASSIC_NUMBERS})
    return states.replace(inventory=inv, **{f: clip(getattr(states, f)) for f in
                                            ("player_health", "player_food", "player_drink", "player_energy")})


MOB_GROUPS = {CRAFTAX: ("melee_mobs", "passive_mobs", "ranged_mobs", "mob_projectiles", "player_projectiles"),
              CLASSIC: ("zombies", "cows", "skeletons", "arrows")}


def _as_the_obs_shows_it(state, obs, env):
    """ONE state edited to what its observation carries: live on-screen mobs whose bit upstream's renderer erased
    are moved off screen (still alive: the boss flag counts live mobs), and Craftax's health is the float the
    vector holds (health / 10, times 10)."""
    rows, cols, channels, mob0 = (9, 11, 83, 42) if env == CRAFTAX else (7, 9, 21, 17)
    at_level = (lambda a: a[state.player_level]) if env == CRAFTAX else (lambda a: a)
    edits = {}
    for k, name in enumerate(MOB_GROUPS[env]):
        mobs = getattr(state, name)
        local = at_level(mobs.position) - state.player_position + jnp.array([rows // 2, cols // 2])
        on_screen = jnp.all((local >= 0) & (local < jnp.array([rows, cols])), axis=-1) & at_level(mobs.mask)
        code = k * 8 + at_level(mobs.type_id) if env == CRAFTAX else k
        tile = jnp.clip(local[:, 0], 0, rows - 1) * cols + jnp.clip(local[:, 1], 0, cols - 1)
        erased = on_screen & (obs[tile * channels + mob0 + code] < 0.5)
        away = state.player_position + jnp.array([rows, cols])
        position = jnp.where(erased[:, None], away, at_level(mobs.position)).astype(mobs.position.dtype)
        edits[name] = mobs.replace(position=mobs.position.at[state.player_level].set(position)
                                   if env == CRAFTAX else position)
    state = state.replace(**edits)
    if env == CRAFTAX:
        state = state.replace(player_health=obs[OBS_SIZES[CRAFTAX] - 51 + 22] * 10.0)
    return state


def _on_screen_mobs(states, env) -> np.ndarray:
    """int [B]: live mob slots on screen (at the player's level) of every state."""
    rows, cols = (9, 11) if env == CRAFTAX else (7, 9)

    def one(s):
        total = 0
        for name in MOB_GROUPS[env]:
            m = getattr(s, name)
            pos, mask = (m.position[s.player_level], m.mask[s.player_level]) if env == CRAFTAX else (m.position, m.mask)
            local = pos - s.player_position + jnp.array([rows // 2, cols // 2])
            total += jnp.sum(jnp.all((local >= 0) & (local < jnp.array([rows, cols])), axis=-1) & mask)
        return total

    return np.asarray(jax.jit(jax.vmap(one))(states))


@pytest.fixture(scope="session")
def obs_cases(state_chunks):
    """env -> (states as the obs shows them, observations, how many states had an erased mob) of one chunk."""
    out = {}
    for env in ENVS:
        states = _in_exact_range(state_chunks[env][0], env)
        obs = UPSTREAM_OBS[env](states)
        shown = jax.jit(jax.vmap(lambda s, o: _as_the_obs_shows_it(s, o, env)))(states, obs)
        out[env] = (shown, obs, int((_on_screen_mobs(shown, env) < _on_screen_mobs(states, env)).sum()))
    return out


@pytest.mark.parametrize("env", ENVS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_obs_ids_equal_state_ids_and_tokenizer(env, fmt, tokenizer, obs_templates, obs_batched, batched_templates,
                                               obs_cases):
    """For 512 diverse states: the ids of craftax's observation equal the state template's ids of the same state
    (as the observation shows it), and the obs template keeps the invariant against the real tokenizer."""
    shown, obs, erased = obs_cases[env]
    assert obs.shape == (512, OBS_SIZES[env])
    print(f"{env}: {erased} of 512 states lost a mob in upstream's observation")
    ids_o, len_o = map(np.asarray, obs_batched[(env, fmt)](obs))
    ids_s, len_s = map(np.asarray, batched_templates[(env, fmt)](shown))
    np.testing.assert_array_equal(len_o, len_s)
    np.testing.assert_array_equal(ids_o, ids_s)
    tpl = obs_templates[(env, fmt)]
    texts = tpl.text(obs)
    reference = tokenizer(texts, add_special_tokens=False)["input_ids"]
    for k, ref in enumerate(reference):
        assert ref == tpl.prefix_ids + ids_o[k, : len_o[k]].tolist(), f"observation {k}:\n{texts[k]}"
    assert render_text(obs[3], env, fmt, source="obs") == tpl.observation_text(obs[3]) == texts[3][len(tpl.head):-len(tpl.tail)]


def _one_state(state_chunks, env, k=0):
    return jax.tree.map(lambda x: x[k], state_chunks[env][0])


def _texts(templates, obs_templates, env, fmt, state, obs):
    return templates[(env, fmt)].observation_text(state), obs_templates[(env, fmt)].observation_text(obs)


@pytest.mark.parametrize("env", ENVS)
def test_a_mob_that_upstream_erased_is_missing_from_the_obs_text(env, state_chunks, templates, obs_templates):
    """Difference 1: upstream's observation loses a live mob when a dead slot of the same type sits on its tile
    (its mob map is written with `.at[tile].set(on_screen)`); the state path shows it, the obs path cannot."""
    s = _one_state(state_chunks, env)
    if env == CRAFTAX:
        lvl = s.player_level
        s = s.replace(light_map=s.light_map.at[lvl].set(1.0))
        mobs = {n: getattr(s, n).replace(mask=getattr(s, n).mask.at[lvl].set(False)) for n in
                ("melee_mobs", "passive_mobs", "ranged_mobs", "mob_projectiles", "player_projectiles")}
        z = mobs["melee_mobs"]
        here = s.player_position + jnp.array([0, 1])
        z = z.replace(position=z.position.at[lvl, :2].set(here), mask=z.mask.at[lvl, 0].set(True),
                      type_id=z.type_id.at[lvl, :2].set(0))
        s = s.replace(**dict(mobs, melee_mobs=z))
        mob_bit = (4 * 11 + 6) * 83 + 42  # tile (row 0, col +1), code 0 (zombie)
    else:
        mobs = {n: getattr(s, n).replace(mask=getattr(s, n).mask & False) for n in ("zombies", "cows", "skeletons", "arrows")}
        z = mobs["zombies"]
        z = z.replace(position=z.position.at[:2].set(s.player_position + jnp.array([0, 1])), mask=z.mask.at[0].set(True))
        s = s.replace(**dict(mobs, zombies=z))
        mob_bit = (3 * 9 + 5) * 21 + 17
    obs = UPSTREAM_OBS[env](jax.tree.map(lambda x: x[None], s))[0]
    assert obs[mob_bit] == 0, "the premise: upstream's vector has lost the zombie"
    state_text, obs_text = _texts(templates, obs_templates, env, "compact", s, obs)
    assert "\n0, 1: zombie\n" in state_text and "zombie" not in obs_text
    state_full, obs_full = _texts(templates, obs_templates, env, "full", s, obs)
    assert "1, 0: Zombie on" in state_full and "Zombie" not in obs_full


def test_craftax_health_is_quantised_by_the_observation(state_chunks, templates, obs_templates, obs_batched,
                                                       batched_templates):
    """Difference 2: the vector holds health / 10 (float32), which maps neighbouring floats together; where
    health x 10 lies within a float step of a rounding half (on CPU: 3.05, 3.15, 5.25, ...), the obs path's one
    decimal can differ by 0.1. Sweep 512 healths on a 0.025 grid (every such half included): only the health
    differs, by 0.1, and only at halves (16 of the 128 on CPU); no other health differs."""
    s = _one_state(state_chunks, CRAFTAX)
    healths = (jnp.arange(512) * 0.025).astype(jnp.float32)
    states = jax.vmap(lambda h: s.replace(player_health=h))(healths)
    obs = UPSTREAM_OBS[CRAFTAX](states)
    ids_o, _ = map(np.asarray, obs_batched[(CRAFTAX, "compact")](obs))
    ids_s, _ = map(np.asarray, batched_templates[(CRAFTAX, "compact")](states))
    differ = np.where((ids_o != ids_s).any(-1))[0]
    print(f"healths shown differently: {np.asarray(healths)[differ]}")
    assert np.all(differ % 4 == 2), "a health other than a rounding half (0.05 + a multiple of 0.1) differs"
    assert len(differ) <= 64
    health = lambda t: float(t.split("health=")[1].split()[0])
    for k in differ:
        a = templates[(CRAFTAX, "compact")].observation_text(jax.tree.map(lambda x: x[k], states))
        b = obs_templates[(CRAFTAX, "compact")].observation_text(obs[k])
        assert a.replace(f"health={health(a):.1f}", "") == b.replace(f"health={health(b):.1f}", "")
        assert abs(health(a) - health(b)) == pytest.approx(0.1)


def test_classic_numbers_are_exact_up_to_772(state_chunks, templates, obs_templates):
    """Difference 3: Classic's vector stores its numbers as float16(n) / 10: exact up to 772, above that a few
    come out one off (the game keeps them below 10; only edited states go there)."""
    s = _one_state(state_chunks, CLASSIC)
    n = jnp.arange(0, 1000, dtype=jnp.int32)
    states = jax.vmap(lambda v: s.replace(inventory=s.inventory.replace(wood=v), player_food=v))(n)
    obs = UPSTREAM_OBS[CLASSIC](states)
    state_texts = templates[(CLASSIC, "compact")].observation_text(states)
    obs_texts = obs_templates[(CLASSIC, "compact")].observation_text(obs)
    assert state_texts[: CLASSIC_EXACT_MAX + 1] == obs_texts[: CLASSIC_EXACT_MAX + 1]
    off = [k for k in range(CLASSIC_EXACT_MAX + 1, 1000) if state_texts[k] != obs_texts[k]]
    assert off and off[0] == CLASSIC_EXACT_MAX + 1
    for k in off:
        wood = lambda t: int(t.split("wood=")[1].split()[0])
        assert abs(wood(state_texts[k]) - wood(obs_texts[k])) == 1


def test_env_is_told_by_the_observation_size():
    assert env_for_obs_size(8268) == CRAFTAX and env_for_obs_size(1345) == CLASSIC
    with pytest.raises(ValueError, match="1000 floats fits no env"):
        env_for_obs_size(1000)


def test_obs_template_refuses_wrong_input(obs_templates, state_chunks):
    tpl = obs_templates[(CLASSIC, "compact")]
    with pytest.raises(ValueError, match=r"shape \[1345\].*jax.vmap"):
        tpl(jnp.zeros((2, 1345)))
    with pytest.raises(ValueError, match="8268 floats is the observation of Craftax-Symbolic-v1"):
        tpl(jnp.zeros(8268))
    with pytest.raises(ValueError, match="source='state'"):
        tpl(_one_state(state_chunks, CLASSIC))
    with pytest.raises(ValueError, match="float vectors, got dtype int32"):
        tpl(jnp.zeros(1345, jnp.int32))
