"""The nodes of an existing Ray cluster (`runner.type: ray`), reached through Ray tasks pinned to them: a node's
commands (NodeRunner, the CommandRunner of this kind of cluster), its engine logs, and the removal of exactly one
deployment's engine servers there (by the registry's records the launcher read, each checked to still be that
engine)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from pathlib import Path

from flagscale.adaptors import ray, ray_scheduling
from flagscale.cluster.node_logs import EngineLog, engine_log_dir, engine_logs_here
from flagscale.cluster.ray_existing import connect
from flagscale.cluster.runner import CommandRunner, CommandTimeout, Result, Session
from flagscale.errors import ClusterError

log = logging.getLogger(__name__)

NODE_TASK_TIMEOUT_S = 60.0


def _run_here(argv: list[str], env: dict[str, str] | None, timeout_s: float | None) -> tuple[int, str, str]:
    try:
        done = subprocess.run(
            argv, env={**os.environ, **(env or {})}, capture_output=True, timeout=timeout_s, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        return 124, "", f"{argv[0]} did not finish within {timeout_s:g}s"
    return done.returncode, done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")


def on_node(node_id: str, fn, *args):
    """fn(*args) in a task on that node (no CPU reserved); its result, within NODE_TASK_TIMEOUT_S."""
    task = ray.remote(num_cpus=0, max_retries=0)(fn).options(
        scheduling_strategy=ray_scheduling.NodeAffinitySchedulingStrategy(node_id, soft=False)
    )
    return ray.get(task.remote(*args), timeout=NODE_TASK_TIMEOUT_S)


class NodeRunner(CommandRunner):
    """A node of an existing Ray cluster: argv runs in a Ray task pinned to it. Nothing is started or stopped as a
    session there (the cluster's nodes are not this runner's)."""

    remote = True

    def __init__(self, node_id: str, address: str, host: str | None = None):
        self.node_id = node_id
        self.address = address
        self.host = host or node_id[:12]

    def open(self) -> None:
        connect(self.address)

    def run(self, argv: list[str], env: dict[str, str] | None = None, timeout_s: float | None = None) -> Result:
        self.open()
        try:
            code, out, err = on_node(self.node_id, _run_here, argv, env, timeout_s)
        except Exception as exc:  # the node died, the task could not be placed
            raise ClusterError(f"running {argv[0]} on node {self.node_id[:12]} failed: {exc}", self.host) from None
        if code == 124:
            raise CommandTimeout(err, self.host, out)
        return Result(code, out, err)

    def start_session(self, argv: list[str], env: dict[str, str], log_path: str, timeout_s: float) -> Session:
        raise NotImplementedError("runner.type: ray starts nothing on the cluster's nodes but the deployment")

    def put_file(self, local: Path, remote: str, mode: int = 0o600) -> None:
        raise NotImplementedError("runner.type: ray copies nothing to the cluster's nodes")

    def make_dir(self, path: str) -> None:
        raise NotImplementedError("runner.type: ray makes no directory on the cluster's nodes")

    def stop_session(self, session: int, leader_start_ticks: int | None) -> list[int]:
        raise NotImplementedError("runner.type: ray stops no Ray node")


def _list_engine_logs(app: str) -> list[tuple[str, float]]:
    return [(found.path, found.mtime) for found in engine_logs_here(engine_log_dir(app))]


def node_engine_logs(app: str) -> list[EngineLog]:
    """Every alive node's engine logs of `app`, each read through a task on its node."""
    found = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        node_id, ip = n["NodeID"], n["NodeManagerAddress"]
        try:
            found += [EngineLog(path, mtime, ip, node_id) for path, mtime in on_node(node_id, _list_engine_logs, app)]
        except Exception as exc:  # noqa: BLE001 - one node failing leaves the others' logs
            log.info("listing engine logs on %s failed: %s", ip, exc)
    return found


# ---- removing exactly one deployment ---------------------------------------------------------------------------


def _is_engine_of(pid: int, port: str) -> bool:
    """The engine_proc wrapper whose vLLM server listens on `port` (the registry record's URL): PID reuse guard."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    words = [a.decode(errors="replace") for a in argv]
    return "flagscale.replica.engine_proc" in words and "--port" in words and port in words


def _stop_engine(pid: int, port: str, grace_s: float) -> bool:
    """On the engine's node: SIGTERM its process group, SIGKILL what is left after grace_s. True when gone."""
    if not _is_engine_of(pid, port):
        return True
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return True
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not _is_engine_of(pid, port):
                return True
            time.sleep(0.2)
    return not _is_engine_of(pid, port)


def remove_leftovers(records: list, grace_s: float = 10.0) -> list[str]:
    """After the application was deleted: every engine server a registry record still names is gone on its node
    (stopped if not). Returns the problems. The records themselves are the caller's to withdraw."""
    problems = []
    for record in records:
        port = record.url.rsplit(":", 1)[-1]
        try:
            if not on_node(record.node_id, _stop_engine, record.engine_pid, port, grace_s):
                problems.append(f"{record.node_ip}: engine pid {record.engine_pid} of {record.serve_id} is still alive")
        except Exception as exc:  # noqa: BLE001 - a dead node took its engines with it
            log.info("checking engine %s on %s: %s", record.engine_pid, record.node_ip, exc)
    return problems
