"""The exact `ray start` argv (and env, log path, record) each start path hands its host's runner: the one-machine
head (no hostfile), a hostfile's head and workers, and the driver node on this machine. Recorded from the three
builders as they were before they became one (ray_node.ray_start_argv), and kept: a change here changes a flag.

Ray's CLI (click) reads options in any order, so an argv is compared as its `ray start` prefix plus the multiset of
its (option, value) pairs; every option and value must match, none may be added, dropped or repeated."""

from __future__ import annotations

import itertools
from pathlib import Path
from types import SimpleNamespace

import pytest

from flagscale.cluster import ray_node
from flagscale.cluster.hostfile import parse_hostfile
from flagscale.cluster.ray_node import ray_cli, start_local_head
from flagscale.cluster.runner import CommandRunner, Result, Session
from flagscale.cluster.state import RunState
from flagscale.errors import ClusterError
from flagscale.launchers import ssh as ssh_launcher
from flagscale.launchers.ssh import SshClusterStart

EXP_DIR = "/nonexistent/exp"  # short: the one-machine temp dir is EXP_DIR/ray
TOKEN = "/nonexistent/exp/ray_auth_token"
# ssh_launcher.host_temp_dir(EXP_DIR, host), recorded
TEMP = {"node-a": "/tmp/fsr-3260ede3b9/ray", "node-b": "/tmp/fsr-5364ea9ed0/ray"}
AUTH = {"RAY_AUTH_MODE": "token"}
# every node starts in a shell that sets umask 077 (and runs cmds.before_start, when given) before it execs `ray start`
SHELL = ["bash", "-c", 'umask 077\nexec "$@"', "flagscale-before-start"]


def canon(argv: list[str]) -> tuple[list[str], list[tuple[str, str | None]]]:
    """argv as `[*ray_cli(), "start"]` (checked exactly) and its sorted (option, value) pairs."""
    start = argv.index("start") + 1
    prefix, rest, pairs = argv[:start], argv[start:], []
    i = 0
    while i < len(rest):
        assert rest[i].startswith("--"), f"stray word {rest[i]!r} in {argv}"
        value = rest[i + 1] if i + 1 < len(rest) and not rest[i + 1].startswith("--") else None
        pairs.append((rest[i], value))
        i += 1 if value is None else 2
    return prefix, sorted(pairs, key=lambda p: (p[0], p[1] or ""))


def assert_same_argv(actual: list[str], expected: list[str]) -> None:
    """`actual` as SHELL runs `expected` (a `ray start` argv), options in any order."""
    assert actual[:4] == SHELL, actual[:4]
    actual = actual[4:]
    assert canon(actual) == canon(expected)
    assert len(actual) == len(expected)


class FakeRunner(CommandRunner):
    """Records what a start path asks of a host; `ray start` 'exits 0' at once."""

    def __init__(self, host: str, remote: bool, calls: list, address: str | None = None):
        self.host, self.remote, self.calls, self.address = host, remote, calls, address or host

    listings: dict[str, str] = {}  # vendor CLI -> what it prints; any other is not installed on the host

    def run(self, argv, env=None, timeout_s=None) -> Result:
        if argv[0] in ("nvidia-smi", "npu-smi", "rocm-smi", "mx-smi"):  # a family's device listing (ssh.py)
            out = self.listings.get(argv[0])
            return Result(0, out, "") if out is not None else Result(127, "", f"{argv[0]}: command not found")
        raise AssertionError(f"unexpected run {argv}")

    def start_session(self, argv, env, log_path, timeout_s) -> Session:
        self.calls.append((self.host, argv, env, log_path))
        return Session(1000 + len(self.calls), 77, lambda: Result(0, "", ""))

    def put_file(self, local, remote, mode=0o600) -> None:
        self.calls.append((self.host, "put_file", str(local), remote))

    def make_dir(self, path, mode=0o700) -> None:
        self.calls.append((self.host, "make_dir", path))

    def stop_session(self, session, leader_start_ticks):
        raise AssertionError("unexpected stop")


@pytest.fixture
def calls(monkeypatch):
    """Fixed free ports (in the order asked), no state file written, no GCS waited for, no real LocalRunner."""
    ports = itertools.count(41001)
    for module in (ray_node, ssh_launcher):
        monkeypatch.setattr(module, "free_port", lambda: next(ports), raising=False)
    monkeypatch.setattr(RunState, "save", lambda self: None)
    monkeypatch.setattr(ray_node, "wait_for_port", lambda *a, **k: True)
    recorded: list = []
    for module in (ray_node, ssh_launcher):
        monkeypatch.setattr(module, "LocalRunner", lambda host="localhost": FakeRunner(host, False, recorded))
    monkeypatch.setattr(ssh_launcher, "local_ip_towards", lambda ip: "10.0.0.9")
    monkeypatch.setattr(SshClusterStart, "_wait_joined", lambda self: None)
    return recorded


def new_state() -> RunState:
    return RunState(app_name="a", exp_dir=EXP_DIR, endpoint="http://x", ray_address="", token_path=TOKEN)


def records(state: RunState) -> list[tuple]:
    return [(r.host, r.role, r.session, r.leader_start_ticks, r.temp_dir, r.remote, r.chip, r.slots, r.node_ip)
            for r in state.hosts]  # fmt: skip


@pytest.mark.parametrize("num_gpus", [None, 2])
def test_one_machine_head(calls, num_gpus):
    state = new_state()
    start_local_head(state, 4, num_gpus, {"E": "1"}, None, Path("/logs/ray-head.log"), port=6379)
    expected = [
        *ray_cli(), "start", "--head", "--port", "6379", "--num-cpus", "4", "--temp-dir", "/nonexistent/exp/ray",
        "--include-dashboard", "false", "--disable-usage-stats", "--ray-client-server-port", "41001", "--no-monitor",
        "--include-log-monitor", "false", "--dashboard-port", "41002", "--dashboard-agent-listen-port", "41003",
        "--node-manager-port", "0", "--object-manager-port", "0", "--min-worker-port", "20000",
        "--max-worker-port", "29999",
    ]  # fmt: skip
    if num_gpus is not None:
        expected += ["--num-gpus", "2"]
    [(host, argv, env, log_path)] = calls
    assert_same_argv(argv, expected)
    assert (host, env, log_path) == (
        "localhost",
        {"E": "1", **AUTH, "RAY_AUTH_TOKEN_PATH": TOKEN},
        "/logs/ray-head.log",
    )
    assert state.ray_address == "127.0.0.1:6379"
    assert records(state) == [("localhost", "head", 1001, 77, "/nonexistent/exp/ray", False, None, None, None)]


def test_one_machine_head_runs_before_start_in_the_same_shell(calls):
    start_local_head(new_state(), 1, None, {}, "echo hi", Path("/logs/ray-head.log"), port=6379)
    [(_, argv, _, _)] = calls
    assert argv[:4] == ["bash", "-c", 'umask 077\nset -e\necho hi\nexec "$@"', "flagscale-before-start"]
    assert argv[4 : 4 + len(ray_cli()) + 2] == [*ray_cli(), "start", "--head"]


def launch(
    tmp_path,
    hostfile_text: str,
    num_cpus: int | None,
    before_start: str | None = None,
    port: int = 8000,
    listings: dict[str, str] | None = None,
):
    path = tmp_path / "hostfile"
    path.write_text(hostfile_text)
    cluster = SimpleNamespace(
        hostfile=parse_hostfile(path),
        ssh={},
        num_cpus_per_host=num_cpus,
        join_timeout_s=60,
        host_envs={"node-b": {"B": "2"}},
    )
    plan = SimpleNamespace(cluster=cluster, ray_port=6379, before_start=before_start, log_dir=Path("/logs"), port=port)
    state = new_state()
    launcher = SshClusterStart(state, plan, {"PYTHONPATH": "/p"})
    recorded: list = []
    addresses = {"node-a": "10.0.0.1", "node-b": "10.0.0.2"}
    launcher.runners = {h: FakeRunner(h, True, recorded, addresses[h]) for h in launcher.runners}
    for runner in launcher.runners.values():
        runner.listings = listings or {}
    launcher.start(SimpleNamespace(print=lambda *a, **k: None))
    return state, recorded


NPU_SMI_ONE = """\
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
| 0     910B3               | OK            | 93.6        40                0    / 0             |
| 0                         | 0000:C1:00.0  | 0           0    / 0          3339 / 65536         |
"""


def test_npu_hosts_start_with_npu_resources_and_their_listing_is_recorded(calls, tmp_path):
    state, remote = launch(
        tmp_path, "node-a slots=1 type=ascend\nnode-b slots=1 type=910B\n", 4, listings={"npu-smi": NPU_SMI_ONE}
    )
    starts = {c[0]: c[1] for c in remote if c[1] not in ("make_dir", "put_file")}
    assert '{"NPU": 1.0, "accelerator_type:ascend": 1.0, "flagscale_head": 1.0}' in starts["node-a"]
    assert '{"NPU": 1.0, "accelerator_type:910B": 1.0}' in starts["node-b"]
    assert "--num-gpus" in starts["node-a"] and starts["node-a"][starts["node-a"].index("--num-gpus") + 1] == "0"
    assert state.extra["devices"]["node-b"] == [{"index": 0, "name": "910B3", "memory_mib": 65536}]


def test_a_host_listing_fewer_devices_than_its_slots_fails_before_any_ray_start(calls, tmp_path):
    with pytest.raises(ClusterError) as info:
        launch(
            tmp_path, "node-a slots=1 type=ascend\nnode-b slots=2 type=ascend\n", 4, listings={"npu-smi": NPU_SMI_ONE}
        )
    assert "node-b slots=2 of Ascend NPUs (ascend), but `npu-smi info` there lists 1" in str(info.value)
    assert not [c for c in calls if "ray" in " ".join(map(str, c[1]))]


def test_hostfile_head_workers_and_driver_node(calls, tmp_path):
    state, remote = launch(tmp_path, "node-a slots=2 type=gpu\nnode-b slots=4 type=cpu:chipX\n", num_cpus=8)
    # hosts are prepared in parallel: compared as a set
    prepared = sorted(c for c in remote if c[1] in ("make_dir", "put_file"))
    assert prepared == sorted(
        [
            ("node-a", "make_dir", TEMP["node-a"]),
            ("node-a", "put_file", TOKEN, f"{TEMP['node-a']}/auth_token"),
            ("node-b", "make_dir", TEMP["node-b"]),
            ("node-b", "put_file", TOKEN, f"{TEMP['node-b']}/auth_token"),
        ]
    )
    started = [c for c in remote if c[1] not in ("make_dir", "put_file")]
    assert [c[0] for c in started] == ["node-a", "node-b"]  # the head first
    (_, head_argv, head_env, head_log), (_, worker_argv, worker_env, worker_log) = started
    assert_same_argv(
        head_argv,
        [
            *ray_cli(), "start", "--head", "--port", "6379", "--include-dashboard", "false",
            "--node-ip-address", "10.0.0.1", "--temp-dir", TEMP["node-a"],
            "--resources", '{"accelerator_type:gpu": 1.0, "flagscale_head": 1.0}', "--disable-usage-stats",
            "--node-manager-port", "0", "--object-manager-port", "0", "--min-worker-port", "20000",
            "--max-worker-port", "29999", "--num-cpus", "8", "--num-gpus", "2",
        ],
    )  # fmt: skip
    assert_same_argv(
        worker_argv,
        [
            *ray_cli(), "start", "--address", "10.0.0.1:6379",
            "--node-ip-address", "10.0.0.2", "--temp-dir", TEMP["node-b"],
            "--resources", '{"cpu:chipX": 4.0, "accelerator_type:cpu:chipX": 1.0}', "--disable-usage-stats",
            "--node-manager-port", "0", "--object-manager-port", "0", "--min-worker-port", "20000",
            "--max-worker-port", "29999", "--num-cpus", "8", "--num-gpus", "0",
        ],
    )  # fmt: skip
    assert head_env == {"PYTHONPATH": "/p", **AUTH, "RAY_AUTH_TOKEN_PATH": f"{TEMP['node-a']}/auth_token"}
    assert worker_env == {"PYTHONPATH": "/p", "B": "2", **AUTH, "RAY_AUTH_TOKEN_PATH": f"{TEMP['node-b']}/auth_token"}
    assert (head_log, worker_log) == (f"{TEMP['node-a']}/ray-start.log", f"{TEMP['node-b']}/ray-start.log")

    [(host, driver_argv, driver_env, driver_log)] = calls  # the driver node: on this machine
    assert_same_argv(
        driver_argv,
        [
            *ray_cli(), "start", "--address", "10.0.0.1:6379", "--node-ip-address", "10.0.0.9",
            "--num-cpus", "0", "--num-gpus", "0", "--temp-dir", "/nonexistent/exp/ray", "--disable-usage-stats",
            "--node-manager-port", "0", "--object-manager-port", "0", "--dashboard-agent-listen-port", "41001",
            "--min-worker-port", "20000", "--max-worker-port", "29999",
        ],
    )  # fmt: skip
    assert (host, driver_env, driver_log) == (
        "localhost",
        {"PYTHONPATH": "/p", **AUTH, "RAY_AUTH_TOKEN_PATH": TOKEN},
        "/logs/ray-driver-node.log",
    )
    assert state.ray_address == "10.0.0.1:6379" and state.extra["driver_ip"] == "10.0.0.9"
    assert records(state) == [
        ("node-a", "head", 1005, 77, TEMP["node-a"], True, "gpu", 2, "10.0.0.1"),
        ("node-b", "worker", 1006, 77, TEMP["node-b"], True, "cpu:chipX", 4, "10.0.0.2"),
        ("localhost", "driver", 1001, 77, "/nonexistent/exp/ray", False, None, None, "10.0.0.9"),
    ]


def test_untyped_hostfile_without_num_cpus(calls, tmp_path):
    """No type: slots are GPUs; a worker declares empty custom resources; no --num-cpus (Ray counts them)."""
    _, remote = launch(tmp_path, "node-a slots=1\nnode-b slots=3\n", num_cpus=None, before_start="echo hi")
    started = [c for c in remote if c[1] not in ("make_dir", "put_file")]
    (_, head_argv, _, _), (_, worker_argv, _, _) = started
    wrap = ["bash", "-c", 'umask 077\nset -e\necho hi\nexec "$@"', "flagscale-before-start"]
    assert head_argv[:4] == wrap and worker_argv[:4] == wrap
    assert_same_argv(
        SHELL + head_argv[4:],
        [
            *ray_cli(), "start", "--head", "--port", "6379", "--include-dashboard", "false",
            "--node-ip-address", "10.0.0.1", "--temp-dir", TEMP["node-a"], "--resources", '{"flagscale_head": 1.0}',
            "--disable-usage-stats", "--node-manager-port", "0", "--object-manager-port", "0",
            "--min-worker-port", "20000", "--max-worker-port", "29999", "--num-gpus", "1",
        ],
    )  # fmt: skip
    assert_same_argv(
        SHELL + worker_argv[4:],
        [
            *ray_cli(), "start", "--address", "10.0.0.1:6379",
            "--node-ip-address", "10.0.0.2", "--temp-dir", TEMP["node-b"], "--resources", "{}",
            "--disable-usage-stats", "--node-manager-port", "0", "--object-manager-port", "0",
            "--min-worker-port", "20000", "--max-worker-port", "29999", "--num-gpus", "3",
        ],
    )  # fmt: skip
    [(_, driver_argv, _, _)] = calls  # no before_start on this machine's driver node
    assert driver_argv[: 4 + len(ray_cli()) + 1] == [*SHELL, *ray_cli(), "start"]


def worker_port_flags(argv: list[str]) -> tuple[str, str]:
    return argv[argv.index("--min-worker-port") + 1], argv[argv.index("--max-worker-port") + 1]


@pytest.mark.parametrize(
    ("serve_port", "expected"),
    [(None, ("20000", "29999")), (8000, ("20000", "29999")), (28000, ("20000", "27999")), (21000, ("21001", "29999"))],
)
def test_one_machine_heads_workers_never_take_the_deployments_port(calls, serve_port, expected):
    """A Ray worker that took the serving port between the run's check and the router's bind failed a run."""
    start_local_head(new_state(), 4, None, {}, None, Path("/logs/ray-head.log"), port=6379, serve_port=serve_port)
    [(_, argv, _, _)] = calls
    assert worker_port_flags(argv) == expected


def test_every_hostfile_node_keeps_the_deployments_port_out_of_its_worker_ports(calls, tmp_path):
    _, remote = launch(tmp_path, "node-a slots=1\nnode-b slots=1\n", num_cpus=2, port=25000)
    started = [c[1] for c in remote if c[1] not in ("make_dir", "put_file")] + [c[1] for c in calls]
    assert len(started) == 3 and {worker_port_flags(argv) for argv in started} == {("20000", "24999")}
