"""System prompts and the Qwen3 chat framing around the observation text."""
from __future__ import annotations

from importlib import resources
from pathlib import Path

from render.envs import CLASSIC, CRAFTAX

_PROMPT_FILES = {CRAFTAX: "craftax_system.txt", CLASSIC: "classic_system.txt"}
_FORMAT_FILES = {"compact": "format_compact.txt", "full": "format_full.txt"}
_SENTINEL = "\x00OBSERVATION\x00"


def _read_prompt(name: str) -> str:
    return resources.files("render").joinpath("prompts", name).read_text(encoding="utf-8").strip()


def default_system_prompt(env_name: str, fmt: str) -> str:
    """Our system prompt for `env_name`: the game and its actions, then how format `fmt` reads."""
    return _read_prompt(_PROMPT_FILES[env_name]) + "\n\n" + _read_prompt(_FORMAT_FILES[fmt])


def resolve_system_prompt(system_prompt, env_name: str, fmt: str) -> str:
    """None -> our default; an existing file path (str or Path) -> its text; any other string -> itself."""
    if system_prompt is None:
        return default_system_prompt(env_name, fmt)
    if isinstance(system_prompt, Path):
        if not system_prompt.is_file():
            raise FileNotFoundError(f"system prompt file {system_prompt} does not exist")
        return system_prompt.read_text(encoding="utf-8")
    if not isinstance(system_prompt, str):
        raise TypeError(f"system_prompt must be None, a string or a path, got {type(system_prompt).__name__}")
    if "\n" not in system_prompt and len(system_prompt) < 4096 and Path(system_prompt).is_file():
        return Path(system_prompt).read_text(encoding="utf-8")
    return system_prompt


def chat_frame(tokenizer, system: str) -> tuple[str, str]:
    """(head, tail) such that head + observation + tail is the tokenizer's chat template applied to
    [system, user(observation)] with the generation prompt and thinking disabled."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": _SENTINEL}]
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    if text.count(_SENTINEL) != 1:
        raise ValueError("the tokenizer's chat template does not place the user message verbatim once")
    head, tail = text.split(_SENTINEL)
    return head, tail
