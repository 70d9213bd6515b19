"""Hidden-state layers (HF indices: 0 embeddings, k after k layers, -1 the final post-norm state): parsing
`--llm-layer 8,16,24,-1`, checking it against a model's depth, and where each labelled layer lives in a file
(`hidden_state` the first, `hidden_state_L<k>` the others). Below every tool and the offline data reader.
"""
from __future__ import annotations


def model_depth(name) -> int:
    """The number of decoder layers of model `name` (a preset or a checkpoint directory / hub id), read from its
    config only (nothing loaded): the valid hidden-state indices are -(L+1)..L."""
    from jaxllm.config import PRESETS, Qwen3Config
    from jaxllm.resolve import resolve_checkpoint_dir

    if str(name) in PRESETS:
        return int(PRESETS[str(name)].num_hidden_layers)
    return int(Qwen3Config.from_json(resolve_checkpoint_dir(name, tuple(PRESETS)) / "config.json").num_hidden_layers)


def parse_layers(text: str, depth: int | None = None, flag: str = "--llm-layer") -> tuple[int, ...]:
    """`8,16,24,-1` -> (8, 16, 24, -1): HF hidden-state indices, at least one, no repeats (after normalising with
    `depth` when given, which also checks the range). ValueError (one line naming the fix) otherwise."""
    try:
        layers = tuple(int(x) for x in str(text).split(","))
    except ValueError:
        raise ValueError(f"{flag} {text}: give one index or several separated by commas, e.g. {flag} 8,16,24,-1"
                         ) from None
    if depth is not None:
        bad = [k for k in layers if not -(depth + 1) <= k <= depth]
        if bad:
            raise ValueError(f"{flag} {text}: index {bad[0]} is past the model's depth ({depth} layers: indices "
                             f"{-(depth + 1)}..{depth}; 0 = embeddings, -1 = final); pick indices in that range")
        norm = [k % (depth + 1) for k in layers]
        if len(set(norm)) != len(norm):
            raise ValueError(f"{flag} {text}: a layer is given twice (-1 is {depth}); give each layer once")
    return layers


def layer_key(index: int) -> str:
    """The array name of hidden-state index `index` (0..L) in a file labelled with several layers."""
    return f"hidden_state_L{int(index)}"


def hidden_key_of(labelling: dict | None, layer: int | None, flag: str = "--hidden-layer") -> str:
    """The array that holds hidden-state index `layer` in files with `labelling` (None: the first labelled layer,
    `hidden_state`). ValueError (one line naming the fix) for a layer the files do not hold."""
    if layer is None:
        return "hidden_state"
    lab = labelling or {}
    depth = lab.get("model_layers")
    layers = lab.get("llm_layers") or [lab.get("llm_layer")]
    norm = lambda k: None if k is None else (int(k) % (depth + 1) if depth is not None else int(k))  # noqa: E731
    in_range = depth is None or -(depth + 1) <= int(layer) <= depth
    want = norm(layer) if in_range else None
    if in_range and layers and want == norm(layers[0]):
        return "hidden_state"
    if in_range and want in [norm(k) for k in layers[1:]]:
        return layer_key(want)
    have = ", ".join(str(k) for k in layers if k is not None) or "none recorded"
    raise ValueError(f"{flag} {layer}: the files hold no such layer (they hold {have}); choose one of those, or "
                     f"relabel with rl.label --llm-layer including {layer}")
