"""render: the token template equals the real tokenizer on the rendered text, for many diverse states.

States come from `render.sample_states` (random play with several seeds, Craftax in god mode reaching
every floor, plus states edited for coverage); the coverage each test relies on is asserted.
"""
from __future__ import annotations

import re
from collections import Counter

import jax
import numpy as np
import pytest

from render import render_text
from render.envs import CLASSIC, CRAFTAX

ENVS = (CRAFTAX, CLASSIC)
FORMATS = ("compact", "full")
CHUNK = 512  # states per chunk of the conftest's `state_chunks` (4 chunks per env)


@pytest.fixture(scope="session")
def rendered(templates, batched_templates, state_chunks):
    """(env, fmt) -> (ids [N, T], lengths [N], prompt texts [N]) over all chunks."""
    out = {}
    for (env, fmt), tpl in templates.items():
        batched = batched_templates[(env, fmt)]
        ids, lens, texts = [], [], []
        for chunk in state_chunks[env]:
            i, n = batched(chunk)
            ids.append(np.asarray(i))
            lens.append(np.asarray(n))
            texts += tpl.text(chunk)
        out[(env, fmt)] = (np.concatenate(ids), np.concatenate(lens), texts)
    return out


@pytest.mark.parametrize("env", ENVS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_template_ids_equal_tokenizer(env, fmt, tokenizer, templates, rendered):
    tpl = templates[(env, fmt)]
    ids, lens, texts = rendered[(env, fmt)]
    assert len(texts) >= 2000
    assert ids.shape == (len(texts), tpl.max_len) and ids.dtype == np.int32
    reference = tokenizer(texts, add_special_tokens=False)["input_ids"]
    prefix = tpl.prefix_ids
    for k, ref in enumerate(reference):
        n = int(lens[k])
        assert ref[: len(prefix)] == prefix, f"state {k}: prompt head differs"
        assert ref[len(prefix):] == ids[k, :n].tolist(), f"state {k}: ids differ from the tokenizer on:\n{texts[k]}"
        assert (ids[k, n:] == tpl.pad_id).all()
    assert lens.max() <= tpl.max_len


@pytest.mark.parametrize("env", ENVS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_position_is_written_once(env, fmt, templates, state_chunks, rendered):
    """The scatter writes positions 0..length-1 exactly once each. On CPU a position written twice takes the
    last write, so the ids test above could pass while a GPU, which does not order a scatter's writes, gives
    other ids (this happened: a number's unused digit slot landed on its '.')."""
    tpl = templates[(env, fmt)]
    _, positions, lens = map(np.asarray, jax.jit(jax.vmap(tpl.tokens_and_positions))(state_chunks[env][0]))
    np.testing.assert_array_equal(lens, rendered[(env, fmt)][1][:CHUNK])
    for row, length in zip(positions, lens):
        np.testing.assert_array_equal(np.sort(row[row < tpl.max_len]), np.arange(length))


@pytest.mark.parametrize("env", ENVS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_text_is_the_chat_template(env, fmt, tokenizer, templates, rendered, state_chunks):
    tpl = templates[(env, fmt)]
    _, _, texts = rendered[(env, fmt)]
    observations = [obs for chunk in state_chunks[env] for obs in render_text(chunk, env, fmt)]
    assert len(observations) == len(texts) >= 2000
    system = _system_of(tpl)
    for k, obs in enumerate(observations):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": obs}]
        expected = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
        assert texts[k] == expected


def _system_of(tpl) -> str:
    from render.chat import default_system_prompt

    return default_system_prompt(tpl.env_name, tpl.fmt.name)


def test_single_state_jit_and_text_agree_with_batch(templates, state_chunks, rendered):
    tpl = templates[(CRAFTAX, "compact")]
    chunk = state_chunks[CRAFTAX][1]
    ids_b, lens_b, texts_b = rendered[(CRAFTAX, "compact")]
    single = jax.jit(tpl)
    for k in (0, 7, CHUNK - 1):
        state = jax.tree_util.tree_map(lambda x: x[k], chunk)
        ids, n = single(state)
        assert int(n) == lens_b[CHUNK + k]
        np.testing.assert_array_equal(np.asarray(ids), ids_b[CHUNK + k])
        assert tpl.text(state) == texts_b[CHUNK + k]


def _scan_of_shard_map(tpl):
    """jit(scan over chunks of shard_map(vmap(tpl))): how the trainer calls the template."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    spec = jax.sharding.PartitionSpec("d")

    def body(carry, batch):
        return carry, jax.shard_map(jax.vmap(tpl), mesh=mesh, in_specs=spec, out_specs=(spec, spec))(batch)

    return jax.jit(lambda states: jax.lax.scan(body, 0, states)[1])


def test_template_inside_scan_and_shard_map(templates, state_chunks, rendered):
    """The trainer calls the template under jit, vmapped, inside lax.scan and per device in shard_map."""
    chunk = jax.tree_util.tree_map(lambda x: x[:8].reshape((2, 4) + x.shape[1:]), state_chunks[CLASSIC][0])
    ids, lens = _scan_of_shard_map(templates[(CLASSIC, "compact")])(chunk)
    ids_ref, lens_ref, _ = rendered[(CLASSIC, "compact")]
    np.testing.assert_array_equal(np.asarray(ids).reshape(8, -1), ids_ref[:8])
    np.testing.assert_array_equal(np.asarray(lens).reshape(8), lens_ref[:8])


def test_kernel_lowers_for_cuda_inside_scan_and_shard_map(templates, state_chunks):
    """The GPU path of the Pallas assembly, as the trainer calls it, lowers to one Triton kernel (on CPU: exported
    for CUDA, not run). Under shard_map its outputs must state the mesh axes they vary over, or tracing fails."""
    import dataclasses

    tpl = dataclasses.replace(templates[(CLASSIC, "compact")], assembly="pallas")
    chunk = jax.tree_util.tree_map(lambda x: x[:8].reshape((2, 4) + x.shape[1:]), state_chunks[CLASSIC][0])
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    exported = jax.export.export(_scan_of_shard_map(tpl), platforms=["cuda"], disabled_checks=[triton])(chunk)
    module = exported.mlir_module()
    assert module.count("xla.gpu.triton") >= 1 and "render_template_assembly" in module


# ------------------------------------------------------------------------------------------ coverage

MOB_LINE = re.compile(r"^-?\d+, -?\d+: (.+?) on ")


@pytest.mark.parametrize("env", ENVS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_pallas_assembly_equals_jnp_assembly(env, fmt, templates, state_chunks, rendered):
    """The one-kernel assembly (`assembly="pallas"`, run by Pallas's interpreter on CPU) gives the same ids and
    lengths as the XLA one, on the 12 longest and 12 shortest prompts of the first chunk."""
    import dataclasses

    ids, lens, _ = rendered[(env, fmt)]
    order = np.argsort(lens[:CHUNK], kind="stable")
    pick = np.concatenate([order[:12], order[-12:]])
    states = jax.tree.map(lambda x: x[pick], state_chunks[env][0])
    tpl = dataclasses.replace(templates[(env, fmt)], assembly="pallas")
    got_ids, got_lens = jax.jit(jax.vmap(tpl))(states)
    np.testing.assert_array_equal(np.asarray(got_lens), lens[pick])
    np.testing.assert_array_equal(np.asarray(got_ids), ids[pick])


@pytest.mark.parametrize("lane_width", [4, 8])
def test_pallas_assembly_at_each_lane_width(lane_width, templates, state_chunks, rendered):
    """Both lane widths the kernel may pick give the jnp ids (Classic full fits both; at 4, its choices wider than
    4 tokens split across lanes); a number wider than the lane is refused with UnsupportedLayout (Classic compact's
    labelled counts need 8)."""
    from render.layout import UnsupportedLayout
    from render.pallas_assembly import make_pallas_assembler

    tpl = templates[(CLASSIC, "full")]
    ids, lens, _ = rendered[(CLASSIC, "full")]
    pick = np.argsort(lens[:CHUNK], kind="stable")[[0, -1]]
    states = jax.tree.map(lambda x: x[pick], state_chunks[CLASSIC][0])
    assemble = make_pallas_assembler(tpl._sections, tpl.max_len, tpl.pad_id, lane_width=lane_width)
    got_ids, got_lens = jax.jit(jax.vmap(lambda s: assemble(tpl._values(s))))(states)
    np.testing.assert_array_equal(np.asarray(got_lens), lens[pick])
    np.testing.assert_array_equal(np.asarray(got_ids), ids[pick])
    compact = templates[(CLASSIC, "compact")]
    if lane_width == 4:
        with pytest.raises(UnsupportedLayout, match="wider than a lane"):
            make_pallas_assembler(compact._sections, compact.max_len, compact.pad_id, lane_width=4)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the Triton-compiled kernel needs a GPU")
@pytest.mark.parametrize("env", ENVS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_auto_assembly_is_the_kernel_on_gpu(env, fmt, templates, state_chunks, rendered):
    """On a GPU the default assembly compiles to the one Pallas kernel (whose ids `rendered` holds, checked against
    the tokenizer above) and equals the XLA assembly."""
    import dataclasses

    tpl = templates[(env, fmt)]
    assert tpl.assembly == "auto"
    batched = jax.jit(jax.vmap(tpl))
    assert "render_template_assembly" in batched.lower(state_chunks[env][0]).compile().as_text()
    xla_ids, xla_lens = jax.jit(jax.vmap(dataclasses.replace(tpl, assembly="jnp")))(state_chunks[env][0])
    ids, lens, _ = rendered[(env, fmt)]
    np.testing.assert_array_equal(np.asarray(xla_lens), lens[:CHUNK])
    np.testing.assert_array_equal(np.asarray(xla_ids), ids[:CHUNK])


def test_coverage_of_craftax_states(rendered):
    """The 2,048 Craftax states reach what the invariant is claimed on."""
    _, _, texts = rendered[(CRAFTAX, "full")]
    mobs, floors = Counter(), Counter()
    flags = Counter()
    for text in texts:
        obs = text.split("<|im_start|>user\n", 1)[1]
        for line in obs.splitlines():
            m = MOB_LINE.match(line)
            if m and not m.group(1).endswith(("torch", "ladder_down", "ladder_up", "ladder_down_blocked")):
                mobs[m.group(1)] += 1
        floors[re.search(r"Floor: (\d)", obs).group(1)] += 1
        flags["darkness"] += "Darkness" in obs
        flags["sleeping"] += "Is Sleeping: True" in obs
        flags["armour"] += " Helmet with " in obs or " Boots with " in obs
        flags["fire enchantment"] += "with Fire enchantment" in obs
        flags["3-digit count"] += re.search(r"^(Wood|Book|XP): \d{3}$", obs, re.M) is not None
        flags["zero inventory"] += "Wood: 0\nStone: 0\nCoal: 0" in obs
        flags["fractional health"] += re.search(r"Health: \d+\.[1-9]", obs) is not None
    expected_mobs = {"Zombie", "Gnome Warrior", "Orc Soldier", "Lizard", "Knight", "Troll", "Pigman",
                     "Frost Troll", "Cow", "Bat", "Snail", "Skeleton", "Gnome Archer", "Orc Mage", "Kobold",
                     "Archer", "Deep Thing", "Fire Elemental", "Ice Elemental", "Arrow", "Dagger", "Fireball",
                     "Iceball", "Slimeball", "Arrow (Player)", "Dagger (Player)", "Fireball (Player)",
                     "Iceball (Player)", "Slimeball (Player)"}
    assert expected_mobs <= set(mobs), f"mobs never on screen: {expected_mobs - set(mobs)}"
    assert set(floors) == {str(f) for f in range(9)}, f"floors reached: {sorted(floors)}"
    for flag, n in flags.items():
        assert n >= 20, f"only {n} states with {flag}"


def test_coverage_of_classic_states(rendered):
    _, _, texts = rendered[(CLASSIC, "full")]
    joined = "\n".join(texts)
    for name in ("Zombie on", "Cow on", "Skeleton on", "Arrow on", "Is Sleeping: True", "Iron Sword\n",
                 "Wood Pickaxe\n", "Wood: 0\n"):
        assert joined.count(name) >= 20, name
    assert re.search(r"^Wood: \d{3}$", joined, re.M)


def test_compact_lists_informative_tiles_nearest_first(rendered):
    """Compact lists exactly the non-background lit tiles, nearest first, with row, col coordinates,
    checked against the full rendering of the same states (an independent reading of the text);
    and K lets >= 99% of the test states list all of theirs."""
    from render.formats_craftax import COMPACT_MAX_TILES

    full = rendered[(CRAFTAX, "full")][2]
    compact = rendered[(CRAFTAX, "compact")][2]
    background = {"grass", "sand", "path", "fire_grass", "ice_grass"}
    fits = 0
    for text_full, text_compact in zip(full, compact):
        expected = []
        for line in text_full.split("<|im_start|>user\nMap:\n", 1)[1].split("\n\nInventory:")[0].splitlines():
            coords, thing = line.split(": ", 1)
            col, row = (int(v) for v in coords.split(", "))
            parts = thing.split(" on ")
            if thing == "Darkness" or (len(parts) == 1 and parts[0] in background):
                continue
            expected.append((row * row + col * col, row, col))
        expected.sort()
        obs = text_compact.split("<|im_start|>user\n", 1)[1]
        listed = re.findall(r"^(-?\d+), (-?\d+): ", obs.split("Inventory:")[0], re.M)
        listed = [(int(r), int(c)) for r, c in listed]
        assert listed == [(r, c) for _, r, c in expected][:COMPACT_MAX_TILES]
        fits += len(expected) <= COMPACT_MAX_TILES
    assert fits >= 0.99 * len(full), f"K={COMPACT_MAX_TILES} fits only {fits} of {len(full)} states"


@pytest.mark.parametrize("env", ENVS)
def test_compact_lists_at_most_k_tiles(env, tokenizer, templates, state_chunks):
    """A view where every tile is informative (stone all around, lit) lists exactly the K nearest tiles (the format's
    cap, `first_k`); ids equal the tokenizer's, and the Pallas assembly (interpreted) equals the jnp one on these
    rows, present up to K and absent after."""
    import dataclasses

    from craftax.craftax.constants import BlockType

    import render.formats_classic as classic
    import render.formats_craftax as craftax

    module = craftax if env == CRAFTAX else classic
    state = jax.tree.map(lambda x: x[0], state_chunks[env][0])
    if env == CRAFTAX:
        level = state.player_level
        state = state.replace(map=state.map.at[level].set(BlockType.STONE.value),
                              light_map=state.light_map.at[level].set(1.0),
                              item_map=state.item_map.at[level].set(0))
    else:
        state = state.replace(map=state.map.at[:].set(BlockType.STONE.value))
    tpl = templates[(env, "compact")]
    ids, length = jax.jit(tpl)(state)
    text = tpl.text(state)
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == tpl.prefix_ids + np.asarray(ids)[:int(length)].tolist()
    listed = re.findall(r"^(-?\d+), (-?\d+): ", text.split("<|im_start|>user\n", 1)[1].split("Inventory:")[0], re.M)
    nearest = [tuple(map(int, module.OFFSETS[i])) for i in module.NEAREST[:module.COMPACT_MAX_TILES]]
    assert [(int(r), int(c)) for r, c in listed] == nearest
    pallas = jax.jit(dataclasses.replace(tpl, assembly="pallas"))(state)
    np.testing.assert_array_equal(np.asarray(pallas[0]), np.asarray(ids))
    assert int(pallas[1]) == int(length)


# ------------------------------------------------------------------------------- upstream (full)

NUM_UPSTREAM = 48  # render_craftax_text reads the device per tile (~0.3 s a state)


def _float_line(line: str):
    m = re.fullmatch(r"(Health|Light): (-?[\d.e-]+)", line)
    return (m.group(1), float(m.group(2))) if m else None


def test_full_matches_upstream_render_craftax_text(state_chunks, rendered):
    """`full` == craftax's render_craftax_text line by line, apart from the documented deviations:
    Health (1 decimal, negative shown as 0.0) and Light (2 decimals) precision, and mobs that
    upstream's renderer erases (a dead or off-screen slot of the same type overwrites the tile)."""
    from craftax.craftax.renderer import render_craftax_text

    chunk = state_chunks[CRAFTAX][0]
    texts = rendered[(CRAFTAX, "full")][2]
    picks = list(range(NUM_UPSTREAM // 2)) + list(range(CHUNK // 2, CHUNK // 2 + NUM_UPSTREAM // 2))
    erased = 0
    for k in picks:
        state = jax.tree_util.tree_map(lambda x: x[k], chunk)
        upstream = render_craftax_text(state).splitlines()
        ours = texts[k].split("<|im_start|>user\n", 1)[1].split("<|im_end|>")[0].splitlines()
        assert len(ours) == len(upstream), f"state {k}: {len(ours)} lines vs upstream {len(upstream)}"
        for a, b in zip(ours, upstream):
            if a == b:
                continue
            fa, fb = _float_line(a), _float_line(b)
            if fa and fb and fa[0] == fb[0]:
                tol = 0.05 if fa[0] == "Health" else 0.005
                assert abs(fa[1] - max(fb[1], 0.0)) <= tol + 1e-6, (a, b)
                continue
            # Upstream erased a visible mob: ours is upstream's line with the mob inserted.
            m = re.fullmatch(r"(-?\d+, -?\d+: )(.+?) on (.+)", a)
            assert m and b == m.group(1) + m.group(3), f"state {k}: {a!r} vs upstream {b!r}"
            erased += 1
    print(f"upstream erased {erased} visible mobs in {len(picks)} states")
