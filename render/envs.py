"""Env names, their craftax classes, and the format registry: the one place that maps an env name to code.

Craftax's own `make_craftax_env_from_name` builds the env; `ENVS` says where the rest of each env lives and the
facts other modules read (observation size, the observation decoder, the pixel renderer).
"""
from __future__ import annotations

import functools
import importlib
from typing import NamedTuple

import jax

from render.layout import Format

CRAFTAX = "Craftax-Symbolic-v1"
CLASSIC = "Craftax-Classic-Symbolic-v1"
FORMATS = ("compact", "full")


class EnvModules(NamedTuple):
    """Where an env's pieces live (module paths, imported on first use) and its facts."""

    state: str  # its raw `EnvState` class
    constants: str  # its `Achievement` enum and `BLOCK_PIXEL_SIZE_IMG`
    formats: str  # its render formats (`formats()` -> {name: Format}) and `view_from_state`
    obs_size: int  # floats of its symbolic observation vector
    obs_view: str  # the `render.observation` function: one observation vector -> the formats' `View`
    renderer: str  # its pixel renderer (`make_craftax_pixel_renderer`)
    night_noise: bool  # the renderer takes `do_night_noise`


ENVS: dict[str, EnvModules] = {
    CRAFTAX: EnvModules("craftax.craftax.craftax_state", "craftax.craftax.constants", "render.formats_craftax",
                        obs_size=9 * 11 * 83 + 51, obs_view="craftax_view", renderer="craftax.craftax.renderer",
                        night_noise=True),
    CLASSIC: EnvModules("craftax.craftax_classic.envs.craftax_state", "craftax.craftax_classic.constants",
                        "render.formats_classic", obs_size=7 * 9 * 21 + 22, obs_view="classic_view",
                        renderer="craftax.craftax_classic.renderer", night_noise=False),
}
ENV_NAMES = tuple(ENVS)


def check_env_name(env_name: str) -> EnvModules:
    """`env_name`'s modules; ValueError naming the supported envs if it is not one of them."""
    if env_name not in ENVS:
        raise ValueError(f"unknown env {env_name!r}; choose one of {', '.join(ENV_NAMES)}")
    return ENVS[env_name]


def make_raw_env(env_name: str):
    """The craftax env of `env_name` without auto-reset, and its default params."""
    check_env_name(env_name)
    # Concrete even when called while an outer jit traces (e.g. `jax.jit(lambda seed: sample_states(...))`): craftax
    # imports its env modules here on first use, and their module-level jnp constants (CLOSE_BLOCKS, DIRECTIONS, ...)
    # would otherwise be that trace's tracers, kept by the modules (UnexpectedTracerError in every later call).
    with jax.ensure_compile_time_eval():
        from craftax.craftax_env import make_craftax_env_from_name

        env = make_craftax_env_from_name(env_name, auto_reset=False)
        return env, env.default_params


def achievement_names(env_name: str) -> tuple[str, ...]:
    """`env_name`'s achievements, lower case, in the order of its achievement vector."""
    achievement = importlib.import_module(check_env_name(env_name).constants).Achievement
    return tuple(a.name.lower() for a in sorted(achievement, key=lambda a: a.value))


def state_class(env_name: str) -> type:
    """The raw craftax `EnvState` class of `env_name`."""
    return importlib.import_module(check_env_name(env_name).state).EnvState


def check_state(state, env_name: str) -> None:
    """Raise TypeError unless `state` is the raw craftax EnvState of `env_name` (batched or not)."""
    expected = state_class(env_name)
    if not isinstance(state, expected):
        raise TypeError(
            f"render for {env_name!r} needs a {expected.__module__}.{expected.__qualname__}, got "
            f"{type(state).__module__}.{type(state).__qualname__}. Pass the raw craftax state of that env "
            "(unwrap LogWrapper/AutoReset wrappers first, e.g. `wrapped_state.env_state`), or build the "
            "template for the env the state comes from."
        )


def is_batched(state) -> bool:
    """True if `state` has a leading batch axis (player_position is [B, 2] rather than [2])."""
    return state.player_position.ndim == 2


@functools.lru_cache(maxsize=None)
def get_format(env_name: str, fmt: str) -> Format:
    """The `Format` (layout + values function) of `env_name` in format `fmt`."""
    modules = check_env_name(env_name)
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    return importlib.import_module(modules.formats).formats()[fmt]
