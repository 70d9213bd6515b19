"""Ctrl-C during training: the first one lets the updates already started finish (the loop starts the next update
before it reads the current one, so that can be two), checkpoints the last and stops, and says so in numbers; a
second one (or one before any update finished here, when there is nothing new to save) stops at once
(KeyboardInterrupt)."""
from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Callable


class StopOnInterrupt:
    """Context manager installing the SIGINT handler (main thread only). Call the object once per finished update:
    it returns True when the run should stop there."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say = say
        self.requested = False
        self._armed = False  # an update finished in this invocation: a checkpoint would keep something
        self._previous = None
        self._reading: int | None = None  # the update whose results the loop waits for
        self._last: int | None = None  # the last update that runs when a stop is requested now
        self.describe: Callable[[], str] | None = None  # a loop's own message for a Ctrl-C now (rl.offline train)

    def __enter__(self) -> "StopOnInterrupt":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested or not self._armed:
            raise KeyboardInterrupt
        self.requested = True
        self.say(self.message())

    def running(self, reading: int, last: int) -> None:
        """The loop's state: it waits for update `reading`; a stop requested now ends after update `last` (the
        one after `reading` when it was already started)."""
        self._reading, self._last = reading, last

    def message(self) -> str:
        """What a Ctrl-C now does, in update numbers."""
        again = "Ctrl-C again to stop at once"
        if self.describe is not None:
            return f"{self.describe()} ({again})"
        if self._last is None or self._reading is None:
            return f"Ctrl-C: stopping after the update in progress, with a checkpoint ({again})"
        if self._last > self._reading:
            return (f"Ctrl-C: finishing updates {self._reading} and {self._last} (both already started), then "
                    f"saving a checkpoint of update {self._last} and stopping ({again})")
        return f"Ctrl-C: finishing update {self._last}, then saving a checkpoint of it and stopping ({again})"

    def __call__(self) -> bool:
        self._armed = True
        return self.requested
