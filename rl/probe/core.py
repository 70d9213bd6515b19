"""The probe of one policy: base states, every pair kind built and evaluated (the same compiled programs for every
kind, all modes), prompt-only edits, the texts of the first pairs, and value diagnostics on trajectory files."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rl.jit import CompileAhead, compile_llm, compile_program
from rl.probe import pairs as pairs_mod
from rl.probe import prompts
from rl.probe import build
from rl.probe.forward import encode_fn, make_encode, make_heads, make_prepare, modes_for, pad_ids
from rl.probe.metrics import STAT_KEYS, pair_stats
from rl.probe.parts import ProbePolicy
from rl.probe.states import Play, base_state_shapes


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
    """The compiled pieces for one policy: `prepare` (observations and ids of given states), `encode` (the LLM on
    both sides, shared by every kind), `heads` (the policy under every mode), and `evaluate`."""

    def __init__(self, policy: ProbePolicy, modes: tuple[str, ...] | None = None):
        self.policy = policy
        self.modes = tuple(modes or modes_for(policy))
        self.prepare = make_prepare(policy)
        self.encode = make_encode(policy, self.modes)
        self.heads = make_heads(policy, self.modes)
        llm = policy.llm
        if llm is not None:
            self._tail = prompts.tail_length(llm.template, llm.tokenizer)

    def vectors(self, ids_lo, ids_hi, len_lo, len_hi, encode=None):
        """(real, other) hidden vectors of both sides (None, None without an LLM); `encode`: a compiled executable
        of `self.encode` to run instead."""
        if self.policy.llm is None:
            return None, None
        llm = self.policy.llm
        return (encode or self.encode)(llm.args, llm.other_args, ids_lo, ids_hi, len_lo, len_hi)

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
        real, other = self.vectors(ids_lo, ids_hi, len_lo, len_hi)
        return jax.device_get(self.heads(self.policy.params, obs_lo, obs_hi, real, other, key))


def _texts(policy: ProbePolicy, states) -> list[str]:
    """The observation text of every state (the run's template; the compact format for a run without LLM)."""
    if policy.llm is not None:
        return policy.llm.template.observation_text(states)
    from render import render_text

    return render_text(states, policy.env, "compact")


def _take(states, idx):
    return jax.tree.map(lambda a: a[np.asarray(idx)], states)


def ids_widths(policy: ProbePolicy, entries: list[build.Entry], n: int) -> tuple[int, int]:
    """(the pairs program's ids width, the width the LLM reads for a kind without injected text). Injected texts
    need MAX_INJECTED more slots; every kind reads that one width (one compile of the LLM call) where the LLM's
    static plan is the same at both widths (`ProbeLLM.plan`: then the vectors are the same bit for bit), else the
    others keep the template's width (two compiles)."""
    llm = policy.llm
    if llm is None:
        return 0, 0
    t = int(llm.template.max_len)
    if not any(e.inject for e in entries):
        return t, t
    wide = t + prompts.MAX_INJECTED
    same = llm.plan is not None and llm.plan(2 * n, t) == llm.plan(2 * n, wide)
    return wide, wide if same else t


def _start_compiles(ahead: CompileAhead, policy: ProbePolicy, prober: Prober, pairs_program, state_shapes, n: int,
                    widths: tuple[int, int], make_play=None) -> Play | None:
    """Begin compiling the pairs program, the heads, the play's window (of `make_play()`, when the probe plays, from
    its inputs' shapes; its envs reset in a thread of their own meanwhile) and the LLM call at each ids width the
    kinds read, for `n` pairs of base states shaped `state_shapes` (`CompileAhead`: background threads). Returns the
    play (None without `make_play`).

    Everything starts at once: the play's window (env steps + the LLM) is the longest compile, and anything waiting
    for another job adds to it. On an H200 the window compiled in ~70 s, and it started only after the envs' reset
    (~30 s); the kinds' LLM call, which waited for the window so as to find its GEMMs in XLA's in-process autotuning
    cache, then added 18 s more (issue 35)."""
    from render.observation import OBS_SIZES

    sds = jax.ShapeDtypeStruct
    key = jax.random.PRNGKey(0)
    ahead.start("pairs", pairs_program, state_shapes, key, sds((), jnp.int32), sds((), jnp.bool_),
                sds((), jnp.int32))
    obs = sds((n, OBS_SIZES[policy.env]), jnp.float32)
    llm = policy.llm
    real = other = None
    if llm is not None:
        lengths = sds((n,), jnp.int32)
        ids = sds((n, widths[0]), jnp.int32)
        real, other = jax.eval_shape(encode_fn(policy, prober.modes), llm.args, llm.other_args, ids, ids, lengths,
                                     lengths)
    ahead.start("heads", prober.heads, policy.params, obs, obs, real, other, key)
    play = None
    if make_play is not None:
        play = make_play()
        ahead.submit("play", play.compile)
        ahead.submit("envs reset", play.reset)
    if llm is not None:
        for w in sorted(set(widths)):
            ids = sds((n, w), jnp.int32)
            args = (llm.args, llm.other_args, ids, ids, lengths, lengths)
            ahead.start(f"LLM encode (width {w})", prober.encode, *args)
    return play


def probe_policy(policy: ProbePolicy, kinds=None, n_pairs: int = 128, seed: int = 0, play_steps: int = 1024,
                 show: int = 0, modes=None, states=None, say=lambda text: None) -> dict[str, Any]:
    """Probe `policy`: {"kinds": {name: KindResult}, "not_built": {name: why}}. `states` (raw EnvStates [N])
    replaces the policy's own play (tests).

    The programs (the play's window, the pairs of every kind, the LLM on a kind's prompts, the policy's heads)
    compile in background threads, all before anything runs (`_start_compiles`); then the policy plays for base
    states and every kind runs the same executables. A prompt-only kind
    whose ids equal its state kind's (an edit that draws nothing at random) reuses that kind's vectors."""
    t_start = time.perf_counter()
    kinds = list(kinds or all_kinds(policy.uses_hidden))
    check_kinds(kinds)
    prober = Prober(policy, modes)
    entries, not_built = build.plan_entries(policy, kinds)
    n = n_pairs if states is None else int(states.player_position.shape[0])
    width, read_width = ids_widths(policy, entries, n)
    edits = build.edit_names(entries)
    pairs_program = build.make_pairs(policy, edits, width)
    ahead = CompileAhead(say)
    shapes = (base_state_shapes(policy, n_pairs) if states is None else
              jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), states))
    llm_part = "" if policy.llm is None else ", the LLM on a kind's prompts"
    play_part = "" if states is not None else ", the play's window (the envs reset meanwhile)"
    say(f"compiling the probe's programs in the background: the pairs of all {len(entries)} kinds (one program), "
        f"the policy's heads{play_part}{llm_part} ...")
    t_compile = time.perf_counter()
    make_play = None if states is not None else lambda: Play(policy, n_pairs, seed, play_steps)
    play = _start_compiles(ahead, policy, prober, pairs_program, shapes, n, (width, read_width), make_play)
    # every program compiled before anything runs: a compile beside the play's windows (CPU compiles, GPU autotuning)
    # slowed each window ~12x on an H100 (issue 35: windows 2-16 took 4.8 s each instead of 0.4 s)
    ahead.wait_all()
    t_compile = time.perf_counter() - t_compile
    say(f"compiled in {t_compile:.1f} s ({ahead.summary()})")
    t_play = time.perf_counter()
    if play is not None:
        states = play.play(say, ahead.get("play"))
    t_play = time.perf_counter() - t_play
    pairs_exec = ahead.get("pairs")
    heads_exec = ahead.get("heads")
    say(f"probing {len(entries)} kinds of {n} pairs under {len(prober.modes)} mode(s) ...")
    t_kinds = time.perf_counter()
    results, shared = _run_entries(policy, prober, entries, states, seed, show, pairs_exec, heads_exec,
                                   ahead, width, read_width, say)
    t_kinds = time.perf_counter() - t_kinds
    ordered = {name: results[name] for name in kinds if name in results}
    total = time.perf_counter() - t_start
    say(f"probe done in {total:.1f} s (load excluded): compile {t_compile:.1f} s, play {t_play:.1f} s, kinds "
        f"{t_kinds:.1f} s "
        f"({shared} of {len(entries)} reused another kind's LLM vectors)")
    return {"kinds": ordered, "not_built": {k: not_built[k] for k in kinds if k in not_built}}


def _run_entries(policy, prober, entries, states, seed, show, pairs_exec, heads_exec, ahead, width, read_width,
                 say):
    """Every entry through the pairs, encode and heads executables: ({name: KindResult}, how many reused)."""
    key = jax.random.PRNGKey(seed)
    edits = build.edit_names(entries)
    results: dict[str, KindResult] = {}
    kept: dict[str, tuple] = {}  # state kind -> (ids/lengths it encoded, its vectors): for prompt-only reuse
    shared = 0
    for j, entry in enumerate(entries):
        t0 = time.perf_counter()
        k_pairs, k_mode = jax.random.split(jax.random.fold_in(key, entry.index))
        p = pairs_exec(states, k_pairs, jnp.int32(edits.index(entry.edit)), jnp.bool_(entry.prompt_only),
                       jnp.int32(entry.inject))
        what = ""
        if policy.llm is None:
            real, other = None, None
        else:
            w = width if entry.inject else read_width
            ids = tuple(x[:, :w] if w < width else x for x in (p.ids_low, p.ids_high)) + (p.len_low, p.len_high)
            source = kept.get(entry.edit) if entry.prompt_only and not entry.inject else None
            if source is not None and _same(source[0], ids):
                real, other = source[1]
                shared += 1
                what = f", the LLM vectors of {entry.edit} reused (the same prompts)"
            else:
                real, other = prober.vectors(*ids, encode=ahead.get(f"LLM encode (width {w})"))
                what = f", LLM on {4 if other is not None else 2} x {p.ok.shape[0]} prompts"
            if not entry.prompt_only:
                kept[entry.name] = (ids, (real, other))
        values, logp = jax.device_get(heads_exec(policy.params, p.obs_low, p.obs_high, real, other, k_mode))
        ok = np.asarray(p.ok)
        texts = []
        if show:
            idx = np.flatnonzero(ok)[:show]
            if entry.inject:
                inj = prompts.INJECTIONS[entry.inject - 1]
                texts = [(t, t + inj.text) for t in _texts(policy, _take(p.low, idx))]
            else:
                texts = list(zip(_texts(policy, _take(p.low, idx)), _texts(policy, _take(p.high, idx))))
        results[entry.name] = _result(entry.name, entry.expected_sign, entry.doc, prober.modes, values, logp, ok,
                                      texts)
        say(f"  [{j + 1}/{len(entries)}] {entry.name}: {time.perf_counter() - t0:.1f} s{what}")
    return results, shared


def _same(a: tuple, b: tuple) -> bool:
    """Whether two (ids_low, ids_high, len_low, len_high) tuples hold the same values (one small device check)."""
    return all(x.shape == y.shape for x, y in zip(a, b)) and bool(
        jnp.all(jnp.asarray([jnp.array_equal(x, y) for x, y in zip(a, b)])))


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
