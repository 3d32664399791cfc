"""An existing Ray cluster (`runner.type: ray`): a KubeRay RayCluster, a Slurm job's Ray, a team's shared cluster.

This runner starts no Ray node and stops none. It connects as a driver to the cluster's GCS (`runner.address`, else
RAY_ADDRESS) with the token auth Ray itself reads from the environment (RAY_AUTH_MODE=token with RAY_AUTH_TOKEN,
RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token), ships the flagscale package to the cluster as the job's `py_modules`
(the nodes need Ray, vLLM and the same Python, not this checkout), and reads the cluster's nodes once, before
planning (ClusterFacts). What a deployment leaves on the cluster is its Serve application, its registry entries and
its engine processes, all named by the application's name; `remove_deployment` removes exactly those.

The driver's side is flagscale/cluster/ray_existing.py; each node is reached through a Ray task pinned to it
(flagscale/cluster/ray_node_tasks.py): the logs action reads engine logs with it, stop checks with it that no
engine process of the deployment is left.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from rich.console import Console

from flagscale.adaptors import ray
from flagscale.cluster.node_logs import EngineLog
from flagscale.cluster.placement import Target
from flagscale.cluster.ray_existing import (
    HEAD_RESOURCE,
    Placement,
    connect,
    demand_of,
    describe,
    gather_facts,
    place,
    resolve_address,
)
from flagscale.cluster.ray_facts import fmt
from flagscale.cluster.ray_node_tasks import NodeRunner, node_engine_logs, remove_leftovers
from flagscale.cluster.state import RunState
from flagscale.errors import ConfigError, FlagScaleError
from flagscale.launchers.base import Launcher, TargetFacts
from flagscale.net import endpoint_in_use
from flagscale.replica.process import NODE_LOG_DIR
from flagscale.replica.registry import list_replicas, withdraw_all

if TYPE_CHECKING:  # planning sits a floor above the launchers
    from flagscale.plan import EnginePlan, Plan


class RayClusterLauncher(Launcher):
    """runner.type: ray: deploys onto an existing Ray cluster, starting and stopping no node of it."""

    name = "ray"
    probes_local_gpus = False  # the cluster's nodes have the GPUs
    router_host_moved_because = (
        "on a Ray cluster the router runs on the cluster's head node, and loopback there is not reachable from here"
    )

    def engine_hosts(self, plan: Plan) -> list[str]:
        return [node.ip for node in plan.ray_cluster.nodes] if plan.ray_cluster else []

    def claims(self, runner) -> bool:
        return runner.type == "ray"

    def check_runner(self, runner, where: str) -> None:
        if runner.hostfile:
            raise ConfigError(
                "runner.type: ray deploys onto a running Ray cluster; runner.hostfile names hosts to start one on. "
                "Set one of them",
                f"{where}: experiment.runner.hostfile",
            )
        for key in ("ray_port", "num_cpus", "head"):
            if getattr(runner, key) is not None:
                raise ConfigError(
                    f"runner.{key} sets up a Ray node this runner starts; with runner.type: ray the cluster's own "
                    "nodes are used as they are",
                    f"{where}: experiment.runner.{key}",
                )

    def gather(self, config, sources) -> TargetFacts:
        """The cluster's facts, read by connecting (this process stays its driver)."""
        for key in ("before_start", "after_stop"):
            if getattr(config.experiment.cmds, key):
                raise ConfigError(
                    f"cmds.{key} runs on the hosts whose Ray nodes this runner starts and stops; with runner.type: "
                    "ray it starts none (set up the cluster's nodes in its own image or job script)",
                    f"{sources.main}: experiment.cmds.{key}",
                )
        where = f"{sources.main}: experiment.runner"
        address = resolve_address(config.experiment.runner.address, dict(os.environ), where)
        return TargetFacts(ray_cluster=gather_facts(address))

    def port_taken(self, facts: TargetFacts, host: str, port: int) -> str | None:
        head = facts.ray_cluster.head.ip
        if endpoint_in_use(head, port):
            return (
                f"port {port} on the cluster's head node {head} is already in use (another deployment's router?): "
                "pick another deploy.port"
            )
        return None

    def target(self, facts: TargetFacts) -> Target:
        return Target.ray_cluster(facts.ray_cluster)

    def router_host(self, host: str, facts: TargetFacts, where: str) -> str:
        """What the router binds on the cluster's head node: its IP (deploy.host left at loopback, or that IP), or
        every interface (0.0.0.0 / ::)."""
        head = facts.ray_cluster.head.ip
        if host in ("0.0.0.0", "::", head):
            return host
        if host in ("127.0.0.1", "localhost"):
            return head
        raise ConfigError(
            f"deploy.host {host!r}: on a Ray cluster the router runs on the head node ({head}); set deploy.host to "
            "that IP, or 0.0.0.0",
            where,
        )

    def place(self, facts: TargetFacts, app_name: str, groups: list, where: str) -> Placement:
        """A new deployment on what the nodes have free now, an update (the application runs there already, holding
        its share) on their totals."""
        cluster = facts.ray_cluster
        wanted = [
            (
                g.serve_id,
                g.initial_replicas,
                demand_of(g.ray_actor_options),
                g.ray_actor_options.get("label_selector", {}),
            )
            for g in groups
        ]
        return place(wanted, cluster, free=app_name not in cluster.applications, where=where)

    def endpoint_host(self, plan: Plan) -> str:
        return plan.ray_cluster.head.ip  # the router runs on the cluster's head node

    def describe(self, plan: Plan) -> list:
        facts = plan.ray_cluster
        return [
            f"Ray cluster at {facts.address} (runner.type: ray; nothing is started or stopped but the deployment):",
            *(f"  node {line}" for line in describe(facts)),
            f"router: on the head node {facts.head.ip}",
            "replicas would go (first fit on what the nodes have free):",
            *(f"  {line}" for line in plan.placement.lines()),
            f"exp_dir: {plan.exp_dir}",
        ]

    def rank_hosts(self, plan: Plan, engine: EnginePlan) -> list[tuple[str, int]]:
        return [("a node of the Ray cluster", engine.devices_per_replica * engine.initial_replicas)]

    def auth_token(self, plan: Plan) -> str | None:
        return None  # the cluster has its own token, from the environment

    def check_free(self, plan: Plan) -> None:
        facts = plan.ray_cluster
        if plan.app_name in facts.applications:
            raise FlagScaleError(
                f"the Ray cluster at {facts.address} already runs a Serve application '{plan.app_name}' "
                "(another exp_dir's deployment, or one started elsewhere): give this one another experiment.exp_name",
                "experiment.exp_name",
            )

    def start(self, state: RunState, plan: Plan, console: Console) -> str:
        facts = plan.ray_cluster
        state.ray_address = facts.address
        state.save()
        return (
            f"using the Ray cluster at {facts.address}: {len(facts.nodes)} node(s), the router on {facts.head.ip} "
            "(nothing started)"
        )

    def connect(self, state: RunState) -> None:
        connect(state.ray_address)  # its address; the token from the environment

    def engine_log_dir(self, plan: Plan) -> str:
        return NODE_LOG_DIR  # the exp_dir is not on the cluster's nodes: under each node's Ray session log dir

    def router_resources(self) -> dict[str, float]:
        return {HEAD_RESOURCE: 0.001}

    @contextlib.contextmanager
    def removing_app(self, state: RunState, console: Console) -> Iterator[None]:
        """The cluster keeps running: what is left of this deployment there, its engine servers and its registry
        entries, is removed after its application, nothing else."""
        engines = list_replicas(state.app_name)  # read before the application goes
        yield
        console.print(f"checking that no engine of '{state.app_name}' is left on the cluster's nodes ...")
        problems = remove_leftovers(engines)
        withdraw_all(state.app_name)
        if problems:
            raise RuntimeError("; ".join(problems))

    def stop(self, state: RunState, console: Console) -> list[str]:
        return []  # no node of the cluster is this run's

    def hosts(self, state: RunState, replicas: list[dict]) -> list[dict] | None:
        return node_rows(replicas)

    @contextlib.contextmanager
    def reading_registry(self, state: RunState) -> Iterator[None]:
        try:
            self.connect(state)  # the nodes' logs are read through Ray: a driver
            yield
        finally:
            ray.shutdown()

    def engine_logs(self, state: RunState, log_dir: str) -> list[EngineLog]:
        self.connect(state)
        return node_engine_logs(state.app_name)

    def node_runner(self, state: RunState):
        return lambda node_id, host: NodeRunner(node_id, state.ray_address, host)


def node_rows(replicas: list[dict]) -> list[dict]:
    """status: the cluster's nodes from Ray's node table (alive ones, and any that held a replica)."""
    rows = []
    for node in ray.nodes():
        on_it = [r for r in replicas if node["NodeID"].startswith(r["node_id"])]
        if not node.get("Alive") and not on_it:
            continue
        resources = node.get("Resources", {})
        chips = [k.removeprefix("accelerator_type:") for k in resources if k.startswith("accelerator_type:")]
        rows.append(
            {
                "host": node["NodeManagerAddress"],
                "role": "head + router" if HEAD_RESOURCE in resources else "worker",
                "chip": ", ".join(chips) or None,
                "slots": fmt({k: v for k, v in resources.items() if k in ("CPU", "GPU")}),
                "ray_node": "alive" if node.get("Alive") else "dead",
                "node_id": node["NodeID"][:12],
                "session": None,
                "replicas": [f"{r['serve_id']}/{r['replica_id']}" for r in on_it],
            }
        )
    return rows


LAUNCHER = RayClusterLauncher()
