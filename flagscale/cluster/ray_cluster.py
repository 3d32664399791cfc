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

import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from flagscale.cluster.runner import CommandRunner, CommandTimeout, Result, Session
from flagscale.errors import ClusterError, ConfigError
from flagscale.net import port_open

log = logging.getLogger(__name__)

RAY_ADDRESS_ENV = "RAY_ADDRESS"
# Ray gives the head node this resource (1.0); a sliver of it pins the router there.
HEAD_RESOURCE = "node:__internal_head__"
ANSWER_TIMEOUT_S = 5.0  # an address nobody answers fails within this
# Under the node's Ray session log dir, so Ray's own log API (ray.util.state.list_logs / get_log) lists them too.
ENGINE_LOG_SUBDIR = "flagscale"
NODE_TASK_TIMEOUT_S = 60.0
UNSCHEDULABLE = ("node:", "memory", "object_store_memory")  # totals that are no one's to ask for


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


@dataclass(frozen=True)
class NodeFacts:
    node_id: str
    ip: str
    is_head: bool
    total: dict[str, float]
    available: dict[str, float]
    labels: dict[str, str] = field(default_factory=dict)

    def offers(self, free: bool = False) -> dict[str, float]:
        """What replicas can ask for here (CPU, GPU, custom resources), in total or free now."""
        resources = self.available if free else self.total
        return {k: v for k, v in resources.items() if not k.startswith(UNSCHEDULABLE)}


@dataclass(frozen=True)
class ClusterFacts:
    """The cluster as one connection found it, before planning: its alive nodes and its Serve applications."""

    address: str
    nodes: list[NodeFacts]
    applications: list[str] = field(default_factory=list)

    @property
    def head(self) -> NodeFacts:
        return next((n for n in self.nodes if n.is_head), self.nodes[0])

    def most(self, resource: str) -> float:
        return max((n.total.get(resource, 0.0) for n in self.nodes), default=0.0)

    def resource_names(self) -> list[str]:
        return sorted({k for n in self.nodes for k in n.offers() if k not in ("CPU", "GPU")})


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

    from flagscale.cluster.ray_compat import check_gcs_auth
    from flagscale.cluster.ray_env import project_root
    from flagscale.cluster.ray_node import RAY_NAMESPACE

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

    from flagscale.cluster.ray_compat import free_resources_per_node

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
    from flagscale.cluster.ray_compat import serve_details

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


def fmt(resources: dict[str, float]) -> str:
    return ", ".join(f"{k}:{v:g}" for k, v in sorted(resources.items()) if v) or "nothing"


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


def fmt_labels(labels: dict[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(labels.items()))


def accelerator_requirement(accelerator: str, facts: ClusterFacts, where: str) -> tuple[str, str]:
    """resources.accelerator on a Ray cluster names what its nodes already have, looked for in this order:
    ("resource", "accelerator_type:<X>"): Ray's resource of GPU nodes of that type;
    ("devices", "<X>"): a custom resource <X>, counted in devices (TP x PP x DP per replica);
    ("label", key): a node label whose value is <X> (e.g. ray.io/accelerator-type=<X>), a label selector."""
    typed = f"accelerator_type:{accelerator}"
    names = facts.resource_names()
    if typed in names:
        return "resource", typed
    if accelerator in names:
        return "devices", accelerator
    keys = sorted({k for n in facts.nodes for k, v in n.labels.items() if v == accelerator})
    if keys:
        return "label", keys[0]
    types = [n.removeprefix("accelerator_type:") for n in names if n.startswith("accelerator_type:")]
    custom = [n for n in names if not n.startswith("accelerator_type:")]
    labels = sorted({f"{k}={v}" for n in facts.nodes for k, v in n.labels.items() if not k.startswith("ray.io/node")})
    raise ConfigError(
        f"resources.accelerator={accelerator!r}, but no node of the Ray cluster at {facts.address} has it (accelerator "
        f"types: {', '.join(types) or 'none'}; custom resources: {', '.join(custom) or 'none'}; labels: "
        f"{', '.join(labels) or 'none'})",
        where,
    )


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


def engine_log_dir(app: str) -> str:
    """Where this node's engine replicas of `app` write their logs: under the node's Ray session log dir."""
    from flagscale.cluster.ray_compat import node_logs_dir

    return os.path.join(node_logs_dir(), ENGINE_LOG_SUBDIR, app)


def _list_engine_logs(app: str) -> list[tuple[str, float]]:
    directory = Path(engine_log_dir(app))
    found = []
    for path in directory.glob("engine-*.log"):
        try:
            found.append((str(path), path.stat().st_mtime))
        except OSError:
            continue
    return found


def node_engine_logs(app: str) -> list[tuple[NodeFacts | None, str, float]]:
    """Every alive node's engine logs of `app`: (node, path, mtime)."""
    import ray

    found = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        node = NodeFacts(n["NodeID"], n["NodeManagerAddress"], HEAD_RESOURCE in n.get("Resources", {}), {}, {})
        try:
            found += [(node, path, mtime) for path, mtime in on_node(node.node_id, _list_engine_logs, app)]
        except Exception as exc:  # noqa: BLE001 - one node failing leaves the others' logs
            log.info("listing engine logs on %s failed: %s", node.ip, exc)
    return found


# ---- removing exactly one deployment ---------------------------------------------------------------------------


def _is_engine_of(pid: int, port: str) -> bool:
    """The engine_proc wrapper whose vLLM server listens on `port` (the registry record's URL): PID reuse guard."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    words = [a.decode(errors="replace") for a in argv]
    return "flagscale.serve.engine_proc" in words and "--port" in words and port in words


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
    from flagscale.serve.registry import withdraw_all

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
