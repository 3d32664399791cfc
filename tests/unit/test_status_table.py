"""`status`'s table at 80 columns: what an operator scans first, every cell whole; `output=wide` has the rest."""

from __future__ import annotations

import io

from rich.console import Console

from flagscale.actions.status_report import (
    DeploymentStatus,
    ReplicaRow,
    RouterProcess,
    RouterTotals,
    StatusReport,
)
from flagscale.actions.status_table import render as render_report


def replica(serve_id, replica_id, engine_kind="vllm", role="colocated", **extra):
    fields = {
        "serve_id": serve_id,
        "replica_id": replica_id,
        "engine_kind": engine_kind,
        "role": role,
        "host": "10.77.0.12",
        "node_id": "a" * 12,
        "pid": 41234,
        "engine_pid": 41240,
        "url": "http://10.77.0.12:45123",
        "heartbeat_age_s": 1.5,
        "state": "READY",
        "worker_cpus": [],
        "gpus": [],
        "ranks": [],
        "log": "/tmp/x.log",
        "engine": {"running": 3.0, "waiting": 1.0, "kv_cache_usage": 0.25},
        "requests_served": 120,
        "router": {"inflight": 4, "circuit": "closed", "migrations": 0, "prefix_blocks": 17},
    }
    return ReplicaRow(**{**fields, **extra})


REPORT = StatusReport(
    app="qwen-serve",
    endpoint="http://127.0.0.1:8000",
    models=["qwen2.5-7b-instruct", "tiny-gguf"],
    status="RUNNING",
    http_health="ok",
    healthy=True,
    deployments={
        "qwen2.5-7b-instruct": DeploymentStatus("HEALTHY", {"RUNNING": 2}, ""),
        "tiny-gguf": DeploymentStatus("UPDATING", {"RUNNING": 1, "STARTING": 1}, "x" * 300),
        "router": DeploymentStatus("HEALTHY", {"RUNNING": 1}, ""),
    },
    replicas=[
        replica(
            "qwen2.5-7b-instruct",
            "k3j4h5g6",
            worker_cpus=[0, 1],
            ranks=[
                {"rank": 0, "pid": 41250, "host": "10.77.0.12", "cpus": [0], "gpus": []},
                {"rank": 1, "pid": 51250, "host": "10.77.0.13", "cpus": [1], "gpus": []},
            ],
        ),
        replica("qwen2.5-7b-instruct", "p0q9r8s7", role="decode", gpus=["0", "1"]),
        replica("tiny-gguf", "z1y2x3w4", engine_kind="llama_cpp", engine={"running": 0.0, "waiting": 0.0}),
    ],
    router=RouterTotals(
        inflight=4,
        moved=0,
        resumed=0,
        processes={
            "router-a1b2c3d4": RouterProcess(pid=7001, inflight=3, served=90, moved=0, draining=False),
            "router-e5f6g7h8": RouterProcess(pid=7002, inflight=1, served=30, moved=0, draining=False),
        },
    ),
)


def render(wide: bool, width: int) -> str:
    out = io.StringIO()
    render_report(Console(file=out, width=width, highlight=False, color_system=None), REPORT, wide=wide)
    return out.getvalue()


def test_default_table_fits_80_columns_with_every_cell_whole():
    text = render(wide=False, width=80)
    assert max(len(line) for line in text.splitlines()) <= 80, text
    assert "…" not in text, text
    cells = ("k3j4h5g6", "llama_cpp", "10.77.0.12 +1", "cpu 0|1", "gpu 0,1", "3+1 25%", "(decode)")
    for cell in (*cells, "router-e5f6g7h8", "7002", "2 process(es)"):
        assert cell in text, (cell, text)
    assert "http://10.77.0.12:45123" not in text  # the URL, pids, router columns: output=wide
    assert "tiny-gguf: " + "x" * 20 in text.replace("\n", "")  # an unhealthy deployment's message, wrapped below


def test_wide_table_has_the_rest_and_each_rank():
    text = render(wide=True, width=260)
    for cell in ("http://10.77.0.12:45123", "41240", "17 prefix_blocks", "engine ranks", "51250", "10.77.0.13"):
        assert cell in text, (cell, text)


def test_a_sleeping_replica_shows_asleep_in_the_state_column():
    report = StatusReport(
        **{**vars(REPORT), "replicas": [replica("m", "s1e2e3p4", asleep=True), replica("m", "a1w2k3e4")]}
    )
    out = io.StringIO()
    render_report(Console(file=out, width=80, highlight=False, color_system=None), report, wide=False)
    rows = {line.split()[1]: line for line in out.getvalue().splitlines() if line.startswith("m ")}
    assert "ASLEEP" in rows["s1e2e3p4"] and "READY" not in rows["s1e2e3p4"]
    assert "READY" in rows["a1w2k3e4"]


def test_wide_table_says_which_cache_knowledge_each_replica_is_routed_on():
    from flagscale.actions.status_table import _kv_events

    live = {"blocks": 40, "events_per_s": 2.5, "last_seq": 17, "replays": 1, "live": True, "state": "live"}
    events = "tcp://10.77.0.12:31001"
    assert _kv_events(replica("m", "a")) == "approximate"  # llama.cpp, kv_events: false
    assert _kv_events(replica("m", "a", kv_events=events)) == "10.77.0.12:31001"  # published, not followed yet
    cell = _kv_events(replica("m", "a", kv_events=events, router={"kv_index": live}))
    assert cell == "live 40 blocks 2.5/s seq 17 replays 1"
    silent = {**live, "live": False, "state": "silent"}
    assert "silent" in _kv_events(replica("m", "a", kv_events=events, router={"kv_index": silent}))
    # a replica of two data-parallel engines: a stream per rank, their blocks summed, each rank's sequence
    ranks = "tcp://10.77.0.12:31001 tcp://10.77.0.12:31002"
    assert _kv_events(replica("m", "a", kv_events=ranks)) == "10.77.0.12:31001 10.77.0.12:31002"
    both = {**live, "last_seq": [17, 9]}
    cell = _kv_events(replica("m", "a", kv_events=ranks, router={"kv_index": both}))
    assert cell == "live 40 blocks over 2 DP ranks 2.5/s seq 17/9 replays 1"


def test_decode_only_requests_are_said_and_an_unknown_heartbeat_age_is_a_dash():
    import dataclasses

    report = dataclasses.replace(REPORT, router=dataclasses.replace(REPORT.router, decode_only=7))
    report.replicas = [dataclasses.replace(REPORT.replicas[0], heartbeat_age_s=None)]
    out = io.StringIO()
    render_report(Console(file=out, width=260, highlight=False, color_system=None), report, wide=True)
    text = out.getvalue()
    assert "router: 7 disaggregated requests decoded without prefill (decode-only" in text, text
    assert "None" not in text and "Nones ago" not in text
    assert "decoded without prefill" not in render(wide=False, width=80)  # said only when it happened


def test_status_lists_each_dp_ranks_kv_event_endpoint():
    from flagscale.actions.status import _kv_endpoints

    ranks = [{"endpoint": "tcp://h:31001", "replay_endpoint": "tcp://h:31011"}, {"endpoint": "tcp://h:31002"}]
    assert _kv_endpoints({"endpoint": "tcp://h:31001", "ranks": ranks}) == "tcp://h:31001 tcp://h:31002"
    assert _kv_endpoints({"endpoint": "tcp://h:31001", "ranks": ranks[:1]}) == "tcp://h:31001"
    assert _kv_endpoints({}) == ""


def test_a_deployment_scaling_up_or_down_still_counts_as_serving_for_the_exit_code():
    from flagscale.actions.status import serving

    def report(*states: str, app: str = "RUNNING", health: str = "ok") -> StatusReport:
        deployments = {f"d{i}": DeploymentStatus(status=s, replicas={"RUNNING": 1}) for i, s in enumerate(states)}
        return StatusReport(app="a", endpoint="http://x", models=[], status=app, http_health=health,
                            deployments=deployments)  # fmt: skip

    assert serving(report("HEALTHY", "DOWNSCALING")) and serving(report("UPSCALING"))
    assert not serving(report("HEALTHY", "UNHEALTHY")) and not serving(report("UPDATING"))
    assert not serving(report("DEPLOY_FAILED")) and not serving(report("HEALTHY", app="DEPLOYING"))
    assert not serving(report("HEALTHY", health="connection refused"))
