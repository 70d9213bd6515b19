"""Unroll the short `lax.scan`s inside a function we do not own (Craftax's step and reset), without changing results.

A Craftax step is thousands of small GPU kernels, and many of them are loop overhead: its ~50 inner scans (over mob
slots, projectile slots, the 12 inventory rows...; lengths 2-12, about 250 iterations per env step) each launch a
counter increment and device-to-device copies of their carry on every iteration, beside the body's own kernels.
Fully unrolling a short scan removes that overhead and lets XLA fuse neighbouring iterations' elementwise work.

`unroll_short_scans(fn, max_length)` traces `fn` to a jaxpr at call time (inside the caller's trace), sets `unroll`
to the full length on every scan of at most `max_length` steps (at any depth: inside other scans, jits, conds and
while loops) and evaluates the rewritten jaxpr. The primitives and their order are unchanged, so the results are
the same bits (tests/test_rl_speed.py); only the loop structure XLA sees differs. The cost is compile time: the
unrolled bodies are that many times larger.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
from jax.extend import core as jcore

_SUB_JAXPR_PARAMS = ("jaxpr", "body_jaxpr", "cond_jaxpr", "call_jaxpr")


def unroll_short_scans(fn: Callable, max_length: int) -> Callable:
    """`fn` with every `lax.scan` of length <= `max_length` fully unrolled (`max_length` < 2: `fn` itself).
    `fn` takes and returns pytrees of arrays; closed-over arrays become constants of the traced jaxpr."""
    if max_length < 2:
        return fn

    @functools.wraps(fn)
    def unrolled(*args):
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        rewritten = rewrite_closed(closed, max_length)
        outs = jcore.jaxpr_as_fun(rewritten)(*jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return unrolled


def rewrite_closed(closed: Any, max_length: int) -> Any:
    """A `ClosedJaxpr` with its short scans unrolled (`unroll_short_scans`)."""
    return jcore.ClosedJaxpr(rewrite_jaxpr(closed.jaxpr, max_length), closed.consts)


def rewrite_jaxpr(jaxpr: Any, max_length: int) -> Any:
    """A `Jaxpr` with its short scans unrolled, at every depth."""
    return jaxpr.replace(eqns=[_rewrite_eqn(eqn, max_length) for eqn in jaxpr.eqns])


def _rewrite_eqn(eqn: Any, max_length: int) -> Any:
    params = dict(eqn.params)
    changed = False
    for name in _SUB_JAXPR_PARAMS:
        sub = params.get(name)
        if sub is None:
            continue
        if isinstance(sub, jcore.ClosedJaxpr):
            params[name], changed = rewrite_closed(sub, max_length), True
        elif isinstance(sub, jcore.Jaxpr):
            params[name], changed = rewrite_jaxpr(sub, max_length), True
    if "branches" in params:  # lax.cond / lax.switch
        params["branches"] = tuple(rewrite_closed(b, max_length) for b in params["branches"])
        changed = True
    if eqn.primitive.name == "scan" and 1 < params["length"] <= max_length and params.get("unroll") != params["length"]:
        params["unroll"], changed = params["length"], True
    return eqn.replace(params=params) if changed else eqn


def count_scans(fn: Callable, *args) -> dict[int, int]:
    """{scan length: how many scans of that length} in `fn`'s jaxpr at every depth that still loop (unroll < length):
    what `unroll_short_scans` leaves as loops."""
    counts: dict[int, int] = {}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "scan" and eqn.params.get("unroll", 1) < eqn.params["length"]:
                counts[eqn.params["length"]] = counts.get(eqn.params["length"], 0) + 1
            for name in _SUB_JAXPR_PARAMS:
                sub = eqn.params.get(name)
                if sub is not None:
                    walk(getattr(sub, "jaxpr", sub))
            for b in eqn.params.get("branches", ()):
                walk(b.jaxpr)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return counts
