"""rl.variants: prompt variants for rl.eval / rl.offline eval. Each transform changes the ids the LLM reads exactly
as it says (checked against the template's own ids and the tokenizer), and bad specs are one line naming the fix."""
import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl.variants import (RANDOM_FOLD, Variant, check_sections, gather, load_prompts_file, make_variant_encoder,
                         parse_prompt_flag, variant_ids)

CLASSIC = "Craftax-Classic-Symbolic-v1"
VOCAB = 1000


@pytest.fixture(scope="module")
def tpl(tokenizer):
    from render import build_template

    return build_template(tokenizer, CLASSIC, fmt="compact", assembly="jnp")


@pytest.fixture(scope="module")
def states():
    from rl.envs import BatchedEnv

    env = BatchedEnv(CLASSIC, 3)
    _, state = env.reset(jax.random.PRNGKey(0))
    key = jax.random.PRNGKey(1)
    for _ in range(5):  # a few steps: the inventory and status differ between envs
        key, k1, k2 = jax.random.split(key, 3)
        _, state, *_ = env.step(k1, state, jax.random.randint(k2, (3,), 0, env.num_actions))
    return state.env_state


def _rows(tpl, states, transform=None, key=jax.random.PRNGKey(5)):
    ids, lengths = jax.vmap(tpl)(states)
    if transform is not None:
        ids, lengths = transform(ids, lengths, key)
    ids, lengths = np.asarray(ids), np.asarray(lengths)
    return [list(ids[i, :lengths[i]]) for i in range(len(lengths))]


def _tail(tpl, tokenizer):
    return list(tokenizer([tpl.tail], add_special_tokens=False)["input_ids"][0])


def _only(tpl, keep, states):
    """The ids of the sections `keep` alone (the chat tail cut off)."""
    import dataclasses

    body = tuple(s.name for s, _ in tpl._sections if s.name not in keep and s.name != "chat_tail")
    return _rows(dataclasses.replace(tpl, dropped=body), states)


@pytest.mark.parametrize("section,names,gone", [("inventory", ("items_label", "items"), "Inventory"),
                                                 ("map", ("header", "map"), "Map:"),
                                                 ("status", ("status",), None)])
def test_drop_removes_exactly_that_sections_tokens(tpl, tokenizer, states, section, names, gone):
    full = _rows(tpl, states)
    vtpl, transform = variant_ids(Variant("v", "drop", sections=(section,)), tpl, tokenizer, VOCAB)
    dropped = _rows(vtpl, states, transform)
    order = [s.name for s, _ in tpl._sections]
    before = tuple(order[:order.index(names[0])])
    tail = len(_tail(tpl, tokenizer))
    for i in range(3):
        n_before = len(_only(tpl, before, states)[i]) - tail if before else 0
        block = _only(tpl, names, states)[i][:-tail]
        assert full[i][n_before:n_before + len(block)] == block
        assert dropped[i] == full[i][:n_before] + full[i][n_before + len(block):]
        if gone:
            assert gone in tokenizer.decode(full[i]) and gone not in tokenizer.decode(dropped[i])


def test_fixed_text_is_the_same_ids_for_every_state(tpl, tokenizer, states):
    text = "You are standing in an empty field."
    vtpl, transform = variant_ids(Variant("v", "fixed", text), tpl, tokenizer, VOCAB)
    rows = _rows(vtpl, states, transform)
    expected = list(tokenizer([text], add_special_tokens=False)["input_ids"][0]) + _tail(tpl, tokenizer)
    assert rows == [expected] * 3


def test_empty_is_the_chat_tail_alone(tpl, tokenizer, states):
    vtpl, transform = variant_ids(Variant("v", "empty"), tpl, tokenizer, VOCAB)
    assert _rows(vtpl, states, transform) == [_tail(tpl, tokenizer)] * 3


def test_random_tokens_keep_the_length_and_the_tail(tpl, tokenizer, states):
    full = _rows(tpl, states)
    vtpl, transform = variant_ids(Variant("v", "random"), tpl, tokenizer, VOCAB)
    a = _rows(vtpl, states, transform, jax.random.PRNGKey(5))
    b = _rows(vtpl, states, transform, jax.random.PRNGKey(6))
    tail = _tail(tpl, tokenizer)
    for f, x, y in zip(full, a, b):
        game = len(f) - len(tail)
        assert len(x) == len(f) and x[game:] == tail and max(x[:game]) < VOCAB
        assert np.mean(np.array(x[:game]) != np.array(f[:game])) > 0.9 and x[:game] != y[:game]
    assert a == _rows(vtpl, states, transform, jax.random.PRNGKey(5))  # deterministic in the key


def test_system_keeps_the_game_ids_and_changes_the_prefix(tpl, tokenizer, states):
    from rl.llm import LLMSetup

    v = Variant("v", "system", "You are a pirate.")
    vtpl, transform = variant_ids(v, tpl, tokenizer, VOCAB)
    assert _rows(vtpl, states, transform) == _rows(tpl, states)
    other = LLMSetup(None, tokenizer, tpl, None, 0).with_prompt(v.text).template
    assert other.prefix_ids != tpl.prefix_ids and "You are a pirate." in other.head
    assert _rows(other, states) == _rows(tpl, states)


def test_the_encoder_reads_the_variant_ids(tpl, tokenizer, states):
    """make_variant_encoder hands encode_ids exactly the transformed ids (the key folded as documented)."""
    seen = {}

    def encode_ids(params, cache, ids, lengths):
        seen["ids"], seen["lengths"] = ids, lengths
        return jnp.zeros((ids.shape[0], 4))

    llm = SimpleNamespace(template=tpl, tokenizer=tokenizer, model=SimpleNamespace(config=SimpleNamespace(
        vocab_size=VOCAB)))
    key = jax.random.PRNGKey(9)
    make_variant_encoder(Variant("v", "random"), llm, encode_ids)(None, None, states, key)
    _, transform = variant_ids(Variant("v", "random"), tpl, tokenizer, VOCAB)
    ids, lengths = transform(*jax.vmap(tpl)(states), jax.random.fold_in(key, RANDOM_FOLD))
    np.testing.assert_array_equal(seen["ids"], ids)
    np.testing.assert_array_equal(seen["lengths"], lengths)


def test_specs_from_flags_and_files(tmp_path):
    (tmp_path / "p.txt").write_text("Be brief.")
    assert parse_prompt_flag("short=@" + str(tmp_path / "p.txt")) == Variant("short", "system", "Be brief.")
    assert parse_prompt_flag("x=a=b") == Variant("x", "system", "a=b")
    f = tmp_path / "v.yaml"
    f.write_text("no_inv: {drop: inventory}\nfixed: {game_text: hello}\ngarbage: {random_tokens: true}\n"
                 "nothing: {empty: true}\npirate: You are a pirate.\nfromfile: {system_file: %s}\n" % (tmp_path / "p.txt"))
    got = {v.name: v for v in load_prompts_file(f)}
    assert got["no_inv"].sections == ("inventory",) and got["fixed"].text == "hello"
    assert got["garbage"].kind == "random" and got["nothing"].kind == "empty"
    assert got["pirate"].describe() == {"kind": "system", "system_prompt": "You are a pirate."}
    assert got["fromfile"].text == "Be brief."
    j = tmp_path / "v.json"
    j.write_text(json.dumps({"no_map": {"drop": ["map", "status"]}}))
    assert load_prompts_file(j)[0].sections == ("map", "status")


@pytest.mark.parametrize("flags,file_text,message", [
    (["p=@/no/such/file.txt"], None, "no such file; give an existing file after @"),
    (["noequals"], None, "give NAME=TEXT or NAME=@FILE"),
    (["real=hello"], None, "is a built-in mode"),
    (["a=x", "a=y"], None, "given twice"),
    ([], "v: {drop: weather}", "unknown section weather; known sections: map, inventory, status"),
    ([], "v: {shout: true}", "unknown transform 'shout'"),
    ([], "[1, 2]", "must map variant names to specs"),
])
def test_bad_specs_are_one_line(tmp_path, flags, file_text, message):
    path = None
    if file_text is not None:
        path = tmp_path / "v.yaml"
        path.write_text(file_text)
    with pytest.raises(ValueError, match=message) as e:
        gather(flags, path)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="no such file"):
        gather([], tmp_path / "missing.yaml")


def test_status_is_not_separate_in_the_full_format():
    with pytest.raises(ValueError, match="--obs-format full has no separate status section; drop one of map, "
                                         "inventory"):
        check_sections([Variant("v", "drop", sections=("status",))], "full")
