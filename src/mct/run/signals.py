"""SIGTERM / SIGINT in a training process: finish the step, save, exit 143 / 130.

``StopRequest.install()`` replaces the default handlers (SIGINT's KeyboardInterrupt
would abandon the step anywhere, even half-way through an optimizer update) with one
that records the signal; the training loop looks at it between steps, all ranks
agree (a MAX all-reduce), write the checkpoint of the last completed step and exit
with 128 + the signal number. A watchdog bounds all of this by
``train.preempt_timeout_s``: past it the process exits at once (the previous
complete checkpoint is still on disk: checkpoint writes are atomic).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from dataclasses import dataclass, field
from types import FrameType

HANDLED = (signal.SIGTERM, signal.SIGINT)


class Preempted(RuntimeError):
    """Stopped by a signal after saving what could be saved; ``exit_code`` = 128 + signum."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


@dataclass
class StopRequest:
    """The first stop signal received (0: none) and the watchdog that bounds the stop."""

    timeout_s: float = 30.0
    signum: int = 0
    _timer: threading.Timer | None = field(default=None, repr=False)
    _previous: dict = field(default_factory=dict, repr=False)

    def install(self) -> "StopRequest":
        """Handle SIGTERM and SIGINT in this (main) thread; no-op elsewhere."""
        if threading.current_thread() is threading.main_thread():
            for sig in HANDLED:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)
        self._previous.clear()
        self.cancel_watchdog()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum:  # the same signal often arrives twice (terminal + launcher): once is enough
            return
        self.signum = signum
        self._timer = threading.Timer(self.timeout_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        name = signal.Signals(self.signum).name
        print(f"mct: {name}: no checkpoint within train.preempt_timeout_s = {self.timeout_s:g} s; exiting "
              f"(the newest complete checkpoint is unchanged)", file=sys.stderr, flush=True)
        os._exit(128 + self.signum)

    def cancel_watchdog(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""
