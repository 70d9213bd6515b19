"""rl.probe (issue 25): every pair kind edits exactly its fields (state, craftax's observation, rendered text),
batched == one pair at a time, a hand-built critic gives the exact differences, the prompt-only and injected-text
edits, value diagnostics against plain loops, a plain PPO run end to end, and bad input in one line.

Classic, a few fresh worlds as base states (the run-based test plays the policy for them); the tiny LLM.
"""
from __future__ import annotations

import difflib
import json
import re

import distrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from render.envs import CLASSIC
from rl.probe import pairs as P
from rl.probe.core import Prober, probe_policy
from rl.probe.metrics import STAT_KEYS, returns_to_go, value_diagnostics
from rl.probe.policy import ProbePolicy

N = 4
MAP = 7 * 9 * 21  # Classic observation: [7, 9, 21] window, then 22 flat values
FLAT = {"health": 12, "food": 13, "drink": 14, "energy": 15, "light": 20,
        **{k: i for i, k in enumerate(("wood", "stone", "coal", "iron", "diamond", "sapling"))}}
MOB_CHANNEL = {"zombie": 17, "skeleton": 19, "arrow": 20}
CLASSIC_KINDS = [k for k in P.KINDS if k.builder(CLASSIC) is not None]


@pytest.fixture(scope="module")
def states():
    from render.sample_states import reset_states

    return reset_states(CLASSIC, N, seed=3)


@pytest.fixture(scope="module")
def built(states):
    """kind name -> (low, high, ok, obs_low, obs_high, text_low, text_high) on the base states: craftax's own
    observation and the compact text of every side (one batched call each)."""
    from render import render_text
    from render.envs import make_raw_env

    env, _ = make_raw_env(CLASSIC)
    obs = jax.jit(jax.vmap(env.get_obs))
    out = {}
    for i, kind in enumerate(CLASSIC_KINDS):
        edit = jax.jit(jax.vmap(kind.builder(CLASSIC)))
        low, high, ok = edit(jax.random.split(jax.random.PRNGKey(i), N), states)
        out[kind.name] = jax.device_get((low, high, ok, obs(low), obs(high))) + (
            render_text(low, CLASSIC, "compact"), render_text(high, CLASSIC, "compact"))
    return out


def _changed_fields(a, b) -> set[str]:
    changed = set()
    for name in a.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if any(not np.array_equal(u, v) for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y))):
            changed.add(name)
    return changed


def _one(tree, i):
    return jax.tree.map(lambda a: a[i], tree)


def _text_diff(a: str, b: str) -> list[str]:
    return [d for d in difflib.ndiff(a.splitlines(), b.splitlines()) if d[:2] in ("- ", "+ ")]


@pytest.mark.parametrize("kind", CLASSIC_KINDS, ids=lambda k: k.name)
def test_each_kind_changes_exactly_its_fields(kind, built):
    """State: only the kind's fields differ; craftax's own observation: only the indices of that fact; the
    rendered text: only the lines of that fact."""
    low, high, ok, obs_low, obs_high, text_low, text_high = built[kind.name]
    assert ok.sum() >= N - 1, f"{kind.name} could be built on only {ok.sum()} of {N} fresh worlds"
    name = kind.name.split("_")[0]
    for i in np.flatnonzero(ok):
        changed = _changed_fields(_one(low, i), _one(high, i))
        assert changed and changed <= set(kind.fields), (kind.name, changed)
        d = np.flatnonzero(obs_low[i] != obs_high[i])
        if name in FLAT:
            assert d.tolist() == [MAP + FLAT[name]], (kind.name, d)
        elif kind.name == "darkness":
            assert d.tolist() == [MAP + FLAT["light"]], d
        elif name in MOB_CHANNEL:  # the mob's channel on 1 tile (absent) or 2 tiles (far)
            assert (d < MAP).all() and set(d % 21) == {MOB_CHANNEL[name]}, d
            assert len(d) == (1 if kind.name.endswith("adjacent") else 2), d
        else:  # a block on one tile: its old and new one-hot channels
            assert len(d) == 2 and (d < MAP).all() and len(set(d // 21)) == 1 and (d % 21 < 17).all(), d
        diff = _text_diff(text_low[i], text_high[i])
        if name in FLAT or kind.name == "darkness":
            label = "Status:" if name in ("health", "food", "drink", "energy", "darkness") else "Inventory:"
            assert len(diff) == 2 and all(line[2:].startswith(label) for line in diff), diff
            shown = "light=" if name == "darkness" else f"{name}="
            assert shown in diff[1], diff
        elif name in MOB_CHANNEL:
            assert {line[2:].split(": ")[1] for line in diff} == {name}, diff
            assert len(diff) == (1 if kind.name.endswith("adjacent") else 2), diff
            adjacent = [line for line in diff if line.startswith("+ ")]
            r, c = map(int, re.match(r"\+ (-?\d), (-?\d):", adjacent[0]).groups())
            assert abs(r) + abs(c) == 1, adjacent
        else:
            block = {"table_in_view": "crafting table", "water_in_view": "water"}[kind.name]
            assert diff[0].startswith("+ ") and diff[0].endswith(f": {block}"), diff
            assert all(line.startswith("- ") for line in diff[1:]) and len(diff) <= 2, diff  # at most one pushed out


# --------------------------------------------------------------------------------------- hand-built policies

def _critic(params, obs, hidden=None):
    """V = w * (health - energy) read from the observation (exact integers); logits [0, health/10, energy/10]."""
    health = jnp.round(obs[:, MAP + FLAT["health"]] * 10)
    energy = jnp.round(obs[:, MAP + FLAT["energy"]] * 10)
    v = params["w"] * (health - energy)
    if hidden is not None:
        v = v + 0.0 * hidden.sum(-1)
    logits = jnp.stack([jnp.zeros_like(health), obs[:, MAP + FLAT["health"]], obs[:, MAP + FLAT["energy"]]], -1)
    return distrax.Categorical(logits=logits), v


def test_hand_built_critic_gives_exact_differences_and_signs(states):
    policy = ProbePolicy("hand-built", CLASSIC, {"w": jnp.float32(1.0)}, _critic, None, 0, 0.99)
    probe = probe_policy(policy, ["health", "energy", "food", "zombie_adjacent", "prompt:health"], states=states)
    assert "prompt:health" in probe["not_built"]  # no LLM: no prompt-only edits
    k = probe["kinds"]
    assert set(k["health"].modes) == {"real"}
    health, energy, food = (k[n].modes["real"] for n in ("health", "energy", "food"))
    d = P.STATUS_HIGH - P.STATUS_LOW
    assert health["n"] == N and health["sign_correct"] == 1.0
    assert health["mean_dv"] == health["median_dv"] == health["p10_dv"] == health["p90_dv"] == d
    assert energy["sign_correct"] == 0.0 and energy["mean_dv"] == -d
    assert food["mean_dv"] == 0.0 and food["sign_correct"] == 0.0 and food["kl"] == 0.0
    f16 = lambda x: float(np.float16(x / 10))  # craftax stores status / 10 in float16
    lp = lambda h: jax.nn.log_softmax(jnp.array([0.0, f16(h), f16(9)]))  # energy of a fresh world: 9
    kl = float(jnp.sum(jnp.exp(lp(P.STATUS_LOW)) * (lp(P.STATUS_LOW) - lp(P.STATUS_HIGH))))
    assert health["kl"] == pytest.approx(kl, rel=1e-5)
    top = lambda h: int(np.argmax(lp(h)))  # numpy's argmax: the first of tied logits, as the probe's
    assert health["top_changed"] == float(top(P.STATUS_LOW) != top(P.STATUS_HIGH))
    assert set(health) >= set(STAT_KEYS)


def test_offline_run_loads_through_the_contract(tmp_path, monkeypatch, states):
    """A config.json of kind offline-awr goes to rl.offline.load_policy (CONTRACTS.md; stubbed here to return an
    `rl.offline.policy.OfflinePolicy` of a hand-built critic instead of restoring a trained one)."""
    import rl.offline
    from rl.offline.policy import OfflinePolicy
    from rl.probe.policy import load_policy

    monkeypatch.setattr(rl.offline, "load_policy",
                        lambda run_dir: OfflinePolicy(CLASSIC, {"w": jnp.float32(2.0)}, _critic, False, None, 0))
    (tmp_path / "config.json").write_text(json.dumps({"kind": "offline-awr", "gamma": 0.9}))
    policy = load_policy(tmp_path)
    assert policy.env == CLASSIC and policy.gamma == 0.9 and not policy.uses_hidden
    probe = probe_policy(policy, ["health"], states=states)
    assert probe["kinds"]["health"].modes["real"]["mean_dv"] == 2 * (P.STATUS_HIGH - P.STATUS_LOW)


@pytest.fixture(scope="module")
def llm_policy():
    """The hand-built critic reading the tiny LLM's hidden state (with weight 0 for its value; a small weight
    on the logits), built like an online run's policy."""
    from rl.config import TrainConfig
    from rl.llm import load_llm
    from rl.probe.policy import _llm_parts

    cfg = TrainConfig(env=CLASSIC, encoder="inscan", model="tiny", llm_dtype="float32")
    llm = load_llm(cfg)

    def apply(params, obs, hidden):
        pi, v = _critic(params, obs, hidden)
        return distrax.Categorical(logits=pi.logits + 0.01 * hidden[:, :3]), v + params["h"] * hidden[:, 0]

    parts = _llm_parts(cfg, llm.model, llm.tokenizer, llm.template, llm.prefix_cache)
    return ProbePolicy("hand-built-llm", CLASSIC, {"w": jnp.float32(1.0), "h": jnp.float32(0.0)}, apply, parts, 4, 0.99)


def test_batched_equals_one_pair_at_a_time(llm_policy, built):
    """real, zero and other_prompt are per pair (noise and shuffled depend on the batch by design)."""
    prober = Prober(llm_policy)  # every mode: the same program as the next test's (the compile cache serves it)
    per_pair = [prober.modes.index(m) for m in ("real", "zero", "other_prompt")]
    low, high = built["zombie_adjacent"][:2]
    key = jax.random.PRNGKey(0)
    values, logp = prober.evaluate(low, high, key)
    for i in range(2):
        v1, lp1 = prober.evaluate(jax.tree.map(lambda a: a[i:i + 1], low), jax.tree.map(lambda a: a[i:i + 1], high),
                                  key)
        np.testing.assert_allclose(v1[per_pair, :, 0], values[per_pair, :, i], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(lp1[per_pair, :, 0], logp[per_pair, :, i], rtol=1e-5, atol=1e-6)
    # the real and other-prompt hidden states differ, so the logits do
    assert not np.allclose(logp[per_pair[0]], logp[per_pair[2]])


def test_all_modes_prompt_only_and_injected_text(llm_policy, states):
    policy = llm_policy
    said = []
    probe = probe_policy(policy, ["health", "prompt:health", "prompt:enemy_adjacent_text",
                                  "prompt:nonsense_text"], states=states, show=1, say=said.append)
    # issue 37 item 13: the progress names every kind, the injected-text ones too (issue 35: with its time)
    per_kind = [line for line in said if line.startswith("  [")]
    assert [line.split("] ", 1)[1].split(": ")[0] for line in per_kind] == [
        "health", "prompt:health", "prompt:enemy_adjacent_text", "prompt:nonsense_text"]
    assert "the LLM vectors of health reused" in per_kind[1]  # prompt:health: the same ids as health
    assert said[-1].startswith("probe done in ") and "load excluded" in said[-1]
    k = probe["kinds"]
    assert list(k["health"].modes) == ["real", "zero", "noise", "shuffled", "other_prompt"]
    for mode, s in k["health"].modes.items():  # V does not read the hidden state: every mode is exact
        assert s["mean_dv"] == P.STATUS_HIGH - P.STATUS_LOW and s["sign_correct"] == 1.0, mode
    for name in ("prompt:health", "prompt:enemy_adjacent_text", "prompt:nonsense_text"):
        s = k[name].modes
        assert all(m["mean_dv"] == 0.0 for m in s.values()), name  # the observation is the same on both sides
        assert s["real"]["kl"] > 0 and s["zero"]["kl"] == 0.0, name  # only the LLM's text changed
    low, high = k["prompt:enemy_adjacent_text"].texts[0]
    assert high == low + "Warning: a zombie is adjacent to you and attacking.\n"


def test_probe_equals_each_kind_evaluated_alone(llm_policy, states):
    """The one pairs program (every edit behind one switch), the shared LLM call, the reused vectors of prompt-only
    kinds and the injected texts give what each kind gives built by its own builder and evaluated alone
    (`Prober.evaluate`: prepare, encode, heads), bit for bit."""
    from rl.probe import prompts
    from rl.probe.core import _result

    kinds = ["health", "zombie_adjacent", "table_in_view", "prompt:health", "prompt:zombie_adjacent",
             "prompt:enemy_adjacent_text", "prompt:nonsense_text"]
    probe = probe_policy(llm_policy, kinds, states=states)
    prober = Prober(llm_policy)
    key = jax.random.PRNGKey(0)
    for i, name in enumerate(kinds):
        k_pairs, k_mode = jax.random.split(jax.random.fold_in(key, i))
        if name in prompts.INJECTION_NAMES:
            inj = prompts.injection(name)
            ids = np.asarray(llm_policy.llm.tokenizer([inj.text], add_special_tokens=False)["input_ids"][0], np.int32)
            ok = np.ones(N, bool)
            if inj.needs_no_adjacent_zombie:
                ok = ~np.asarray(jax.vmap(lambda s: prompts.zombie_adjacent(CLASSIC, s))(states))
            values, logp = prober.evaluate(states, states, k_mode, inject=ids)
        else:
            kind = P.kind(name.removeprefix(prompts.PREFIX))
            low, high, ok = jax.vmap(kind.builder(CLASSIC))(jax.random.split(k_pairs, N), states)
            values, logp = prober.evaluate(low, high, k_mode, prompt_only=name.startswith(prompts.PREFIX))
        want = _result(name, probe["kinds"][name].expected_sign, "", prober.modes, values, logp, np.asarray(ok), [])
        got = probe["kinds"][name]
        diff = {m: {k: (got.modes[m][k], want.modes[m][k]) for k in want.modes[m] if got.modes[m][k] != want.modes[m][k]}
                for m in want.modes}
        assert not any(diff.values()) and got.built == want.built, (name, diff)
    assert list(probe["kinds"]) == kinds


def test_injected_ids_equal_the_tokenizer_on_the_joined_text(llm_policy, states):
    from rl.probe.prompts import inject_ids, tail_length

    llm = llm_policy.llm
    tpl = llm.template
    s = _one(states, 0)
    ids, n = jax.jit(tpl)(s)
    extra = "Purple elephants sing.\n"
    extra_ids = np.asarray(llm.tokenizer([extra], add_special_tokens=False)["input_ids"][0], np.int32)
    out, m = inject_ids(ids, n, extra_ids, tail_length(tpl, llm.tokenizer), tpl.pad_id)
    want = llm.tokenizer([tpl.observation_text(s) + extra + tpl.tail], add_special_tokens=False)["input_ids"][0]
    assert int(m) == len(want) and np.asarray(out)[: int(m)].tolist() == want
    assert (np.asarray(out)[int(m):] == tpl.pad_id).all()


# ------------------------------------------------------------------------------------------ value diagnostics

def test_returns_to_go_and_diagnostics_against_plain_loops():
    rng = np.random.default_rng(0)
    num_envs, steps, gamma = 3, 40, 0.9
    reward = rng.normal(size=num_envs * steps).astype(np.float32)
    done = rng.random(num_envs * steps) < 0.1
    rtg, valid = returns_to_go(reward, done, num_envs, gamma)
    for e in range(num_envs):
        idx = list(range(e, num_envs * steps, num_envs))
        for j, i in enumerate(idx):
            ends = [k for k in idx[j:] if done[k]]
            assert valid[i] == bool(ends)
            if ends:
                path = [k for k in idx[j:] if k <= ends[0]]
                assert rtg[i] == pytest.approx(sum(gamma ** t * reward[k] for t, k in enumerate(path)), rel=1e-6)
    value = rtg + rng.normal(scale=0.5, size=rtg.shape)
    nxt = rng.normal(size=rtg.shape)
    out = value_diagnostics(value, nxt, reward, done, rtg, valid, gamma)
    v, g = value[valid], rtg[valid]
    assert out["pearson"] == pytest.approx(np.corrcoef(v, g)[0, 1])
    assert out["explained_variance"] == pytest.approx(1 - np.var(g - v) / np.var(g))
    td = reward + gamma * nxt * (1 - done) - value
    assert out["td_terminal"]["mean"] == pytest.approx(td[done].mean())
    assert sum(b["n"] for b in out["calibration"]) == valid.sum()


# ------------------------------------------------------------------------------------------- the command

@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """A plain PPO run of the test preset, recording its rollouts as trajectory files."""
    from rl.train import main as train_main

    root = tmp_path_factory.mktemp("probe")
    assert train_main(["--preset", "test", "--run-dir", str(root / "run"), "--save-trajectories",
                       str(root / "traj"), "--quiet"]) == 0
    return root


def test_plain_ppo_run_probes_without_llm_modes(plain_run, capsys):
    from rl.probe.__main__ import main

    out = plain_run / "out"
    rc = main([str(plain_run / "run"), "--pairs", "3", "--play-steps", "8", "--kinds", "health", "zombie_adjacent",
               "prompt:wood", "--out", str(out), "--show", "1", "--trajectories", str(plain_run / "traj")])
    assert rc == 0
    data = json.loads((out / "probe.json").read_text())
    (run,) = data["runs"]
    assert run["run"] == str(plain_run / "run") and set(run["kinds"]) == {"health", "zombie_adjacent"}
    for k in run["kinds"].values():
        assert k["expected_sign"] in (1, -1) and list(k["modes"]) == ["real"]
        assert set(k["modes"]["real"]) == set(STAT_KEYS)
    details = json.loads((out / "probe_details.json").read_text())
    assert details["runs"][0]["value"]["samples"] == 8 * 8 * 3
    assert (out / "probe.png").stat().st_size > 0 and "zombie_adjacent" in (out / "show.txt").read_text()
    assert "health" in capsys.readouterr().out


@pytest.mark.parametrize("argv, says", [
    (["/nonexistent/run"], "not a run directory"),
    (["RUN", "--kinds", "bogus"], "unknown pair kind"),
    (["RUN", "--trajectories", "DAMAGED"], "traj-000000000000.npz: unreadable as .npz"),  # issue 37 item 3
])
def test_bad_input_is_one_line(argv, says, plain_run, capsys, tmp_path):
    import shutil

    from rl.probe.__main__ import main

    damaged = tmp_path / "damaged"
    shutil.copytree(plain_run / "traj", damaged)
    corrupt_middle(damaged / "traj-000000000000.npz")  # still a valid zip: only the member's CRC tells
    argv = [str(plain_run / "run") if a == "RUN" else str(damaged) if a == "DAMAGED" else a for a in argv]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and says in err[0], err
    assert "loading" not in " ".join(err)  # refused before the run is loaded and played


def corrupt_middle(path):
    """Overwrite 64 bytes in the middle of a file (an .npz stays a valid zip; the member's CRC no longer matches)."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 64] = bytes(b ^ 0xFF for b in data[mid:mid + 64])
    path.write_bytes(bytes(data))


def test_one_ids_width_where_the_llm_plan_allows(llm_policy):
    """Kinds without injected text read the injected width (one LLM compile) only where the LLM's static plan is
    the same at both widths; otherwise the template's width."""
    import dataclasses

    from rl.probe import build, prompts
    from rl.probe.core import ids_widths

    t = llm_policy.llm.template.max_len
    wide = t + prompts.MAX_INJECTED
    with_text, _ = build.plan_entries(llm_policy, ["health", "prompt:nonsense_text"])
    without, _ = build.plan_entries(llm_policy, ["health", "prompt:health"])
    same = dataclasses.replace(llm_policy, llm=dataclasses.replace(llm_policy.llm, plan=lambda b, w: "one plan"))
    unknown = dataclasses.replace(llm_policy, llm=dataclasses.replace(llm_policy.llm, plan=None))
    assert ids_widths(same, with_text, 4) == (wide, wide)
    assert ids_widths(unknown, with_text, 4) == (wide, t)
    assert ids_widths(same, without, 4) == (t, t)
    # on the CPU the windowed attention reads max_len: the plans differ, each width keeps its compile
    assert ids_widths(llm_policy, with_text, 4) == (wide, t)


def test_packed_plan_sees_the_width_only_through_the_attention():
    """jaxllm.encoder.packed_plan: cuDNN's grid is the same for close widths; the XLA form's window is not."""
    import jax.numpy as jnp

    from jaxllm.encoder import packed_plan

    impl, capacity, sizes, per_pass = packed_plan(256, 1138, None, jnp.float32)
    assert impl == "xla" and capacity == 36864 and per_pass == 1138 and sizes[-1] == 36864  # DEFAULT_CAPACITY
    assert packed_plan(256, 1138, None, jnp.float32) != packed_plan(256, 1170, None, jnp.float32)


def test_the_play_compiles_ahead_and_plays_play_states_base_states(llm_policy, monkeypatch):
    """Playing for its base states, the probe compiles the play's window beside its other programs and runs nothing
    before every program compiled (issue 35: compiles beside the play's windows slowed each ~12x on an H100); the
    compiled-ahead play (one executable for every window: the carry between windows holds no hidden state) gives
    `play_states`' base states bit for bit."""
    from rl.probe import core
    from rl.probe.states import play_states

    said, played = [], {}
    run_entries = core._run_entries

    def spy(policy, prober, entries, states, *args):
        played["states"] = states
        return run_entries(policy, prober, entries, states, *args)

    monkeypatch.setattr(core, "_run_entries", spy)
    probe_policy(llm_policy, ["health"], n_pairs=3, play_steps=12, say=said.append)
    first = lambda prefix: next(i for i, line in enumerate(said) if line.startswith(prefix))  # noqa: E731
    compiled, playing = first("compiled in "), first("playing ")
    assert compiled < playing and "the play compiled ahead" in said[playing]
    assert all(name in said[compiled] for name in ("play ", "pairs ", "LLM encode", "heads ")), said[compiled]
    assert not any(line.startswith("waiting for") for line in said[playing:])  # nothing compiles after the play
    assert any(line.startswith("  played window 3/3") for line in said)  # windows after the first: the same program
    want = play_states(llm_policy, 3, 0, 12)
    for a, b in zip(jax.tree.leaves(played["states"]), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
