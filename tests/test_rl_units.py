"""Units of the trainer: env wrapper vs craftax itself, GAE vs a plain loop, network fusion, PPO loss."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl.envs import BatchedEnv
from rl.networks import ActorCritic, ActorCriticAug
from rl.ppo import PPOHyper, Transition, gae, ppo_loss

CLASSIC = "Craftax-Classic-Symbolic-v1"


@pytest.fixture(scope="module")
def stepped():
    env = BatchedEnv(CLASSIC, num_envs=8, reset_ratio=4)  # 2 blocks of 4 envs: 2 fresh worlds per step
    obs, state = jax.jit(env.reset)(jax.random.PRNGKey(0))
    es = state.env_state
    health = es.player_health.at[jnp.array([0, 2, 5])].set(0)  # these three die on this step
    state = state._replace(env_state=es.replace(player_health=health),
                           episode_return=jnp.arange(8, dtype=jnp.float32), episode_length=jnp.full(8, 3, jnp.int32))
    action = jnp.arange(8, dtype=jnp.int32) % env.num_actions
    key = jax.random.PRNGKey(1)
    out = jax.jit(env.step)(key, state, action)
    return env, state, action, key, out


def test_env_step_matches_craftax_and_resets_done_envs(stepped):
    env, state, action, key, (obs, new, reward, done, info) = stepped
    raw, params = env.raw_env, env.env_params
    k_step, k_reset = jax.random.split(key)
    keys_of = lambda k, n: jnp.stack([jax.random.fold_in(k, i) for i in range(n)])  # key i = fold_in(k, i)
    ref_obs, ref_state, ref_reward, ref_done, _ = jax.vmap(raw.step, in_axes=(0, 0, 0, None))(
        keys_of(k_step, 8), state.env_state, action, params)
    pool_obs, pool_state = jax.vmap(raw.reset, in_axes=(0, None))(keys_of(k_reset, 2), params)
    done = np.asarray(done)
    assert done.tolist() == np.asarray(ref_done).tolist() and done[[0, 2, 5]].all() and done.sum() == 3
    np.testing.assert_array_equal(reward, ref_reward)
    live = ~done
    np.testing.assert_array_equal(np.asarray(obs)[live], np.asarray(ref_obs)[live])
    np.testing.assert_array_equal(np.asarray(new.env_state.map)[live], np.asarray(ref_state.map)[live])
    # done envs 0, 2, 5 take their block's world: 0, 0, 1 (block = env // reset_ratio)
    for env_i, world in ((0, 0), (2, 0), (5, 1)):
        np.testing.assert_array_equal(np.asarray(obs)[env_i], np.asarray(pool_obs)[world])
        np.testing.assert_array_equal(np.asarray(new.env_state.map)[env_i], np.asarray(pool_state.map)[world])
    # episode statistics: finished episodes report return/length and restart from 0
    ret = np.arange(8) + np.asarray(reward)
    np.testing.assert_allclose(np.asarray(info.episode_return), np.where(done, ret, 0), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(info.episode_length), np.where(done, 4, 0))
    np.testing.assert_allclose(np.asarray(new.episode_return), np.where(done, 0, ret), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(new.episode_length), np.where(done, 0, 4))
    ach = np.asarray(ref_state.achievements).astype(bool) & done[:, None]
    np.testing.assert_array_equal(np.asarray(info.achievements), ach)


def test_env_step_of_a_slice_equals_the_same_envs_of_the_whole_batch(stepped):
    """What a device computes for its envs (`env_index`) is the whole batch's result for those envs."""
    env, state, action, key, out = stepped
    part = lambda x: x[4:]
    got = jax.jit(env.step)(key, jax.tree.map(part, state), part(action), jnp.arange(4, 8))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(jax.tree.map(part, out))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_unknown_env_is_refused():
    with pytest.raises(ValueError, match="choose one of"):
        BatchedEnv("Craftax-Nope-v1", 4)


def test_gae_matches_plain_loop():
    rng = np.random.default_rng(0)
    t, b, gamma, lam = 7, 3, 0.9, 0.8
    reward, value = rng.normal(size=(t, b)).astype(np.float32), rng.normal(size=(t, b)).astype(np.float32)
    done = rng.random((t, b)) < 0.3
    last = rng.normal(size=b).astype(np.float32)
    traj = Transition(None, None, None, None, jnp.asarray(value), jnp.asarray(reward), jnp.asarray(done))
    adv, targets = gae(traj, jnp.asarray(last), gamma, lam)
    expect = np.zeros((t, b), np.float32)
    next_adv, next_value = np.zeros(b), last
    for i in reversed(range(t)):
        nd = 1.0 - done[i]
        delta = reward[i] + gamma * next_value * nd - value[i]
        next_adv = delta + gamma * lam * nd * next_adv
        expect[i], next_value = next_adv, value[i]
    np.testing.assert_allclose(np.asarray(adv), expect, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(targets), expect + value, rtol=1e-5, atol=1e-6)


def test_networks_shapes_init_and_fusion():
    obs = jax.random.normal(jax.random.PRNGKey(0), (5, 20))
    h = jax.random.normal(jax.random.PRNGKey(1), (5, 16)) * 3 + 1
    net = ActorCritic(num_actions=7, width=32)
    params = net.init(jax.random.PRNGKey(2), obs)
    pi, v = net.apply(params, obs)
    assert pi.logits.shape == (5, 7) and v.shape == (5,)
    assert float(jnp.abs(pi.probs - 1 / 7).max()) < 0.02  # actor head initialised with scale 0.01: near uniform
    for fusion, invariant in (("norm", True), ("raw", False)):
        aug = ActorCriticAug(num_actions=7, width=32, fusion=fusion)
        p = aug.init(jax.random.PRNGKey(2), obs, h)
        (_, v1), (_, v2) = aug.apply(p, obs, h), aug.apply(p, obs, 100 * h + 5)
        same = np.allclose(np.asarray(v1), np.asarray(v2), atol=1e-4)
        assert same == invariant, fusion  # norm: per-vector standardisation removes scale and shift


def test_ppo_loss_at_behaviour_policy():
    net = ActorCritic(num_actions=4, width=16)
    obs = jax.random.normal(jax.random.PRNGKey(0), (6, 10))
    params = net.init(jax.random.PRNGKey(1), obs)
    pi, value = net.apply(params, obs)
    action = jnp.arange(6) % 4
    batch = Transition(obs, None, action, pi.log_prob(action), value, jnp.zeros(6), jnp.zeros(6, bool))
    adv = jnp.linspace(-1, 1, 6)
    loss, aux = ppo_loss(params, lambda p, o, h: net.apply(p, o, h), batch, adv, value, PPOHyper())
    assert float(aux["clip_frac"]) == 0 and abs(float(aux["approx_kl"])) < 1e-6
    assert abs(float(aux["actor_loss"])) < 1e-6  # ratio 1 and normalised advantages with mean 0
    assert float(aux["value_loss"]) == 0
    np.testing.assert_allclose(float(loss), -0.01 * float(aux["entropy"]), rtol=1e-5)


def test_per_env_minibatches_take_each_envs_permuted_time_slots():
    from rl.ppo import _per_env_minibatches, per_env_time_index

    t, b, m = 8, 3, 4
    key = jax.random.PRNGKey(3)
    index = np.asarray(per_env_time_index(key, t, jnp.arange(b)))
    for env in range(b):  # column b: env b's own permutation, keyed by the global env index
        np.testing.assert_array_equal(index[:, env], jax.random.permutation(jax.random.fold_in(key, env), t))
    assert not all((index[:, 0] == index[:, e]).all() for e in range(1, b))
    time_env = jnp.arange(t)[:, None] * 10 + jnp.arange(b)  # sample (time s, env e) holds 10 s + e
    obs = jnp.stack([time_env, -time_env], -1).astype(jnp.float32)  # [T, B, 2]
    traj = Transition(obs, None, time_env, None, None, None, None)
    mb_traj, mb_adv, _ = _per_env_minibatches((traj, time_env, time_env), key, m, jnp.arange(b), None)
    expect = index.reshape(m, t // m, b) * 10 + np.arange(b)  # minibatch i: slots [i T/M, (i+1) T/M) of every env
    np.testing.assert_array_equal(mb_adv, expect)
    np.testing.assert_array_equal(mb_traj.action, expect)
    np.testing.assert_array_equal(mb_traj.obs[..., 1], -expect)


def test_template_assembly_choices_are_render_s():
    from render.template import ASSEMBLIES
    from rl.config import TEMPLATE_ASSEMBLIES, TrainConfig

    assert TEMPLATE_ASSEMBLIES == ASSEMBLIES
    with pytest.raises(ValueError, match="--template-assembly 'triton' is not one of: auto, jnp, pallas"):
        TrainConfig(template_assembly="triton").validate()


def test_per_env_shuffle_needs_num_steps_divisible_by_num_minibatches():
    from rl.config import PRESETS, TrainConfig
    from rl.ppo import make_optimizer, ppo_update
    from rl.trainer import Trainer

    fields = dict(PRESETS["test"], num_envs=8, num_steps=6, num_minibatches=4, total_timesteps=8 * 6)
    TrainConfig(**fields).validate()  # the global shuffle only needs num_envs x num_steps to split
    with pytest.raises(ValueError, match="--shuffle per_env .* --num-steps 6 .* --num-minibatches 4"):
        TrainConfig(**fields, shuffle="per_env").validate()
    with pytest.raises(ValueError, match="--shuffle 'random' is not one of: global, per_env"):
        TrainConfig(shuffle="random").validate()
    assert Trainer.from_config(TrainConfig(**PRESETS["test"], shuffle="per_env")).hp.shuffle == "per_env"
    zeros = jnp.zeros((6, 2))
    traj = Transition(jnp.zeros((6, 2, 3)), None, zeros.astype(jnp.int32), zeros, zeros, zeros, zeros.astype(bool))
    with pytest.raises(ValueError, match="shuffle per_env splits each env's 6 steps into 4 minibatches"):
        ppo_update(None, None, make_optimizer(1e-3, 1), None, traj, jnp.zeros(2), jax.random.PRNGKey(0),
                   PPOHyper(num_minibatches=4, shuffle="per_env"))


def test_eval_keeps_each_envs_first_episode():
    """rl.eval plays (rl.play) in the trainer's windows (done envs restart): only each env's first finished episode counts."""
    from rl.envs import StepInfo
    from rl.play import Episodes, first_episodes

    # 3 steps x 3 envs: env 0 ends at steps 1 and 2, env 1 never, env 2 at step 0
    length = jnp.array([[0, 0, 5], [4, 0, 0], [7, 0, 0]], jnp.int32)
    ret = jnp.array([[0, 0, 1.5], [2.0, 0, 0], [9.0, 0, 0]])
    ach = jnp.zeros((3, 3, 2), bool).at[1, 0, 0].set(True).at[2, 0, 1].set(True).at[0, 2].set(True)
    seen = Episodes(jnp.zeros(3, bool), jnp.zeros(3), jnp.zeros(3, jnp.int32), jnp.zeros((3, 2), bool))
    out = first_episodes(seen, StepInfo(ret, length, ach))
    assert out.finished.tolist() == [True, False, True]
    assert out.returns.tolist() == [2.0, 0.0, 1.5] and out.lengths.tolist() == [4, 0, 5]
    assert out.achievements.tolist() == [[True, False], [False, False], [True, True]]
    later = first_episodes(out, StepInfo(ret + 100, length + 1, ~ach))  # every env ends at every step now
    assert later.finished.all() and later.returns.tolist() == [2.0, 100.0, 1.5] and later.lengths.tolist() == [4, 1, 5]


def test_restore_policy_reads_a_run_written_before_the_config_sections(tmp_path):
    """tests/fixtures/run_flat_config: a run directory (flat config.json, orbax checkpoint of update 1) written by
    rl.train before the settings became sections (issue 22); `rl.runs.restore_policy` reads it as written."""
    import json
    import shutil
    from pathlib import Path

    from rl.config import TrainConfig
    from rl.rundir import Checkpoints
    from rl.runs import restore_policy

    run = Path(shutil.copytree(Path(__file__).parent / "fixtures" / "run_flat_config", tmp_path / "run"))
    flat = json.loads((run / "config.json").read_text())
    policy = restore_policy(run)
    assert policy.cfg == TrainConfig(**flat).replace(devices=1, save_trajectories=None)
    assert (policy.cfg.envs.num_envs, policy.cfg.ppo.width, policy.cfg.hidden.encoder) == (
        flat["num_envs"], flat["width"], flat["encoder"])
    assert policy.step == 1 and policy.llm is None and policy.encode is None
    ckpt = Checkpoints(run)
    saved = ckpt.restore(None)  # the checkpoint as written, without a target structure
    ckpt.close()
    saved_params = jax.tree.leaves(saved["params"])
    assert len(saved_params) == len(jax.tree.leaves(policy.params)) > 0
    for a, b in zip(saved_params, jax.tree.leaves(policy.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    pi, value = policy.trainer.apply(policy.params, policy.runner.obs, None)
    assert pi.logits.shape == (flat["num_envs"], policy.trainer.env.num_actions) and value.shape == (flat["num_envs"],)


def test_restore_params_is_restore_policys_settings_and_params_without_a_trainer(tmp_path):
    """`rl.runs.restore_params` (the light restore the probe uses: no trainer, nothing compiled) gives the same
    settings, update count and params as `restore_policy`, on the pre-sections fixture run."""
    import shutil
    from pathlib import Path

    from rl.runs import restore_params, restore_policy

    run = Path(shutil.copytree(Path(__file__).parent / "fixtures" / "run_flat_config", tmp_path / "run"))
    light, full = restore_params(run), restore_policy(run)
    assert light.cfg == full.cfg and light.step == full.step == 1
    assert jax.tree.structure(light.params) == jax.tree.structure(full.params)
    for a, b in zip(jax.tree.leaves(light.params), jax.tree.leaves(full.params)):
        assert np.asarray(a).dtype == np.asarray(b).dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    shutil.rmtree(run / "checkpoints")
    with pytest.raises(FileNotFoundError, match="has no checkpoint to probe"):
        restore_params(run, purpose="probe")
