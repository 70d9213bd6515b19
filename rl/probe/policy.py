"""What the probe needs of a trained run, and `load_policy`: THE one function that reads a run directory.

Online runs (`rl.train` run dirs, encoder none or inscan; vllm runs are probed with the in-scan encoder of the
same model, as rl.eval does) are restored through `rl.runs.restore_params` (settings + params, no trainer);
offline runs (config.json with
`"kind": "offline-awr"`) through `rl.offline.load_policy` (docs: the contract in CONTRACTS.md), imported only then.
"""
from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from rl.llm import LLMArgs
from rl.probe.parts import ProbeLLM, ProbePolicy  # noqa: F401 - ProbePolicy: what load_policy returns
from rl.readrun import OFFLINE, run_kind
from rl.modes import OTHER_PROMPT


def _llm_parts(cfg, model, tokenizer, template, prefix_cache, *, labels: bool = False) -> ProbeLLM:
    """ProbeLLM of LLM settings `cfg` from a loaded model (the other prompt's prefix computed here). `labels`: the
    policy was trained on `rl.label`'s float16 labels, so its hidden states are rounded to float16 as they were."""
    from rl.llm import LLMSetup, make_ids_encoder

    setup = LLMSetup(model, tokenizer, template, prefix_cache, int(model.config.hidden_size))
    other = setup.with_prompt(OTHER_PROMPT)
    encode_ids = make_ids_encoder(model.config, layer=cfg.llm_layer, pooling=cfg.pooling, method=cfg.llm_encode,
                                  capacity=cfg.llm_capacity, chunk=cfg.llm_chunk)
    if labels:
        import jax.numpy as jnp

        raw = encode_ids
        encode_ids = lambda *a: raw(*a).astype(jnp.float16).astype(jnp.float32)  # noqa: E731
    plan = None
    if cfg.llm_encode == "packed":
        from jaxllm.encoder import packed_plan

        dtype = model.params["embed_tokens"].dtype
        plan = lambda batch, width: packed_plan(batch, width, cfg.llm_capacity or None, dtype)  # noqa: E731
    return ProbeLLM(template, encode_ids, LLMArgs(model.params, prefix_cache), other.jit_args,
                    tokenizer, cfg.obs_format, cfg.system_prompt, plan)


def check_run_dir(run_dir: Path) -> Path:
    """`run_dir`'s config.json; FileNotFoundError (one line) if there is none."""
    run_kind(run_dir)
    return Path(run_dir) / "config.json"


def load_policy(run_dir: Path) -> ProbePolicy:
    """The newest checkpoint of `run_dir` as a ProbePolicy. ValueError / FileNotFoundError (one line) for a
    directory that is not a run (`rl.readrun.run_kind`: the one reader of a run directory)."""
    run_dir = Path(run_dir)
    kind, raw = run_kind(run_dir)
    if kind == OFFLINE:
        return _load_offline(run_dir, raw)
    return _load_online(run_dir)


def _load_online(run_dir: Path) -> ProbePolicy:
    """An rl.train run: its settings and newest params (`rl.runs.restore_params`: no trainer, nothing compiled), its
    LLM (vllm runs get the in-scan encoder of the same model, as in rl.eval), the params checked against the network
    the config builds."""
    from rl.envs import BatchedEnv
    from rl.llm import load_llm
    from rl.networks import make_network
    from rl.readrun import restore_params

    run = restore_params(run_dir, purpose="probe")
    cfg, params = run.cfg, run.params
    llm = load_llm(cfg) if cfg.uses_llm else None
    env = BatchedEnv(cfg.env, 1)
    network = make_network(env.num_actions, augmented=cfg.uses_llm, fusion=cfg.fusion, width=cfg.width)
    obs = jax.ShapeDtypeStruct((1, _obs_size(cfg.env)), np.float32)
    hidden = jax.ShapeDtypeStruct((1, llm.hidden_size), np.float32) if llm else None
    expected = jax.eval_shape(network.init, jax.random.PRNGKey(0), obs, hidden)
    shape = lambda t: jax.tree.map(lambda a: tuple(a.shape), t)
    if jax.tree.structure(expected) != jax.tree.structure(params) or shape(expected) != shape(params):
        raise ValueError(f"the checkpoint of {run_dir} does not fit the network its config.json describes")
    # on one device, as the LLM's arrays: params restored onto the trainer's mesh would make every program's
    # outputs mesh-sharded, so the play's second window (fed its own outputs) compiled the play again
    params = jax.device_put(jax.tree.map(jax.numpy.asarray, params), jax.devices()[0])
    parts = None if llm is None else _llm_parts(cfg, llm.model, llm.tokenizer, llm.template, llm.prefix_cache)
    return ProbePolicy(str(run_dir), cfg.env, params, network.apply, parts, cfg.skip_n, cfg.gamma)


def _obs_size(env: str) -> int:
    from render.observation import OBS_SIZES

    return OBS_SIZES[env]


def _load_offline(run_dir: Path, raw: dict) -> ProbePolicy:
    """An `rl.offline` run (CONTRACTS.md): its policy, and the in-scan LLM built exactly as its labels were."""
    try:
        from rl.offline import load_policy as load_offline
    except ImportError as e:
        raise ValueError(f"{run_dir} is an offline run but rl.offline cannot be imported ({e})") from None
    pol = load_offline(run_dir)
    parts = None
    if pol.uses_hidden:
        parts = _offline_llm(pol.env, pol.labelling or {})
    zero = None if pol.stats is None else pol.stats["mean"]
    return ProbePolicy(str(run_dir), pol.env, pol.params, pol.apply, parts, int(pol.hidden_skip_n),
                       float(raw.get("gamma", 0.99)), zero)


def _offline_llm(env: str, labelling: dict) -> ProbeLLM:
    """The in-scan LLM of an offline run's `labelling` metadata, rebuilt as its labels were (`rl.llm`: the stored
    prompt text, the prompt hash checked, float16 like the labels), on the state template of the same format."""
    from rl.llm import load_labelled_llm

    cfg, llm = load_labelled_llm(labelling, env, source="state")
    return _llm_parts(cfg, llm.model, llm.tokenizer, llm.template, llm.prefix_cache, labels=True)
