"""This machine alone (no runner.hostfile): a one-host Ray cluster whose head is started through the local runner
(ray_node.start_local_head), the router and the engines beside it on loopback."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from flagscale.cluster.placement import Target
from flagscale.cluster.ray_env import worker_env
from flagscale.cluster.ray_node import start_local_head
from flagscale.cluster.state import RunState
from flagscale.devices import local_gpu_count
from flagscale.errors import ConfigError
from flagscale.launchers.base import CpuDemand, OwnCluster, TargetFacts
from flagscale.net import port_is_free

if TYPE_CHECKING:  # planning sits a floor above the launchers
    from flagscale.plan import EnginePlan, Plan


class LocalLauncher(OwnCluster):
    name = "local"
    engine_bind_host = "127.0.0.1"  # the router is on this machine too

    def claims(self, runner) -> bool:
        return runner.type != "ray" and not runner.hostfile

    def gather(self, config, sources) -> TargetFacts:
        return TargetFacts()

    def port_taken(self, facts: TargetFacts, host: str, port: int) -> str | None:
        return None if port_is_free(host, port) else f"port {port} on {host} is already in use"

    def target(self, facts: TargetFacts) -> Target:
        gpus = facts.gpus
        return Target.this_machine(len(gpus), facts.cpus, min((g.memory_mib for g in gpus), default=None))

    def check_custom_nodes(self, facts: TargetFacts, nodes: list, where_of: Callable[[str], str]) -> None:
        if facts.gpus:
            return
        for node in nodes:
            if node.ray_actor_options.get("num_gpus"):
                raise ConfigError(
                    f"num_gpus={node.ray_actor_options['num_gpus']:g} per replica, but this machine has no GPU",
                    where_of(node.serve_id),
                )

    def head_cpus(self, runner, facts: TargetFacts, demand: CpuDemand, where: str) -> tuple[int, list[str]]:
        """runner.num_cpus, else room for the most replicas; a note when they reserve more than the cores."""
        required = int(-(-demand.required // 1))
        notes = []
        if required > facts.cpus:
            notes.append(f"replicas reserve {required} logical CPUs on a {facts.cpus}-core machine: oversubscribed")
        if runner.num_cpus is None:
            return max(facts.cpus, demand.room), notes
        if runner.num_cpus < required:
            raise ConfigError(
                f"num_cpus={runner.num_cpus}, but the graph's replicas reserve {demand.required:g} CPUs "
                f"({demand.terms})",
                where,
            )
        return runner.num_cpus, notes

    def describe(self, plan: Plan) -> list:
        return [f"Ray head: local, {plan.head_num_cpus} logical CPUs   exp_dir: {plan.exp_dir}"]

    def rank_hosts(self, plan: Plan, engine: EnginePlan) -> list[tuple[str, int]]:
        return [("this machine", engine.devices_per_replica * engine.initial_replicas)]

    def start(self, state: RunState, plan: Plan, console: Console) -> str:
        with console.status("starting a local Ray head ..."):
            start_local_head(
                state,
                num_cpus=plan.head_num_cpus,
                num_gpus=local_gpu_count() or None,
                envs=worker_env(plan.envs),
                before_start=plan.before_start,
                log_path=plan.log_dir / "ray-head.log",
                port=plan.ray_port,
                serve_port=plan.port,
            )
        _link_ray_logs(state, plan.log_dir)
        return f"Ray head up at {state.ray_address}"

    def stop(self, state: RunState, console: Console) -> list[str]:
        console.print("stopping the Ray node(s) this run started ...")
        return super().stop(state, console)


def _link_ray_logs(state: RunState, log_dir: Path) -> None:
    """serve_logs/ray -> the head's Ray session logs (this machine's)."""
    head = state.hosts[0]
    link = log_dir / "ray"
    if head.temp_dir and not link.exists():
        try:
            link.symlink_to(Path(head.temp_dir) / "session_latest" / "logs")
        except OSError:
            pass


LAUNCHER = LocalLauncher()
