"""This process as a driver of an existing Ray cluster (`runner.type: ray`): the address it is given, the
connection (token auth as Ray reads it from the environment, the flagscale package shipped as the job's
`py_modules`), the cluster's nodes as facts read once before planning, and where replicas would fit on them.
Nothing here starts or stops a node (launchers/ray.py is the launcher built on it)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from flagscale.adaptors import ray, ray_exceptions
from flagscale.cluster.driver_signals import keeping_signal_handlers
from flagscale.cluster.ray_compat import check_gcs_auth, free_resources_per_node, serve_details
from flagscale.cluster.ray_env import project_root
from flagscale.cluster.ray_facts import ClusterFacts, NodeFacts, fmt, fmt_labels
from flagscale.cluster.ray_node import RAY_NAMESPACE
from flagscale.errors import ClusterError, ConfigError
from flagscale.net import port_open

RAY_ADDRESS_ENV = "RAY_ADDRESS"
# Ray gives the head node this resource (1.0); a sliver of it pins the router there.
HEAD_RESOURCE = "node:__internal_head__"
ANSWER_TIMEOUT_S = 5.0  # an address nobody answers fails within this


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
    if isinstance(exc, ray_exceptions.AuthenticationError) or "InvalidAuthToken" in str(exc):
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
    if ray.is_initialized():
        return
    check_answers(address)
    try:
        check_gcs_auth(address)  # seconds, where ray.init retries a refused token for ~20 s
        with keeping_signal_handlers():  # a run's SIGTERM stays the run's (cluster/driver_signals.py)
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
