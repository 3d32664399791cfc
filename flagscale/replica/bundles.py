"""The replica's placement group, as Ray placed it: one bundle per host a replica's ranks span (cluster/placement.py
asks for them), each with the host it landed on and what it reserves there."""

from __future__ import annotations

from dataclasses import dataclass

from flagscale.adaptors import ray


@dataclass(frozen=True)
class HostPart:
    """One bundle of the replica's placement group: the host it landed on and what it reserves there."""

    bundle: int
    host: str
    resources: dict[str, float]


def placement_hosts() -> list[HostPart] | None:
    """The replica's placement group's bundles in order, with their hosts; None when it has none (one host)."""
    group = ray.util.get_current_placement_group()
    if group is None:
        return None
    table = ray.util.placement_group_table(group)
    ips = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
    return [
        HostPart(int(index), ips[table["bundles_to_node_id"][index]], dict(resources))
        for index, resources in sorted(table["bundles"].items(), key=lambda item: int(item[0]))
    ]


def actor_options(resources: dict[str, float]) -> dict:
    """Ray actor options that take a whole bundle's resources."""
    options: dict = {"num_cpus": resources.get("CPU", 0), "num_gpus": resources.get("GPU", 0)}
    custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU", "memory")}
    if custom:
        options["resources"] = custom
    if resources.get("memory"):
        options["memory"] = resources["memory"]
    return options
