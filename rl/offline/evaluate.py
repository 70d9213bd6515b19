"""`python -m rl.offline eval RUN_DIR`: play an offline policy in the game; rl.eval's table, chart and eval.json.

Every env plays one episode from a fresh world and only that first episode counts (as `rl.eval`). An augmented
policy reads LLM hidden states made exactly as its training files' labels were: the observation template
(`render.build_template(..., source="obs")`) and `rl.encoders.make_ids_encoder` with the model, layer, pooling,
format, dtype and encode method of the files' `labelling` metadata (the prompt hash is checked), stored in
float16 like the labels. Each env refreshes its own hidden state every `hidden_skip_n` steps and at its own
reset (the first step of every episode), independently of the other envs: an online run's reset rule
(`--reset-hidden zero|pool`, which `rl.play.trainer_window` honours) has no counterpart here, since a labelled
dataset holds every observation's own reading and no reset pool. Ablations (the same worlds; the one table of modes, `rl.modes`): real, zero (the policy's zero: the dataset's mean
hidden state, zero after z-scoring), noise, shuffled (another env's hidden state, rolled by one over the batch),
other_prompt.
"""
from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp

from rl.jit import compile_llm, compile_program
from rl.llm import load_labelled_llm, make_obs_encoder
from rl.modes import MODES, OTHER_PROMPT, ablate, check_modes
from rl.offline.policy import OfflinePolicy, load_policy
from rl.play import episode_results, first_episodes, no_episodes, play_window, play_windows, summarise

DEFAULT_MODES = {"real": ("real", "zero", "shuffled"), "zero": ("zero",), "shuffle": ("shuffled",),
                 "none": ("real",)}


def build_encoder(labelling: dict, env: str, system_prompt: str | None = None):
    """(encode(llm_params, cache, obs [B, O], need bool [B]) -> float32 [B, D], llm_params, cache): the labeller's
    LLM path rebuilt from a `labelling` entry (`rl.llm.load_labelled_llm`; the prompt text comes from the entry,
    `system_prompt` only for files labelled before it was stored); rows with `need` False are left out of the LLM
    call and come back meaningless. ValueError (one line) when the prompt hash differs from the labels'."""
    cfg, llm = load_labelled_llm(labelling, env, system_prompt)
    return make_obs_encoder(cfg, llm), llm.model.params, llm.prefix_cache, llm, cfg


def make_player(policy: OfflinePolicy, num_envs: int, encode: Callable | None, window: int = 64,
                keyed: bool = False):
    """play(seed, max_steps, mode, llm_params, cache) -> numpy results of `num_envs` first episodes (`rl.play`'s
    loop: `play_window`s in `play_windows`; the hidden state is refreshed inside the steps, each env on its own
    clock, from its observation, since the policy learned from labelled observations);
    `mode` indexes `rl.modes.MODES` (zero: the dataset's mean hidden state, zero after z-scoring). `keyed`: `encode`
    also takes a key (a prompt variant's random tokens)."""
    from rl.envs import BatchedEnv

    env = BatchedEnv(policy.env, num_envs)
    n_skip = policy.hidden_skip_n
    mean = None if policy.stats is None else policy.stats["mean"]

    def step(carry, _, params, mode, llm_params, cache):
        state, obs, hidden, clock, key = carry
        key, k_mix, k_act, k_env = jax.random.split(key, 4)
        h_in = None
        if encode is not None:
            need = clock <= 0
            extra = (k_mix,) if keyed else ()
            hidden = jax.lax.cond(need.any(), lambda: jnp.where(need[:, None],
                                                                encode(llm_params, cache, obs, need, *extra), hidden),
                                  lambda: hidden)
            clock = jnp.where(need, n_skip, clock)
            h_in = ablate(hidden, mode, k_mix, zero=mean)
        dist, _ = policy.apply(params, obs, h_in)
        action = dist.sample(seed=k_act)
        obs, state, _, done, info = env.step(k_env, state, action)
        clock = jnp.where(done, 0, clock - 1)  # a reset env refreshes on its next step
        return (state, obs, hidden, clock, key), info

    compile_ = compile_llm if encode is not None else partial(compile_program, runs_llm=False)

    @partial(compile_, static_argnames="length")
    def run_window(carry, seen, params, mode, llm_params, cache, length: int):
        steps = lambda c, n: jax.lax.scan(partial(step, params=params, mode=mode, llm_params=llm_params,  # noqa: E731
                                                  cache=cache), c, None, n)
        carry, seen, _ = play_window(steps, carry, seen, length, fold=lambda seen, carry, info: first_episodes(seen,
                                                                                                             info))
        return carry, seen

    reset = compile_program(lambda key: env.reset(key, jnp.arange(num_envs)), runs_llm=False)

    def play(params, seed: int, max_steps: int, mode: int = 0, llm_params=None, cache=None,
             on_progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
        """on_progress: called after every window with (steps played, episodes finished)."""
        k_reset, key = jax.random.split(jax.random.PRNGKey(seed))
        obs, state = reset(k_reset)
        dim = 0 if mean is None else mean.shape[0]
        carry = (state, obs, jnp.zeros((num_envs, dim), jnp.float32), jnp.zeros(num_envs, jnp.int32), key)
        step_ = lambda carry, seen, length: run_window(carry, seen, params, jnp.int32(mode), llm_params, cache,
                                                       length=length)
        carry, seen = play_windows(step_, carry, no_episodes(num_envs, len(env.achievement_names)), max_steps,
                                   window, clip_last=True, on_progress=on_progress)
        return episode_results(seen, carry[0])

    return play, env.achievement_names


def evaluate(run_dir: str | Path, episodes: int = 128, modes=None, seed: int = 1234, max_steps: int = 10_000,
             system_prompt: str | None = None, say: Callable[[str], None] = lambda text: None,
             status: Callable[[str], None] = lambda text: None, variants=()) -> dict[str, dict]:
    """{mode: rl.play.summarise(...)} of the newest checkpoint of an offline run, one episode per env; then every
    prompt variant (`rl.variants`) played like `real` on the same worlds, under its own name. Each entry also names
    its `checkpoint`, `seed`, `max_steps` and `system_prompt` (the prompt text the hidden states were read behind;
    None without them), as rl.eval's. `say` gets a line before each mode, `status` one while it plays (steps
    played, episodes finished)."""
    policy = load_policy(run_dir)
    modes = check_modes(modes or DEFAULT_MODES[policy.hidden_mode], uses_hidden=policy.uses_hidden)
    if variants and not policy.uses_hidden:
        raise ValueError("this policy reads no hidden state (--hidden none): --prompt/--prompts do not apply")
    if variants:
        from rl.variants import check_sections

        check_sections(variants, (policy.labelling or {}).get("obs_format", "compact"))
    encode = llm_params = cache = None
    if policy.uses_hidden:
        if not policy.labelling:
            raise ValueError(f"{run_dir}: config.json has no `labelling` (the training files carry none), so the "
                             f"hidden states cannot be rebuilt in the game")
        say(f"loading {policy.labelling['model']} (layer {policy.labelling['llm_layer']}, "
            f"{policy.labelling['pooling']} pooling) as the files were labelled ...")
        encode, llm_params, cache, llm, llm_cfg = build_encoder(policy.labelling, policy.env, system_prompt)
    # other_prompt: the same observation ids behind OTHER_PROMPT's prefix cache (the prompt head holds the system text)
    caches = {m: cache for m in modes}
    if "other_prompt" in modes:
        caches["other_prompt"] = llm.with_prompt(OTHER_PROMPT).prefix_cache
    prompt = None
    if policy.uses_hidden:
        from render.chat import resolve_system_prompt

        # the text the labels were read behind: the labelling's own (or --system-prompt for older files)
        prompt = resolve_system_prompt(llm_cfg.system_prompt, policy.env, llm_cfg.obs_format)
    play, names = make_player(policy, episodes, encode)
    results = {}
    progress = (lambda m: lambda steps, done: status(f"  {m}: {steps:,} steps played (at most {max_steps:,}), "
                                                      f"{done}/{episodes} episodes finished"))
    same_play = dict(checkpoint=int(policy.step), seed=seed, max_steps=max_steps, system_prompt=prompt)
    for i, mode in enumerate(modes):
        say(f"[{i + 1}/{len(modes)}] {mode}: {episodes} episodes of update {policy.step}'s policy"
            + (" (compiles first)" if i == 0 else "") + " ...")
        results[mode] = dict(summarise(play(policy.params, seed, max_steps, MODES.index(mode), llm_params,
                                            caches.get(mode), on_progress=progress(mode)), names), **same_play)
    if variants:
        from rl.variants import make_variant_obs_encoder, setup_for

        for i, v in enumerate(variants):
            setup = setup_for(v, llm)
            say(f"[variant {i + 1}/{len(variants)}] {v.name}: {episodes} episodes (compiles first) ...")
            vplay, _ = make_player(policy, episodes, make_variant_obs_encoder(v, setup, llm_cfg), keyed=True)
            entry = summarise(vplay(policy.params, seed, max_steps, 0, llm_params, setup.prefix_cache,
                                    on_progress=progress(v.name)), names)
            results[v.name] = dict(entry, variant=dict(v.describe(), note=v.note()), **same_play)
    return results
