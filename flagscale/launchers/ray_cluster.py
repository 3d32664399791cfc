"""An existing Ray cluster (`runner.type: ray`): a KubeRay RayCluster, a Slurm job's Ray, a team's shared cluster.

This runner starts no Ray node and stops none. It connects as a driver to the cluster's GCS (`runner.address`, else
RAY_ADDRESS) with the token auth Ray itself reads from the environment (RAY_AUTH_MODE=token with RAY_AUTH_TOKEN,
RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token), ships the flagscale package to the cluster as the job's `py_modules`
(the nodes need Ray, vLLM and the same Python, not this checkout), and reads the cluster's nodes once, before
planning (ClusterFacts). What a deployment leaves on the cluster is its Serve application, its registry entries and
its engine processes, all named by the application's name; `remove_deployment` removes exactly those.

Each node is reached through a Ray task pinned to it (NodeRunner, the CommandRunner of this kind of cluster): the
logs action reads engine logs with it, stop checks with it that no engine process of the deployment is left.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from flagscale.cluster.node_logs import engine_log_dir
from flagscale.cluster.placement import Target, endpoint_in_use
from flagscale.cluster.ray_compat import check_gcs_auth, free_resources_per_node, serve_details
from flagscale.cluster.ray_env import project_root
from flagscale.cluster.ray_facts import ClusterFacts, NodeFacts, fmt, fmt_labels
from flagscale.cluster.ray_node import RAY_NAMESPACE
from flagscale.cluster.runner import CommandRunner, CommandTimeout, Result, Session
from flagscale.cluster.state import RunState
from flagscale.errors import ClusterError, ConfigError, FlagScaleError
from flagscale.launchers.base import EngineLog, Launcher, TargetFacts, engine_logs_here
from flagscale.net import port_open
from flagscale.replica.process import NODE_LOG_DIR
from flagscale.replica.registry import list_replicas, withdraw_all

log = logging.getLogger(__name__)

RAY_ADDRESS_ENV = "RAY_ADDRESS"
# Ray gives the head node this resource (1.0); a sliver of it pins the router there.
HEAD_RESOURCE = "node:__internal_head__"
ANSWER_TIMEOUT_S = 5.0  # an address nobody answers fails within this
NODE_TASK_TIMEOUT_S = 60.0


def resolve_address(address: str | None, environ: dict[str, str], where: str) -> str:
    """`runner.address`, else RAY_ADDRESS (Ray's own convention): a GCS `host:port`."""
    chosen = address or environ.get(RAY_ADDRESS_ENV)
    if not chosen:
        raise ConfigError(
            "runner.type: ray connects to a running Ray cluster: set experiment.runner.address to its GCS "
            f"host:port (the head's `ray start --port`, 6379 by default), or {RAY_ADDRESS_ENV}",
            f"{where}.address",
        )
    named = f"{where}.address" if address else RAY_ADDRESS_ENV
    if chosen.startswith("ray://"):
        raise ConfigError(
            f"{chosen}: a Ray Client address; this runner must run on a node of the cluster (for KubeRay: in the "
            "head pod, `kubectl exec`) and take the GCS address, e.g. 127.0.0.1:6379 (docs/clusters.md)",
            named,
        )
    host, _, port = chosen.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{chosen!r} is not a host:port (the GCS address, e.g. 10.0.0.5:6379)", named)
    return chosen


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def check_answers(address: str, timeout_s: float = ANSWER_TIMEOUT_S) -> None:
    """Fail within seconds, naming the address, when nothing listens there (Ray's own connect retries ~2 minutes)."""
    host, port = split_address(address)
    if not port_open(host, port, timeout_s=timeout_s):
        raise ClusterError(
            f"nobody answers at {address} within {timeout_s:g}s: is the Ray head running, and is this its GCS port?",
            address,
        )


def _auth_problem(exc: BaseException) -> str | None:
    from ray.exceptions import AuthenticationError

    if isinstance(exc, AuthenticationError) or "InvalidAuthToken" in str(exc):
        mode = os.environ.get("RAY_AUTH_MODE", "unset")
        given = [name for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH") if os.environ.get(name)]
        return (
            "the cluster refused this runner's token (Ray token auth): give the cluster's token as Ray reads it, "
            "RAY_AUTH_MODE=token with RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH (default ~/.ray/auth_token); here "
            f"RAY_AUTH_MODE={mode}, {' and '.join(given) + ' set' if given else 'neither variable set'}"
        )
    return None


def connect(address: str) -> None:
    """Attach this process to the cluster as a driver, the flagscale package shipped as the job's py_modules (the
    Serve application inherits the job's runtime env, so replicas and their vLLM servers import it)."""
    import ray

    if ray.is_initialized():
        return
    check_answers(address)
    try:
        check_gcs_auth(address)  # seconds, where ray.init retries a refused token for ~20 s
        ray.init(
            address=address,
            namespace=RAY_NAMESPACE,
            runtime_env={"py_modules": [str(Path(project_root()) / "flagscale")]},
            log_to_driver=False,
            logging_level=logging.ERROR,
        )
    except Exception as exc:  # ConnectionError / RuntimeError / AuthenticationError
        raise ClusterError(_auth_problem(exc) or f"cannot connect to the Ray cluster: {exc}", address) from None
    logging.getLogger("ray.serve").setLevel(logging.WARNING)


def gather_facts(address: str) -> ClusterFacts:
    """Connect (see connect) and read the alive nodes, what each has free, and the Serve applications."""
    import ray

    connect(address)
    free = free_resources_per_node()
    nodes = [
        NodeFacts(
            node_id=n["NodeID"],
            ip=n["NodeManagerAddress"],
            is_head=HEAD_RESOURCE in n.get("Resources", {}),
            total=dict(n.get("Resources", {})),
            available=dict(free.get(n["NodeID"], {})),
            labels={k: str(v) for k, v in (n.get("Labels") or {}).items()},
        )
        for n in ray.nodes()
        if n.get("Alive")
    ]
    if not nodes:
        raise ClusterError("the cluster has no alive node", address)
    return ClusterFacts(address, sorted(nodes, key=lambda n: (not n.is_head, n.ip)), serve_applications())


def serve_applications() -> list[str]:
    """The Serve applications running on the connected cluster (none when Serve is not running there)."""
    try:
        return sorted(serve_details().applications)
    except Exception:  # no Serve controller on the cluster yet
        return []


# ---- where replicas would go --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """Which node each replica would take (first fit, biggest replicas first), from what the nodes have free."""

    replicas: list[tuple[str, int, NodeFacts]]  # (serve_id, replica index, node)

    def lines(self) -> list[str]:
        by_node: dict[str, list[str]] = {}
        for serve_id, index, node in self.replicas:
            by_node.setdefault(node.ip, []).append(f"{serve_id}#{index}")
        return [f"{ip}: {', '.join(names)}" for ip, names in by_node.items()]


def demand_of(options: dict) -> dict[str, float]:
    need = {"CPU": options.get("num_cpus", 0), "GPU": options.get("num_gpus", 0), **options.get("resources", {})}
    return {k: float(v) for k, v in need.items() if v}


Group = tuple[str, int, dict[str, float], dict[str, str]]  # serve_id, replicas, one replica's resources, node labels


def place(groups: list[Group], facts: ClusterFacts, free: bool, where: str) -> Placement:
    """groups: (serve_id, replicas, what one replica reserves, the labels its node must have). Refuses, with the
    arithmetic, what does not fit: a replica no node could hold, or more replicas than the nodes hold together (free
    now, or in total)."""
    left = {n.node_id: dict(n.offers(free)) for n in facts.nodes}
    kind = "free" if free else "in total"
    placed: list[tuple[str, int, NodeFacts]] = []
    order = sorted(groups, key=lambda g: -sum(v for k, v in g[2].items() if k in ("CPU", "GPU")))
    for serve_id, count, need, labels in order:
        candidates = [n for n in facts.nodes if all(n.labels.get(k) == v for k, v in labels.items())]
        for index in range(count):
            node = next((n for n in candidates if all(left[n.node_id].get(k, 0) >= v for k, v in need.items())), None)
            if node is None:
                offers = "; ".join(f"{n.ip}{' (head)' if n.is_head else ''}: {fmt(n.offers(free))}" for n in candidates)
                if labels:
                    offers = f"(nodes labelled {fmt_labels(labels)}) {offers or 'none'}"
                fitted = sum(1 for s, _, _ in placed if s == serve_id)
                others = sorted({s for s, _, _ in placed if s != serve_id})
                raise ConfigError(
                    f"serve '{serve_id}': {count} replica(s) x ({fmt(need)}) = {fmt({k: v * count for k, v in need.items()})}"
                    f", but the nodes of the Ray cluster at {facts.address} have {kind}: {offers}; {fitted} of the "
                    f"{count} fit" + (f", beside the replicas of {', '.join(others)} placed first" if others else ""),
                    where,
                )
            for k, v in need.items():
                left[node.node_id][k] = left[node.node_id].get(k, 0) - v
            placed.append((serve_id, index, node))
    return Placement(placed)


def describe(facts: ClusterFacts) -> list[str]:
    """One line per node, for dryrun."""
    lines = []
    for n in facts.nodes:
        labels = fmt_labels({k: v for k, v in n.labels.items() if not k.startswith("ray.io/node")})
        lines.append(
            f"{n.ip}{' (head)' if n.is_head else ''} {n.node_id[:12]}: total {fmt(n.offers())}; free "
            f"{fmt(n.offers(free=True))}" + (f"; labels {labels}" if labels else "")
        )
    return lines


# ---- a node's commands, through a Ray task pinned to it -------------------------------------------------------


def _run_here(argv: list[str], env: dict[str, str] | None, timeout_s: float | None) -> tuple[int, str, str]:
    try:
        done = subprocess.run(
            argv, env={**os.environ, **(env or {})}, capture_output=True, timeout=timeout_s, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        return 124, "", f"{argv[0]} did not finish within {timeout_s:g}s"
    return done.returncode, done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")


def on_node(node_id: str, fn, *args):
    """fn(*args) in a task on that node (no CPU reserved); its result, within NODE_TASK_TIMEOUT_S."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(fn).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
    )
    return ray.get(task.remote(*args), timeout=NODE_TASK_TIMEOUT_S)


class NodeRunner(CommandRunner):
    """A node of an existing Ray cluster: argv runs in a Ray task pinned to it. Nothing is started or stopped as a
    session there (the cluster's nodes are not this runner's)."""

    remote = True

    def __init__(self, node_id: str, address: str, host: str | None = None):
        self.node_id = node_id
        self.address = address
        self.host = host or node_id[:12]

    def open(self) -> None:
        connect(self.address)

    def run(self, argv: list[str], env: dict[str, str] | None = None, timeout_s: float | None = None) -> Result:
        self.open()
        try:
            code, out, err = on_node(self.node_id, _run_here, argv, env, timeout_s)
        except Exception as exc:  # the node died, the task could not be placed
            raise ClusterError(f"running {argv[0]} on node {self.node_id[:12]} failed: {exc}", self.host) from None
        if code == 124:
            raise CommandTimeout(err, self.host, out)
        return Result(code, out, err)

    def start_session(self, argv: list[str], env: dict[str, str], log_path: str, timeout_s: float) -> Session:
        raise NotImplementedError("runner.type: ray starts nothing on the cluster's nodes but the deployment")

    def put_file(self, local: Path, remote: str, mode: int = 0o600) -> None:
        raise NotImplementedError("runner.type: ray copies nothing to the cluster's nodes")

    def make_dir(self, path: str) -> None:
        raise NotImplementedError("runner.type: ray makes no directory on the cluster's nodes")

    def stop_session(self, session: int, leader_start_ticks: int | None) -> list[int]:
        raise NotImplementedError("runner.type: ray stops no Ray node")


def _list_engine_logs(app: str) -> list[tuple[str, float]]:
    return [(found.path, found.mtime) for found in engine_logs_here(engine_log_dir(app))]


def node_engine_logs(app: str) -> list[EngineLog]:
    """Every alive node's engine logs of `app`, each read through a task on its node."""
    import ray

    found = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        node_id, ip = n["NodeID"], n["NodeManagerAddress"]
        try:
            found += [EngineLog(path, mtime, ip, node_id) for path, mtime in on_node(node_id, _list_engine_logs, app)]
        except Exception as exc:  # noqa: BLE001 - one node failing leaves the others' logs
            log.info("listing engine logs on %s failed: %s", ip, exc)
    return found


# ---- removing exactly one deployment ---------------------------------------------------------------------------


def _is_engine_of(pid: int, port: str) -> bool:
    """The engine_proc wrapper whose vLLM server listens on `port` (the registry record's URL): PID reuse guard."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    words = [a.decode(errors="replace") for a in argv]
    return "flagscale.replica.engine_proc" in words and "--port" in words and port in words


def _stop_engine(pid: int, port: str, grace_s: float) -> bool:
    """On the engine's node: SIGTERM its process group, SIGKILL what is left after grace_s. True when gone."""
    if not _is_engine_of(pid, port):
        return True
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return True
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not _is_engine_of(pid, port):
                return True
            time.sleep(0.2)
    return not _is_engine_of(pid, port)


def remove_leftovers(app: str, records: list, grace_s: float = 10.0) -> list[str]:
    """After the application was deleted: every engine server of `app` that a registry record still names is gone
    on its node (stopped if not), and no registry entry of `app` is left. Returns the problems."""
    problems = []
    for record in records:
        port = record.url.rsplit(":", 1)[-1]
        try:
            if not on_node(record.node_id, _stop_engine, record.engine_pid, port, grace_s):
                problems.append(f"{record.node_ip}: engine pid {record.engine_pid} of {record.serve_id} is still alive")
        except Exception as exc:  # noqa: BLE001 - a dead node took its engines with it
            log.info("checking engine %s on %s: %s", record.engine_pid, record.node_ip, exc)
    withdraw_all(app)
    return problems


class RayClusterLauncher(Launcher):
    """runner.type: ray: deploys onto an existing Ray cluster, starting and stopping no node of it."""

    name = "ray"
    probes_local_gpus = False  # the cluster's nodes have the GPUs
    router_host_moved_because = (
        "on a Ray cluster the router runs on the cluster's head node, and loopback there is not reachable from here"
    )

    def engine_hosts(self, plan) -> list[str]:
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

    def endpoint_host(self, plan) -> str:
        return plan.ray_cluster.head.ip  # the router runs on the cluster's head node

    def describe(self, plan) -> list:
        facts = plan.ray_cluster
        return [
            f"Ray cluster at {facts.address} (runner.type: ray; nothing is started or stopped but the deployment):",
            *(f"  node {line}" for line in describe(facts)),
            f"router: on the head node {facts.head.ip}",
            "replicas would go (first fit on what the nodes have free):",
            *(f"  {line}" for line in plan.placement.lines()),
            f"exp_dir: {plan.exp_dir}",
        ]

    def rank_hosts(self, plan, engine) -> list[tuple[str, int]]:
        return [("a node of the Ray cluster", engine.devices_per_replica * engine.initial_replicas)]

    def auth_token(self, plan) -> str | None:
        return None  # the cluster has its own token, from the environment

    def check_free(self, plan) -> None:
        facts = plan.ray_cluster
        if plan.app_name in facts.applications:
            raise FlagScaleError(
                f"the Ray cluster at {facts.address} already runs a Serve application '{plan.app_name}' "
                "(another exp_dir's deployment, or one started elsewhere): give this one another experiment.exp_name",
                "experiment.exp_name",
            )

    def start(self, state: RunState, plan, console: Console) -> str:
        facts = plan.ray_cluster
        state.ray_address = facts.address
        state.save()
        return (
            f"using the Ray cluster at {facts.address}: {len(facts.nodes)} node(s), the router on {facts.head.ip} "
            "(nothing started)"
        )

    def connect(self, state: RunState) -> None:
        connect(state.ray_address)  # its address; the token from the environment

    def engine_log_dir(self, plan) -> str:
        return NODE_LOG_DIR  # the exp_dir is not on the cluster's nodes: under each node's Ray session log dir

    def router_resources(self) -> dict[str, float]:
        return {HEAD_RESOURCE: 0.001}

    @contextlib.contextmanager
    def removing_app(self, state: RunState, console: Console) -> Iterator[None]:
        """The cluster keeps running: what is left of this deployment there, its engine servers and its registry
        entries, is removed after its application, nothing else."""
        engines = list_replicas(state.app_name, include_stale=True)  # read before the application goes
        yield
        console.print(f"checking that no engine of '{state.app_name}' is left on the cluster's nodes ...")
        problems = remove_leftovers(state.app_name, engines)
        if problems:
            raise RuntimeError("; ".join(problems))

    def stop(self, state: RunState, console: Console) -> list[str]:
        return []  # no node of the cluster is this run's

    def hosts(self, state: RunState, replicas: list[dict]) -> list[dict] | None:
        return node_rows(replicas)

    @contextlib.contextmanager
    def reading_registry(self, state: RunState) -> Iterator[None]:
        import ray

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
    import ray

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
