"""Planning against a hostfile: what each engine replica reserves, on which chip type, and whether the
whole graph fits the hostfile's slots. Nothing here touches the network."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flagscale.cluster.hostfile import Hostfile, HostEntry
from flagscale.errors import ConfigError


@dataclass
class ClusterPlan:
    """The multi-host part of a plan: hosts, how to reach them, what each `ray start` declares."""

    hostfile: Hostfile
    ssh: dict[str, Any]  # SshSettings fields
    ray_port: int
    num_cpus_per_host: int | None
    host_envs: dict[str, dict[str, str]]  # experiment.envs with nodes_envs.<host> applied
    placement_strategy: str
    join_timeout_s: float
    demand: dict[str, str] = field(default_factory=dict)  # chip -> arithmetic line, for dryrun


def _parallel_sizes(engine_args: dict) -> tuple[int, int, int]:
    return tuple(int(engine_args.get(k, 1)) for k in ("tensor_parallel_size", "pipeline_parallel_size",
                                                         "data_parallel_size"))  # type: ignore[return-value]


def _hosts_for(accelerator: str | None, hostfile: Hostfile, where: str) -> tuple[str | None, list[HostEntry]]:
    groups = hostfile.by_chip()
    if accelerator is not None:
        if accelerator not in groups:
            types = ", ".join(str(t) for t in groups) or "none"
            raise ConfigError(f"resources.accelerator={accelerator!r}, but {hostfile.path} has no host of that type "
                              f"(types: {types})", where)  # fmt: skip
        return accelerator, groups[accelerator]
    if len(groups) > 1:
        raise ConfigError(f"{hostfile.path} mixes chip types ({', '.join(map(str, groups))}); "
                          "set resources.accelerator to say which one this node runs on", where)  # fmt: skip
    chip, hosts = next(iter(groups.items()))
    return chip, hosts


def place_engine(engine, node, hostfile: Hostfile, strategy: str, where: str) -> None:
    """Rewrite `engine`'s reservations for the hostfile's hosts (the local machine's devices do not matter)."""
    res = node.resources
    chip, hosts = _hosts_for(res.accelerator, hostfile, where)
    devices = engine.devices_per_replica
    on_gpu = hosts[0].is_gpu
    device_key = "GPU" if on_gpu else chip
    cpus = res.num_cpus if res.num_cpus is not None else 1
    label = {f"accelerator_type:{chip}": 0.001} if chip else {}
    options: dict[str, Any] = {"num_cpus": cpus}
    if res.memory:
        options["memory"] = res.memory
    largest = max(h.slots for h in hosts)
    if devices <= largest:
        if on_gpu:
            options["num_gpus"] = res.num_gpus if res.num_gpus is not None else devices
        else:
            options["resources"] = {chip: float(devices)}
        if label:
            options.setdefault("resources", {}).update(label)
    else:
        # More devices than any one host has: the replica takes bundle 0, vLLM's Ray executor the device bundles.
        if label:
            options["resources"] = dict(label)
        engine.placement_bundles = [{"CPU": float(cpus), **label}] + [{device_key: 1.0} for _ in range(devices)]
        engine.placement_strategy = strategy
        if "--distributed-executor-backend" not in engine.argv:
            engine.argv += ["--distributed-executor-backend", "ray"]
    engine.ray_actor_options = options
    engine.device = "gpu" if on_gpu else (chip or "cpu")
    engine.chip = chip


def check_fits(engines_nodes: list[tuple[Any, Any]], hostfile: Hostfile, num_cpus_per_host: int | None,
               where: str) -> dict[str, str]:  # fmt: skip
    """Reject a graph whose replicas need more devices of a chip type than the hostfile lists, showing the sum."""
    demand: dict[str | None, list[str]] = {}
    need: dict[str | None, int] = {}
    for engine, node in engines_nodes:
        tp, pp, dp = _parallel_sizes(node.engine_args)
        replicas = engine.initial_replicas
        demand.setdefault(engine.chip, []).append(
            f"{engine.serve_id}: {replicas} replica(s) x {engine.devices_per_replica} (TP {tp} x PP {pp} x DP {dp})"
        )
        need[engine.chip] = need.get(engine.chip, 0) + replicas * engine.devices_per_replica
    lines = {}
    for chip, total in need.items():
        hosts = hostfile.by_chip()[chip]
        offered = sum(h.slots for h in hosts)
        kind = f"type={chip}" if chip else "untyped"
        line = (f"{' + '.join(demand[chip])} = {total} device(s); {hostfile.path} offers "
                f"{' + '.join(str(h.slots) for h in hosts)} = {offered} slot(s) of {kind}")  # fmt: skip
        if total > offered:
            raise ConfigError(f"the graph does not fit the hostfile: {line}", where)
        lines[str(chip)] = line
    if num_cpus_per_host is not None:
        cpus = sum(e.initial_replicas * e.ray_actor_options.get("num_cpus", 0) for e, _ in engines_nodes)
        offered = num_cpus_per_host * len(hostfile.hosts)
        if cpus > offered:
            raise ConfigError(f"replicas reserve {cpus:g} CPUs, but {len(hostfile.hosts)} host(s) x num_cpus="
                              f"{num_cpus_per_host} = {offered}", where)  # fmt: skip
    return lines


def load_hostfile(config, sources) -> Hostfile | None:
    from flagscale.cluster.hostfile import parse_hostfile

    runner = config.experiment.runner
    if not runner.hostfile:
        return None
    return parse_hostfile(runner.hostfile, runner.head, f"{sources.main}: experiment.runner.head")


def plan_cluster(config, sources, hostfile: Hostfile, engines_nodes: list[tuple[Any, Any]]) -> ClusterPlan:
    from flagscale.cluster.ssh import SshSettings

    runner = config.experiment.runner
    demand = check_fits(engines_nodes, hostfile, runner.num_cpus, f"{sources.main}: experiment.runner.hostfile")
    return ClusterPlan(
        hostfile=hostfile,
        ssh=SshSettings.from_runner(runner).to_dict(),
        ray_port=runner.ray_port or 6379,
        num_cpus_per_host=runner.num_cpus,
        host_envs={h.host: config.experiment.env_for(h.host) for h in hostfile.hosts},
        placement_strategy=runner.placement_strategy,
        join_timeout_s=runner.join_timeout_s,
        demand=demand,
    )


def endpoint_in_use(host: str, port: int) -> bool:
    """Whether something already answers at host:port (the router binds on a remote head, so no local bind test)."""
    import socket

    target = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    try:
        with socket.create_connection((target, port), timeout=2):
            return True
    except OSError:
        return False
