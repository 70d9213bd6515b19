"""What the probe needs of a trained policy (online and offline alike): `ProbePolicy` and its `ProbeLLM`.
`rl.probe.policy.load_policy` builds them from a run directory; states, forward and core only read them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from rl.llm import LLMArgs


@dataclass(frozen=True)
class ProbeLLM:
    """The LLM side of a policy: token template, the batched LLM call and its arrays."""

    template: Any  # render.Template of the run's settings (state -> ids)
    encode_ids: Callable  # (llm_params, prefix_cache, ids [B, T], lengths [B]) -> raw hidden f32 [B, D]
    args: LLMArgs  # params + prefix cache of the run's system prompt
    other_args: LLMArgs  # the same params + the prefix cache of rl.eval's OTHER_PROMPT
    tokenizer: Any
    obs_format: str
    system_prompt: Any  # what build_template took (None = the template's default)
    # (batch, ids width) -> the LLM call's static plan; two widths of equal plans give the same vectors bit for bit
    # (`jaxllm.encoder.packed_plan`). None: unknown, the probe keeps each width's own compile
    plan: Callable[[int, int], Any] | None = None


@dataclass(frozen=True)
class ProbePolicy:
    """A trained policy as the probe uses it (online and offline runs alike)."""

    run: str
    env: str
    params: Any
    apply: Callable  # (params, obs f32 [B, O], raw hidden f32 [B, D] | None) -> (distrax.Categorical, value [B])
    llm: ProbeLLM | None  # None: the policy reads no hidden state
    skip_n: int  # the hidden state is refreshed every skip_n steps while playing (0: once)
    gamma: float  # discount of the return-to-go in the value diagnostics
    zero: Any = None  # the policy's zero hidden state (rl.modes): None = raw zeros; an offline policy's dataset mean

    @property
    def uses_hidden(self) -> bool:
        return self.llm is not None
