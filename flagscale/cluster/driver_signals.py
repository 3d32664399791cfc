"""`ray.init` takes the process's termination signals; a run that must stop what it started takes them back.

Becoming a Ray driver changes two handlers (Ray 2.60):
- `ray.init` sets a Python SIGTERM handler that calls `sys.exit(15)`;
- the driver's core worker installs absl's failure-signal handler (C level) for SIGTERM among others. On SIGTERM it
  prints a stack ("*** SIGTERM received at time=... ***"), arms a 3-second alarm whose handler aborts the process
  (SIGABRT), then hands the signal on. The Python handler's SystemExit starts the run's teardown, and the alarm
  kills it 3 s later: Ray and its engines are left running.

`keeping_signal_handlers` runs a `ray.init` with SIGINT, SIGTERM and SIGHUP blocked and puts the process's own
handlers back afterwards (`signal.signal` installs them with sigaction, over absl's). The threads Ray starts meanwhile
inherit the blocked mask, so these signals reach the main thread only; one that arrived during the call is
delivered, to the restored handler, once the mask is lifted."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def keeping_signal_handlers() -> Iterator[None]:
    """The handlers of HANDLED as they were before the block, and nothing of them delivered during it. (Only the main
    thread handles signals: elsewhere nothing changes.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {signum: signal.getsignal(signum) for signum in HANDLED}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED)
    try:
        yield
    finally:
        for signum, handler in before.items():
            if handler is not None:  # None: set outside Python, nothing to put back
                signal.signal(signum, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
