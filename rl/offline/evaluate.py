"""`python -m rl.offline eval RUN_DIR`: play an offline policy in the game; rl.eval's table, chart and eval.json.

Every env plays one episode from a fresh world and only that first episode counts (as `rl.eval`). An augmented
policy reads LLM hidden states made exactly as its training files' labels were: the observation template
(`render.build_template(..., source="obs")`) and `rl.encoders.make_ids_encoder` with the model, layer, pooling,
format, dtype and encode method of the files' `labelling` metadata (the prompt hash is checked), stored in
float16 like the labels. Each env refreshes its own hidden state every `hidden_skip_n` steps and at its own
reset (the first step of every episode), independently of the other envs. Ablations (the same worlds):
    real      the refreshed hidden states
    zeros     the dataset's mean hidden state (zero after z-scoring)
    shuffled  another env's hidden state (rolled by one over the batch)
"""
from __future__ import annotations

import hashlib
from functools import partial
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.compile import compiler_options, jit as jit_with_options
from rl.eval import Episodes, first_episodes, summarise
from rl.offline.policy import OfflinePolicy, load_policy

MODES = ("real", "zeros", "shuffled")
MEANING = {"real": "the refreshed hidden states, labelled as the training files were",
           "zeros": "the dataset's mean hidden state (zero after z-scoring)",
           "shuffled": "another env's hidden state (rolled by one over the batch)"}  # the table's legend
DEFAULT_MODES = {"real": ("real", "zeros", "shuffled"), "zero": ("zeros",), "shuffle": ("shuffled",),
                 "none": ("real",)}


def build_encoder(labelling: dict, env: str, system_prompt: str | None = None):
    """(encode(llm_params, cache, obs [B, O], need bool [B]) -> float32 [B, D], llm_params, cache) rebuilding the
    labeller's LLM path from a `labelling` entry; rows with `need` False are left out of the LLM call (length 0)
    and come back meaningless. ValueError (one line) when the template's prompt hash differs from the labels'."""
    from jaxllm import load_model, load_tokenizer, prefill
    from render import build_template
    from rl.encoders import make_ids_encoder
    from rl.label import LabelConfig, label_observations

    lab = dict(labelling)
    d = LabelConfig()
    tokenizer = load_tokenizer(lab["model"])
    tpl = build_template(tokenizer, env, fmt=lab["obs_format"], system_prompt=system_prompt, source="obs")
    sha = hashlib.sha256((tpl.head + "\x00" + tpl.tail).encode()).hexdigest()
    if sha != lab.get("prompt_sha256"):
        raise ValueError(f"the training files were labelled behind another prompt (prompt_sha256 "
                         f"{str(lab.get('prompt_sha256'))[:12]}..., this template's {sha[:12]}...); pass the system "
                         f"prompt given to rl.label with --system-prompt")
    dtype = lab.get("llm_dtype", "auto")
    model = load_model(lab["model"], dtype=None if dtype == "auto" else dtype)
    if int(model.config.hidden_size) != int(lab.get("hidden_size", model.config.hidden_size)):
        raise ValueError(f"model {lab['model']} has hidden size {model.config.hidden_size}, the labels "
                         f"{lab['hidden_size']}: is it the model the files were labelled with?")
    cache = jax.jit(prefill, static_argnums=1)(model.params, model.config, np.asarray(tpl.prefix_ids, np.int32))
    encode_ids = make_ids_encoder(model.config, layer=lab["llm_layer"], pooling=lab["pooling"],
                                  method=lab.get("llm_encode", d.llm_encode), capacity=d.llm_capacity,
                                  chunk=d.llm_chunk)

    labels = label_observations(tpl, encode_ids)

    def encode(llm_params, prefix_cache, obs, need):
        return labels(llm_params, prefix_cache, obs, need).astype(jnp.float32)

    return encode, model.params, cache


def make_player(policy: OfflinePolicy, num_envs: int, encode: Callable | None, window: int = 64):
    """play(seed, max_steps, mode, llm_params, cache) -> numpy results of `num_envs` first episodes."""
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
            hidden = jax.lax.cond(need.any(), lambda: jnp.where(need[:, None], encode(llm_params, cache, obs, need),
                                                                hidden), lambda: hidden)
            clock = jnp.where(need, n_skip, clock)
            h_in = jnp.stack([hidden, jnp.broadcast_to(mean, hidden.shape), jnp.roll(hidden, 1, axis=0)])[mode]
        dist, _ = policy.apply(params, obs, h_in)
        action = dist.sample(seed=k_act)
        obs, state, _, done, info = env.step(k_env, state, action)
        clock = jnp.where(done, 0, clock - 1)  # a reset env refreshes on its next step
        return (state, obs, hidden, clock, key), info

    @partial(jit_with_options, compiler_options=compiler_options(), static_argnames="length")
    def run_window(carry, seen, params, mode, llm_params, cache, length: int):
        carry, info = jax.lax.scan(partial(step, params=params, mode=mode, llm_params=llm_params, cache=cache),
                                   carry, None, length)
        return carry, first_episodes(seen, info)

    reset = jax.jit(lambda key: env.reset(key, jnp.arange(num_envs)))

    def play(params, seed: int, max_steps: int, mode: int = 0, llm_params=None, cache=None,
             on_progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
        """on_progress: called after every window with (steps played, episodes finished)."""
        k_reset, key = jax.random.split(jax.random.PRNGKey(seed))
        obs, state = reset(k_reset)
        dim = 0 if mean is None else mean.shape[0]
        carry = (state, obs, jnp.zeros((num_envs, dim), jnp.float32), jnp.zeros(num_envs, jnp.int32), key)
        seen = Episodes(jnp.zeros(num_envs, bool), jnp.zeros(num_envs), jnp.zeros(num_envs, jnp.int32),
                        jnp.zeros((num_envs, len(env.achievement_names)), bool))
        steps = 0
        while steps < max_steps and not bool(seen.finished.all()):
            length = min(window, max_steps - steps)
            carry, seen = run_window(carry, seen, params, jnp.int32(mode), llm_params, cache, length=length)
            steps += length
            if on_progress is not None:
                on_progress(steps, int(seen.finished.sum()))
        seen, running = jax.device_get((seen, carry[0]))
        return dict(returns=np.where(seen.finished, seen.returns, running.episode_return),
                    lengths=np.where(seen.finished, seen.lengths, running.episode_length),
                    achievements=seen.achievements, unfinished=int((~seen.finished).sum()))

    return play, env.achievement_names


def evaluate(run_dir: str | Path, episodes: int = 128, modes=None, seed: int = 1234, max_steps: int = 10_000,
             system_prompt: str | None = None, say: Callable[[str], None] = lambda text: None,
             status: Callable[[str], None] = lambda text: None) -> dict[str, dict]:
    """{mode: rl.eval.summarise(...)} of the newest checkpoint of an offline run, one episode per env; each entry
    also names its `checkpoint`, `seed`, `max_steps` and `system_prompt` (the prompt text the hidden states were
    read behind; None without them), as rl.eval's. `say` gets a line before each mode, `status` one while it
    plays (steps played, episodes finished)."""
    policy = load_policy(run_dir)
    modes = tuple(modes or DEFAULT_MODES[policy.hidden_mode])
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"--modes {' '.join(bad)}: not one of {', '.join(MODES)}")
    if not policy.uses_hidden and modes != ("real",):
        raise ValueError("this policy reads no hidden state (--hidden none): only --modes real applies")
    encode = llm_params = cache = None
    if policy.uses_hidden:
        if not policy.labelling:
            raise ValueError(f"{run_dir}: config.json has no `labelling` (the training files carry none), so the "
                             f"hidden states cannot be rebuilt in the game")
        say(f"loading {policy.labelling['model']} (layer {policy.labelling['llm_layer']}, "
            f"{policy.labelling['pooling']} pooling) as the files were labelled ...")
        encode, llm_params, cache = build_encoder(policy.labelling, policy.env, system_prompt)
    prompt = None
    if policy.uses_hidden:
        from render.chat import resolve_system_prompt

        prompt = resolve_system_prompt(system_prompt, policy.env, policy.labelling["obs_format"])
    play, names = make_player(policy, episodes, encode)
    results = {}
    for i, mode in enumerate(modes):
        say(f"[{i + 1}/{len(modes)}] {mode}: {episodes} episodes of update {policy.step}'s policy"
            + (" (compiles first)" if i == 0 else "") + " ...")
        progress = (lambda m: lambda steps, done: status(f"  {m}: {steps:,} steps played (at most {max_steps:,}), "
                                                          f"{done}/{episodes} episodes finished"))(mode)
        results[mode] = dict(summarise(play(policy.params, seed, max_steps, MODES.index(mode), llm_params, cache,
                                            on_progress=progress), names),
                             checkpoint=int(policy.step), seed=seed, max_steps=max_steps, system_prompt=prompt)
    return results
