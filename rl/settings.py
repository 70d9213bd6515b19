"""The settings library the online (`rl.config`) and offline (`rl.offline.config`) configs share: a field with its
--help line, the ">= 1" checks, the JSON round trip's check of unknown keys, and the resume rule (which settings a
resumed run may change).
"""
from __future__ import annotations

from dataclasses import field
from typing import Any, Iterable, Mapping


def option(default: Any, group: str, help: str, applies: str | None = None, metavar: str | None = None) -> Any:
    """A dataclass field with its --help line and option group in `metadata` (`applies`: see rl.config)."""
    meta = {"group": group, "help": help} | ({"applies": applies} if applies is not None else {}) \
        | ({"metavar": metavar} if metavar else {})
    return field(default=default, metadata=meta)


def flag(name: str) -> str:
    """The command-line spelling of a setting: num_envs -> --num-envs."""
    return "--" + name.replace("_", "-")


def check_at_least_one(settings: Any, names: Iterable[str]) -> None:
    """ValueError (one line naming the flag) for the first of `names` whose value is below 1."""
    for name in names:
        if getattr(settings, name) < 1:
            raise ValueError(f"{flag(name)} must be >= 1, got {getattr(settings, name)}")


def check_known(d: Mapping[str, Any], known: Iterable[str], message: str) -> None:
    """ValueError when `d` has keys outside `known`: `message` formatted with {unknown} (the sorted list)."""
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise ValueError(message.format(unknown=unknown))


def resume_differences(old: Mapping[str, Any], new: Mapping[str, Any], mutable: Iterable[str]) -> dict[str, tuple]:
    """{name: (old, new)} of the settings that differ between a run's stored settings and a resume's, apart from
    the `mutable` ones (those a resume may change: they do not change what an update computes)."""
    mutable = set(mutable)
    return {k: (old[k], new.get(k)) for k in old if k not in mutable and old[k] != new.get(k)}
