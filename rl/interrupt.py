"""Ctrl-C during training: the first one finishes the current update, checkpoints it and stops; a second one (or
one before any update finished here, when there is nothing new to save) stops at once (KeyboardInterrupt)."""
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
        self.say("Ctrl-C: stopping after this update, with a checkpoint (Ctrl-C again to stop at once)")

    def __call__(self) -> bool:
        self._armed = True
        return self.requested
