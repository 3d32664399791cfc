"""A Ray cluster over the hosts of a hostfile (or of a Slurm allocation, cluster/slurm.py): `ray start` on each
host over SSH, and stopping exactly that.

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
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from flagscale import devices
from flagscale.adaptors import ray
from flagscale.cluster import hostfile as hostfiles
from flagscale.cluster import slurm, ssh
from flagscale.cluster.hostfile import HostEntry, Hostfile
from flagscale.cluster.placement import ClusterPlan, Target, plan_cluster
from flagscale.cluster.ray_env import worker_env
from flagscale.cluster.ray_node import RayNode, auth_env, connect, head_port, prepare_ray_temp_dir, start_node
from flagscale.cluster.runner import LocalRunner, SshRunner, parallel
from flagscale.cluster.state import RunState
from flagscale.errors import ClusterError
from flagscale.launchers.base import OwnCluster, TargetFacts
from flagscale.net import endpoint_in_use

if TYPE_CHECKING:  # planning sits a floor above the launchers
    from flagscale.plan import EnginePlan, Plan

log = logging.getLogger(__name__)
DEVICE_LISTING_TIMEOUT_S = 20.0  # a host's vendor CLI listing its devices (nvidia-smi, npu-smi, ...)


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
    serve_port: int | None = None,
) -> RayNode:
    """The Ray node of a hostfile host; `ip_of`: a hostfile host's IP (its ssh config HostName, resolved);
    `serve_port`: the deployment's port, kept out of the node's worker ports."""
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
        serve_port=serve_port,
    )


def _raise_failures(entries: list[HostEntry], results: list, what: str) -> None:
    failed = [(e.host, r) for e, r in zip(entries, results) if isinstance(r, BaseException)]
    if failed:
        lines = "\n".join(f"  {host}: {str(exc).removeprefix(f'{host}: ')}" for host, exc in failed)
        raise ClusterError(f"{what} failed on {len(failed)} host(s):\n{lines}", ", ".join(h for h, _ in failed))


class SshClusterStart:
    """Starting one run's Ray cluster on the hostfile's hosts, in the order the module doc gives."""

    def __init__(self, state: RunState, plan: Plan, remote_env: dict[str, str]):
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
        self._check_devices(entry)
        temp_dir = host_temp_dir(self.state.exp_dir, entry.host)
        runner.make_dir(temp_dir)
        runner.put_file(Path(self.state.token_path), f"{temp_dir}/auth_token")

    def _check_devices(self, entry: HostEntry) -> None:
        """The host's devices as its family's vendor CLI lists them (with the host's envs: its PATH), recorded for
        status; fewer than its slots fails the run here, before any Ray node starts. No CLI there: slots are taken
        as written."""
        family, env = entry.family, self.cluster.host_envs.get(entry.host, {})

        def run(argv: list[str]) -> str | None:
            result = self.runners[entry.host].run(argv, env, timeout_s=DEVICE_LISTING_TIMEOUT_S)
            return result.stdout if result.code == 0 else None

        listed = family.list_devices(run)
        if listed is None:
            return
        self.state.extra.setdefault("devices", {})[entry.host] = [
            {"index": d.index, "name": d.name, "memory_mib": d.memory_mib} for d in listed
        ]
        if len(listed) < entry.slots:
            raise ClusterError(
                f"hostfile line {entry.line} gives {entry.host} slots={entry.slots} of {family.title}s "
                f"({family.name}), but `{' '.join(family.list_argv)}` there lists {len(listed)}",
                entry.host,
            )

    def _start_host(self, entry: HostEntry):
        head = self.cluster.hostfile.head
        temp_dir = host_temp_dir(self.state.exp_dir, entry.host)
        node = host_node(
            entry, head, self.ray_port, self.cluster.num_cpus_per_host, temp_dir, self.ip_of, self.plan.port
        )
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
            "driver",
            self.ray_port,
            temp_dir,
            head_ip=head_ip,
            node_ip=my_ip,
            num_cpus=0,
            num_gpus=0,
            this_machine=True,
            serve_port=self.plan.port,
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


def load_hostfile(config, sources) -> Hostfile | None:
    """runner.hostfile: a hostfile's hosts, or `slurm`: the hosts of the Slurm allocation this runs in."""
    runner = config.experiment.runner
    if not runner.hostfile:
        return None
    if runner.hostfile == slurm.KEYWORD:
        return slurm.allocation_hostfile(os.environ, runner.head, f"{sources.main}: experiment.runner.head")
    return hostfiles.parse_hostfile(runner.hostfile, runner.head, f"{sources.main}: experiment.runner.head")


def named_hosts(config) -> set[str]:
    """The hostfile hosts the config refers to by name: per-host engine args, pinned prefill/decode pools."""
    hosts = set(config.experiment.node_args)
    deploy = config.experiment.runner.deploy
    if deploy.prefill_decode_disaggregation:
        hosts |= {a for a in (deploy.prefill_address, deploy.decode_address) if a != "auto"}
    for node in config.serve:
        pd = node.disaggregation
        if pd is not None:
            hosts |= {pool.host for pool in (pd.prefill, pd.decode) if pool.host}
    return hosts


class SshLauncher(OwnCluster):
    """runner.hostfile: Ray started on every host over SSH (SshClusterStart), the router on the head host."""

    name = "ssh"

    def engine_hosts(self, plan: Plan) -> list[str]:
        return [entry.host for entry in plan.cluster.hostfile.hosts] if plan.cluster else []

    def claims(self, runner) -> bool:
        return runner.type != "ray" and bool(runner.hostfile)

    def gather(self, config, sources) -> TargetFacts:
        hostfile = load_hostfile(config, sources)
        settings = ssh.SshSettings.from_runner(config.experiment.runner)
        known = {entry.host for entry in hostfile.hosts}
        # The replica finds its argv by its node IP: the host's ssh-config HostName, resolved (as `ray start` uses).
        host_ips = {h: resolve_ip(ssh.resolve(h, settings).hostname) for h in sorted(named_hosts(config) & known)}
        return TargetFacts(hostfile=hostfile, host_ips=host_ips)

    def port_taken(self, facts: TargetFacts, host: str, port: int) -> str | None:
        return f"port {port} on {host} is already in use" if endpoint_in_use(host, port) else None

    def target(self, facts: TargetFacts) -> Target:
        return Target.hosts_of(facts.hostfile, facts.host_ips)

    def plan_hosts(self, config, sources, facts: TargetFacts, engines_nodes: list) -> ClusterPlan:
        return plan_cluster(config, sources, facts.hostfile, engines_nodes)

    def describe(self, plan: Plan) -> list:
        cluster = plan.cluster
        table = Table(title=f"hosts ({cluster.hostfile.path}, over SSH)", title_justify="left")
        for column in ("host", "role", "chip", "slots"):
            table.add_column(column)
        for entry in cluster.hostfile.hosts:
            role = "head + router" if entry is cluster.hostfile.head else "worker"
            table.add_row(entry.host, role, entry.chip or "-", str(entry.slots))
        fits = [f"fits {chip}: {line}" for chip, line in cluster.demand.items()]
        return [table, *fits, f"exp_dir: {plan.exp_dir}"]

    def rank_hosts(self, plan: Plan, engine: EnginePlan) -> list[tuple[str, int]]:
        return [(h.host, h.slots) for h in plan.cluster.hostfile.matching(engine.chip)]

    def start(self, state: RunState, plan: Plan, console: Console) -> str:
        hosts = len(plan.cluster.hostfile.hosts)
        with console.status(f"starting Ray on {hosts} host(s) over SSH ..."):
            common_env = {k: v for k, v in worker_env(plan.envs).items() if k not in plan.envs}  # envs go per host
            SshClusterStart(state, plan, common_env).start(console)
        return f"Ray cluster up: head {state.ray_address}, {hosts} host(s) joined"

    def host_envs(self, plan: Plan) -> dict[str, dict[str, str]]:
        return plan.cluster.host_envs

    def engine_env(self, plan: Plan) -> dict[str, str]:
        return {}  # each host's Ray node already has its own envs

    def router_resources(self) -> dict[str, float]:
        return {hostfiles.HEAD_RESOURCE: 0.001}  # the head host, where deploy.host is

    def can_attach(self, state: RunState) -> bool:
        return "driver_ip" in state.extra  # the driver attaches through the local Ray node; before it, nothing ran

    def stop(self, state: RunState, console: Console) -> list[str]:
        if state.hosts:
            console.print(f"stopping the Ray nodes this run started on {len(state.hosts)} host(s) ...")
        return super().stop(state, console)

    def hosts(self, state: RunState, replicas: list[dict]) -> list[dict] | None:
        """One row per hostfile host, with its Ray node's state as the GCS sees it."""
        nodes = {n["NodeID"]: n for n in ray.nodes()}
        rows = []
        for record in state.hosts:
            if not record.remote:
                continue
            node = nodes.get(record.node_id or "")
            on_it = [r for r in replicas if record.node_id and record.node_id.startswith(r["node_id"])]
            rows.append(
                {
                    "host": record.host,
                    "role": record.role,
                    "chip": record.chip,
                    "family": _family_of(record.chip),
                    "devices": state.extra.get("devices", {}).get(record.host),
                    "slots": record.slots,
                    "ray_node": "alive" if node and node.get("Alive") else "dead",
                    "node_id": (record.node_id or "")[:12],
                    "session": record.session,
                    "replicas": [f"{r['serve_id']}/{r['replica_id']}" for r in on_it],
                }
            )
        return rows or None


def _family_of(chip: str | None) -> str:
    found = devices.chip_family(chip) if chip else None
    return (found[0] if found else devices.get(devices.DEFAULT_FAMILY)).name


LAUNCHER = SshLauncher()
