"""`ray.init` takes the process's termination signals; a run that must stop what it started keeps them.

Becoming a Ray driver changes two handlers (Ray 2.60):
- `ray.init` on the main thread sets a Python SIGTERM handler that calls `sys.exit(15)`;
- the driver's core worker installs absl's failure-signal handler (C level, process-wide, from any thread) for SIGTERM
  among others. On SIGTERM it prints a stack ("*** SIGTERM received at time=... ***"), arms a 3-second alarm whose
  handler aborts the process (SIGABRT), then hands the signal on. The Python handler's SystemExit starts the run's
  teardown, and the alarm kills it 3 s later: Ray and its engines are left running.
And a signal that interrupts `ray.init` itself leaves a core worker made but Ray not marked initialized: the
teardown's own `ray.init` then aborts the process ("The process is already initialized for core worker").

`keeping_signal_handlers` runs a `ray.init` so that none of this happens: Ray sets no SIGTERM handler
(ray_compat.ray_sets_no_sigterm_handler), its core worker no failure-signal handler (ray_compat.no_failure_signal_handler;
a crash of the driver then has no C++ stack, only Python's), and on the main thread SIGINT, SIGTERM and SIGHUP are
held meanwhile: noted, then raised again once the process's own handlers are back. (A teardown may attach from a
bounded worker thread, cluster/bounded.py: no handler can be set there, and the teardown's own note a signal.)"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

from flagscale.cluster.ray_compat import no_failure_signal_handler, ray_sets_no_sigterm_handler

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def keeping_signal_handlers() -> Iterator[None]:
    """The process's handlers of HANDLED as they were, and any of those signals that came during the block handled by
    them after it (on the main thread; elsewhere only Ray's handlers are kept out)."""
    no_failure_signal_handler()
    held: list[int] = []
    before = {}
    if threading.current_thread() is threading.main_thread():
        for signum in HANDLED:
            if signal.getsignal(signum) not in (signal.SIG_IGN, None):  # None: a handler set outside Python
                before[signum] = signal.signal(signum, lambda signum, _frame: held.append(signum))
    try:
        with ray_sets_no_sigterm_handler():
            yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(held):
            signal.raise_signal(signum)
