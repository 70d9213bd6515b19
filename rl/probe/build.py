"""Every kind's pairs from ONE compiled program, on the device.

`plan_entries(policy, kinds)` turns the kinds to probe into `Entry`s (which edit, prompt-only, which injected
sentence) and the reasons of those not built; `make_pairs(policy, entries, width)` compiles one function
(base states [N], key, edit, prompt_only, inject) -> `Pairs` of one entry: both sides' states, craftax's own
observation of both sides (the low one on both for a prompt-only kind), the run's token ids of both sides at one
`width` with their lengths, and ok. The entry picks its edit and its injected sentence with `lax.switch` (one
branch per distinct edit), so every kind runs the same executable on arrays of one shape: one compile, where a
program per kind compiled once per kind.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from rl.jit import compile_program
from rl.probe import pairs as pairs_mod
from rl.probe import prompts
from rl.probe.parts import ProbePolicy

BASE, BASE_NO_ZOMBIE = "base", "base_no_zombie"  # the injections' edits: the base state on both sides


@dataclass(frozen=True)
class Entry:
    """One kind to probe: its row in the program's edit switch and injection switch."""

    name: str
    index: int  # position in the requested kinds (its keys are fold_in(key, index))
    edit: str  # a state kind's name, BASE or BASE_NO_ZOMBIE
    prompt_only: bool
    inject: int  # 0: none; i >= 1: prompts.INJECTIONS[i - 1] appended to the low text
    expected_sign: int
    doc: str


@flax.struct.dataclass
class Pairs:
    """One entry's pairs as the program returns them (device arrays; ids/lengths None without an LLM)."""

    low: Any
    high: Any
    ok: jax.Array
    obs_low: jax.Array
    obs_high: jax.Array
    ids_low: jax.Array | None
    ids_high: jax.Array | None
    len_low: jax.Array | None
    len_high: jax.Array | None


def plan_entries(policy: ProbePolicy, kinds: list[str]) -> tuple[list[Entry], dict[str, str]]:
    """(entries to build, {kind: why not built}) of `kinds` in order, for `policy`'s env and LLM."""
    entries, not_built = [], {}
    for i, name in enumerate(kinds):
        prompt_only = name.startswith(prompts.PREFIX)
        if prompt_only and not policy.uses_hidden:
            not_built[name] = "prompt-only edits need a policy that reads an LLM hidden state"
            continue
        if name in prompts.INJECTION_NAMES:
            inj = prompts.injection(name)
            entries.append(Entry(name, i, BASE_NO_ZOMBIE if inj.needs_no_adjacent_zombie else BASE, True,
                                 prompts.INJECTION_NAMES.index(name) + 1, inj.expected_sign,
                                 f"text + {inj.text.strip()!r}"))
            continue
        kind = pairs_mod.kind(name[len(prompts.PREFIX):] if prompt_only else name)
        if kind.builder(policy.env) is None:
            not_built[name] = f"{policy.env} has no {', '.join(kind.fields)} for this edit"
            continue
        doc = ("observation of low; LLM reads: " if prompt_only else "") + kind.doc
        entries.append(Entry(name, i, kind.name, prompt_only, 0, kind.expected_sign, doc))
    return entries, not_built


def edit_names(entries: list[Entry]) -> tuple[str, ...]:
    """The distinct edits of `entries`, in first-use order: the program's edit switch."""
    return tuple(dict.fromkeys(e.edit for e in entries))


def injected_ids(tokenizer) -> tuple[np.ndarray, ...]:
    """The token ids of every injected sentence (prompts.INJECTIONS order)."""
    return tuple(np.asarray(tokenizer([i.text], add_special_tokens=False)["input_ids"][0], np.int32)
                 for i in prompts.INJECTIONS)


def make_pairs(policy: ProbePolicy, edits: tuple[str, ...], width: int):
    """The compiled pairs program: f(states [N], key, edit int32, prompt_only bool, inject int32) -> `Pairs`, where
    `edit` indexes `edits` and `inject` is an `Entry.inject`; ids are right-padded with the template's pad id to
    `width` (>= the template's max_len, + MAX_INJECTED where a sentence is injected)."""
    from render.envs import make_raw_env

    env = policy.env
    raw_env, _ = make_raw_env(env)
    llm = policy.llm
    branches = [_edit_branch(env, name) for name in edits]
    injections = () if llm is None else injected_ids(llm.tokenizer)
    for ids in injections:
        if len(ids) > prompts.MAX_INJECTED:
            raise ValueError(f"an injected text may take {prompts.MAX_INJECTED} tokens, this one takes {len(ids)}")
    if llm is not None and width < llm.template.max_len + prompts.MAX_INJECTED:
        injections = ()  # no entry injects (`core.ids_widths` gave the template's width): no injected branch to fit
    tail = None if llm is None else prompts.tail_length(llm.template, llm.tokenizer)

    def program(states, key, edit, prompt_only, inject):
        low, high, ok = jax.lax.switch(edit, branches, key, states)
        obs_low, obs_high = (jax.vmap(raw_env.get_obs)(s).astype(jnp.float32) for s in (low, high))
        obs_high = jnp.where(prompt_only, obs_low, obs_high)
        if llm is None:
            return Pairs(low, high, ok, obs_low, obs_high, None, None, None, None)
        (ids_low, len_low), (ids_high, len_high) = (jax.vmap(llm.template)(s) for s in (low, high))
        pad = lambda ids: jnp.pad(ids, ((0, 0), (0, width - ids.shape[1])), constant_values=llm.template.pad_id)

        def appended(extra):
            def branch(ids_low, len_low, ids_high, len_high):
                ids, lengths = jax.vmap(lambda i, n: prompts.inject_ids(i, n, extra, tail, llm.template.pad_id))(
                    ids_low, len_low)
                return pad(ids), lengths
            return branch

        keep = lambda ids_low, len_low, ids_high, len_high: (pad(ids_high), len_high)
        ids_high, len_high = jax.lax.switch(inject, [keep] + [appended(x) for x in injections],
                                            ids_low, len_low, ids_high, len_high)
        return Pairs(low, high, ok, obs_low, obs_high, pad(ids_low), ids_high, len_low, len_high)

    return compile_program(program, runs_llm=False)


def _edit_branch(env: str, name: str):
    """(key, states [N]) -> (low, high, ok [N]) of edit `name` (a state kind, BASE or BASE_NO_ZOMBIE)."""
    if name in (BASE, BASE_NO_ZOMBIE):
        def base(key, states):
            n = states.player_position.shape[0]
            ok = jnp.ones((n,), bool)
            if name == BASE_NO_ZOMBIE:
                ok = ~jax.vmap(lambda s: prompts.zombie_adjacent(env, s))(states)
            return states, states, ok
        return base
    edit = pairs_mod.kind(name).builder(env)
    return lambda key, states: jax.vmap(edit)(jax.random.split(key, states.player_position.shape[0]), states)
