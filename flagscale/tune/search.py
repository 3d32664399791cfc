"""The search: check the space, prune, run each remaining candidate as a trial, record, rank, leave the best."""

from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from flagscale.actions.bench import bench_settings, tokenizer_for
from flagscale.cluster.state import RunState
from flagscale.config.load import ConfigSources, resolve_api_key
from flagscale.config.schema import BenchConfig, ServeConfig
from flagscale.errors import ConfigError, WriteError
from flagscale.paths import private_dir, private_file
from flagscale.plan import build_plan, engine_args_of, served_names
from flagscale.tune import history, prune
from flagscale.tune.report import best_of, rank, render, write_best_config, write_plot
from flagscale.tune.space import Space, candidate_config, check_values, describe, read_space
from flagscale.tune.trial import (
    BenchWorker,
    deploy,
    failure_reason,
    goodput_of,
    latency_columns,
    load_levels,
    refused_by_engine,
    scaled_load,
    stop_deployment,
)

DEFAULT_LEVELS = [1, 2, 4, 8, 16]
OUT_DIR = "auto_tuner"


@dataclass
class Candidate:
    values: dict[str, Any]
    config: ServeConfig
    key: str
    row: dict[str, Any] = field(default_factory=dict)  # its history.csv row

    @property
    def status(self) -> str | None:
        return self.row.get("status")


@dataclass
class Search:
    config: ServeConfig
    sources: ConfigSources
    exp_dir: str
    space: Space
    model: str
    settings: BenchConfig
    levels: list[int]
    candidates: list[Candidate]
    earlier: list[dict[str, Any]]  # history rows of candidates no longer in the space

    @property
    def out_dir(self) -> Path:
        return Path(self.exp_dir) / OUT_DIR

    @property
    def dims(self) -> list[str]:
        return list(self.space.dims)

    def engine_args_key(self, candidate: Candidate) -> str:
        """The engine arguments the candidate's replicas start with: candidates that share them differ only in
        resources (replica count, placement)."""
        node = candidate.config.serve[self.space.node_index]
        return json.dumps(engine_args_of(node, candidate.config), sort_keys=True, default=str)

    def rows(self) -> list[dict[str, Any]]:
        return [c.row for c in self.candidates]

    def save(self) -> None:
        history.write(self.out_dir / history.FILE, self.dims, [*self.rows(), *self.earlier])


def prepare(config: ServeConfig, sources: ConfigSources, exp_dir: str) -> Search:
    """Everything checked and pruned, nothing started: bad input raises ConfigError naming the key."""

    tuner = config.experiment.auto_tuner
    assert tuner is not None
    space = read_space(config, sources.main)
    check_values(config, space)
    node = config.serve[space.node_index]
    model = served_names(node, engine_args_of(node, config))[0]
    settings = bench_settings(config, model).model_copy(
        update={"model": model, "slo_ttft_ms": None, "slo_tpot_ms": None}
    )
    levels = tuner.concurrency or (
        settings.concurrency if "concurrency" in config.experiment.bench.model_fields_set else DEFAULT_LEVELS
    )
    levels = sorted(set(levels))
    workload = {**settings.model_dump(exclude={"concurrency", "slo_ttft_ms", "slo_tpot_ms"}), "levels": levels}
    if tuner.concurrency_per_device:  # a key of its own only when set: earlier searches' keys stay valid
        workload["per_device"] = True
    earlier = {row["key"]: row for row in history.read(Path(exp_dir) / OUT_DIR / history.FILE) if row.get("key")}
    candidates = []
    for values in space.candidates():
        key = history.trial_key(values, space.serve_id, workload, tuner.slo)
        candidate = Candidate(values, candidate_config(config, space, values), key)
        previous = earlier.pop(key, None)
        if previous is not None and previous.get("status") in history.FINISHED:
            candidate.row = {**previous, **values, "deployed_by": "earlier search"}
        else:
            candidate.row = {**values, "key": key, **_pruned(candidate.config, sources, space, tuner.cards)}
        candidates.append(candidate)
    return Search(config, sources, exp_dir, space, model, settings, levels, candidates, list(earlier.values()))


def devices_of(engine) -> float:
    """The devices a candidate's replicas take: TP x PP x DP each, or, for replicas sharing a GPU (num_gpus < 1),
    their share of it, so that two half-GPU replicas count as one device."""
    per_replica = engine.devices_per_replica
    gpus = engine.ray_actor_options.get("num_gpus") or 0
    if engine.device == "gpu" and 0 < gpus < per_replica:
        per_replica = gpus
    return per_replica * engine.initial_replicas


def _pruned(config: ServeConfig, sources: ConfigSources, space: Space, cards: int | None) -> dict[str, Any]:
    """{} for a candidate that may run, else its skipped row: why it cannot fit."""

    try:
        plan = build_plan(config, sources, check_port=False)
    except ConfigError as exc:
        return {"status": "skipped", "reason": str(exc)}
    engine = next(e for e in plan.engines if e.serve_id == space.serve_id)
    devices = devices_of(engine)
    args = {**engine_args_of(config.serve[space.node_index], config), "model": engine.model}
    utilization = float(args.get("gpu_memory_utilization") or engine.kind.default_gpu_memory_utilization)
    problem = prune.devices_problem(devices, cards) or prune.replica_memory_problem(
        args, engine.devices_per_replica, engine.device, prune.device_bytes_of(engine.device), utilization
    )
    if problem is None and engine.device == "cpu" and plan.cluster is None:
        problem = prune.shared_ram_problem(engine.initial_replicas, utilization)
    if problem:
        return {"status": "skipped", "reason": problem, "devices": devices}
    return {"devices": devices}


def dryrun(search: Search, console: Console) -> int:
    """What a search would run and what pruning skips; nothing is started."""
    console.print(
        f"auto_tune of node '{search.space.serve_id}': {len(search.candidates)} candidate(s) over "
        f"{', '.join(search.dims)}; load {_workload(search)}"
    )
    for index, candidate in enumerate(search.candidates, 1):
        status = candidate.status
        what = (
            "would run" if status is None else f"finished earlier ({status})" if status in history.FINISHED else status
        )
        reason = f": {candidate.row.get('reason')}" if status == "skipped" else ""
        console.print(f"  {index:>3}. {escape(describe(candidate.values))}  {what}{escape(reason)}", soft_wrap=True)
    return 0


def _workload(search: Search) -> str:
    s = search.settings
    return (
        f"{s.num_prompts} prompts of {s.input_len} -> {s.output_len} tokens per pass at concurrency "
        f"{', '.join(map(str, search.levels))}"
        + (", each times the candidate's devices" if search.config.experiment.auto_tuner.concurrency_per_device else "")
    )


def run_search(search: Search, console: Console) -> int:
    tuner = search.config.experiment.auto_tuner
    assert tuner is not None
    control = tuner.control
    todo = [c for c in search.candidates if c.status is None]
    skipped = sum(c.status == "skipped" for c in search.candidates)
    finished = sum(c.status in history.FINISHED for c in search.candidates)
    if not todo and not finished:
        reasons = list(dict.fromkeys(c.row["reason"] for c in search.candidates))
        raise ConfigError(
            "no candidate can run, pruning skipped them all: " + "; ".join(reasons[:3]),
            search.space.where,
        )
    private_dir(search.out_dir)  # logs and history may name secrets: the user's alone
    log_path = private_file(search.out_dir / "tuner.log")
    # Ctrl-C (and SIGTERM) end the search the same way, even when started with SIGINT ignored (a background job).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    _announce(search, console, len(todo), skipped, finished)
    search.save()
    started = time.monotonic()
    with log_path.open("a") as log_file:
        log_console = Console(file=log_file, width=160, highlight=False, soft_wrap=True)
        worker = BenchWorker(private_file(search.out_dir / "bench.log"), resolve_api_key(search.config, search.sources))
        refused: dict[str, Candidate] = {}  # engine args -> the candidate whose engine exited at start with them
        try:
            for number, candidate in enumerate(todo, 1):
                if control.max_time is not None and time.monotonic() - started > control.max_time:
                    for rest in todo[number - 1 :]:
                        rest.row.update(status=None, reason=f"not run: max_time {control.max_time:g}s reached")
                    console.print(
                        f"[yellow]max_time {control.max_time:g}s reached: {len(todo) - number + 1} not run[/]"
                    )
                    break
                tag = f"[{number}/{len(todo)}]"
                same_args = refused.get(search.engine_args_key(candidate))
                if same_args is not None:
                    _refused_before(candidate, same_args, console, tag)
                    search.save()
                    continue
                if number > 1 and control.interval:
                    time.sleep(control.interval)
                if _trial(search, candidate, worker, console, log_console, tag):
                    refused[search.engine_args_key(candidate)] = candidate
                search.save()
        except KeyboardInterrupt:
            console.print("[yellow]interrupted: history.csv keeps what was measured; stopping the deployment[/]")
            worker.close()
            stop_deployment(search.exp_dir, 0, log_console)
            search.save()
            return 130
        except WriteError:  # history.csv or state.json could not be written (a full disk): nothing left running
            console.print("[red]cannot record the search; stopping the deployment[/]")
            worker.close()
            stop_deployment(search.exp_dir, 0, log_console)
            raise
        finally:
            worker.close()
        search.save()
        return _finish(search, console, log_console)


def _announce(search: Search, console: Console, todo: int, skipped: int, finished: int) -> None:
    tuner = search.config.experiment.auto_tuner
    slo = tuner.slo
    console.print(
        f"auto_tune of node '{search.space.serve_id}': {len(search.candidates)} candidate(s); {todo} to run, "
        f"{skipped} skipped by pruning, {finished} finished in an earlier search (history.csv)\n"
        f"  load: {_workload(search)}; " + (f"SLO {_slo_text(slo)}" if slo else f"ranked by {tuner.performance.metric}")
    )
    for candidate in search.candidates:
        if candidate.status == "skipped":
            console.print(
                f"  skipped {escape(describe(candidate.values))}: {escape(candidate.row['reason'])}", soft_wrap=True
            )


def _slo_text(slo: dict[str, dict[str, float]]) -> str:
    return ", ".join(
        f"{metric} {stat} <= {limit:g}" for metric, limits in slo.items() for stat, limit in limits.items()
    )


def _refused_before(candidate: Candidate, same_args: Candidate, console: Console, tag: str) -> None:
    """A candidate whose engine arguments an earlier trial's engine refused at start fails the same way: recorded
    as failed with that cause, without deploying it again."""
    reason = f"not run: same engine args as {describe(same_args.values)}, whose engine exited at start: "
    reason += same_args.row["reason"]
    candidate.row.update(status="failed", reason=reason[:500], elapsed_s=0.0)
    console.print(f"{tag} {escape(describe(candidate.values))}: [red]failed[/]: {escape(reason)}", soft_wrap=True)


def _trial(
    search: Search, candidate: Candidate, worker: BenchWorker, console: Console, log_console: Console, tag: str
) -> bool:
    """Deploy and load one candidate; records its row. True when its engine exited at start (refused its args)."""
    tuner = search.config.experiment.auto_tuner
    control, slo = tuner.control, tuner.slo
    t0 = time.monotonic()
    deadline = t0 + control.max_time_per_task
    console.print(f"{tag} {escape(describe(candidate.values))}: deploying ...", end="")
    log_console.rule(f"{tag} {describe(candidate.values)}")
    try:
        startup = min(candidate.config.experiment.runner.deploy.startup_timeout_s, deadline - time.monotonic())
        how = deploy(candidate.config.model_copy(deep=True), search.sources, search.exp_dir, log_console, startup)
        console.print(f" {how} {time.monotonic() - t0:.0f}s;", end="")
        state = RunState.load(search.exp_dir)
        tokenizer = tokenizer_for(candidate.config, search.model) or search.model

        def progress(concurrency: int, row: dict[str, Any], missed: list[str]) -> None:
            verdict = f" [red]missed {escape(', '.join(missed))}[/]" if missed else ""
            failed = f" [red]{row['failed']} failed[/]" if row["failed"] else ""
            console.print(
                f" c={concurrency} {row['req_s']:.2f} req/s TTFT p99 {row['ttft_ms']['p99']:.0f} ms{failed}{verdict};",
                end="",
            )

        devices = candidate.row.get("devices") or 1
        settings, levels = scaled_load(search.settings, search.levels, devices if tuner.concurrency_per_device else 1)
        rows = load_levels(worker, state.endpoint, search.model, tokenizer, settings, levels, slo, deadline, progress)
        outcome = goodput_of(rows, slo)
        candidate.row.update(
            status="done",
            reason=None,
            goodput=round(outcome.goodput, 3),
            goodput_per_device=round(outcome.goodput / devices, 4),
            slo_ratio=None if outcome.closest_ratio is None else round(outcome.closest_ratio, 3),
            deployed_by=how,
            **latency_columns(outcome.row),
        )
        console.print(f" goodput {outcome.goodput:.2f} req/s ({outcome.goodput / devices:.3f} per device)")
    except KeyboardInterrupt:
        console.print()
        raise
    except Exception as exc:  # noqa: BLE001 - a failed trial is recorded and the search goes on
        log_console.print(f"trial failed: {exc}")
        reason = failure_reason(exc)
        candidate.row.update(status="failed", reason=reason)
        console.print(f" [red]failed[/]: {escape(reason)}", soft_wrap=True)
        stop_deployment(search.exp_dir, 0, log_console)  # nothing half-deployed is carried into the next trial
        candidate.row["elapsed_s"] = round(time.monotonic() - t0, 1)
        return refused_by_engine(exc)
    candidate.row["elapsed_s"] = round(time.monotonic() - t0, 1)
    return False


def _finish(search: Search, console: Console, log_console: Console) -> int:
    tuner = search.config.experiment.auto_tuner
    slo = tuner.slo
    rows = search.rows()
    ranked = rank(rows, slo, tuner.performance.metric, tuner.performance.order)
    best = best_of(ranked, slo)
    render(console, rows, ranked, search.dims, slo)
    plot = search.out_dir / "auto_tune.png"
    write_plot(rows, best, slo, plot, f"auto_tune of '{search.space.serve_id}': {_workload(search)}")
    console.print(f"history: {search.out_dir / history.FILE}\nplot   : {plot}\nlog    : {search.out_dir / 'tuner.log'}")
    if best is None:
        stop_deployment(search.exp_dir, 0, log_console)
        if ranked:
            closest = ranked[0]
            console.print(
                f"[red]no candidate meets the SLO[/] ({_slo_text(slo)}); closest: "
                f"{escape(describe({d: closest.get(d) for d in search.dims}))} at concurrency {closest.get('concurrency')}: "
                f"TTFT p99 {closest.get('ttft_p99_ms')} ms, TPOT p99 {closest.get('tpot_p99_ms')} ms "
                f"({closest.get('slo_ratio')} x the tightest limit)",
                soft_wrap=True,
            )
        else:
            console.print("[red]no candidate finished a trial[/]; see the reasons above and the log")
        return 1
    winner = next(c for c in search.candidates if c.row is best)
    best_dir, env_vars = write_best_config(winner.config, search.exp_dir, search.out_dir / "best")
    console.print(
        f"[green]best[/]: {escape(describe(winner.values))}"
        + (f", goodput {best['goodput']} req/s ({best['goodput_per_device']} per device)" if slo else "")
        + f"\nbest config: {best_dir}/serve.yaml; run it with:\n"
        f"  python run.py --config-path {best_dir} --config-name serve"
        + (f"\nit reads its secrets from the environment: set {', '.join(env_vars)} first" if env_vars else ""),
        soft_wrap=True,
    )
    if tuner.control.run_best:
        startup = winner.config.experiment.runner.deploy.startup_timeout_s
        how = deploy(winner.config.model_copy(deep=True), search.sources, search.exp_dir, log_console, startup)
        console.print(f"run_best: the best is serving at {_endpoint(search.exp_dir)}/v1 ({how}); action=stop stops it")
    else:
        stop_deployment(search.exp_dir, search.config.experiment.runner.deploy.drain_timeout_s, log_console)
        console.print("stopped the deployment (control.run_best is false)")
    return 0


def _endpoint(exp_dir: str) -> str:
    state = RunState.load(exp_dir)
    return state.endpoint if state else "?"
