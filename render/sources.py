"""What a template reads: a raw env state or the env's symbolic observation (`SOURCES`), and the function from
either to the formats' `View`. Above both `render.envs` (per env) and `render.observation` (the obs decoding).
"""
from __future__ import annotations

import importlib

from render.envs import check_env_name, check_state, is_batched
from render.observation import VIEWS, check_obs

SOURCES = ("state", "obs")  # what a template reads: a raw env state, or the env's symbolic observation vector


def view_function(env_name: str, source: str):
    """The function from ONE unbatched input to the formats' `View` of `env_name`: `source="state"` reads a raw
    craftax `EnvState`, `source="obs"` a symbolic observation vector (`render.observation`)."""
    modules = check_env_name(env_name)
    if source not in SOURCES:
        raise ValueError(f"unknown source {source!r}; choose one of {', '.join(SOURCES)}")
    if source == "obs":
        return VIEWS[env_name]
    return importlib.import_module(modules.formats).view_from_state


def check_input(x, env_name: str, source: str, batched: bool | None = None) -> None:
    """Raise unless `x` is what a template of `source` reads for `env_name` (`batched`: True [B, ...], False
    unbatched, None either; a state's batching is not checked here)."""
    if source == "obs":
        check_obs(x, env_name, batched)
    else:
        check_state(x, env_name)


def input_is_batched(x, source: str) -> bool:
    """True if `x` (a state or observation of `source`) has a leading batch axis."""
    return x.ndim == 2 if source == "obs" else is_batched(x)
