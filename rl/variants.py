"""Prompt variants: evaluate a policy while its LLM reads a modified prompt (`rl.eval --prompt/--prompts`,
`rl.offline eval --prompt/--prompts`).

A variant either replaces the system prompt, or transforms the game text the LLM reads, at the level of the token
ids (what the LLM reads is exactly what is said here):

| kind | spec | the ids the LLM reads |
|---|---|---|
| system | `NAME=TEXT`, `NAME=@FILE`; file: `{system: TEXT}` / `{system_file: PATH}` / a plain string | the same game ids behind another system prompt (another prefix cache) |
| drop | `{drop: inventory}` (or map, status; a list drops several) | the game ids without that section's tokens (the rest unchanged, closed up) |
| fixed | `{game_text: TEXT}` | every state reads the same ids: TEXT's tokens, then the chat tail |
| random | `{random_tokens: true}` | each game token replaced by a uniform random token id (same length; the chat tail kept), fresh every refresh |
| empty | `{empty: true}` | no game text at all: only the chat tail after the prompt head |

`--prompts FILE` is YAML or JSON: a mapping NAME -> spec. Every variant is played on the same worlds and seeds as
`real`, and its description (with the full system text or game text) is stored in eval.json.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

KINDS = ("system", "drop", "fixed", "random", "empty")
SECTIONS = {  # user-facing section -> the layout sections of each format that hold it
    "map": {"compact": ("header", "map"), "full": ("header", "map")},
    "inventory": {"compact": ("items_label", "items"), "full": ("inventory",)},
    "status": {"compact": ("status",)},
}
RANDOM_FOLD = 7  # the random-token variant's key: fold_in(the window's ablation key, RANDOM_FOLD)


@dataclass(frozen=True)
class Variant:
    name: str
    kind: str
    text: str | None = None  # system prompt (system) or game text (fixed)
    sections: tuple[str, ...] = ()  # drop

    def describe(self) -> dict[str, Any]:
        """What eval.json stores: the kind and everything needed to say exactly what the LLM read."""
        out: dict[str, Any] = {"kind": self.kind}
        if self.kind == "system":
            out["system_prompt"] = self.text
        elif self.kind == "fixed":
            out["game_text"] = self.text
        elif self.kind == "drop":
            out["dropped"] = list(self.sections)
        return out

    def note(self) -> str:
        """One line for the table's legend."""
        short = lambda t: (t[:60] + "...") if len(t) > 63 else t  # noqa: E731
        return {"system": lambda: f"variant: system prompt {short(self.text)!r}",
                "drop": lambda: f"variant: the game text without its {' and '.join(self.sections)} section",
                "fixed": lambda: f"variant: every state's game text replaced by {short(self.text)!r}",
                "random": lambda: "variant: random tokens in place of the game text (same length)",
                "empty": lambda: "variant: no game text (only the chat frame)"}[self.kind]()


def _read(path: str, what: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{what} @{path}: no such file; give an existing file after @ (or the text itself)")
    return p.read_text(encoding="utf-8")


def _name(name: str, flag: str) -> str:
    from rl.modes import MODES

    name = name.strip()
    if not name or not all(c.isalnum() or c in "_-." for c in name):
        raise ValueError(f"{flag}: variant name {name!r} must be letters, digits, '_', '-' or '.' (e.g. "
                         f"--prompt pirate=@pirate.txt)")
    if name in MODES:
        raise ValueError(f"{flag}: variant name {name!r} is a built-in mode ({', '.join(MODES)}); choose another")
    return name


def parse_prompt_flag(value: str) -> Variant:
    """`--prompt NAME=TEXT` or `NAME=@FILE`: a system-prompt variant. ValueError (one line) naming the fix."""
    name, sep, spec = value.partition("=")
    if not sep:
        raise ValueError(f"--prompt {value!r}: give NAME=TEXT or NAME=@FILE (e.g. --prompt pirate=@pirate.txt)")
    name = _name(name, "--prompt")
    text = _read(spec[1:], f"--prompt {name}=") if spec.startswith("@") else spec
    return Variant(name, "system", text)


def _from_spec(name: str, spec: Any, where: str) -> Variant:
    if isinstance(spec, str):
        return Variant(name, "system", spec)
    if not isinstance(spec, dict) or len(spec) != 1:
        raise ValueError(f"{where}: variant {name!r} must be a text or one of {{system: TEXT}}, {{system_file: PATH}},"
                         f" {{drop: SECTION}}, {{game_text: TEXT}}, {{random_tokens: true}}, {{empty: true}}")
    (key, val), = spec.items()
    if key == "system":
        return Variant(name, "system", str(val))
    if key == "system_file":
        return Variant(name, "system", _read(str(val), f"{where}: variant {name!r} system_file"))
    if key == "drop":
        sections = (val,) if isinstance(val, str) else tuple(val)
        bad = [s for s in sections if s not in SECTIONS]
        if bad or not sections:
            raise ValueError(f"{where}: variant {name!r} drops unknown section {', '.join(map(str, bad)) or '(none)'};"
                             f" known sections: {', '.join(SECTIONS)}")
        return Variant(name, "drop", sections=sections)
    if key == "game_text":
        return Variant(name, "fixed", str(val))
    if key == "random_tokens" and val is True:
        return Variant(name, "random")
    if key == "empty" and val is True:
        return Variant(name, "empty")
    raise ValueError(f"{where}: variant {name!r} has unknown transform {key!r}; known: system, system_file, drop, "
                     f"game_text, random_tokens: true, empty: true")


def load_prompts_file(path: str | Path) -> list[Variant]:
    """The variants of a YAML or JSON file (a mapping NAME -> spec). ValueError (one line) naming the fix."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--prompts {path}: no such file; give a YAML or JSON file of named variants")
    text = p.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except ValueError:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"--prompts {path}: neither JSON nor YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict) or not data:
        raise ValueError(f"--prompts {path}: must map variant names to specs (e.g. `no_inventory: {{drop: "
                         f"inventory}}`)")
    return [_from_spec(_name(str(k), f"--prompts {path}"), v, f"--prompts {path}") for k, v in data.items()]


def gather(prompt_flags=(), prompts_file: str | Path | None = None) -> list[Variant]:
    """Every variant of `--prompt` flags and a `--prompts` file, names unique. ValueError (one line)."""
    variants = [parse_prompt_flag(v) for v in prompt_flags or ()]
    if prompts_file is not None:
        variants += load_prompts_file(prompts_file)
    names = [v.name for v in variants]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"variant name {', '.join(dup)} given twice; give each variant its own name")
    return variants


def check_sections(variants, fmt: str) -> None:
    """ValueError (one line) for a variant dropping a section format `fmt` does not have on its own."""
    for v in variants:
        for s in v.sections:
            if fmt not in SECTIONS[s]:
                have = [k for k, per in SECTIONS.items() if fmt in per]
                raise ValueError(f"variant {v.name!r}: --obs-format {fmt} has no separate {s} section; drop one of "
                                 f"{', '.join(have)}")


# ------------------------------------------------------------------------------------------------ the ids


def _tail_length(template, tokenizer) -> int:
    return len(tokenizer([template.tail], add_special_tokens=False)["input_ids"][0])


def variant_ids(variant: Variant, template, tokenizer, vocab_size: int):
    """(template', transform) for `variant`: `template'` the template of the game ids the variant keeps (sections
    dropped), `transform(ids [B, T], lengths [B], key) -> (ids, lengths)` what it does to them (pure jnp)."""
    import dataclasses

    fmt = template.fmt.name
    body = tuple(s.name for s, _ in template._sections if s.name != "chat_tail")
    identity = lambda ids, lengths, key: (ids, lengths)  # noqa: E731
    if variant.kind == "system":
        return template, identity
    if variant.kind == "drop":
        check_sections([variant], fmt)
        names = tuple(n for s in variant.sections for n in SECTIONS[s][fmt])
        return dataclasses.replace(template, dropped=names), identity
    only_tail = dataclasses.replace(template, dropped=body)
    if variant.kind == "empty":
        return only_tail, identity
    if variant.kind == "fixed":
        extra = np.asarray(tokenizer([variant.text], add_special_tokens=False)["input_ids"][0], np.int32)
        if len(extra) == 0:
            return only_tail, identity

        def fixed(ids, lengths, key):
            k = len(extra)
            pad = jnp.full((ids.shape[0], k), template.pad_id, ids.dtype)
            return jnp.concatenate([jnp.broadcast_to(jnp.asarray(extra, ids.dtype), pad.shape), ids], 1), lengths + k

        return only_tail, fixed
    if variant.kind == "random":
        tail = _tail_length(template, tokenizer)

        def random(ids, lengths, key):
            noise = jax.random.randint(key, ids.shape, 0, vocab_size, ids.dtype)
            game = jnp.arange(ids.shape[1])[None, :] < (lengths - tail)[:, None]
            return jnp.where(game, noise, ids), lengths

        return template, random
    raise ValueError(f"unknown variant kind {variant.kind!r}")


def make_variant_encoder(variant: Variant, llm, encode_ids: Callable) -> Callable:
    """(llm_params, prefix_cache, inputs [B], key) -> hidden [B, D]: the template's ids of the inputs (states or
    observations, as `llm.template` reads) transformed by `variant`, then `encode_ids`."""
    tpl, transform = variant_ids(variant, llm.template, llm.tokenizer, vocab_size(llm))

    def encode(llm_params, prefix_cache, inputs, key):
        ids, lengths = jax.vmap(tpl)(inputs)
        ids, lengths = transform(ids, lengths, jax.random.fold_in(key, RANDOM_FOLD))
        return encode_ids(llm_params, prefix_cache, ids, lengths)

    return encode


def vocab_size(llm) -> int:
    """Token ids a random-token variant draws from: the tokenizer's base vocabulary (no special tokens) that the
    model can embed."""
    n = getattr(llm.tokenizer, "vocab_size", None) or len(llm.tokenizer)
    return int(min(n, llm.model.config.vocab_size)) if llm.model is not None else int(n)


def setup_for(variant: Variant, llm):
    """The LLMSetup a variant reads behind: another system prompt's (a new prefix cache), else `llm` itself."""
    return llm.with_prompt(variant.text) if variant.kind == "system" else llm


def make_variant_obs_encoder(variant: Variant, llm, llm_cfg) -> Callable:
    """(llm_params, cache, obs [B, O], need bool [B], key) -> float32 [B, D]: an offline policy's hidden state under
    `variant`, made as `rl.label` makes labels (the observation template, float16 rounding), rows with `need`
    False left out of the LLM call."""
    from rl.llm import make_ids_encoder

    tpl, transform = variant_ids(variant, llm.template, llm.tokenizer, vocab_size(llm))
    encode_ids = make_ids_encoder(llm.model.config, **llm_cfg.encode_options())

    def encode(llm_params, prefix_cache, obs, need, key):
        ids, lengths = jax.vmap(tpl)(obs)
        ids, lengths = transform(ids, lengths, jax.random.fold_in(key, RANDOM_FOLD))
        lengths = jnp.where(need, lengths, 0)
        return encode_ids(llm_params, prefix_cache, ids, lengths).astype(jnp.float16).astype(jnp.float32)

    return encode
