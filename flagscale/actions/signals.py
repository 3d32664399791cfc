"""The signals a run handles: SIGTERM and SIGHUP while it starts are handled as Ctrl-C is (what was started is
stopped), and a run that stays attached (foreground=true) ends on any of them.

The first stop signal of a start starts the one teardown; any further one (a second SIGTERM, a Ctrl-C, a SIGHUP)
while it runs is noted on stderr, never a new teardown nor an end to this one. Ray's driver would take SIGTERM over
(a handler calling sys.exit, and absl's, which aborts the process 3 s later): flagscale/cluster/driver_signals.py
keeps these handlers across `ray.init`."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)
TERMINATING = (signal.SIGTERM, signal.SIGHUP)
STOP_SIGNALS = (signal.SIGINT, *TERMINATING)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP during a run's start: handled as Ctrl-C is (what was started is stopped)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_terminated(signum: int, _frame) -> None:
    note_further_signals()  # before raising: a second signal must not interrupt the teardown the first starts
    raise Terminated(signum)


def _raise_interrupted(_signum: int, _frame) -> None:
    note_further_signals()
    raise KeyboardInterrupt


def _note(signum: int, _frame) -> None:
    """A stop signal while what was started is stopped: said, and nothing else."""
    name = signal.Signals(signum).name
    try:
        os.write(2, f"{name} received: already stopping what was started; waiting for that to finish\n".encode())
    except OSError:  # a terminal that hung up
        pass
    log.warning("%s received during the teardown: noted, the teardown goes on", name)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def stop_on_termination() -> dict:
    """SIGTERM and SIGHUP raise Terminated from now on, Ctrl-C KeyboardInterrupt (unless this process was started
    with SIGINT ignored); the first of them switches all three to noting (note_further_signals). Returns the handlers
    they had, to restore. (Only the main thread may install handlers: elsewhere nothing changes.)"""
    if not _in_main_thread():
        return {}
    previous = {signum: signal.signal(signum, _raise_terminated) for signum in TERMINATING}
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, _raise_interrupted)
    return previous


def restore_handlers(previous: dict) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def note_further_signals() -> None:
    """While what was started is stopped: SIGTERM, SIGHUP and Ctrl-C are noted and do not cut the teardown short.
    (SIGINT stays ignored where this process was started with it ignored.)"""
    if not _in_main_thread():
        return
    for signum in STOP_SIGNALS:
        if signum != signal.SIGINT or signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, _note)


def exit_code(exc: KeyboardInterrupt) -> int:
    """130 for Ctrl-C, 128 + its number for the others."""
    return 128 + exc.signum if isinstance(exc, Terminated) else 130


def call_on_stop_signals(callback: Callable[[], None]) -> None:
    """Ctrl-C, SIGTERM and SIGHUP call `callback`. Installed explicitly: a process started in the background
    inherits SIGINT ignored, and Ctrl-C (or `kill -INT`) must still stop the run; a handler also keeps the signal
    out of library code."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, lambda *_: callback())
