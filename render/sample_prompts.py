"""Real Craftax prompts for measuring an LLM: the token template over sampled craftax states (the parity tools,
`jaxllm.parity`, compare models on them)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

ENV_DEFAULT = "Craftax-Symbolic-v1"


def craftax_states(env_name: str, num_states: int, seed: int = 0, steps: int = 0) -> Any:
    """``num_states`` raw craftax states stacked on a leading axis (`render.sample_states`).

    steps == 0: reset states of ``num_states`` different worlds (cheapest to compile). steps > 0: states of
    random play, each taken after a random number of steps up to ``steps`` (``typical_states``); more varied
    (inventories, mobs, damage) but a longer compile.
    """
    from render.sample_states import reset_states, typical_states

    if steps <= 0:
        return reset_states(env_name, num_states, seed)
    return typical_states(env_name, num_states, seed, max_steps=steps)


@dataclass
class PromptSet:
    """Real Craftax prompts: the template's constant head plus each state's rest (right-padded)."""

    prefix_ids: list[int]
    rest_ids: np.ndarray  # int32 [N, max_len]
    lengths: np.ndarray  # int32 [N]
    states: Any = field(repr=False)
    template: Any = field(repr=False)

    def whole(self) -> list[list[int]]:
        """Each full prompt as one unpadded id list (what an HTTP server gets)."""
        return [self.prefix_ids + self.rest_ids[i, :n].tolist() for i, n in enumerate(self.lengths)]


def craftax_prompts(tokenizer: Any, num_prompts: int, env_name: str = ENV_DEFAULT, fmt: str = "compact",
                    seed: int = 0, steps: int = 0) -> PromptSet:
    """``num_prompts`` prompts from ``render.build_template`` over ``craftax_states``."""
    import jax

    from render import build_template

    template = build_template(tokenizer, env_name, fmt=fmt)
    states = craftax_states(env_name, num_prompts, seed=seed, steps=steps)
    ids, lengths = jax.jit(jax.vmap(template))(states)
    return PromptSet(list(template.prefix_ids), np.asarray(ids, np.int32), np.asarray(lengths, np.int32),
                     states, template)


