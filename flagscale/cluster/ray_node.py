"""Ray node lifecycle: start a Ray node (head, worker or driver) as a recorded session on a host, through that
host's CommandRunner (cluster/runner.py: this machine or SSH), wait for it, connect a driver, stop exactly that
session. No hostfile is a one-host cluster on the local runner (launchers/local.py); launchers/ssh.py starts
every host through the same start_node.

Token auth stays on: `run` writes a token file under exp_dir (mode 0600); every Ray process we start
and every driver we connect gets RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH pointing at it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from flagscale.adaptors import ray
from flagscale.cluster import ssh
from flagscale.cluster.driver_signals import keeping_signal_handlers
from flagscale.cluster.ray_compat import RAY_CLI_MODULE, node_ip_init_kwargs, reload_ray_config
from flagscale.cluster.ray_compat import connect_kv as connect_gcs
from flagscale.cluster.runner import CommandRunner, CommandTimeout, LocalRunner, parallel, runner_for
from flagscale.cluster.state import HostRecord, RunState
from flagscale.cluster.tempdirs import user_tmp_root
from flagscale.errors import ClusterError
from flagscale.net import free_port, port_open, wait_for_port
from flagscale.secrets import mask_argv

log = logging.getLogger(__name__)
RAY_NAMESPACE = "flagscale"
_state_lock = threading.Lock()  # hosts start in parallel; each records its session in the one state file


def write_token(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def auth_env(token_path: str | None) -> dict[str, str]:
    if not token_path:
        return {}
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path)}


# Ray's longest socket path under its temp dir: "/session_<date>_<time>_<usec>_<pid>/sockets/plasma_store"
RAY_SOCKET_TAIL = 64
SUN_PATH_MAX = 107


def ray_temp_dir(exp_dir: str, tmp: str = "/tmp") -> str:
    """Ray's unix sockets live under the temp dir, whose path must stay short (sun_path is 108 bytes): exp_dir/ray,
    else a directory of this user's own under /tmp/flagscale-<uid> (or, when another user took that name, under the
    user's cache: tempdirs.user_tmp_root), checked by prepare_ray_temp_dir."""
    candidate = os.path.join(exp_dir, "ray")
    if len(candidate) <= 30:  # + "/session_<date>_<pid>/sockets/plasma_store" stays under 107
        return candidate
    temp_dir = f"{user_tmp_root(tmp)}/{hashlib.sha256(exp_dir.encode()).hexdigest()[:10]}"
    if len(temp_dir) + RAY_SOCKET_TAIL > SUN_PATH_MAX:
        raise ClusterError(
            f"{tmp}/flagscale-{os.getuid()} belongs to someone else, and the private directory used instead "
            f"({temp_dir}) is too long for Ray's socket paths: set FLAGSCALE_CACHE to a short directory of yours, "
            f"or use an exp_dir of at most 26 characters (Ray's dir is then <exp_dir>/ray)"
        )
    return temp_dir


def prepare_ray_temp_dir(exp_dir: str) -> str:
    """ray_temp_dir, created private to this user; one under /tmp that someone else made first is refused."""
    temp_dir = ray_temp_dir(exp_dir)
    if not temp_dir.startswith(exp_dir + os.sep):
        LocalRunner().make_dir(temp_dir)
    return temp_dir


def ray_cli() -> list[str]:
    """The `ray` command as this interpreter runs it, wherever (or whether) the console script was installed.
    Remote hosts run the same interpreter path: the hosts of a run share one install. `-P` (3.11+) keeps the
    current directory off sys.path, as it is for the console script."""
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *safe_path, "-m", RAY_CLI_MODULE]


def with_before_start(argv: list[str], before_start: str | None) -> list[str]:
    """Run the user's `cmds.before_start` snippet in the same shell that then execs argv (FlagScale semantics),
    under umask 077: what the node writes (Ray's logs, the engines' logs, their files) is the user's alone, on every
    host. argv crosses as positional parameters, never spliced into the snippet."""
    snippet = f"{PRIVATE_UMASK}\nset -e\n{before_start}\n" if before_start else f"{PRIVATE_UMASK}\n"
    return ["bash", "-c", snippet + 'exec "$@"', "flagscale-before-start", *argv]


PRIVATE_UMASK = "umask 077"


# Ray's workers listen on ports of a range (Ray's default: 10002-19999, where users often put a service). Every node a
# run starts takes this one instead, less the deployment's own port when that falls inside it: a worker that
# took the port between the run's check and the router's bind would make the router fail.
WORKER_PORTS = (20000, 29999)


def worker_ports(serve_port: int | None) -> tuple[int, int]:
    """The node's worker port range: WORKER_PORTS, cut at `serve_port` (keeping the larger side) when inside."""
    low, high = WORKER_PORTS
    if serve_port is None or not low <= serve_port <= high:
        return low, high
    return (low, serve_port - 1) if serve_port - low >= high - serve_port else (serve_port + 1, high)


ROLES = ("head", "worker", "driver")


@dataclass(frozen=True)
class RayNode:
    """One Ray node to start, as `ray start` is told (ray_start_argv). `role`: head, worker, or driver (the CPU-less
    node on this machine a multi-host run drives from). `this_machine`: the node runs beside the runner (the head of a
    run without a hostfile, or the driver node): Ray's fixed default listener ports become free ones, and a head
    drops what a one-machine serving cluster does not use. Every node's workers take ports of WORKER_PORTS, never
    `serve_port` (the deployment's port, where the node's host serves it)."""

    role: str
    port: int  # the head's GCS port
    temp_dir: str
    head_ip: str | None = None  # worker, driver: the head's IP (the node joins head_ip:port)
    node_ip: str | None = None  # None: Ray picks this node's IP
    num_cpus: int | None = None  # None: Ray counts them
    num_gpus: int | None = None  # None: Ray counts them
    resources: dict[str, float] | None = None  # custom resources; None: no --resources
    this_machine: bool = False
    serve_port: int | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.role != "head" and not self.head_ip:
            raise ValueError(f"a {self.role} node joins a head: head_ip is needed")


def ray_start_argv(node: RayNode) -> list[str]:
    """The one `ray start` argv, for every node of every run."""
    head = node.role == "head"
    argv = [*ray_cli(), "start"]
    if head:
        argv += ["--head", "--port", str(node.port), "--include-dashboard", "false"]
    else:
        argv += ["--address", f"{node.head_ip}:{node.port}"]
    if node.node_ip is not None:
        argv += ["--node-ip-address", node.node_ip]
    argv += ["--temp-dir", node.temp_dir, "--disable-usage-stats"]
    argv += ["--node-manager-port", "0", "--object-manager-port", "0"]
    if node.num_cpus is not None:
        argv += ["--num-cpus", str(node.num_cpus)]
    if node.num_gpus is not None:
        argv += ["--num-gpus", str(node.num_gpus)]
    if node.resources is not None:
        argv += ["--resources", json.dumps(node.resources)]
    low, high = worker_ports(node.serve_port)
    argv += ["--min-worker-port", str(low), "--max-worker-port", str(high)]
    if not node.this_machine:
        return argv
    if head:
        argv += ["--ray-client-server-port", str(free_port()), "--dashboard-port", str(free_port())]
        # What a static serving cluster does not use (~160 MB RSS less on the head): the autoscaler monitor, and
        # the log monitor (drivers don't stream worker logs; they stay in the session dir).
        argv += ["--no-monitor", "--include-log-monitor", "false"]
    return [*argv, "--dashboard-agent-listen-port", str(free_port())]


def start_node(
    state: RunState,
    runner: CommandRunner,
    node: RayNode,
    env: dict[str, str],
    log_path: str,
    timeout_s: float,
    before_start: str | None = None,
    what: str = "`ray start`",
    **record: object,
) -> HostRecord:
    """Start one Ray node on the runner's host as a new session, after the user's `before_start` in the same shell;
    record the session in `state` (saved) before waiting for `ray start` to exit, so a failure from here on is torn
    down by session id. `record`: further HostRecord fields."""
    argv = with_before_start(ray_start_argv(node), before_start)
    log.info("%s: %s", runner.host, " ".join(mask_argv(argv)))  # before_start may set a token
    session = runner.start_session(argv, env, log_path, timeout_s)
    host = HostRecord(
        host=runner.host,
        role=node.role,
        session=session.id,
        leader_start_ticks=session.start_ticks,
        remote=runner.remote,
        temp_dir=node.temp_dir,
        node_ip=node.node_ip,
        **record,
    )
    with _state_lock:
        state.hosts.append(host)
        state.save()
    try:
        result = session.wait()
    except CommandTimeout as exc:
        raise ClusterError(f"{what} {exc.message}", runner.host) from None
    if result.code != 0:
        tail = "\n    ".join(result.stdout.splitlines())
        raise ClusterError(f"{what} exited with {result.code}:\n    {tail}", runner.host)
    return host


# Run on the head's host: bind port 0 on every interface, as the GCS will bind, and print the port the OS gave.
_PRINT_FREE_PORT = "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"


def head_port(runner: CommandRunner, ray_port: int | None) -> int:
    """The GCS port of the run's head: runner.ray_port when set, else a port free on the head's host when the
    run starts (free when asked, not reserved)."""
    if ray_port is not None:
        return ray_port
    if not runner.remote:
        return free_port()
    result = runner.run([sys.executable, "-c", _PRINT_FREE_PORT], timeout_s=30)
    words = result.stdout.split()
    if result.code != 0 or not words or not words[-1].isdigit():
        output = f"{result.stdout.strip()} {result.stderr.strip()}".strip()
        raise ClusterError(
            f"could not find a free port for the Ray head (exit {result.code}: {output or 'no output'}); "
            "set experiment.runner.ray_port",
            runner.host,
        )
    return int(words[-1])


def start_local_head(
    state: RunState,
    num_cpus: int,
    num_gpus: int | None,
    envs: dict[str, str],
    before_start: str | None,
    log_path: Path,
    timeout_s: float = 90,
    port: int | None = None,
    serve_port: int | None = None,
) -> HostRecord:
    """No hostfile: a one-host cluster, the head on this machine through the local runner.
    `port`: the GCS port (runner.ray_port); None: a free one (head_port). `serve_port`: the deployment's port."""
    runner = LocalRunner()
    port = head_port(runner, port)
    temp_dir = prepare_ray_temp_dir(state.exp_dir)
    state.ray_address = f"127.0.0.1:{port}"
    node = RayNode(
        "head", port, temp_dir, num_cpus=num_cpus, num_gpus=num_gpus, this_machine=True, serve_port=serve_port
    )
    record = start_node(
        state,
        runner,
        node,
        {**envs, **auth_env(state.token_path)},
        str(log_path),
        timeout_s,
        before_start,
        "`ray start --head`",
    )
    _wait_for_port("127.0.0.1", port, timeout_s=30, what="Ray GCS")
    return record


def _wait_for_port(host: str, port: int, timeout_s: float, what: str) -> None:
    if not wait_for_port(host, port, timeout_s):
        raise ClusterError(f"{what} at {host}:{port} did not accept connections within {timeout_s:.0f}s", host)


def _use_token(state: RunState) -> None:
    """This process authenticates to the run's cluster with the run's token."""
    env = auth_env(state.token_path)
    if env and os.environ.get("RAY_AUTH_TOKEN_PATH") != env["RAY_AUTH_TOKEN_PATH"]:
        os.environ.update(env)
        reload_ray_config()  # Ray reads RAY_AUTH_MODE into its config when imported


def connect_kv(state: RunState) -> None:
    """Read the run's GCS key-value store (the replica registry) without becoming a Ray driver: no core worker,
    no driver to tear down when the process exits. (A cluster the run did not start: connect() instead.)"""
    _use_token(state)
    try:
        connect_gcs(state.ray_address)
    except Exception as exc:  # noqa: BLE001 - AuthenticationError, RpcError, ...
        raise ClusterError(f"cannot reach Ray's GCS at {state.ray_address}: {exc}", state.ray_address) from None


def connect(state: RunState) -> None:
    """Connect this process as a Ray driver to the cluster the run started (token auth from the state). Any run's
    cluster: flagscale.launchers.connect."""
    if ray.is_initialized():
        return
    _use_token(state)
    # Multi-host: attach to the run's Ray node on this machine, whose IP is on the route to the head.
    node_ip = node_ip_init_kwargs(state.extra.get("driver_ip"))
    try:
        with keeping_signal_handlers():  # a run's SIGTERM stays the run's (cluster/driver_signals.py)
            ray.init(
                address=state.ray_address,
                namespace=RAY_NAMESPACE,
                log_to_driver=False,
                logging_level=logging.ERROR,
                configure_logging=True,
                **node_ip,
            )
    except Exception as exc:  # ray raises ConnectionError / RuntimeError / AuthenticationError
        raise ClusterError(f"cannot connect to Ray at {state.ray_address}: {exc}", state.ray_address) from None
    logging.getLogger("ray.serve").setLevel(logging.WARNING)


def cluster_alive(state: RunState) -> bool:
    host, _, port = state.ray_address.rpartition(":")
    try:
        return port_open(host, int(port), timeout_s=2)
    except ValueError:  # no address recorded yet
        return False


def stop_node(record: HostRecord, settings: ssh.SshSettings) -> str | None:
    """Stop exactly the session `record` names, on its host, through that host's runner (and remove the auth token
    copied there). Returns a line when something of it may be left (host unreachable, processes alive), else None."""
    runner = runner_for(record.host, record.remote, settings)
    try:
        runner.open()
    except ClusterError as exc:
        return f"{record.host}: unreachable, skipped ({exc})"
    try:
        left = runner.stop_session(record.session, record.leader_start_ticks)
        if record.remote and record.temp_dir:
            runner.run(["rm", "-f", f"{record.temp_dir}/auth_token"], timeout_s=30)
        if left:
            return f"{record.host}: processes of session {record.session} are still alive: {left}"
        return None
    except Exception as exc:  # noqa: BLE001 - one host failing must not keep the others running
        return f"{record.host}: stopping failed: {exc}"
    finally:
        runner.close()


def stop_nodes(state: RunState) -> list[str]:
    """Stop every Ray node this run started, on every host, all in parallel. Returns one line per host not cleanly
    stopped."""
    settings = ssh.SshSettings(**state.extra.get("ssh", {}))
    records = [r for r in state.hosts if r.session is not None]
    results = parallel(records, lambda r: stop_node(r, settings))
    return [
        f"{r.host}: stopping failed: {v}" if isinstance(v, BaseException) else v for r, v in zip(records, results) if v
    ]
