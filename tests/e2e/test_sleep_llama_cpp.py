"""End to end on one host: idle llama.cpp replicas asleep (resources.sleep_delay_s) and woken by their next request.

llama-server unloads its model after `--sleep-idle-seconds` without a task and loads it again for the next request
(its own log says both); the replica publishes the state, status shows it, and the router sends a request to an
awake replica first and counts the wakes it causes. One deployment, two nodes, in order: dryrun says what sleep
means for this engine -> both replicas of the first fall asleep -> one request wakes one replica only and is
answered -> the woken one falls asleep again. The second node also has an SLO (min_replicas 0, max 2): it starts
both replicas at `run` and its planner sizes the replicas awake, so idle, both sleep and are kept, not stopped; a
request wakes one of those same replicas, which the planner then counts awake -> stop.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from tests.conftest import STATUS_WAIT_S, llama_cpp_node, run_cli, status_cli, wait_for, write_config

PORT = 19283
MODEL, PLANNED = "nap", "planned"
SLEEP_DELAY_S = 2
REPLICAS = 2
PLANNED_RESOURCES = {
    "min_replicas": 0,
    "max_replicas": 2,
    "upscale_delay_s": 0,
    "downscale_delay_s": 2,
    "slo": {"ttft_ms": 5000},
    "sleep_delay_s": SLEEP_DELAY_S,
    "num_cpus": 1,
}
KEPT_S = 15  # how long the planner's target has been zero when its replica must still be there
ENTERS = "server is entering sleeping state"  # llama-server's own log lines (tools/server: handle_sleep)
EXITS = "server is exiting sleeping state"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    root = tmp_path_factory.mktemp("sleep-llama")
    node = llama_cpp_node(MODEL, num_replicas=REPLICAS, sleep_delay_s=SLEEP_DELAY_S, num_cpus=1)
    planned = llama_cpp_node(PLANNED)
    planned["resources"] = PLANNED_RESOURCES
    conf = write_config(root / "conf", [node, planned], root / "exp", PORT)
    dryrun = run_cli(conf, "action=dryrun", timeout=300)
    result = run_cli(conf, timeout=600)
    yield {"conf": conf, "exp": root / "exp", "dryrun": dryrun, "run": result}
    if (root / "exp" / "state.json").exists():
        run_cli(conf, "action=stop", timeout=300)


@pytest.fixture(scope="module")
def client(deployment):
    assert deployment["run"].returncode == 0, deployment["run"].output
    return openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="none", timeout=120, max_retries=0)


def status_json(deployment) -> dict:
    result = status_cli(deployment["conf"], "output=json")
    assert result.returncode == 0, result.output
    return json.loads(result.stdout[result.stdout.index("{") :])


def replicas(deployment, serve_id: str = MODEL) -> list[dict]:
    return [r for r in status_json(deployment)["replicas"] if r["serve_id"] == serve_id]


def asleep_count(deployment, count: int):
    """MODEL's replicas, once exactly `count` of the READY ones are asleep (else None)."""
    found = replicas(deployment)
    ready = [r for r in found if r["state"] == "READY"]
    return found if len(ready) == REPLICAS and sum(r["asleep"] for r in ready) == count else None


def engine_log(deployment, replica: dict) -> str:
    shown = run_cli(deployment["conf"], "action=logs", f"replica={replica['replica_id']}", "lines=400", timeout=120)
    assert shown.returncode == 0, shown.output
    return shown.stdout


def wakes() -> float:
    """The wakes of MODEL's replicas the router counted (flagscale_router_replica_wakes_total)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics", timeout=30) as resp:
        lines = resp.read().decode().splitlines()
    counted = [line for line in lines if line.startswith("flagscale_router_replica_wakes_total{")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in counted if f'model="{MODEL}"' in line)


def test_dryrun_says_the_replicas_sleep_and_wake_by_themselves(deployment):
    dryrun = deployment["dryrun"]
    assert dryrun.returncode == 0, dryrun.output
    assert f"serve '{MODEL}': a replica idle for {SLEEP_DELAY_S}s sleeps (llama.cpp sleep mode" in dryrun.stdout
    assert "wakes by itself for the next request" in dryrun.stdout
    assert "idle: sleeps; all max_replicas started at run, the SLO planner sizes the replicas awake" in " ".join(
        dryrun.stdout.split()
    )
    assert f"sleep_idle_seconds={SLEEP_DELAY_S}" in dryrun.stdout  # the engine arg the delay becomes


def test_idle_replicas_fall_asleep_and_the_engine_says_so(deployment, client):
    asleep = wait_for(lambda: asleep_count(deployment, REPLICAS), STATUS_WAIT_S, "both replicas asleep")
    for replica in asleep:
        said = lambda r=replica: ENTERS in engine_log(deployment, r)  # noqa: E731
        wait_for(said, 60, f"llama-server of replica {replica['replica_id']} to say it sleeps")
    wait_for(lambda: status_cli(deployment["conf"]).stdout.count("ASLEEP") >= REPLICAS, 60, "status's table: ASLEEP")


def test_a_request_wakes_one_replica_and_is_answered(deployment, client):
    wait_for(lambda: asleep_count(deployment, REPLICAS), STATUS_WAIT_S, "both replicas asleep")
    before = wakes()
    answer = client.completions.create(model=MODEL, prompt="wake up", max_tokens=4)
    assert answer.choices[0].text and answer.usage.completion_tokens == 4
    assert wakes() == before + 1
    # the engine logs reach the replicas' log files through a relay: read until the wake shows
    found = lambda: [r for r in replicas(deployment) if EXITS in engine_log(deployment, r)] or None  # noqa: E731
    woken = wait_for(found, 60, "a llama-server's log to say it woke")
    assert len(woken) == 1, [r["replica_id"] for r in woken]  # the other was sent nothing
    # idle again, it sleeps again: the engine's second sleep
    wait_for(lambda: engine_log(deployment, woken[0]).count(ENTERS) >= 2, 60, "the woken llama-server asleep again")
    wait_for(lambda: asleep_count(deployment, REPLICAS), STATUS_WAIT_S, "both replicas asleep again")


def planned_idle(deployment, started: list[str], since: dict) -> dict | None:
    """The status once PLANNED's planner has wanted no replica awake for KEPT_S (as this test saw it; `since`
    keeps when) and all its replicas sleep (else None); the replicas must be the ones started at `run` all along
    (kept, not stopped and started again)."""
    report = status_json(deployment)
    record = report["planner"].get(PLANNED, {})
    live = [r for r in report["replicas"] if r["serve_id"] == PLANNED and r["state"] == "READY"]
    assert sorted(r["replica_id"] for r in live) == started, (live, record)
    if record.get("target") != 0 or not all(r["asleep"] for r in live):
        since.clear()
        return None
    since.setdefault("t", time.monotonic())
    return report if time.monotonic() - since["t"] >= KEPT_S else None


def test_a_planned_node_starts_max_replicas_keeps_them_asleep_and_wakes_one(deployment, client):
    most = PLANNED_RESOURCES["max_replicas"]

    def all_ready():
        ready = [r["replica_id"] for r in replicas(deployment, PLANNED) if r["state"] == "READY"]
        return sorted(ready) if len(ready) == most else None

    started = wait_for(all_ready, STATUS_WAIT_S, f"{PLANNED}'s {most} replicas, all started at run")
    since: dict[str, float] = {}
    report = wait_for(lambda: planned_idle(deployment, started, since), STATUS_WAIT_S, f"{PLANNED} idle, asleep, kept")
    record = report["planner"][PLANNED]
    assert record["sleeps"] and record["replicas"] == most and record["asleep"] == most, record
    shown = lambda: f"{most} (0 awake) -> 0 awake" in " ".join(status_cli(deployment["conf"]).stdout.split())  # noqa: E731
    wait_for(shown, 60, f"status's planner table: {most} (0 awake) -> 0 awake")
    answer = client.completions.create(model=PLANNED, prompt="still there?", max_tokens=4)
    assert answer.usage.completion_tokens == 4
    # one kept replica woke for it, the other was sent nothing: no replica was started
    woke = lambda: [r for r in replicas(deployment, PLANNED) if EXITS in engine_log(deployment, r)] or None  # noqa: E731
    assert len(wait_for(woke, 60, f"a llama-server log of {PLANNED} to say it woke")) == 1

    def counted_awake():
        record = status_json(deployment)["planner"][PLANNED]
        return record if record["target"] >= 1 else None

    # an answer takes milliseconds: a window may see it as finished tokens only; either way one is wanted awake
    record = wait_for(counted_awake, 120, f"{PLANNED}'s planner to want a replica awake", interval=0.5)
    assert sorted(r["replica_id"] for r in replicas(deployment, PLANNED)) == started, record


def test_stop_ends_sleeping_replicas(deployment, client):
    result = run_cli(deployment["conf"], "action=stop", timeout=300)
    assert result.returncode == 0, result.output
    assert not Path(deployment["exp"], "state.json").exists()
