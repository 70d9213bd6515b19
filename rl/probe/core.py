"""The probe of one policy: base states, every pair kind built and evaluated (one jitted call per kind, all modes),
prompt-only edits, the texts of the first pairs, and value diagnostics on trajectory files."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from rl.jit import compile_llm, compile_program
from rl.probe import pairs as pairs_mod
from rl.probe import prompts
from rl.probe.forward import make_forward, make_prepare, modes_for, pad_ids
from rl.probe.metrics import STAT_KEYS, pair_stats
from rl.probe.parts import ProbePolicy
from rl.probe.states import play_states


def all_kinds(uses_hidden: bool) -> tuple[str, ...]:
    """Every kind name: the state kinds, then (policies with an LLM) their prompt-only versions and injections."""
    names = pairs_mod.KIND_NAMES
    if uses_hidden:
        names += tuple(prompts.PREFIX + k for k in pairs_mod.KIND_NAMES) + prompts.INJECTION_NAMES
    return names


def check_kinds(kinds) -> None:
    """ValueError (one line, naming the choices) for a kind name the probe does not know."""
    known = all_kinds(True)
    bad = [k for k in kinds if k not in known]
    if bad:
        raise ValueError(f"unknown pair kind(s) {', '.join(bad)}; choose from {', '.join(known)}")


@dataclass
class KindResult:
    """One kind's outcome: contract statistics per mode, and what stays out of probe.json."""

    name: str
    expected_sign: int
    doc: str
    built: int
    skipped: int
    modes: dict[str, dict[str, Any]]
    texts: list[tuple[str, str]] = field(default_factory=list)  # (low, high) observation texts of the first pairs

    def contract(self) -> dict[str, Any]:
        return {"expected_sign": self.expected_sign,
                "modes": {m: {k: s[k] for k in STAT_KEYS} for m, s in self.modes.items()}}

    def details(self) -> dict[str, Any]:
        return {"doc": self.doc, "pairs": self.built, "skipped": self.skipped,
                "top_changed": {m: s["top_changed"] for m, s in self.modes.items()}}


class Prober:
    """The compiled pieces for one policy (prepare, forward, per-kind pair builders) and `evaluate`."""

    def __init__(self, policy: ProbePolicy, modes: tuple[str, ...] | None = None):
        self.policy = policy
        self.modes = tuple(modes or modes_for(policy))
        self.prepare = make_prepare(policy)
        self.forward = make_forward(policy, self.modes)
        self._builders: dict[str, Callable] = {}
        llm = policy.llm
        if llm is not None:
            self._tail = prompts.tail_length(llm.template, llm.tokenizer)

    def builder(self, kind: pairs_mod.PairKind) -> Callable | None:
        """Jitted (states [N], key) -> (low, high, ok) of `kind` on this env; None where it does not exist."""
        if kind.name not in self._builders:
            edit = kind.builder(self.policy.env)
            self._builders[kind.name] = None if edit is None else compile_program(
                lambda states, key: jax.vmap(edit)(jax.random.split(key, states.player_position.shape[0]), states),
                runs_llm=False)
        return self._builders[kind.name]

    def evaluate(self, low, high, key, prompt_only: bool = False, inject: np.ndarray | None = None):
        """(values [M, 2, N], log-probs [M, 2, N, A]) as numpy: the pairs (low[i], high[i]) under every mode.
        prompt_only: both sides observe `low`, only the LLM's ids come from `high`; `inject`: ids appended to
        the low text instead (high unused)."""
        obs_lo, obs_hi, ids_lo, ids_hi, len_lo, len_hi = self.prepare(low, high)
        if prompt_only or inject is not None:
            obs_hi = obs_lo
        if inject is not None:
            llm = self.policy.llm
            if len(inject) > prompts.MAX_INJECTED:
                raise ValueError(f"an injected text may take {prompts.MAX_INJECTED} tokens, this one takes {len(inject)}")
            ids_hi, len_hi = jax.vmap(lambda i, n: prompts.inject_ids(i, n, inject, self._tail, llm.template.pad_id))(
                ids_lo, len_lo)
            width = ids_lo.shape[1] + prompts.MAX_INJECTED  # one width (one compile) for every injected text
            ids_lo, ids_hi = (pad_ids(x, width, llm.template.pad_id) for x in (ids_lo, ids_hi))
        llm_args = (self.policy.llm.args, self.policy.llm.other_args) if self.policy.llm else (None, None)
        out = self.forward(self.policy.params, *llm_args, obs_lo, obs_hi, ids_lo, ids_hi, len_lo, len_hi, key)
        return jax.device_get(out)


def _texts(policy: ProbePolicy, states) -> list[str]:
    """The observation text of every state (the run's template; the compact format for a run without LLM)."""
    if policy.llm is not None:
        return policy.llm.template.observation_text(states)
    from render import render_text

    return render_text(states, policy.env, "compact")


def _take(states, idx):
    return jax.tree.map(lambda a: a[np.asarray(idx)], states)


def probe_policy(policy: ProbePolicy, kinds=None, n_pairs: int = 128, seed: int = 0, play_steps: int = 1024,
                 show: int = 0, modes=None, states=None, say=lambda text: None) -> dict[str, Any]:
    """Probe `policy`: {"kinds": {name: KindResult}, "not_built": {name: why}}. `states` (raw EnvStates [N])
    replaces the policy's own play (tests)."""
    prober = Prober(policy, modes)
    kinds = list(kinds or all_kinds(policy.uses_hidden))
    check_kinds(kinds)
    if states is None:
        say(f"playing {n_pairs} envs x {play_steps} steps with the policy for base states ...")
        states = play_states(policy, n_pairs, seed, play_steps)
    n = states.player_position.shape[0]
    results: dict[str, KindResult] = {}
    not_built: dict[str, str] = {}
    key = jax.random.PRNGKey(seed)
    for i, name in enumerate(kinds):
        k_pairs, k_mode = jax.random.split(jax.random.fold_in(key, i))
        prompt_only = name.startswith(prompts.PREFIX)
        if prompt_only and not policy.uses_hidden:
            not_built[name] = "prompt-only edits need a policy that reads an LLM hidden state"
            continue
        if name in prompts.INJECTION_NAMES:
            say(f"  {name} ...")
            inj = prompts.injection(name)
            ids = np.asarray(policy.llm.tokenizer([inj.text], add_special_tokens=False)["input_ids"][0], np.int32)
            ok = np.ones(n, bool)
            if inj.needs_no_adjacent_zombie:
                ok = ~np.asarray(compile_program(jax.vmap(lambda s: prompts.zombie_adjacent(policy.env, s)),
                                                  runs_llm=False)(states))
            values, logp = prober.evaluate(states, states, k_mode, inject=ids)
            low_texts = _texts(policy, _take(states, np.flatnonzero(ok)[:show])) if show else []
            texts = [(t, t + inj.text) for t in low_texts]
            results[name] = _result(name, inj.expected_sign, f"text + {inj.text.strip()!r}", prober.modes, values,
                                    logp, ok, texts)
            continue
        kind = pairs_mod.kind(name[len(prompts.PREFIX):] if prompt_only else name)
        build = prober.builder(kind)
        if build is None:
            not_built[name] = f"{policy.env} has no {', '.join(kind.fields)} for this edit"
            continue
        say(f"  {name} ...")
        low, high, ok = build(states, k_pairs)
        ok = np.asarray(ok)
        values, logp = prober.evaluate(low, high, k_mode, prompt_only=prompt_only)
        texts = []
        if show:
            idx = np.flatnonzero(ok)[:show]
            texts = list(zip(_texts(policy, _take(low, idx)), _texts(policy, _take(high, idx))))
        doc = ("observation of low; LLM reads: " if prompt_only else "") + kind.doc
        results[name] = _result(name, kind.expected_sign, doc, prober.modes, values, logp, ok, texts)
    return {"kinds": results, "not_built": not_built}


def _result(name, sign, doc, modes, values, logp, ok, texts) -> KindResult:
    stats = {m: pair_stats(values[j, 0], values[j, 1], logp[j, 0], logp[j, 1], ok, sign) for j, m in enumerate(modes)}
    return KindResult(name, sign, doc, int(ok.sum()), int((~ok).sum()), stats, texts)


def trajectory_values(policy: ProbePolicy, directory: Path, batch: int = 512) -> dict[str, Any]:
    """Value diagnostics of `policy` on the trajectory files in `directory` (rl.probe.metrics.value_diagnostics),
    the hidden state of each observation read fresh by the run's LLM through the observation template (as rl.label
    does)."""
    from rl.probe.metrics import load_trajectories, returns_to_go, value_diagnostics

    data = load_trajectories(directory, policy.env)
    llm = policy.llm
    obs_template = None
    if llm is not None:
        from render import build_template

        obs_template = build_template(llm.tokenizer, policy.env, fmt=llm.obs_format,
                                      system_prompt=llm.system_prompt, source="obs")

    @partial(compile_llm if llm is not None else partial(compile_program, runs_llm=False))
    def values(params, llm_args, obs):
        hidden = None
        if obs_template is not None:
            ids, lengths = jax.vmap(obs_template)(obs)
            hidden = llm.encode_ids(*llm_args, ids, lengths)
        return policy.apply(params, obs, hidden)[1]

    def all_values(obs):
        out = []
        for start in range(0, len(obs), batch):
            chunk = obs[start:start + batch]
            padded = np.concatenate([chunk, np.repeat(chunk[-1:], batch - len(chunk), 0)])
            out.append(np.asarray(values(policy.params, llm.args if llm else None, jnp.asarray(padded)))[:len(chunk)])
        return np.concatenate(out)

    v, v_next = all_values(data["obs"]), all_values(data["next_obs"])
    rtg, valid = returns_to_go(data["reward"], data["done"], data["num_envs"], policy.gamma)
    return value_diagnostics(v, v_next, data["reward"], data["done"], rtg, valid, policy.gamma)
