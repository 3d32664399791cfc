"""A Ray cluster over the hosts of a hostfile: `ray start` on each host over SSH, and stopping exactly that.

Order: SSH to every host in parallel (an unreachable host fails the run before anything starts), copy
the run's auth token to a per-run directory on each host, start the head, then the workers in parallel,
then a CPU-less Ray node on this machine so the runner can be a Ray driver (a driver needs a local
raylet), and wait until every host shows up alive in ray.nodes(). Each remote `ray start` runs in a new
session whose id the host echoes back first; that id is recorded before anything else can go wrong,
and `stop` ends exactly the processes of that session on that host.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from flagscale.cluster import ssh
from flagscale.cluster.hostfile import HostEntry
from flagscale.cluster.processes import read_process, session_members, stop_session
from flagscale.cluster.ray_node import auth_env, free_port, ray_executable, ray_temp_dir, with_before_start
from flagscale.cluster.state import HostRecord, RunState
from flagscale.errors import ClusterError

log = logging.getLogger(__name__)

# Keep Ray's worker ports away from the ports users pick for the router and engines.
WORKER_PORTS = ("20000", "29999")
# The minimal wrapper around the argv: print our session id, run argv with its output in a log, print the
# log (so a failure's stderr comes back), exit with argv's code. argv arrives as positional parameters.
LAUNCHER = 'echo "$$"; log=$1; shift; "$@" >"$log" 2>&1 </dev/null; code=$?; cat "$log"; exit "$code"'
STOP_TIMEOUT_S = 60


def host_temp_dir(exp_dir: str, host: str) -> str:
    """Per run and per host (test hosts share one filesystem); short, as Ray's socket paths must be."""
    return f"/tmp/fsr-{hashlib.sha256(f'{exp_dir}|{host}'.encode()).hexdigest()[:10]}"


def resolve_ip(host: str) -> str:
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return socket.gethostbyname(host)


def local_ip_towards(ip: str) -> str:
    """This machine's source address on the route to `ip` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((ip, 9))
        return sock.getsockname()[0]


def ray_start_argv(entry: HostEntry, head: HostEntry, port: int, num_cpus: int | None, temp_dir: str) -> list[str]:
    is_head = entry is head
    num_gpus, resources = entry.ray_resources(is_head)
    argv = [ray_executable(), "start"]
    if is_head:
        argv += ["--head", "--port", str(port), "--include-dashboard", "false"]
    else:
        argv += ["--address", f"{resolve_ip(head.host)}:{port}"]
    argv += [
        "--node-ip-address", resolve_ip(entry.host),
        "--temp-dir", temp_dir,
        "--resources", json.dumps(resources),
        "--disable-usage-stats",
        "--node-manager-port", "0", "--object-manager-port", "0",
        "--min-worker-port", WORKER_PORTS[0], "--max-worker-port", WORKER_PORTS[1],
    ]  # fmt: skip
    if num_cpus is not None:
        argv += ["--num-cpus", str(num_cpus)]
    argv += ["--num-gpus", str(num_gpus or 0)]
    return argv


def launch_argv(ray_argv: list[str], before_start: str | None, log_path: str) -> list[str]:
    return ["setsid", "-w", "sh", "-c", LAUNCHER, "flagscale-launch", log_path,
            *with_before_start(ray_argv, before_start)]  # fmt: skip


def _parallel(items: list, fn: Callable) -> list:
    """fn over items in threads; each item's result, or the exception it raised, in the items' order."""
    if not items:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(items))) as pool:
        futures = [pool.submit(fn, item) for item in items]
    return [f.exception() if f.exception() is not None else f.result() for f in futures]


def _raise_failures(entries: list[HostEntry], results: list, what: str) -> None:
    failed = [(e.host, r) for e, r in zip(entries, results) if isinstance(r, BaseException)]
    if failed:
        lines = "\n".join(f"  {host}: {str(exc).removeprefix(f'{host}: ')}" for host, exc in failed)
        raise ClusterError(f"{what} failed on {len(failed)} host(s):\n{lines}", ", ".join(h for h, _ in failed))


class ClusterLauncher:
    def __init__(self, state: RunState, plan, remote_env: dict[str, str]):
        self.state = state
        self.plan = plan
        self.cluster = plan.cluster
        self.settings = ssh.SshSettings(**self.cluster.ssh)
        self.remote_env = remote_env  # PYTHONPATH etc., before the per-host envs
        self.clients: dict[str, object] = {}
        self._lock = threading.Lock()

    def start(self, console) -> None:
        hostfile = self.cluster.hostfile
        self.state.extra["ssh"] = self.cluster.ssh
        self.state.save()
        try:
            hosts, workers, head = hostfile.hosts, hostfile.workers, hostfile.head
            connected = _parallel(hosts, lambda e: ssh.connect(e.host, self.settings))
            self.clients = {e.host: c for e, c in zip(hosts, connected) if not isinstance(c, BaseException)}
            _raise_failures(hosts, connected, "SSH")
            _raise_failures(hosts, _parallel(hosts, self._prepare), "preparing")
            console.print(f"SSH to {len(hosts)} host(s) ok; starting the Ray head on {head.host}")
            _raise_failures([head], _parallel([head], self._start_host), "`ray start --head`")
            self.state.ray_address = f"{resolve_ip(head.host)}:{self.cluster.ray_port}"
            self.state.save()
            _raise_failures(workers, _parallel(workers, self._start_host), "`ray start` (worker)")
            self._start_driver_node()
            self._wait_joined()
        finally:
            for client in self.clients.values():
                client.close()

    def _prepare(self, entry: HostEntry) -> None:
        client = self.clients[entry.host]
        temp_dir = host_temp_dir(self.state.exp_dir, entry.host)
        ssh.make_dir(client, temp_dir)
        ssh.put_file(client, Path(self.state.token_path), f"{temp_dir}/auth_token")

    def _start_host(self, entry: HostEntry) -> HostRecord:
        hostfile = self.cluster.hostfile
        client = self.clients[entry.host]
        temp_dir = host_temp_dir(self.state.exp_dir, entry.host)
        ray_argv = ray_start_argv(entry, hostfile.head, self.cluster.ray_port, self.cluster.num_cpus_per_host, temp_dir)
        argv = launch_argv(ray_argv, self.plan.before_start, f"{temp_dir}/ray-start.log")
        env = {**self.remote_env, **self.cluster.host_envs.get(entry.host, {}),
               **auth_env(f"{temp_dir}/auth_token")}  # fmt: skip
        log.info("%s: %s", entry.host, ssh.remote_command(argv, env))
        _, stdout, stderr = client.exec_command(ssh.remote_command(argv, env), timeout=self.cluster.join_timeout_s)
        stdout.channel.shutdown_write()
        first = stdout.readline().strip()
        if not first.isdigit():
            rest = stdout.read().decode(errors="replace") + stderr.read().decode(errors="replace")
            raise ClusterError(f"could not start a new session: {(first + chr(10) + rest).strip()}", entry.host)
        record = HostRecord(host=entry.host, role="head" if entry is hostfile.head else "worker",
                            session=int(first), temp_dir=temp_dir, remote=True, chip=entry.chip,
                            slots=entry.slots, node_ip=resolve_ip(entry.host))  # fmt: skip
        with self._lock:
            self.state.hosts.append(record)
            self.state.save()
        output = stdout.read().decode(errors="replace") + stderr.read().decode(errors="replace")
        code = stdout.channel.recv_exit_status()
        if code != 0:
            tail = "\n    ".join(output.strip().splitlines()[-12:])
            raise ClusterError(f"`ray start` exited with {code}:\n    {tail}", entry.host)
        return record

    def _start_driver_node(self) -> None:
        """A Ray node without CPUs on this machine: the runner's driver attaches to it. Nothing is scheduled
        there (the router needs the head marker, engines need CPUs or chips)."""
        head_ip = resolve_ip(self.cluster.hostfile.head.host)
        my_ip = local_ip_towards(head_ip)
        temp_dir = ray_temp_dir(self.state.exp_dir)
        argv = [
            ray_executable(), "start", "--address", f"{head_ip}:{self.cluster.ray_port}",
            "--node-ip-address", my_ip, "--num-cpus", "0", "--num-gpus", "0", "--temp-dir", temp_dir,
            "--disable-usage-stats", "--node-manager-port", "0", "--object-manager-port", "0",
            "--dashboard-agent-listen-port", str(free_port()),
        ]  # fmt: skip
        log_path = self.plan.log_dir / "ray-driver-node.log"
        env = {**os.environ, **self.remote_env, **auth_env(self.state.token_path)}
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)  # fmt: skip
        info = read_process(proc.pid)
        self.state.hosts.append(HostRecord(host="localhost", role="driver", session=proc.pid, temp_dir=temp_dir,
                                           leader_start_ticks=info.start_ticks if info else None, node_ip=my_ip))  # fmt: skip
        self.state.extra["driver_ip"] = my_ip
        self.state.save()
        try:
            code = proc.wait(timeout=self.cluster.join_timeout_s)
        except subprocess.TimeoutExpired:
            raise ClusterError(f"the local driver node did not start; see {log_path}", "localhost") from None
        if code != 0:
            tail = "\n    ".join(log_path.read_text(errors="replace").strip().splitlines()[-8:])
            raise ClusterError(f"the local driver node failed to join {head_ip}:\n    {tail}", "localhost")

    def _wait_joined(self) -> None:
        import ray

        from flagscale.cluster.ray_node import connect

        connect(self.state)
        deadline = time.monotonic() + self.cluster.join_timeout_s
        wanted = {r.node_ip: r for r in self.state.hosts}
        while True:
            alive = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            for ip, record in wanted.items():
                record.node_id = alive.get(ip, record.node_id)
            missing = [r.host for ip, r in wanted.items() if ip not in alive]
            if not missing:
                order = {e.host: i for i, e in enumerate(self.cluster.hostfile.hosts)}
                self.state.hosts.sort(key=lambda r: order.get(r.host, len(order)))  # hostfile order, driver last
                self.state.save()
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"did not join the Ray cluster within {self.cluster.join_timeout_s:g}s",
                                   ", ".join(missing))  # fmt: skip
            time.sleep(0.5)


def start_cluster(state: RunState, plan, remote_env: dict[str, str], console) -> None:
    ClusterLauncher(state, plan, remote_env).start(console)


# ---- stop ----------------------------------------------------------------------------------------


def _stop_remote(record: HostRecord, settings: ssh.SshSettings) -> str | None:
    try:
        client = ssh.connect(record.host, settings)
    except ClusterError as exc:
        return f"{record.host}: unreachable, skipped ({exc})"
    try:
        argv = [sys.executable, "-m", "flagscale.cluster.processes", "stop", str(record.session)]
        from flagscale.serve.app import project_root

        result = ssh.run(client, argv, {"PYTHONPATH": project_root()}, timeout_s=STOP_TIMEOUT_S)
        if record.temp_dir:
            ssh.run(client, ["rm", "-f", f"{record.temp_dir}/auth_token"], timeout_s=30)
        if result.code != 0:
            return f"{record.host}: processes of session {record.session} are still alive: {result.stdout.strip()} " \
                   f"{result.stderr.strip()}"
        return None
    except Exception as exc:  # noqa: BLE001 - one host failing must not keep the others running
        return f"{record.host}: stopping failed: {exc}"
    finally:
        client.close()


def _stop_local(record: HostRecord) -> str | None:
    stop_session(record.session, None)
    if session_members(record.session):
        return f"{record.host}: processes of session {record.session} are still alive"
    return None


def stop_hosts(state: RunState) -> list[str]:
    """Stop every host's Ray node this run started, all in parallel. Returns one line per host not cleanly stopped."""
    settings = ssh.SshSettings(**state.extra.get("ssh", {}))
    records = [r for r in state.hosts if r.session is not None]
    results = _parallel(records, lambda r: _stop_remote(r, settings) if r.remote else _stop_local(r))
    return [f"{r.host}: stopping failed: {v}" if isinstance(v, BaseException) else v
            for r, v in zip(records, results) if v]  # fmt: skip
