"""Driver work whose Ray calls take no timeout, given a bound anyway.

Ray's driver calls that `status` makes (ray.init, serve.status, Serve's instance details, the internal KV store) wait
for their answer without a limit; a Serve controller or GCS that does not answer would keep the command waiting
forever and silently. `within` runs such work on a thread of its own, waits for it a bounded time, and otherwise
raises NoAnswer naming the step the work had reached (the work calls `note(step)` as it goes). The thread left
behind is still inside a Ray call, and Ray's exit handler (ray.shutdown) could wait on it as long: the CLI then ends
its process at once (exit_now, from actions/dispatch.main_exit).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from flagscale.errors import ClusterError, ConfigError

T = TypeVar("T")
Note = Callable[[str], None]  # the work's way of saying what it waits for next

_left_behind: list[threading.Thread] = []  # threads whose work ran out of time
# The bounds a user may set, in seconds (docs/operations.md): checked by every action before it starts anything.
STATUS_BOUND_ENV = "FLAGSCALE_STATUS_TIMEOUT_S"  # the whole of `status`
STOP_SERVE_BOUND_ENV = "FLAGSCALE_STOP_SERVE_TIMEOUT_S"  # the Serve part of a stop (drain and removal)


def seconds_from_env(variable: str, default: float) -> float:
    """The bound `variable` sets, else `default`; a ConfigError naming the variable when it is no positive number."""
    raw = os.environ.get(variable, "")
    if not raw:
        return default
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0:
        raise ConfigError(f"not a number of seconds above 0: {raw!r}", variable)
    return seconds


def check_env_bounds() -> None:
    for variable in (STATUS_BOUND_ENV, STOP_SERVE_BOUND_ENV):
        seconds_from_env(variable, 1.0)


class NoAnswer(ClusterError):
    """A bounded wait ran out; `step` is what the work was waiting for."""

    def __init__(self, message: str, step: str):
        self.step = step
        super().__init__(message)


def within(seconds: float, work: Callable[[Note], T], what: str) -> T:
    """`work(note)` on a daemon thread, waited for at most `seconds`. Its result, or its exception re-raised here;
    past the bound, NoAnswer: "<what>: no answer within N s while <the last step noted>", followed by where the
    time went: the steps before it that took a second or more."""
    steps: list[tuple[str, float]] = [("starting", time.monotonic())]  # each step noted and when it began
    outcome: dict[str, Any] = {}

    def note(now: str) -> None:
        steps.append((now, time.monotonic()))

    def run() -> None:
        try:
            outcome["result"] = work(note)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, name=f"flagscale-bounded: {what}", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        _left_behind.append(thread)
        done = list(steps)
        step = done[-1][0]
        message = f"{what}: no answer within {seconds:g} s while {step}"
        slow = [f"{name} {end - begun:.0f} s" for (name, begun), (_, end) in zip(done, done[1:]) if end - begun >= 1]
        raise NoAnswer(message + (f" (before it: {'; '.join(slow)})" if slow else ""), step)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def left_behind() -> bool:
    """Whether a thread of work that ran out of time may still be running."""
    return any(thread.is_alive() for thread in _left_behind)


def exit_now(code: int) -> None:
    """Ends the process at once, its output flushed, without the exit handlers that could wait on a thread
    left behind."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
