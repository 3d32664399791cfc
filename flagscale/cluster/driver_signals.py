"""`ray.init` takes the process's termination signals; a run that must stop what it started keeps them.

Becoming a Ray driver changes two handlers (Ray 2.60):
- `ray.init` on the main thread sets a Python SIGTERM handler that calls `sys.exit(15)`;
- the driver's core worker installs absl's failure-signal handler (C level, process-wide, from any thread) for SIGTERM
  among others. On SIGTERM it prints a stack ("*** SIGTERM received at time=... ***"), arms a 3-second alarm whose
  handler aborts the process (SIGABRT), then hands the signal on. The Python handler's SystemExit starts the run's
  teardown, and the alarm kills it 3 s later: Ray and its engines are left running.

`keeping_signal_handlers` runs a `ray.init` so that neither sticks: the core worker is told to install no failure-signal
handler (ray_compat.no_failure_signal_handler; a crash of the driver then has no C++ stack, only Python's), SIGINT,
SIGTERM and SIGHUP are blocked on the calling thread meanwhile, and on the main thread the process's own handlers are
put back afterwards. The threads Ray starts inherit the blocked mask, so these signals reach the process's own
threads only; one that arrived during the call is delivered, to the restored handler, once the mask is lifted. (A
teardown attaches from a worker thread, within a bound: cluster/bounded.py. There Ray sets no Python handler.)"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

from flagscale.cluster.ray_compat import no_failure_signal_handler

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def keeping_signal_handlers() -> Iterator[None]:
    """The handlers of HANDLED as they were before the block, and none of them delivered to this thread during it."""
    no_failure_signal_handler()
    on_main = threading.current_thread() is threading.main_thread()
    before = {signum: signal.getsignal(signum) for signum in HANDLED} if on_main else {}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED)
    try:
        yield
    finally:
        for signum, handler in before.items():
            if handler is not None:  # None: set outside Python, nothing to put back
                signal.signal(signum, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
