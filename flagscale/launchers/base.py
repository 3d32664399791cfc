"""What a launcher provides: the one interface planning, `run`, `dryrun`, `stop`, `status` and `logs` talk to about
where the run's Ray cluster comes from. They never ask which launcher it is; they ask it.

A launcher is stateless (one instance per kind, `LAUNCHER` in its module, registered in flagscale/launchers/
__init__.py); what it learns is in TargetFacts (before planning), in the Plan (its payload: Plan.cluster for the
hostfile's hosts, Plan.ray_cluster and Plan.placement for an existing Ray cluster) and in the RunState (what it
started, for stop, status and logs).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from flagscale.cluster.hostfile import Hostfile
from flagscale.cluster.node_logs import EngineLog, engine_logs_here
from flagscale.cluster.placement import ClusterPlan, Target
from flagscale.cluster.ray_existing import Placement
from flagscale.cluster.ray_facts import ClusterFacts
from flagscale.cluster.ray_node import connect as connect_started
from flagscale.cluster.ray_node import connect_kv, stop_nodes, write_token
from flagscale.cluster.runner import CommandRunner
from flagscale.cluster.state import RunState
from flagscale.config.load import ConfigSources
from flagscale.config.schema import RunnerConfig, ServeConfig
from flagscale.devices import Gpu
from flagscale.errors import ConfigError

if TYPE_CHECKING:  # planning sits a floor above the launchers: its types are named, its modules not imported
    from flagscale.plan import EnginePlan, Plan

# The router on a host other than this one: the engines listen on their node's IP (EngineSpec.bind_host).
NODE_IP = "node-ip"


@dataclass(frozen=True)
class TargetFacts:
    """What planning needs to know about the target, gathered once before it (flagscale/facts.py)."""

    gpus: list[Gpu] = field(default_factory=list)  # this machine's (none when the target is a Ray cluster)
    cpus: int = 1  # this machine's cores
    hostfile: Hostfile | None = None  # runner.hostfile, read and checked
    host_ips: dict[str, str] = field(default_factory=dict)  # hostfile host named by the config -> its node IP
    ray_cluster: ClusterFacts | None = None  # an existing Ray cluster's (runner.type: ray)
    port_taken: str | None = None  # the error naming who holds the endpoint's port; None: free or not checked


@dataclass(frozen=True)
class CpuDemand:
    """What the run's replicas reserve in logical CPUs, for the head's Ray node (Launcher.head_cpus)."""

    required: float  # the replicas' CPUs at the start
    room: int  # room for the most replicas autoscaling may start, and one spare engine replica (an update)
    terms: str  # the sum, spelled out for errors


class Launcher(ABC):
    """One way to get the run's Ray cluster: this machine, a hostfile's hosts over SSH, an existing Ray cluster."""

    name: str  # the registry's key, recorded in the run's state (state.extra["cluster"])
    probes_local_gpus: bool = True  # this machine's GPUs are facts about the target (not so on a Ray cluster)
    engine_bind_host: str = NODE_IP  # where engines listen: their node's IP, or 127.0.0.1 beside the router

    # ---- choosing it, and the facts before planning --------------------------------------------------------

    @abstractmethod
    def claims(self, runner: RunnerConfig) -> bool:
        """Whether experiment.runner selects this launcher."""

    def check_runner(self, runner: RunnerConfig, where: str) -> None:
        """Refuse runner keys this launcher cannot honour (`where`: the config file)."""

    @abstractmethod
    def gather(self, config: ServeConfig, sources: ConfigSources) -> TargetFacts:
        """The target's facts this launcher reads (hosts, their IPs, a cluster's nodes); the port comes later."""

    @abstractmethod
    def port_taken(self, facts: TargetFacts, host: str, port: int) -> str | None:
        """The error naming who holds the endpoint's port where the router will bind, or None."""

    # ---- planning ------------------------------------------------------------------------------------------

    @abstractmethod
    def target(self, facts: TargetFacts) -> Target:
        """What replicas are placed on (cluster/placement.py)."""

    def check_custom_nodes(self, facts: TargetFacts, nodes: list, where_of: Callable[[str], str]) -> None:
        """Refuse custom nodes the target cannot hold (`where_of`: serve_id -> where in the config)."""

    def head_cpus(
        self, runner: RunnerConfig, facts: TargetFacts, demand: CpuDemand, where: str
    ) -> tuple[int, list[str]]:
        """The logical CPUs the head's Ray node declares when this launcher starts it, and notes for dryrun."""
        return max(facts.cpus, demand.room), []

    def router_host(self, host: str, facts: TargetFacts, where: str) -> str:
        """What the router binds, from deploy.host."""
        return host

    # why router_host may move deploy.host (said in run's and dryrun's output when it does)
    router_host_moved_because: str = ""

    def engine_hosts(self, plan: Plan) -> list[str]:
        """The addresses engine servers listen on when they bind their node's address (engine_bind_host NODE_IP),
        as far as the plan knows them: for the warning about listening without a key."""
        return []

    def plan_hosts(
        self, config: ServeConfig, sources: ConfigSources, facts: TargetFacts, engines_nodes: list
    ) -> ClusterPlan | None:
        """The hosts part of the plan (Plan.cluster), when the launcher starts Ray on several hosts."""
        return None

    def place(self, facts: TargetFacts, app_name: str, groups: list, where: str) -> Placement | None:
        """Where each replica would go (Plan.placement), when the launcher can tell before the run."""
        return None

    def endpoint_host(self, plan: Plan) -> str:
        """The host clients reach the router at."""
        return "127.0.0.1" if plan.host in ("0.0.0.0", "::") else plan.host

    # ---- dryrun --------------------------------------------------------------------------------------------

    @abstractmethod
    def describe(self, plan: Plan) -> list[Any]:
        """What dryrun prints about the cluster: lines (printed as they are) or rich renderables."""

    @abstractmethod
    def rank_hosts(self, plan: Plan, engine: EnginePlan) -> list[tuple[str, int]]:
        """(host, free slots) that a replica's ranks would be placed over, in order, for dryrun."""

    # ---- run -----------------------------------------------------------------------------------------------

    @abstractmethod
    def auth_token(self, plan: Plan) -> str | None:
        """The path of the token the run's Ray processes and drivers authenticate with (None: the environment's)."""

    def check_free(self, plan: Plan) -> None:
        """Refuse a run that would collide with one already on the target."""

    def launch(self, state: RunState, plan: Plan, console: Console) -> str:
        """Bring the cluster up (start), recorded in the state first; returns a line saying what is up."""
        state.extra["cluster"] = self.name
        return self.start(state, plan, console)

    @abstractmethod
    def start(self, state: RunState, plan: Plan, console: Console) -> str:
        """Start every Ray node of the plan's target this launcher owns, each recorded in the state."""

    @abstractmethod
    def connect(self, state: RunState) -> None:
        """Attach this process to the run's cluster as a Ray driver."""

    def host_envs(self, plan: Plan) -> dict[str, dict[str, str]]:
        """Each host's envs (experiment.envs with nodes_envs applied), by host name; {}: plan.envs everywhere."""
        return {}

    def engine_env(self, plan: Plan) -> dict[str, str]:
        """The envs an engine replica passes its server (those its Ray node lacks)."""
        return plan.envs

    def engine_log_dir(self, plan: Plan) -> str:
        """Where the engine replicas write their logs (EngineSpec.log_dir)."""
        return str(plan.log_dir)

    def router_resources(self) -> dict[str, float]:
        """The Ray resources that pin the router (to the head node); {}: wherever Ray puts it."""
        return {}

    # ---- stop, status, logs --------------------------------------------------------------------------------

    def can_attach(self, state: RunState) -> bool:
        """Whether a driver can attach to what the state records (before that, nothing was deployed)."""
        return True

    @contextlib.contextmanager
    def removing_app(self, state: RunState, console: Console) -> Iterator[None]:
        """Around deleting the run's Serve application (connected as a driver): what else must go with it."""
        yield

    @abstractmethod
    def stop(self, state: RunState, console: Console) -> list[str]:
        """Stop the Ray nodes the run started; returns one line per host not cleanly stopped."""

    def hosts(self, state: RunState, replicas: list[dict]) -> list[dict] | None:
        """status: one row per host or node (connected as a driver), with the replicas on it; None: no table."""
        return None

    @abstractmethod
    def reading_registry(self, state: RunState) -> contextlib.AbstractContextManager[None]:
        """Connected so that the replica registry (and engine_logs) can be read, for the `logs` action."""

    def engine_logs(self, state: RunState, log_dir: str) -> list[EngineLog]:
        """Every engine log of the run, wherever it is (log_dir: the exp_dir's serve_logs on this machine)."""
        return engine_logs_here(log_dir)

    def node_runner(self, state: RunState) -> Callable[[str, str], CommandRunner] | None:
        """(node id, host) -> the runner that reads a log on a Ray node; None: logs are read here or over SSH."""
        return None


class OwnCluster(Launcher):
    """A Ray cluster the run starts itself (this machine, or a hostfile's hosts): a token of its own, written under
    exp_dir, and `stop` ends exactly the Ray sessions the state records (cluster/ray_node.py)."""

    def check_runner(self, runner: RunnerConfig, where: str) -> None:
        if runner.address:
            raise ConfigError(
                "runner.address is the address of an existing Ray cluster: it needs runner.type: ray",
                f"{where}: experiment.runner.address",
            )

    def auth_token(self, plan: Plan) -> str | None:
        return str(write_token(Path(plan.exp_dir) / "ray_auth_token"))

    def connect(self, state: RunState) -> None:
        connect_started(state)

    def stop(self, state: RunState, console: Console) -> list[str]:
        return stop_nodes(state)

    @contextlib.contextmanager
    def reading_registry(self, state: RunState) -> Iterator[None]:
        connect_kv(state)  # the registry only: no driver to tear down on Ctrl-C or at the end of `follow`
        yield
