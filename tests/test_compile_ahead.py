"""rl.jit.CompileAhead: jobs in background threads, a job that waits for others (`after`), `wait_all`, `summary`."""
from __future__ import annotations

import threading
import time

import pytest

from rl.jit import CompileAhead


def test_a_job_after_another_starts_when_it_ended():
    said, order = [], []
    gate = threading.Event()
    ahead = CompileAhead(said.append)

    def first():
        gate.wait(5)
        order.append("first")
        return "one"

    def second():
        order.append("second")
        return "two"

    ahead.submit("first", first)
    ahead.submit("second", second, after=("first",))
    ahead.submit("free", lambda: order.append("free") or "three")
    time.sleep(0.2)
    assert "second" not in order and not ahead.done("second")  # waits for `first`
    gate.set()
    ahead.wait_all()
    assert order.index("first") < order.index("second")
    assert [ahead.get(n) for n in ("first", "second", "free")] == ["one", "two", "three"]
    assert [part.split(" ")[0] for part in ahead.summary().split(", ")] == ["first", "second", "free"]


def test_a_failed_job_does_not_stop_the_job_after_it():
    ahead = CompileAhead()

    def fails():
        raise RuntimeError("no")

    ahead.submit("bad", fails)
    ahead.submit("good", lambda: 1, after=("bad",))
    ahead.wait_all()  # errors stay for get
    assert ahead.get("good") == 1 and ahead.summary().startswith("good ")
    with pytest.raises(RuntimeError, match="no"):
        ahead.get("bad")
