"""The signals a run handles: SIGTERM and SIGHUP while it starts are handled as Ctrl-C is (what was started is
stopped), and a run that stays attached (foreground=true) ends on any of them."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

TERMINATING = (signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP during a run's start: handled as Ctrl-C is (what was started is stopped)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_terminated(signum: int, _frame) -> None:
    raise Terminated(signum)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def stop_on_termination() -> dict:
    """SIGTERM and SIGHUP raise Terminated from now on; the handlers they had, to restore. (Only the main thread
    may install handlers: elsewhere nothing changes.)"""
    if not _in_main_thread():
        return {}
    return {signum: signal.signal(signum, _raise_terminated) for signum in TERMINATING}


def restore_handlers(previous: dict) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def ignore_termination() -> None:
    """While what was started is stopped: a second SIGTERM or SIGHUP must not cut the teardown short."""
    if _in_main_thread():
        for signum in TERMINATING:
            signal.signal(signum, signal.SIG_IGN)


def exit_code(exc: KeyboardInterrupt) -> int:
    """130 for Ctrl-C, 128 + its number for the others."""
    return 128 + exc.signum if isinstance(exc, Terminated) else 130


def call_on_stop_signals(callback: Callable[[], None]) -> None:
    """Ctrl-C, SIGTERM and SIGHUP call `callback`. Installed explicitly: a process started in the background
    inherits SIGINT ignored, and Ctrl-C (or `kill -INT`) must still stop the run; a handler also keeps the signal
    out of library code."""
    for signum in (signal.SIGINT, *TERMINATING):
        signal.signal(signum, lambda *_: callback())


def ignore_ctrl_c() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
