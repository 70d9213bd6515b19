"""Craftax state -> text -> token ids, as a Python renderer and a jittable token template.

Public API:
    build_template(tokenizer, env_name, fmt="compact", system_prompt=None, source="state") -> Template
    render_text(state, env_name, fmt="compact", source="state") -> str | list[str]
    Template: .prefix_ids, .max_len, .pad_id, __call__(state) -> (ids, length), .text(state)
    source="obs": the same from craftax's symbolic observation vector instead of the state (docs/RENDER.md)
"""
from render.api import build_template, render_text
from render.template import Template, UnsafeBoundaryError

__all__ = ["build_template", "render_text", "Template", "UnsafeBoundaryError"]
