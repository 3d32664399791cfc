"""Which logs `action=logs` shows: the runner's and each engine replica's, found in the replica registry of a running
deployment and in <exp_dir>/serve_logs/ (flagscale/actions/logs.py), narrowed by serve_id= / replica=."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from flagscale import launchers
from flagscale.actions.runner_log import LOG_DIR, RUNNER_LOG
from flagscale.cluster.node_logs import EngineLog, engine_logs_here
from flagscale.cluster.ray_node import cluster_alive
from flagscale.cluster.state import HostRecord, RunState
from flagscale.errors import ConfigError
from flagscale.replica import registry


@dataclass(frozen=True)
class LogSource:
    """One log file: the runner's (serve_id None) or an engine replica's."""

    path: str
    serve_id: str | None = None
    replica_id: str | None = None
    host: str = "localhost"  # where the file is: the replica's node IP, or the hostfile host's name
    ssh_host: str | None = None  # the hostfile host to read it over SSH when it is not readable here
    role: str = ""
    unlisted: bool = False  # a running deployment's engine log that its registry does not list (starting, or gone)
    node_id: str | None = None  # the Ray node it is on (its launcher may read it there: Launcher.node_runner)

    @property
    def name(self) -> str:
        return f"{self.serve_id}/{self.replica_id}" if self.serve_id else "runner"

    def header(self) -> str:
        if self.serve_id is None:
            return f"==> runner log ({self.host}): {self.path} <=="
        role = f" ({self.role})" if self.role else ""
        note = " [not in the registry: starting, or gone]" if self.unlisted else ""
        return f"==> serve_id {self.serve_id}{role}, replica {self.replica_id}, host {self.host}: {self.path}{note} <=="


def parse_engine_log_name(name: str) -> tuple[str, str] | None:
    """engine-<serve_id>-<replica>.log -> (serve_id, replica). A serve_id may hold '-'; Serve's replica ids do not."""
    if not (name.startswith("engine-") and name.endswith(".log")):
        return None
    serve_id, sep, replica = name[len("engine-") : -len(".log")].rpartition("-")
    if not (sep and serve_id and replica):
        return None
    return serve_id, replica


def engine_log_files(log_dir: Path, since: float | None = None) -> list[LogSource]:
    """The engine logs in log_dir (modified at or after `since`, when given), oldest first."""
    return log_sources(engine_logs_here(log_dir), since)


def log_sources(engine_logs: list[EngineLog], since: float | None = None) -> list[LogSource]:
    """Engine logs as sources to read (modified at or after `since`, when given: unlisted), oldest first."""
    found = []
    for log in engine_logs:
        parsed = parse_engine_log_name(os.path.basename(log.path))
        if parsed and (since is None or log.mtime >= since):
            unlisted = since is not None
            found.append((log.mtime, LogSource(log.path, *parsed, log.host, unlisted=unlisted, node_id=log.node_id)))
    return [source for _, source in sorted(found, key=lambda item: item[0])]


def registry_sources(state: RunState, records) -> list[LogSource]:
    """The registry's replicas (ReplicaRecord), each with the hostfile host it runs on (multi-host: SSH reads)."""
    by_node = {h.node_id: h for h in state.hosts if h.node_id}
    by_ip = {h.node_ip: h for h in state.hosts if h.node_ip}
    sources = []
    for r in sorted(records, key=lambda r: (r.serve_id, r.replica_id)):
        host: HostRecord | None = by_node.get(r.node_id) or by_ip.get(r.node_ip)
        remote = host is not None and host.remote
        shown = f"{r.node_ip} ({host.host})" if remote and host.host != r.node_ip else r.node_ip
        sources.append(
            LogSource(
                r.log_path,
                r.serve_id,
                r.replica_id,
                shown,
                host.host if remote else None,
                r.role or "",
                node_id=r.node_id,
            )
        )
    return sources


def serve_id_matches(source: LogSource, serve_id: str) -> bool:
    # A disaggregated node <id> is served by two pools, <id>-prefill and <id>-decode.
    return source.serve_id in (serve_id, f"{serve_id}-prefill", f"{serve_id}-decode")


def select(sources: list[LogSource], serve_id: str | None = None, replica: str | None = None) -> list[LogSource]:
    """The engine logs that serve_id / replica name (a replica: its id, or a prefix of one id only). An unknown or
    ambiguous one is a ConfigError listing the valid choices."""
    engines = [s for s in sources if s.serve_id is not None]
    if serve_id is not None:
        chosen = [s for s in engines if serve_id_matches(s, serve_id)]
        if not chosen:
            known = sorted({s.serve_id for s in engines if s.serve_id})
            raise ConfigError(
                f"no engine replica of serve_id '{serve_id}'; "
                + (f"serve_ids with logs: {', '.join(known)}" if known else "there are no engine logs"),
                "serve_id",
            )
        engines = chosen
    if replica is None:
        return engines
    exact = [s for s in engines if s.replica_id == replica]
    matches = exact or [s for s in engines if s.replica_id and s.replica_id.startswith(replica)]
    if len(matches) == 1:
        return matches
    listing = ", ".join(s.name for s in engines) or "none"
    scope = f" of serve_id '{serve_id}'" if serve_id is not None else ""
    if not matches:
        raise ConfigError(f"no engine replica{scope} matches '{replica}'; replicas: {listing}", "replica")
    raise ConfigError(
        f"'{replica}' matches {len(matches)} replicas ({', '.join(s.name for s in matches)}); give more of the id",
        "replica",
    )


def running_state_of(exp_dir: str) -> RunState | None:
    state = RunState.load(exp_dir)
    return state if state is not None and cluster_alive(state) else None


def discover(exp_dir: str, state: RunState | None, note: Callable[[str], None]) -> list[LogSource]:
    """The runner log (when present) and every engine log: the registry's and the log dir's (see the module doc)."""
    log_dir = Path(exp_dir) / LOG_DIR
    runner_log = log_dir / RUNNER_LOG
    sources = [LogSource(str(runner_log))] if runner_log.is_file() else []
    if state is None:
        return sources + engine_log_files(log_dir)
    launcher = launchers.of_state(state)
    try:
        with launcher.reading_registry(state):
            live = registry_sources(state, registry.list_replicas(state.app_name))
            known = {s.replica_id for s in live}
            extra = [s for s in new_engine_logs(state, log_dir) if s.replica_id not in known]
    except Exception as exc:  # noqa: BLE001 - the log files are still worth showing
        note(f"cannot read the replica registry ({exc}); showing the engine logs under {log_dir}")
        return sources + [replace(s, unlisted=False) for s in engine_log_files(log_dir, since=state.started_at)]
    return sources + live + extra


def new_engine_logs(state: RunState, log_dir: Path) -> list[LogSource]:
    """The run's engine logs wherever its launcher keeps them, modified since the run started, oldest first."""
    return log_sources(launchers.of_state(state).engine_logs(state, str(log_dir)), state.started_at)
