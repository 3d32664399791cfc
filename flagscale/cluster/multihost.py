"""A Ray cluster over the hosts of a hostfile: `ray start` on each host over SSH, and stopping exactly that.

Order: SSH to every host in parallel (an unreachable host fails the run before anything starts), copy
the run's auth token to a per-run directory on each host, start the head, then the workers in parallel,
then a CPU-less Ray node on this machine so the runner can be a Ray driver (a driver needs a local
raylet), and wait until every host shows up alive in ray.nodes(). Every node, remote or the local driver, is
started by ray_node.start_node through its host's CommandRunner (cluster/runner.py): a new session whose id
is recorded before anything else can go wrong, and `stop` (ray_node.stop_nodes) ends exactly that session.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import socket
import time
from collections.abc import Callable
from pathlib import Path

from flagscale.cluster import ssh
from flagscale.cluster.hostfile import HostEntry
from flagscale.cluster.ray_node import RayNode, auth_env, head_port, prepare_ray_temp_dir, start_node
from flagscale.cluster.runner import LocalRunner, SshRunner, parallel
from flagscale.cluster.state import RunState
from flagscale.errors import ClusterError

log = logging.getLogger(__name__)


def host_temp_dir(exp_dir: str, host: str) -> str:
    """Per run and per host (test hosts share one filesystem); short, as Ray's socket paths must be. Ray's temp dir
    inside a private parent, created and checked on the host (runner.make_dir, cluster/tempdirs.py)."""
    return f"/tmp/fsr-{hashlib.sha256(f'{exp_dir}|{host}'.encode()).hexdigest()[:10]}/ray"


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


def host_node(
    entry: HostEntry,
    head: HostEntry,
    port: int,
    num_cpus: int | None,
    temp_dir: str,
    ip_of: Callable[[str], str] = resolve_ip,
) -> RayNode:
    """The Ray node of a hostfile host; `ip_of`: a hostfile host's IP (its ssh config HostName, resolved)."""
    is_head = entry is head
    num_gpus, resources = entry.ray_resources(is_head)
    return RayNode(
        "head" if is_head else "worker",
        port,
        temp_dir,
        head_ip=None if is_head else ip_of(head.host),
        node_ip=ip_of(entry.host),
        num_cpus=num_cpus,
        num_gpus=num_gpus or 0,
        resources=resources,
    )


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
        self.runners = {e.host: SshRunner(e.host, self.settings) for e in self.cluster.hostfile.hosts}
        self._ips: dict[str, str] = {}
        self.ray_port = plan.ray_port  # None until start() asks the head for a free one

    def ip_of(self, host: str) -> str:
        """A hostfile host's IP: the address its ssh config entry names (HostName), else the name itself."""
        if host not in self._ips:
            self._ips[host] = resolve_ip(self.runners[host].address)
        return self._ips[host]

    def start(self, console) -> None:
        hostfile = self.cluster.hostfile
        self.state.extra["ssh"] = self.cluster.ssh
        self.state.save()
        try:
            hosts, workers, head = hostfile.hosts, hostfile.workers, hostfile.head
            _raise_failures(hosts, parallel(hosts, lambda e: self.runners[e.host].open()), "SSH")
            _raise_failures(hosts, parallel(hosts, self._prepare), "preparing")
            console.print(f"SSH to {len(hosts)} host(s) ok; starting the Ray head on {head.host}")
            self.ray_port = head_port(self.runners[head.host], self.plan.ray_port)
            self.state.ray_address = f"{self.ip_of(head.host)}:{self.ray_port}"
            _raise_failures([head], parallel([head], self._start_host), "`ray start --head`")
            _raise_failures(workers, parallel(workers, self._start_host), "`ray start` (worker)")
            self._start_driver_node()
            self._wait_joined()
        finally:
            for runner in self.runners.values():
                runner.close()

    def _prepare(self, entry: HostEntry) -> None:
        runner = self.runners[entry.host]
        temp_dir = host_temp_dir(self.state.exp_dir, entry.host)
        runner.make_dir(temp_dir)
        runner.put_file(Path(self.state.token_path), f"{temp_dir}/auth_token")

    def _start_host(self, entry: HostEntry):
        head = self.cluster.hostfile.head
        temp_dir = host_temp_dir(self.state.exp_dir, entry.host)
        node = host_node(entry, head, self.ray_port, self.cluster.num_cpus_per_host, temp_dir, self.ip_of)
        env = {**self.remote_env, **self.cluster.host_envs.get(entry.host, {}), **auth_env(f"{temp_dir}/auth_token")}
        return start_node(
            self.state,
            self.runners[entry.host],
            node,
            env,
            f"{temp_dir}/ray-start.log",
            self.cluster.join_timeout_s,
            self.plan.before_start,
            chip=entry.chip,
            slots=entry.slots,
        )

    def _start_driver_node(self) -> None:
        """A Ray node without CPUs on this machine: the runner's driver attaches to it. Nothing is scheduled
        there (the router needs the head marker, engines need CPUs or chips)."""
        head_ip = self.ip_of(self.cluster.hostfile.head.host)
        my_ip = local_ip_towards(head_ip)
        temp_dir = prepare_ray_temp_dir(self.state.exp_dir)
        self.state.extra["driver_ip"] = my_ip
        node = RayNode(
            "driver", self.ray_port, temp_dir, head_ip=head_ip, node_ip=my_ip, num_cpus=0, num_gpus=0, this_machine=True
        )
        start_node(
            self.state,
            LocalRunner(),
            node,
            {**self.remote_env, **auth_env(self.state.token_path)},
            str(self.plan.log_dir / "ray-driver-node.log"),
            self.cluster.join_timeout_s,
            what=f"the local driver node (joining {head_ip})",
        )

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
                raise ClusterError(
                    f"did not join the Ray cluster within {self.cluster.join_timeout_s:g}s", ", ".join(missing)
                )
            time.sleep(0.5)
