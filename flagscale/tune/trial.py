"""One trial: the candidate deployed on the real target, then loaded through the router at rising concurrency with
vLLM's serving benchmark (flagscale/actions/bench.py), until the SLO is missed or the levels run out.

The first candidate starts the deployment (actions.run.run); each next one is applied to it in place
(actions.update_in_place.update: same Ray cluster, only the changed replicas restart). A change that cannot be applied in
place, or a deployment left by a failed trial, is stopped and started afresh.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from flagscale.actions.bench import LATENCY_METRICS, _run_logged, report_row, vllm_bench_argv
from flagscale.actions.run import refuse_if_running, run, running_state, update
from flagscale.actions.stop import stop
from flagscale.cluster.state import RunState
from flagscale.config.load import resolve_api_key
from flagscale.config.schema import BenchConfig
from flagscale.errors import DeployError, FlagScaleError, error_excerpt
from flagscale.plan import build_plan
from flagscale.update import diff, snapshot

# Statistic names of the SLO -> the keys of bench.report_row's latency stats.
STATISTICS = ("mean", "p50", "p90", "p99")


def slo_misses(row: dict[str, Any], slo: dict[str, dict[str, float]]) -> list[str]:
    """The SLO limits one benchmark pass (a bench.report_row) misses, e.g. 'ttft_ms p99 812.0 > 500'."""
    misses = []
    for metric, limits in slo.items():
        for statistic, limit in limits.items():
            value = row[metric][statistic]
            if value > limit:
                misses.append(f"{metric} {statistic} {value:.1f} > {limit:g}")
    return misses


def slo_ratio(row: dict[str, Any], slo: dict[str, dict[str, float]]) -> float:
    """The worst measured / limit of a pass: <= 1 meets the SLO; how close a miss came."""
    return max(row[metric][statistic] / limit for metric, limits in slo.items() for statistic, limit in limits.items())


def passes_complete(row: dict[str, Any]) -> bool:
    return row["failed"] == 0 and row["completed"] > 0


@dataclass
class Outcome:
    """What a trial's levels came to: the pass its numbers are reported from, and its goodput (request/s)."""

    row: dict[str, Any] | None  # the reported pass (None: no pass at all)
    goodput: float
    slo_met: bool
    closest_ratio: float | None  # with an SLO: the lowest pass's worst measured / limit


def goodput_of(rows: list[dict[str, Any]], slo: dict[str, dict[str, float]] | None) -> Outcome:
    """Passes in climbing concurrency -> the trial's goodput. With an SLO: the request throughput of the highest
    pass that meets it with no failed request, climbing stops at the first miss; its numbers are reported (the
    lowest pass's when none meets it). Without one: the highest pass's throughput, every pass counts."""
    if not rows:
        return Outcome(None, 0.0, False, None)
    if slo is None:
        top = rows[-1]
        return Outcome(top, top["req_s"] if passes_complete(top) else 0.0, passes_complete(top), None)
    best = None
    for row in rows:
        if slo_misses(row, slo) or not passes_complete(row):
            break
        best = row
    if best is None:
        return Outcome(rows[0], 0.0, False, slo_ratio(rows[0], slo))
    return Outcome(best, best["req_s"], True, slo_ratio(rows[0], slo))


def scaled_load(settings: BenchConfig, levels: list[int], devices: float) -> tuple[BenchConfig, list[int]]:
    """The workload for a candidate on `devices` devices when every device is to see the same load: each level and
    the prompts per level times the devices, rounded (the same settings and levels for one device or less)."""
    factor = max(1, round(devices))
    if factor == 1:
        return settings, levels
    return settings.model_copy(update={"num_prompts": settings.num_prompts * factor}), [c * factor for c in levels]


class TrialTimeout(FlagScaleError):
    pass


class BenchWorker:
    """vLLM's benchmark in a worker process, one pass at a time, each bounded: a pass past its time is ended by
    terminating the worker (a fresh one serves the next pass)."""

    def __init__(self, log_path: Path, api_key: str | None = None):
        self.log_path = log_path
        self.api_key = api_key  # to the worker's environment only (flagscale/actions/bench.py: _run_logged)
        self._pool = None

    def run_pass(self, argv: list[str], timeout_s: float) -> dict[str, Any]:
        if self._pool is None:
            self._pool = multiprocessing.get_context("spawn").Pool(1)
        pending = self._pool.apply_async(_run_logged, (argv, str(self.log_path), self.api_key))
        try:
            return pending.get(timeout=max(1.0, timeout_s))
        except multiprocessing.TimeoutError:
            self.close()
            raise TrialTimeout(f"a benchmark pass ran past max_time_per_task ({timeout_s:.0f}s left)") from None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None


def load_levels(
    worker: BenchWorker,
    endpoint: str,
    model: str,
    tokenizer: str,
    settings: BenchConfig,
    levels: list[int],
    slo: dict[str, dict[str, float]] | None,
    deadline: float,
    progress,
) -> list[dict[str, Any]]:
    """One benchmark pass per level, climbing; with an SLO, stops after the first pass that misses it."""
    rows = []
    for concurrency in levels:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TrialTimeout(f"max_time_per_task reached before the pass at concurrency {concurrency}")
        # One warm-up request first: a replica's first request pays one-time costs that are not its latency.
        argv = vllm_bench_argv(endpoint, model, tokenizer, settings, concurrency, num_warmups=1)
        result = worker.run_pass(argv, left)
        row = report_row(concurrency, result)
        row["total_tok_s"] = float(result.get("total_token_throughput", 0.0))
        rows.append(row)
        missed = slo_misses(row, slo) if slo else []
        progress(concurrency, row, missed)
        if missed or not passes_complete(row):
            break
    return rows


def deploy(candidate, sources, exp_dir: str, log_console: Console, startup_timeout_s: float) -> str:
    """The candidate serving from exp_dir: how it got there ("run", "update", "restart")."""
    bound = startup_timeout_s + WORKER_MARGIN_S
    how = in_worker(_deploy, log_console, bound, "the deployment", candidate, sources, exp_dir, startup_timeout_s)
    if how != NOT_IN_PLACE:
        return how
    stop_deployment(exp_dir, candidate.experiment.runner.deploy.drain_timeout_s, log_console)
    in_worker(_deploy, log_console, bound, "the deployment", candidate, sources, exp_dir, startup_timeout_s)
    return "restart"


# What _deploy answers for a candidate the running deployment cannot take in place: it is stopped and the candidate
# started afresh, each step in a process of its own (a stop and a run in one process would leave the run unable to
# join its new cluster).
NOT_IN_PLACE = "not in place"


def stop_deployment(exp_dir: str, drain_timeout_s: float, log_console: Console) -> None:
    in_worker(
        _stop, log_console, drain_timeout_s + WORKER_MARGIN_S, "stopping the deployment", exp_dir, drain_timeout_s
    )


# Beyond its own bounds (startup_timeout_s, drain_timeout_s), what a deployment step may take: starting or stopping
# the Ray nodes, imports.
WORKER_MARGIN_S = 300


def in_worker(target, log_console: Console, timeout_s: float, what: str, *args):
    """target(*args, console) in a fresh process whose output goes to log_console's file; waits at most timeout_s.

    Each deployment step gets its own process: Ray keeps per-process state (the connection, the auth token it read)
    that would tie this one to the first cluster it joined, and a trial starts, updates and stops several."""
    context = multiprocessing.get_context("spawn")
    log_console.file.flush()
    receive, send = context.Pipe(duplex=False)
    worker = context.Process(target=_worker_main, args=(send, target, args, log_console.file.name), daemon=False)
    worker.start()
    send.close()
    try:
        if not receive.poll(timeout_s):
            os.kill(worker.pid, signal.SIGINT)  # a run in progress stops what it started
            worker.join(WORKER_CLEANUP_S)
            if worker.is_alive():
                worker.kill()
            raise TrialTimeout(f"{what} did not finish within {timeout_s:.0f}s; see {log_console.file.name}")
        kind, value = receive.recv()
    except EOFError:
        worker.join(30)
        raise DeployError(f"the deployment worker exited with code {worker.exitcode} before it answered") from None
    except KeyboardInterrupt:
        # Passed on to the worker (its own process group), whose clean-up (a run stops what it started) is waited for.
        if worker.is_alive():
            os.kill(worker.pid, signal.SIGINT)
        worker.join(WORKER_CLEANUP_S)
        raise
    worker.join(30)
    if kind == "interrupted":
        raise KeyboardInterrupt
    if kind == "error":
        error_type, message, exit_code = value
        error = DeployError(message)
        error.exit_code = exit_code
        raise error
    return value


WORKER_CLEANUP_S = 300


def _worker_main(send, target, args, log_path: str) -> None:
    os.setpgrp()  # out of the terminal's process group: a Ctrl-C reaches it once, passed on by the search
    with open(log_path, "a") as log_file:
        console = Console(file=log_file, width=160, highlight=False, soft_wrap=True)
        try:
            send.send(("ok", target(*args, console)))
        except KeyboardInterrupt:
            send.send(("interrupted", None))
        except FlagScaleError as exc:
            log_file.write(traceback.format_exc())
            send.send(("error", (type(exc).__name__, str(exc), exc.exit_code)))
        except BaseException as exc:  # noqa: BLE001 - reported to the search, which records it
            log_file.write(traceback.format_exc())
            send.send(("error", (type(exc).__name__, f"{type(exc).__name__}: {exc}", 1)))


def _stop(exp_dir: str, drain_timeout_s: float, log_console: Console) -> None:
    if RunState.load(exp_dir) is not None:
        stop(exp_dir, log_console, drain_timeout_s)


# flagscale/actions/deploy.py's words for replicas that Serve could not place within schedule_timeout_s.
UNSCHEDULABLE = "replicas cannot be scheduled"


def _deploy(candidate, sources, exp_dir: str, startup_timeout_s: float, log_console: Console) -> str:
    candidate.experiment.runner.deploy.startup_timeout_s = max(1.0, startup_timeout_s)
    api_key = resolve_api_key(candidate, sources)
    running = running_state(exp_dir)
    if running is not None:
        recorded = running.extra.get("config")
        plan = build_plan(candidate, sources, check_port=False)
        snap = snapshot(candidate, api_key, plan.graph)
        if recorded is not None and all(change.in_place for change in diff(recorded, snap)):
            try:
                code = update(running, plan, snap, log_console, sources.main)
            except FlagScaleError as exc:
                # update records the new config as soon as it starts applying it: not recorded means it refused
                # before changing anything (e.g. no room for a spare replica). Recorded, the candidate itself
                # failed, unless its new replicas only waited for room that the old ones hold (run's message for
                # replicas Serve cannot place). Either way a fresh start can still apply it.
                state = RunState.load(exp_dir)
                applied = state is not None and state.extra.get("config") == snap
                if applied and UNSCHEDULABLE not in str(exc):
                    raise
                log_console.print(f"not applicable in place ({exc}); stopping and starting afresh")
                return NOT_IN_PLACE
            if code != 0:
                raise DeployError(f"the in-place update ended with exit code {code}")
            return "update"
        return NOT_IN_PLACE
    refuse_if_running(exp_dir, log_console)
    plan = build_plan(candidate, sources)
    code = run(plan, log_console, snapshot=snapshot(candidate, api_key, plan.graph))
    if code == 130:
        raise KeyboardInterrupt
    if code != 0:
        raise DeployError(f"run ended with exit code {code}")
    return "run"


# flagscale/replica/engine.py's words for an engine server that exited before it was healthy: it refused its
# arguments (or its model), which no other replica count or placement changes.
ENGINE_EXITED_AT_START = "during start-up"


def refused_by_engine(exc: BaseException) -> bool:
    return ENGINE_EXITED_AT_START in str(exc) and "exited with code" in str(exc)


def failure_reason(exc: BaseException, lines: int = 3) -> str:
    """The first lines of the cause, on one line (a CSV cell)."""
    text = str(exc)
    excerpt = error_excerpt(text, after=lines - 1, fallback=lines) or text
    return " | ".join(line.strip() for line in excerpt.splitlines()[:lines])[:500]


def latency_columns(row: dict[str, Any] | None) -> dict[str, Any]:
    """A pass's numbers as history.csv columns."""
    if row is None:
        return {}
    out: dict[str, Any] = {
        "concurrency": row["concurrency"],
        "request_throughput": round(row["req_s"], 3),
        "output_throughput": round(row["output_tok_s"], 2),
        "total_token_throughput": round(row.get("total_tok_s", 0.0), 2),
        "failed_requests": row["failed"],
    }
    for metric in LATENCY_METRICS:
        short = metric
        stats = row[f"{metric}_ms"]
        out[f"{short}_mean_ms"] = round(stats["mean"], 2)
        if metric != "e2el":
            out[f"{short}_p50_ms"] = round(stats["p50"], 2)
            out[f"{short}_p99_ms"] = round(stats["p99"], 2)
    return out
