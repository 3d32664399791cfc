"""Ray node lifecycle: start a head (or worker) as a new session, wait for it, connect a driver, stop it.

Token auth stays on: `run` writes a token file under exp_dir (mode 0600); every Ray process we start
and every driver we connect gets RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH pointing at it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

from flagscale.cluster.processes import read_process, session_members, stop_session
from flagscale.cluster.state import HostRecord, RunState
from flagscale.errors import ClusterError

log = logging.getLogger(__name__)
RAY_NAMESPACE = "flagscale"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def write_token(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def auth_env(token_path: str | None) -> dict[str, str]:
    if not token_path:
        return {}
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path)}


def ray_temp_dir(exp_dir: str) -> str:
    """Ray's unix sockets live under the temp dir, whose path must stay short (sun_path is 108 bytes)."""
    candidate = os.path.join(exp_dir, "ray")
    if len(candidate) <= 30:  # + "/session_<date>_<pid>/sockets/plasma_store" stays under 107
        return candidate
    return f"/tmp/flagscale-ray-{hashlib.sha256(exp_dir.encode()).hexdigest()[:10]}"


def ray_executable() -> str:
    return str(Path(sys.executable).parent / "ray")


def with_before_start(argv: list[str], before_start: str | None) -> list[str]:
    """Run the user's `cmds.before_start` snippet in the same shell that then execs argv (FlagScale semantics).
    argv crosses as positional parameters, never spliced into the snippet."""
    if not before_start:
        return argv
    return ["bash", "-c", f'set -e\n{before_start}\nexec "$@"', "flagscale-before-start", *argv]


def head_argv(port: int, num_cpus: int, num_gpus: int | None, temp_dir: str, resources: dict | None = None) -> list[str]:
    argv = [
        ray_executable(), "start", "--head",
        "--port", str(port),
        "--num-cpus", str(num_cpus),
        "--temp-dir", temp_dir,
        "--include-dashboard", "false",
        "--disable-usage-stats",
        "--ray-client-server-port", str(free_port()),
        # What a static serving cluster does not use (~160 MB RSS less on the head):
        "--no-monitor",  # the autoscaler monitor
        "--include-log-monitor", "false",  # drivers don't stream worker logs; they stay in the session dir
        "--dashboard-port", str(free_port()),
        "--dashboard-agent-listen-port", str(free_port()),
        "--node-manager-port", "0",
        "--object-manager-port", "0",
    ]  # fmt: skip
    if num_gpus is not None:
        argv += ["--num-gpus", str(num_gpus)]
    if resources:
        argv += ["--resources", json.dumps(resources)]
    return argv


def start_local_head(
    state: RunState, num_cpus: int, num_gpus: int | None, envs: dict[str, str], before_start: str | None,
    log_path: Path, timeout_s: float = 90,
) -> HostRecord:
    """Start a Ray head on this machine in a new session; record it in `state` before waiting on it."""
    port = free_port()
    temp_dir = ray_temp_dir(state.exp_dir)
    argv = with_before_start(head_argv(port, num_cpus, num_gpus, temp_dir), before_start)
    env = {**os.environ, **envs, **auth_env(state.token_path)}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)  # fmt: skip
    info = read_process(proc.pid)
    record = HostRecord(host="localhost", role="head", session=proc.pid,
                        leader_start_ticks=info.start_ticks if info else None, temp_dir=temp_dir)  # fmt: skip
    state.hosts.append(record)
    state.ray_address = f"127.0.0.1:{port}"
    state.save()
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ClusterError(f"`ray start --head` did not finish within {timeout_s:.0f}s; see {log_path}", "localhost") from None
    if code != 0:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-8:]
        raise ClusterError("`ray start --head` failed:\n  " + "\n  ".join(tail), "localhost")
    _wait_for_port("127.0.0.1", port, timeout_s=30, what="Ray GCS")
    return record


def _wait_for_port(host: str, port: int, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise ClusterError(f"{what} at {host}:{port} did not accept connections within {timeout_s:.0f}s", host)


def connect(state: RunState) -> None:
    """Connect this process as a Ray driver to the run's cluster (token auth from the state)."""
    import ray

    if ray.is_initialized():
        return
    env = auth_env(state.token_path)
    if env and os.environ.get("RAY_AUTH_TOKEN_PATH") != env["RAY_AUTH_TOKEN_PATH"]:
        os.environ.update(env)
        # Ray reads RAY_AUTH_MODE into its config when imported; refresh it as Ray itself does.
        from ray._raylet import Config

        Config.initialize("")
    # Multi-host: attach to the run's Ray node on this machine, whose IP is on the route to the head.
    node_ip = {"_node_ip_address": state.extra["driver_ip"]} if state.extra.get("driver_ip") else {}
    try:
        ray.init(address=state.ray_address, namespace=RAY_NAMESPACE, log_to_driver=False,
                 logging_level=logging.ERROR, configure_logging=True, **node_ip)  # fmt: skip
    except Exception as exc:  # ray raises ConnectionError / RuntimeError / AuthenticationError
        raise ClusterError(f"cannot connect to Ray at {state.ray_address}: {exc}", state.ray_address) from None
    logging.getLogger("ray.serve").setLevel(logging.WARNING)


def cluster_alive(state: RunState) -> bool:
    host, _, port = state.ray_address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            return True
    except (OSError, ValueError):
        return False


def stop_local_nodes(state: RunState) -> list[str]:
    """Stop every Ray node this run started on this machine. Returns a line per session that survived."""
    problems = []
    for record in state.hosts:
        if record.session is None:
            continue
        killed = stop_session(record.session, None)
        if killed:
            log.info("%s: SIGKILLed %d process(es) after the grace period: %s", record.host, len(killed), killed)
        if session_members(record.session):
            problems.append(f"{record.host}: processes of session {record.session} are still alive")
    return problems
