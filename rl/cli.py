"""Command-line plumbing shared by the entry points: a parser whose --help shows every option's help and default,
that accepts `--flag_name` as a silent spelling of `--flag-name`, and options built from a dataclass's fields."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Sequence


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module docstring as written; every option's help followed by its default (when it has one)."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=34, width=120)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or "(default" in text or action.required or not action.option_strings or isinstance(
                action, (argparse._HelpAction, argparse._StoreTrueAction, argparse._StoreFalseAction)):
            return text
        default = getattr(action, "shown_default", action.default)
        if default is argparse.SUPPRESS:
            return text
        return f"{text} (default: {_show(default)})"


def _show(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    if isinstance(value, int) and abs(value) >= 10_000:
        return f"{value:_}"
    return str(value)


class Parser(argparse.ArgumentParser):
    """argparse with HelpFormatter, and `--some_flag` read as `--some-flag` (the underscored spellings of older
    commands keep working without doubling --help)."""

    def __init__(self, **kw: Any) -> None:
        kw.setdefault("formatter_class", HelpFormatter)
        super().__init__(**kw)

    def error(self, message: str):  # type: ignore[override]
        """One line (argparse's default prints the whole usage first), exit code 2; an unknown option gets the
        nearest known one as a hint."""
        hint = self._did_you_mean(message)
        self.exit(2, f"{self.prog}: error: {message}{hint} (--help lists every option)\n")

    def _did_you_mean(self, message: str) -> str:
        import difflib

        prefix = "unrecognized arguments: "
        if not message.startswith(prefix):
            return ""
        known = [o for o in self._option_string_actions if o.startswith("--")]
        given = [a.split("=")[0] for a in message[len(prefix):].split() if a.startswith("--")]
        hints = [m[0] for m in (difflib.get_close_matches(g.replace("_", "-"), known, n=1) for g in given) if m]
        return f" (did you mean {', '.join(hints)}?)" if hints else ""

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None):  # type: ignore[override]
        import sys

        args = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args([self._dashed(a) for a in args], namespace)

    def add_subparsers(self, **kw: Any):  # type: ignore[override]
        """Subcommands parsed by `SubcommandParser`: a mistyped flag of `prog train` is reported (with the nearest
        of train's own flags) by the subcommand, not by the top parser, which knows none of them."""
        if kw.get("parser_class", Parser) is Parser:
            kw["parser_class"] = SubcommandParser
        return super().add_subparsers(**kw)

    def _dashed(self, arg: str) -> str:
        if not arg.startswith("--") or "_" not in arg:
            return arg
        name, eq, value = arg.partition("=")
        dashed = name.replace("_", "-")
        return dashed + eq + value if dashed in self._option_string_actions and name not in \
            self._option_string_actions else arg


class SubcommandParser(Parser):
    """The parser of one subcommand (`python -m rl.offline train`): arguments it does not know are its own error,
    with the typo hint drawn from its own flags."""

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None):  # type: ignore[override]
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def parse_bool(s: str) -> bool:
    """true/false, yes/no, on/off, 1/0 (any case)."""
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {s!r}")


PROMPT_METAVAR = "TEXT|@FILE"


def prompt_text(value: str) -> str:
    """A prompt option's value (every tool's `--system-prompt`): `@FILE` is the file's text, anything else the text
    itself. A plain value that looks like a file path (one word with a slash or a file extension) is refused, so a
    mistyped path never becomes the prompt. argparse.ArgumentTypeError (one line, naming the value and the fix)."""
    import re
    from pathlib import Path

    if value.startswith("@"):
        path = Path(value[1:]).expanduser()
        if not path.is_file():
            raise argparse.ArgumentTypeError(f"{value}: no such file {str(path)!r} (@FILE reads a prompt from a file)")
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise argparse.ArgumentTypeError(f"{value}: cannot read it as UTF-8 text ({e})") from None
    word = value.strip()
    if word and not any(c.isspace() for c in word) and (
            "/" in word or "\\" in word or word.startswith("~") or re.search(r"\.[A-Za-z][A-Za-z0-9]{0,4}$", word)):
        exists = Path(word).expanduser().is_file()
        raise argparse.ArgumentTypeError(
            f"{value!r} looks like a file path ({'an existing file' if exists else 'no such file'}); write @{word} to "
            f"read a prompt from a file, or give the prompt's text (a sentence)")
    return value


def add_dataclass_options(parser: argparse.ArgumentParser, fields: type | Sequence[dataclasses.Field],
                          groups: Sequence[str], choices: dict[str, Sequence[str]] | None = None,
                          types: dict[str, Any] | None = None, *, defaults: bool = False) -> None:
    """One `--field-name` option per field (of a dataclass, or a sequence of fields), under its metadata's group (in
    `groups` order; a group not listed: the parser's own options), with its metadata's help and its default shown.
    `defaults`: the field's default is the option's default too; otherwise the parser's own (e.g. SUPPRESS: only
    given flags land)."""
    choices, types = choices or {}, types or {}
    sections = {g: parser.add_argument_group(g) for g in groups}
    for f in (dataclasses.fields(fields) if isinstance(fields, type) else fields):
        section = sections.get(f.metadata.get("group"), parser)
        kw: dict[str, Any] = {"dest": f.name, "help": f.metadata.get("help", "")}
        if f.name in choices:
            kw["choices"] = choices[f.name]
            kw["metavar"] = "{" + ",".join(choices[f.name]) + "}"
        elif "type" in f.metadata:  # e.g. an optional int (default None)
            kw["type"], kw["metavar"] = f.metadata["type"], "N"
        elif isinstance(f.default, bool):
            kw["type"], kw["metavar"] = parse_bool, "BOOL"
        elif isinstance(f.default, (int, float)):
            kw["type"], kw["metavar"] = type(f.default), "N" if isinstance(f.default, int) else "X"
        else:
            kw["type"], kw["metavar"] = str, "TEXT"
        if f.name in types:  # a parser of its own, e.g. {"system_prompt": prompt_text}
            kw["type"] = types[f.name]
            kw["metavar"] = PROMPT_METAVAR if types[f.name] is prompt_text else kw["metavar"]
        kw["metavar"] = f.metadata.get("metavar", kw["metavar"])
        if defaults:
            kw["default"] = f.default
        action = section.add_argument("--" + f.name.replace("_", "-"), **kw)
        action.shown_default = f.default


def add_compile_cache_option(p: argparse.ArgumentParser | Any) -> None:
    """--compile-cache DIR|off: JAX's persistent compilation cache (on by default; jaxllm.compile)."""
    from jaxllm.compile import default_cache_dir

    p.add_argument("--compile-cache", dest="compile_cache", metavar="DIR", default=None,
                   help=f"keep compiled programs here so the next start skips most compiling (default: "
                        f"{default_cache_dir()}; JAX_COMPILATION_CACHE_DIR wins; up to 16 GiB unless "
                        f"JAX_COMPILATION_CACHE_MAX_SIZE says otherwise, the least recently used going first); off = "
                        f"do not keep them")


def apply_compile_cache(args: argparse.Namespace) -> None:
    """Turn on the persistent compilation cache that --compile-cache names (default on)."""
    from jaxllm.compile import enable_persistent_cache

    enable_persistent_cache(getattr(args, "compile_cache", None))
