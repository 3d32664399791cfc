"""What planning needs to know about the target, gathered once before it: this machine's GPUs and cores, the
hostfile, the IPs of the hosts the config names, an existing Ray cluster's nodes, whether the endpoint's port is
taken. `build_plan` is then a pure function of the config and these facts (dryrun and tests can hand it any)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from flagscale.cluster.hostfile import Hostfile
from flagscale.config.load import ConfigSources
from flagscale.config.schema import ServeConfig
from flagscale.devices import Gpu, local_gpus
from flagscale.errors import ConfigError

DEFAULT_PORT = 8000


@dataclass(frozen=True)
class TargetFacts:
    gpus: list[Gpu] = field(default_factory=list)  # this machine's (none when the target is a Ray cluster)
    cpus: int = 1  # this machine's cores
    hostfile: Hostfile | None = None  # runner.hostfile, read and checked
    host_ips: dict[str, str] = field(default_factory=dict)  # hostfile host named by the config -> its node IP
    ray_cluster: Any = None  # an existing Ray cluster's ClusterFacts (runner.type: ray)
    port_taken: str | None = None  # the error naming who holds the endpoint's port; None: free or not checked


def endpoint_port(config: ServeConfig) -> int:
    """deploy.port, else FlagScale's meaning of the first engine node's engine_args.port, else 8000."""
    port = config.experiment.runner.deploy.port
    if port is not None:
        return port
    cli_args = config.experiment.runner.cli_args
    engine_ports = ({**cli_args, **n.merged_engine_args()}.get("port") for n in config.serve if n.is_engine)
    return next((p for p in engine_ports if isinstance(p, int)), DEFAULT_PORT)


def named_hosts(config: ServeConfig) -> set[str]:
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


def gather(config: ServeConfig, sources: ConfigSources, check_port: bool = True) -> TargetFacts:
    """Every probe planning depends on (nvidia-smi, DNS, the Ray cluster's GCS, the endpoint's port), once."""
    from flagscale.cluster.placement import load_hostfile

    ray_facts = _existing_ray_cluster(config, sources)
    hostfile = load_hostfile(config, sources)
    host_ips = {}
    if hostfile is not None:
        from flagscale.cluster import ssh
        from flagscale.cluster.multihost import resolve_ip

        settings = ssh.SshSettings.from_runner(config.experiment.runner)
        known = {entry.host for entry in hostfile.hosts}
        # The replica finds its argv by its node IP: the host's ssh-config HostName, resolved (as `ray start` uses).
        host_ips = {h: resolve_ip(ssh.resolve(h, settings).hostname) for h in sorted(named_hosts(config) & known)}
    port_taken = _port_taken(config, sources, hostfile, ray_facts) if check_port else None
    return TargetFacts(
        gpus=local_gpus() if ray_facts is None else [],
        cpus=os.cpu_count() or 1,
        hostfile=hostfile,
        host_ips=host_ips,
        ray_cluster=ray_facts,
        port_taken=port_taken,
    )


def _port_taken(config: ServeConfig, sources: ConfigSources, hostfile, ray_facts) -> str | None:
    from flagscale.cluster.placement import endpoint_in_use
    from flagscale.net import port_is_free

    deploy = config.experiment.runner.deploy
    port = endpoint_port(config)
    if ray_facts is not None:
        if endpoint_in_use(ray_facts.head.ip, port):
            return (
                f"port {port} on the cluster's head node {ray_facts.head.ip} is already in use (another "
                "deployment's router?): pick another deploy.port"
            )
        return None
    if hostfile is not None:
        return f"port {port} on {deploy.host} is already in use" if endpoint_in_use(deploy.host, port) else None
    return None if port_is_free(deploy.host, port) else f"port {port} on {deploy.host} is already in use"


def _existing_ray_cluster(config: ServeConfig, sources: ConfigSources):
    """runner.type: ray: the cluster's facts, read by connecting (this process stays its driver); else None."""
    from flagscale.cluster.launch import cluster_kind

    runner = config.experiment.runner
    if cluster_kind(runner, sources.main) != "ray":
        return None
    cmds = config.experiment.cmds
    for key in ("before_start", "after_stop"):
        if getattr(cmds, key):
            raise ConfigError(
                f"cmds.{key} runs on the hosts whose Ray nodes this runner starts and stops; with runner.type: ray "
                "it starts none (set up the cluster's nodes in its own image or job script)",
                f"{sources.main}: experiment.cmds.{key}",
            )
    from flagscale.cluster import ray_cluster

    address = ray_cluster.resolve_address(runner.address, dict(os.environ), f"{sources.main}: experiment.runner")
    return ray_cluster.gather_facts(address)
