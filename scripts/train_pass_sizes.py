"""`python -m rl.train` with the packed encoder's pass sizes fixed: what each compiled pass size costs a cold start.

    python scripts/train_pass_sizes.py 4608,36864 --encoder inscan --model qwen3-30b-a3b --llm-dtype fp8 ...
    python scripts/train_pass_sizes.py six ...          # the six sizes used before 2026-11-29 (bench_encoder)
    python scripts/train_pass_sizes.py default ...      # jaxllm.pass_capacities, for the same call

Every program this process traces (the update, the first states' LLM call) compiles the sizes given, each at most the
pass's capacity, plus the capacity itself (a size above the capacity is dropped).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jaxllm.encoder  # noqa: E402


def fixed_sizes(spec: str):
    """A replacement for `jaxllm.encoder.pass_capacities` that returns the sizes `spec` names."""
    if spec == "default":
        return jaxllm.encoder.pass_capacities
    if spec == "six":
        from scripts.bench_encoder import six_pass_sizes

        return six_pass_sizes
    sizes = [int(s) for s in spec.split(",")]

    def pass_capacities(capacity: int, max_len: int) -> tuple[int, ...]:
        return tuple(sorted({s for s in sizes if max_len <= s <= capacity} | {int(capacity)}))

    return pass_capacities


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    jaxllm.encoder.pass_capacities = fixed_sizes(argv[0])
    from rl.train import main as train_main

    print(f"pass sizes: {argv[0]}", flush=True)
    return train_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
