"""What a kernel in a GPU profile computes: find instructions by name in XLA's optimised HLO dumps.

A profile names XLA's kernels (`loop_convert_fusion`, `sort_34_1`, ...) but not what they compute. Run the program
with `XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text"`, then

    python scripts/hlo_fusions.py DIR loop_convert_fusion sort_34_1

prints, for each module after optimisations that has one of the names, the instruction (its shape and operands) and
the body of the computation it calls (a fusion's elementwise steps). A kernel name matches the instruction whose
name it is with '.' and '-' written '_', also with a `_N` suffix (one instruction, several kernels); when two
instructions fit one name, both are printed.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path


def computations(text: str) -> dict[str, list[str]]:
    """The HLO module's computations by name: their lines, header to closing brace."""
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$", line)
        if header and current is None:
            current = found.setdefault(header.group(1), [])
        if current is not None:
            current.append(line)
            if line.startswith("}"):
                current = None
    return found


def _kernel_name(instruction: str) -> str:
    """An HLO instruction's name as a GPU kernel name spells it ('.' and '-' become '_')."""
    return re.sub(r"[.\-]", "_", instruction)


def matches(instruction: str, kernel: str) -> bool:
    """Whether a profile's kernel name is this instruction's kernel: the same name with '.' and '-' as '_', or that
    name with a `_N` suffix (an instruction emitted as several kernels, such as a sort)."""
    own, kernel = _kernel_name(instruction), _kernel_name(kernel)
    return kernel == own or re.fullmatch(re.escape(own) + r"(_\d+)+", kernel) is not None


def describe(text: str, name: str, max_body: int = 40, width: int = 400) -> list[str]:
    """The lines defining the instruction behind kernel `name` (`matches`) in an HLO module's text and the
    computations they call."""
    bodies = computations(text)
    out = []
    for line in text.splitlines():
        defined = re.match(r"^\s*(?:ROOT )?%?([\w.\-]+) = ", line)
        if not defined or not matches(defined.group(1), name):
            continue
        out.append(line.strip()[:width])
        for called in re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", line):
            body = bodies.get(called, [])
            out.extend("    " + b.strip()[:width] for b in body[:max_body])
            if len(body) > max_body:
                out.append(f"    ... {len(body) - max_body} more lines")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dump", type=Path, help="the --xla_dump_to folder")
    parser.add_argument("names", nargs="+", help="instruction names as a profile shows them")
    parser.add_argument("--max-body", type=int, default=40, help="lines of each called computation to print")
    args = parser.parse_args(argv)
    for path in sorted(args.dump.glob("*after_optimizations.txt")):
        text = path.read_text()
        report = []
        for name in args.names:
            found = describe(text, name, args.max_body)
            if found:
                report += [f"-- {name}", *found]
        if report:
            print(f"== {path.name}")
            print("\n".join(report))


if __name__ == "__main__":
    main()
