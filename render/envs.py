"""Env names, their state classes, and the format registry."""
from __future__ import annotations

import functools

from render.layout import Format

CRAFTAX = "Craftax-Symbolic-v1"
CLASSIC = "Craftax-Classic-Symbolic-v1"
ENV_NAMES = (CRAFTAX, CLASSIC)
FORMATS = ("compact", "full")


def _check_env_name(env_name: str) -> None:
    if env_name not in ENV_NAMES:
        raise ValueError(f"unknown env {env_name!r}; render supports {', '.join(ENV_NAMES)}")


def state_class(env_name: str) -> type:
    """The raw craftax `EnvState` class of `env_name`."""
    _check_env_name(env_name)
    if env_name == CRAFTAX:
        from craftax.craftax.craftax_state import EnvState
    else:
        from craftax.craftax_classic.envs.craftax_state import EnvState
    return EnvState


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
    _check_env_name(env_name)
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if env_name == CRAFTAX:
        from render.formats_craftax import formats
    else:
        from render.formats_classic import formats
    return formats()[fmt]


SOURCES = ("state", "obs")  # what a template reads: a raw env state, or the env's symbolic observation vector


def view_function(env_name: str, source: str):
    """The function from ONE unbatched input to the formats' `View` of `env_name`: `source="state"` reads a raw
    craftax `EnvState`, `source="obs"` a symbolic observation vector (`render.observation`)."""
    if env_name not in ENV_NAMES:
        raise ValueError(f"unknown env {env_name!r}; render supports {', '.join(ENV_NAMES)}")
    if source not in SOURCES:
        raise ValueError(f"unknown source {source!r}; choose one of {', '.join(SOURCES)}")
    if source == "obs":
        from render.observation import VIEWS

        return VIEWS[env_name]
    if env_name == CRAFTAX:
        from render.formats_craftax import view_from_state
    else:
        from render.formats_classic import view_from_state
    return view_from_state


def check_input(x, env_name: str, source: str, batched: bool | None = None) -> None:
    """Raise unless `x` is what a template of `source` reads for `env_name` (`batched`: True [B, ...], False
    unbatched, None either; a state's batching is not checked here)."""
    if source == "obs":
        from render.observation import check_obs

        check_obs(x, env_name, batched)
    else:
        check_state(x, env_name)


def input_is_batched(x, source: str) -> bool:
    """True if `x` (a state or observation of `source`) has a leading batch axis."""
    return x.ndim == 2 if source == "obs" else is_batched(x)
