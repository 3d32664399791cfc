"""An idle engine replica asleep (resources.sleep_delay_s; docs/operations.md, "Idle replicas asleep").

A thread of the replica reads its engine's own /metrics every TICK_S. When the requests it holds (running and
waiting) have been zero and its request counters unchanged for sleep_delay_s (IdleJudge, pure), it asks the engine
to sleep (its kind's SleepMode: vLLM level 1, weights to host memory, KV cache freed; requests still running finish
first, new ones are held by the engine until its wake) and publishes `asleep` in its registry record. The router
wakes it for the next request (flagscale/router/wake.py); the thread sees the engine awake again and publishes that.
An engine that sleeps by itself (llama.cpp: its idle delay is an engine arg) is only watched: the thread reads
whether it sleeps every TICK_S and publishes each change.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from flagscale.engines.base import EngineKind
from flagscale.engines.metrics import engine_metrics

TICK_S = 1.0
METRICS_TIMEOUT_S = 2.0
SLEEP_TIMEOUT_S = 120.0  # an engine's sleep copies its weights to host memory (a few GB/s)


@dataclass
class IdleJudge:
    """How long an engine has been idle, from successive reads of its /metrics: no request running or waiting
    (`load_metrics`) and its request counters (`activity_metrics`) unchanged since the last read."""

    delay_s: float
    load_metrics: tuple[str, ...]
    activity_metrics: tuple[str, ...]
    _last: tuple[float, ...] | None = field(default=None, init=False)
    _since: float = field(default=0.0, init=False)

    def due(self, metrics: dict[str, float], now: float) -> bool:
        """True when the engine has been idle for delay_s or more as of this read at `now` (monotonic)."""
        busy = sum(metrics.get(name, 0.0) for name in self.load_metrics) > 0
        counters = tuple(metrics.get(name, 0.0) for name in self.activity_metrics)
        if busy or counters != self._last:
            self._last = None if busy else counters
            self._since = now
            return False
        return now - self._since >= self.delay_s

    def reset(self, now: float) -> None:
        """The engine has just woken: its idle time counts from now."""
        self._last, self._since = None, now


class SleepController:
    """The thread that puts one replica's engine to sleep when idle (see the module's doc). `publish(asleep)`
    writes the replica's registry record; `note` writes a line to its engine log."""

    def __init__(
        self,
        kind: EngineKind,
        url: str,
        api_key: str | None,
        delay_s: float,
        publish: Callable[[bool], None],
        note: Callable[[str], None],
    ) -> None:
        assert kind.sleep_mode is not None
        self.mode = kind.sleep_mode
        self.url, self._api_key = url, api_key
        self.judge = IdleJudge(delay_s, kind.load_metrics, self.mode.activity_metrics)
        self.asleep = False
        self._publish, self._note = publish, note
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flagscale-sleep", daemon=True)
        self._failing = False

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(TICK_S):
            try:
                self.tick(time.monotonic())
                self._failing = False
            except (OSError, ValueError) as exc:  # the engine busy or gone: the health check judges that
                if not self._failing:
                    self._note(f"sleep: could not read or change the engine's state ({exc!r}); trying again")
                self._failing = True

    def tick(self, now: float) -> None:
        if self.asleep:
            if not self._engine_sleeping():  # the router woke it
                self.asleep = False
                self.judge.reset(now)
                self._note("sleep: the engine is awake again")
                self._publish(False)
            return
        if self.mode.sleeps_by_itself:
            if self._engine_sleeping():
                self.asleep = True
                self._publish(True)
                self._note(f"sleep: the engine went to sleep by itself, idle for {self.judge.delay_s:g}s")
            return
        metrics = engine_metrics(self.url, METRICS_TIMEOUT_S, self._api_key)
        if not self.judge.due(metrics, now) or self._stop.is_set():
            return
        began = time.monotonic()
        try:
            self._call("POST", self.mode.sleep_path, SLEEP_TIMEOUT_S)
        except OSError:
            if not self._engine_sleeping():
                raise
            # the answer was lost or late, but the engine sleeps (or is going to): the router must know, or the
            # requests it sends would wait in the engine for a wake no one asks for
        self.asleep = True
        self._publish(True)
        self._note(f"sleep: idle for {self.judge.delay_s:g}s; asleep after {time.monotonic() - began:.2f}s")

    def _engine_sleeping(self) -> bool:
        return bool(json.loads(self._call("GET", self.mode.sleeping_path, METRICS_TIMEOUT_S))[self.mode.sleeping_field])

    def _call(self, method: str, path: str, timeout_s: float) -> bytes:
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        request = urllib.request.Request(self.url + path, method=method, headers=headers)
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return resp.read()
