"""Placement: what each engine replica reserves on the target (this machine, or a hostfile's hosts), on which
chip type, and whether the whole graph fits the hostfile's slots. Nothing here touches the network."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flagscale.cluster.host_split import hosts_to_span
from flagscale.cluster.hostfile import HostEntry, Hostfile, host_env
from flagscale.cluster.ray_facts import accelerator_requirement
from flagscale.cluster.ssh import SshSettings
from flagscale.config.replicas import actor_options
from flagscale.config.schema import Resources
from flagscale.errors import ConfigError


@dataclass
class ClusterPlan:
    """The multi-host part of a plan: hosts, how to reach them, what each `ray start` declares."""

    hostfile: Hostfile
    ssh: dict[str, Any]  # SshSettings fields
    num_cpus_per_host: int | None
    host_envs: dict[str, dict[str, str]]  # experiment.envs with nodes_envs.<host> applied
    placement_strategy: str
    join_timeout_s: float
    demand: dict[str, str] = field(default_factory=dict)  # chip -> arithmetic line, for dryrun


@dataclass(frozen=True)
class Target:
    """What replicas are placed on: this machine (one host: its GPUs, or its cores for CPU engines), or the hosts
    of a hostfile (slots of a chip type each)."""

    description: str  # "this machine" or the hostfile's path
    hostfile: Hostfile | None = None
    gpus: int = 0  # this machine only
    cpus: int = 1  # this machine only
    gpu_memory_mib: int | None = None  # this machine only: the smallest GPU's memory
    ray: Any = None  # an existing Ray cluster's ClusterFacts (runner.type: ray); gpus/cpus: its largest node's
    host_ips: dict[str, str] = field(default_factory=dict)  # hostfile hosts the config names -> node IP (facts.py)

    @classmethod
    def this_machine(cls, gpus: int, cpus: int, gpu_memory_mib: int | None = None) -> Target:
        return cls("this machine", None, gpus, cpus, gpu_memory_mib)

    @classmethod
    def ray_cluster(cls, facts) -> Target:
        return cls(
            f"the largest node of the Ray cluster at {facts.address}",
            gpus=int(facts.most("GPU")),
            cpus=int(facts.most("CPU")),
            ray=facts,
        )

    @classmethod
    def hosts_of(cls, hostfile: Hostfile, host_ips: dict[str, str] | None = None) -> Target:
        return cls(hostfile.path, hostfile, host_ips=dict(host_ips or {}))


@dataclass(frozen=True)
class Reservation:
    """Where one engine node's replicas go and what each reserves: decided once, by `reserve`."""

    device: str  # "gpu", "cpu", or a hostfile chip type whose slots are a custom Ray resource
    chip: str | None  # hostfile chip type (resources.accelerator), None when untyped
    ray_actor_options: dict[str, Any]
    auto_replicas: int  # what `num_replicas: auto` comes to on the target
    placement_bundles: list[dict[str, float]] | None = None  # one replica over several hosts: one bundle per host
    placement_strategy: str | None = None
    extra_argv: tuple[str, ...] = ()  # what spanning hosts asks of the engine (nothing: the replica adds it)
    ranks_per_host: int = 0  # the ranks each host of the replica runs (all of them when it fits one host)
    family: str = ""  # the device family of the hosts it runs on (flagscale/devices); "": this machine's or a cluster's


def auto_replicas(devices_per_replica: int, devices_per_host: list[int]) -> int:
    """`num_replicas: auto`: replicas the hosts' devices hold; one spanning hosts if it fits no single host."""
    if devices_per_replica <= max(devices_per_host, default=0):
        return max(1, sum(n // devices_per_replica for n in devices_per_host))
    return max(1, sum(devices_per_host) // devices_per_replica)


def reserve(
    res: Resources,
    parallel: tuple[int, int, int],
    target: Target,
    strategy: str,
    where: str,
    args_where: str,
    spread_dp: bool = False,
) -> Reservation:
    """The one placement decision for an engine node: from its resources and TP x PP x DP to what every replica
    reserves on `target`. `where`/`args_where` name resources/engine_args in errors. `spread_dp`: the replica's
    data-parallel ranks may span hosts (expert parallel: vLLM's multi-node data parallel)."""
    tp, pp, dp = parallel
    devices = tp * pp * dp
    if target.hostfile is None:
        reservation = _on_this_machine(res, devices, parallel, target, where, args_where)
        if target.ray is not None and res.accelerator is not None:
            return _on_accelerator(reservation, res, devices, target, where)
        return reservation
    chip, hosts = _hosts_for(res.accelerator, target.hostfile, where)
    family = hosts[0].family
    on_gpu = family.gpu_spelling
    if res.num_gpus is not None and not on_gpu:
        raise ConfigError(
            f"num_gpus={res.num_gpus:g}, but the hosts it runs on have {family.title}s ({family.name}): num_gpus is the "
            "spelling of GPU families; leave it out, a replica reserves TP x PP x DP of their devices",
            where,
        )
    device_key = hosts[0].device_resource
    cpus = res.num_cpus if res.num_cpus is not None else 1
    label = {f"accelerator_type:{hosts[0].chip}": 0.001} if hosts[0].chip and len({h.chip for h in hosts}) == 1 else {}
    options: dict[str, Any] = {"num_cpus": cpus}
    if res.memory:
        options["memory"] = res.memory
    auto = auto_replicas(devices, [h.slots for h in hosts])
    device = "gpu" if on_gpu else (hosts[0].chip or "cpu")
    if devices <= max(h.slots for h in hosts):
        if on_gpu:
            options["num_gpus"] = res.num_gpus if res.num_gpus is not None else devices
        else:
            options["resources"] = {device_key: float(devices)}
        if label:
            options.setdefault("resources", {}).update(label)
        return Reservation(device, chip, options, auto, ranks_per_host=devices, family=family.name)
    # More devices than any one host has: one bundle per host, each with that host's share of the ranks; the
    # replica takes bundle 0 (API server and the first ranks) and starts the others' ranks (replica/ranks.py).
    nnodes = hosts_to_span(parallel, [h.slots for h in hosts], args_where, spread_dp)
    per_host = devices // nnodes
    share = {device_key: float(per_host), **label}
    if on_gpu:
        options["num_gpus"] = per_host
    else:
        options["resources"] = {device_key: float(per_host)}
    if label:
        options.setdefault("resources", {}).update(label)
    bundles = [{"CPU": float(cpus), **share}] + [dict(share) for _ in range(nnodes - 1)]
    return Reservation(device, chip, options, auto, bundles, strategy, ranks_per_host=per_host, family=family.name)


def _on_this_machine(
    res: Resources, devices: int, parallel: tuple[int, int, int], target: Target, where: str, args_where: str
) -> Reservation:
    if res.num_gpus and res.num_gpus > 0 and target.gpus == 0:
        raise ConfigError(f"num_gpus={res.num_gpus:g} per replica, but {target.description} has no GPU", where)
    on_gpu = (res.num_gpus or 0) > 0 or (res.num_gpus is None and target.gpus > 0)
    offered, kind = (target.gpus, "GPU") if on_gpu else (target.cpus, "CPU")
    if devices > offered:
        tp, pp, dp = parallel
        raise ConfigError(
            f"TP x PP x DP = {tp} x {pp} x {dp} = {devices} {kind} devices per replica, "
            f"but {target.description} offers {offered}",
            args_where,
        )
    options = actor_options(res, default_cpus=1 if on_gpu else devices, default_gpus=devices if on_gpu else 0)
    auto = auto_replicas(devices, [offered])
    return Reservation("gpu" if on_gpu else "cpu", None, options, auto, ranks_per_host=devices)


def _on_accelerator(reservation: Reservation, res: Resources, devices: int, target: Target, where: str) -> Reservation:
    """An existing Ray cluster: resources.accelerator names what its nodes have (ray_facts.accelerator_requirement):
    Ray's `accelerator_type:<X>` (then GPUs as usual, on such a node), a custom resource counted in devices (instead
    of CPUs as the device), or a node label."""
    accelerator = str(res.accelerator)
    how, name = accelerator_requirement(accelerator, target.ray, where)
    options = dict(reservation.ray_actor_options)
    # actor_options marks every accelerator as Ray's accelerator_type:<X>; here it is whichever the cluster has
    resources = {k: v for k, v in options.pop("resources", {}).items() if not k.startswith("accelerator_type:")}
    device = reservation.device
    if how == "devices":
        options["num_cpus"] = res.num_cpus if res.num_cpus is not None else 1
        resources[name] = float(devices)
        device = accelerator
    elif how == "resource":
        resources[name] = 0.001
    else:
        options["label_selector"] = {name: accelerator}
    if resources:
        options["resources"] = resources
    return Reservation(device, accelerator, options, reservation.auto_replicas, ranks_per_host=devices)


def _hosts_for(accelerator: str | None, hostfile: Hostfile, where: str) -> tuple[str | None, list[HostEntry]]:
    """The hosts a node runs on: those resources.accelerator picks (a type as the hostfile writes it, a family, a
    model of chip), or, without it, every host, when they are all of one type."""
    if accelerator is not None:
        hosts = hostfile.matching(accelerator)
        if not hosts:
            types = ", ".join(sorted({f"{h.chip} ({h.family.name})" for h in hostfile.hosts if h.chip})) or "none"
            raise ConfigError(
                f"resources.accelerator={accelerator!r}, but {hostfile.path} has no host of that type or family "
                f"(types: {types})",
                where,
            )
        families = sorted({h.family.name for h in hosts})
        if len(families) > 1 or len({h.device_resource for h in hosts}) > 1:
            raise ConfigError(
                f"resources.accelerator={accelerator!r} picks hosts of several families or types "
                f"({', '.join(sorted({str(h.chip) for h in hosts}))}); name one type",
                where,
            )
        return accelerator, hosts
    groups = hostfile.by_chip()
    if len(groups) > 1:
        raise ConfigError(
            f"{hostfile.path} mixes chip types ({', '.join(map(str, groups))}); "
            "set resources.accelerator to say which one this node runs on",
            where,
        )
    chip, hosts = next(iter(groups.items()))
    return chip, hosts


def check_fits(
    engines_nodes: list[tuple[Any, Any]], hostfile: Hostfile, num_cpus_per_host: int | None, where: str
) -> dict[str, str]:
    """Reject a graph whose replicas need more devices of a chip type than the hostfile lists, showing the sum."""
    demand: dict[str | None, list[str]] = {}
    need: dict[str | None, int] = {}
    for engine, _node in engines_nodes:
        tp, pp, dp = engine.parallel
        replicas = engine.initial_replicas
        demand.setdefault(engine.chip, []).append(
            f"{engine.serve_id}: {replicas} replica(s) x {engine.devices_per_replica} (TP {tp} x PP {pp} x DP {dp})"
        )
        need[engine.chip] = need.get(engine.chip, 0) + replicas * engine.devices_per_replica
    for engine, _node in engines_nodes:
        check_ranks_fit_cores(engine, hostfile, num_cpus_per_host, where)
    lines = {}
    for chip, total in need.items():
        hosts = hostfile.matching(chip)
        offered = sum(h.slots for h in hosts)
        kind = f"type={chip}" if chip else "untyped"
        line = (
            f"{' + '.join(demand[chip])} = {total} device(s); {hostfile.path} offers "
            f"{' + '.join(f'{h.host}: {h.slots}' for h in hosts)} = {offered} {hosts[0].family.name} device(s) of {kind}"
        )
        if total > offered:
            raise ConfigError(f"the graph does not fit the hostfile: {line}", where)
        lines[str(chip)] = line
    _check_family_totals(engines_nodes, hostfile, where)
    if num_cpus_per_host is not None:
        cpus = sum(e.initial_replicas * e.ray_actor_options.get("num_cpus", 0) for e, _ in engines_nodes)
        offered = num_cpus_per_host * len(hostfile.hosts)
        if cpus > offered:
            raise ConfigError(
                f"replicas reserve {cpus:g} CPUs, but {len(hostfile.hosts)} host(s) x num_cpus="
                f"{num_cpus_per_host} = {offered}",
                where,
            )
    return lines


def _check_family_totals(engines_nodes: list[tuple[Any, Any]], hostfile: Hostfile, where: str) -> None:
    """Nodes that pick hosts of one family by different names (`ascend`, `910B`) share its devices: their sum must
    fit the family's hosts too."""
    need: dict[str, list[tuple[str, int]]] = {}
    for engine, _node in engines_nodes:
        family = hostfile.matching(engine.chip)[0].family.name
        need.setdefault(family, []).append((engine.serve_id, engine.initial_replicas * engine.devices_per_replica))
    for family, asks in need.items():
        hosts = [h for h in hostfile.hosts if h.family.name == family]
        total, offered = sum(n for _, n in asks), sum(h.slots for h in hosts)
        if total > offered:
            raise ConfigError(
                f"the graph does not fit the hostfile: {' + '.join(f'{sid}: {n}' for sid, n in asks)} = {total} "
                f"{family} device(s); {hostfile.path} offers {' + '.join(f'{h.host}: {h.slots}' for h in hosts)} = "
                f"{offered}",
                where,
            )


def check_ranks_fit_cores(engine, hostfile: Hostfile, num_cpus_per_host: int | None, where: str) -> None:
    """CPU hosts: each rank gets a core of its own, so a host's ranks of one replica must not outnumber the CPUs
    its Ray node declares (runner.num_cpus / the hostfile's)."""
    ranks = engine.ranks_per_host
    hosts = hostfile.matching(engine.chip)
    if num_cpus_per_host is None or ranks <= 1 or not hosts or not hosts[0].family.on_cpu:
        return
    if ranks > num_cpus_per_host:
        raise ConfigError(
            f"'{engine.serve_id}' runs {ranks} CPU ranks per host (one core each), but each host declares "
            f"num_cpus={num_cpus_per_host}",
            where,
        )


def plan_cluster(config, sources, hostfile: Hostfile, engines_nodes: list[tuple[Any, Any]]) -> ClusterPlan:
    runner = config.experiment.runner
    num_cpus = runner.num_cpus or hostfile.num_cpus
    demand = check_fits(engines_nodes, hostfile, num_cpus, f"{sources.main}: experiment.runner.hostfile")
    return ClusterPlan(
        hostfile=hostfile,
        ssh=SshSettings.from_runner(runner).to_dict(),
        num_cpus_per_host=num_cpus,
        host_envs={h.host: host_env(config, h) for h in hostfile.hosts},
        placement_strategy=runner.placement_strategy,
        join_timeout_s=runner.join_timeout_s,
        demand=demand,
    )
