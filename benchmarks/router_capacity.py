"""How much streaming one router process carries, and how that scales with deploy.router_processes.

Loads the router until it saturates and reports, per number of router processes: streamed chunks (tokens)
per second through the router, the router processes' CPU microseconds per token and per chunk, and the
cores they used; the upstream's and the clients' CPU too, to show which side saturated.

Two upstreams:

- `--upstream replay` (default; labelled "replay" in every row): NOT an engine. Each upstream process is a small
  aiohttp server that answers /v1/completions with a stream in exactly vLLM's chunk format (token ids when asked,
  the prompt's ids on the first chunk, finish_reason on the last, usage when asked), advancing every running
  stream by one token per `--step-ms` like an engine's batch step. The routers are the project's Router class
  (flagscale/router/: the real request path, resumable streams, keys, metrics), started as plain
  processes sharing one port with SO_REUSEPORT, each reading a fixed replica list instead of Ray's registry.
  This measures the router alone, with nothing else on the machine limiting it but the cores. (Without Ray
  the processes share no reports or routing hints: a cost per request, not per token.) `--router floor` puts
  a bare pass-through relay in its place (serve_floor: asyncio protocols, no framework, no parsing), the floor
  that the kernel and the event loop set for any Python router on the host.
- `--upstream deployment`: real engines. Starts the project (`run.py action=run`) with `--replicas` engine
  replicas (on a GPU: the random-weight Llama of benchmarks/gpu/model.py, `--size`, the replicas sharing the GPU;
  without one: the demo model on CPU), measures each `--processes` count after an in-place update of
  deploy.router_processes, and stops it. The router processes are the ones listening on the endpoint's port.
  `--floor`: each load again straight after, through the floor relay (above) in front of the same engine
  replicas: what the router costs beyond the kernel and the event loop, on the engines' own streams.
- `--upstream endpoint --url URL`: a deployment already running; its router processes likewise (`--floor` with
  `--exp-dir`, the deployment's, to find its engine replicas).

The clients are `--clients` processes of `--concurrency` streams each (aiohttp, counting `data:` events without
parsing them), for `--duration` seconds after a warm-up.

  .venv/bin/python benchmarks/router_capacity.py --processes 1 2 --duration 10         # this machine (2 cores)
  .venv/bin/python benchmarks/router_capacity.py --router floor --processes 1 --loads 1x16 6x64 --upstreams 1
  .venv/bin/python benchmarks/router_capacity.py --processes 1 2 4 --upstreams 4 --clients 6 --concurrency 128
  python3 benchmarks/router_capacity.py --upstream deployment --size 1b --replicas 2 --processes 1 2 4   # a GPU
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import psutil  # noqa: E402

from flagscale.devices.nvidia import MULTICAST_OFF  # noqa: E402

MODEL = "demo"
PROMPT_IDS = list(range(1, 129))  # a 128-token prompt, as the replay upstream reports it
WORDS = [" the", " quick", " brown", " fox", " jumps", " over", " a", " lazy", " dog", "."]
STARTUP_TIMEOUT_S = 60
FLOOR_ROW = {"router": "floor relay (not a router)"}  # the label of a row measured through serve_floor


# ---- the replay upstream (not an engine) ------------------------------------------------------------------


def completion_chunk(rid: str, index: int, tokens: int, prompt_ids: list[int] | None, with_ids: bool) -> bytes:
    """One event as vLLM 0.26-0.32's completions stream writes it (pydantic, exclude_unset: every field set)."""
    last = index == tokens - 1
    choice = {
        "index": 0,
        "text": WORDS[index % len(WORDS)],
        "logprobs": None,
        "finish_reason": "length" if last else None,
        "stop_reason": None,
        "prompt_token_ids": prompt_ids if with_ids else None,
        "token_ids": [1000 + index % 500] if with_ids else None,
    }
    chunk = {"id": rid, "object": "text_completion", "created": 1764000000, "model": MODEL, "choices": [choice]}
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


def usage_chunk(rid: str, tokens: int) -> bytes:
    usage = {"prompt_tokens": len(PROMPT_IDS), "completion_tokens": tokens, "total_tokens": len(PROMPT_IDS) + tokens}
    chunk = {
        "id": rid,
        "object": "text_completion",
        "created": 1764000000,
        "model": MODEL,
        "choices": [],
        "usage": usage,
    }
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


def serve_replay(port: int, step_ms: float) -> None:
    """The replay upstream: every `step_ms`, each running stream gets its next token (one event), like an
    engine's batch step; the events are built once per (request shape, position) and reused."""
    import uvloop
    from aiohttp import web

    streams: list[list[Any]] = []  # [response, events, next index, done future]

    async def step_forever() -> None:
        while True:
            await asyncio.sleep(step_ms / 1000)
            for stream in list(streams):
                response, events, index, done = stream
                try:
                    await response.write(events[index])
                except Exception:  # the router hung up
                    streams.remove(stream)
                    done.set_result(None)
                    continue
                stream[2] += 1
                if stream[2] == len(events):
                    streams.remove(stream)
                    done.set_result(None)

    cache: dict[tuple, list[bytes]] = {}

    async def completions(request: web.Request):
        body = await request.json()
        tokens = int(body.get("max_tokens") or 16)
        with_ids = bool(body.get("return_token_ids"))
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        key = (tokens, with_ids, usage)
        if key not in cache:
            rid = "cmpl-replay"
            events = [completion_chunk(rid, i, tokens, PROMPT_IDS if i == 0 else None, with_ids) for i in range(tokens)]
            cache[key] = events + ([usage_chunk(rid, tokens)] if usage else []) + [b"data: [DONE]\n\n"]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        done = asyncio.get_running_loop().create_future()
        streams.append([response, cache[key], 0, done])
        await done
        await response.write_eof()
        return response

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        app.router.add_get("/health", lambda request: web.Response(text="ok"))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, backlog=4096).start()
        asyncio.get_running_loop().create_task(step_forever())
        await asyncio.Event().wait()

    uvloop.run(main())


def serve_router(port: int, upstream_urls: list[str]) -> None:
    """One router process: the project's Router, its replica list fixed to the replay upstreams (instead of
    Ray's registry), listening on `port` beside the others (SO_REUSEPORT)."""
    from flagscale.config.routing import RoutingSpec
    from flagscale.replica import registry
    from flagscale.router.router import Router
    from flagscale.router.spec import RouterSpec

    records = [
        registry.ReplicaRecord(
            app="capacity",
            serve_id="replay",
            replica_id=f"replay-{i}",
            models=[MODEL],
            url=url,
            node_id="",
            node_ip="127.0.0.1",
            pid=0,
            engine_pid=0,
            log_path="",
            updated_at=time.time(),  # (read at start and then hourly: refresh_s below)
        )
        for i, url in enumerate(upstream_urls)
    ]
    registry.list_replicas = lambda app: records  # the benchmark's stand-in for the GCS
    spec = RouterSpec(
        app="capacity",
        host="127.0.0.1",
        port=port,
        models={MODEL: "replay"},
        pin_cpus=False,
        routing={MODEL: RoutingSpec()},
        refresh_s=3600,
        share_with_peers=False,  # no Ray here: no shared reports or routing hints (per request, not per token)
    )
    Router(spec)
    threading.Event().wait()  # serving on the router's own thread until SIGTERM


def serve_floor(port: int, upstream_urls: list[str]) -> None:
    """The floor any Python router on this host stands on: a pass-through relay on bare asyncio protocols (uvloop)
    that forwards each request to an upstream (round robin, a new connection per request) and writes every byte
    of the answer to the client from the upstream's data_received - no HTTP framework, no task woken per chunk,
    no parsing of events, no retries, keys or metrics. Not a router: it only shows what the kernel and the event
    loop cost per streamed token, against which the project's router is measured."""
    import itertools

    import uvloop

    targets = itertools.cycle([url.removeprefix("http://").split(":") for url in upstream_urls])

    class Upstream(asyncio.Protocol):
        def __init__(self, client: asyncio.Transport) -> None:
            self.client = client

        def connection_made(self, transport) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            self.client.write(data)  # head and chunked body as they come: the client's parser frames them
            if data.endswith(b"0\r\n\r\n"):
                self.transport.close()

    class Client(asyncio.Protocol):
        def connection_made(self, transport) -> None:
            self.transport, self.buffer = transport, b""

        def data_received(self, data: bytes) -> None:
            self.buffer += data
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end].decode("latin1").split("\r\n")
            length = next((int(h.split(":")[1]) for h in head[1:] if h.lower().startswith("content-length:")), 0)
            if len(self.buffer) < end + 4 + length:
                return
            body, self.buffer = self.buffer[end + 4 : end + 4 + length], self.buffer[end + 4 + length :]
            request = f"{head[0]}\r\nHost: upstream\r\nContent-Type: application/json\r\n"
            request += f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            asyncio.get_running_loop().create_task(self.forward(request.encode() + body))

        async def forward(self, request: bytes) -> None:
            host, port = next(targets)
            transport, _ = await asyncio.get_running_loop().create_connection(
                lambda: Upstream(self.transport), host, int(port)
            )
            transport.write(request)

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(
            Client, "127.0.0.1", port, backlog=1024, reuse_port=True
        )
        await server.serve_forever()

    uvloop.run(main())


# ---- the clients ------------------------------------------------------------------------------------------


def run_client(url: str, concurrency: int, seconds: float, warmup: float, tokens: int, api_key: str | None) -> None:
    """`concurrency` streams back to back for warm-up + `seconds`; prints JSON: events, requests, failures in the
    measured window."""
    import aiohttp
    import uvloop

    body = json.dumps(
        {"model": MODEL, "prompt": "x " * 128, "max_tokens": tokens, "stream": True, "ignore_eos": True}
    ).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    counts = {"events": 0, "requests": 0, "failed": 0}

    async def one_stream(session, measuring) -> None:
        events = 0
        async with session.post(url + "/v1/completions", data=body, headers=headers) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}")
            tail = b""
            async for data in resp.content.iter_any():
                data = tail + data
                events += data.count(b"\n\ndata: ") + (data.startswith(b"data: ") and not tail)
                tail = data[-8:]
        if measuring():
            counts["events"] += events
            counts["requests"] += 1

    async def worker(session, start_at, end_at) -> None:
        loop = asyncio.get_running_loop()
        while loop.time() < end_at:
            try:
                await one_stream(session, lambda: loop.time() >= start_at and loop.time() < end_at)
            except Exception:
                if loop.time() >= start_at:
                    counts["failed"] += 1
                await asyncio.sleep(0.05)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        start_at = loop.time() + warmup
        end_at = start_at + seconds
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
            await asyncio.gather(*(worker(session, start_at, end_at) for _ in range(concurrency)))

    uvloop.run(main())
    print(json.dumps(counts))


# ---- the driver -------------------------------------------------------------------------------------------


def free_port() -> int:
    from flagscale.net import free_port as pick

    return pick()


def wait_listening(url: str, path: str = "/health") -> None:
    import urllib.request

    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url + path, timeout=2):
                return
        time.sleep(0.2)
    raise RuntimeError(f"{url}{path} did not answer within {STARTUP_TIMEOUT_S}s")


def cpu_of(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = psutil.Process(pid).cpu_times()
            total += times.user + times.system
    return total


def listening_pids(port: int) -> list[int]:
    """The processes listening on `port` (the router processes of a deployment's endpoint)."""
    pids = set()
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            pids.add(conn.pid)
    return sorted(pids)


class Processes:
    """Processes this benchmark started, each in a session of its own; all stopped at the end (by pid)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, *argv: str, stdout=subprocess.DEVNULL) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, __file__, *argv], stdout=stdout, stdin=subprocess.DEVNULL, start_new_session=True
        )
        self.procs.append(proc)
        return proc

    def stop(self, procs: list[subprocess.Popen] | None = None) -> None:
        for proc in procs if procs is not None else self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs if procs is not None else self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def load(
    args, url: str, procs: Processes, router_pids: list[int], upstream_pids: list[int], shape: tuple[int, int]
) -> dict[str, Any]:
    """One measured pass of `shape` (client processes, streams each): the clients' events and the CPU each side
    used in the measured window."""
    client_count, concurrency = shape
    clients = [
        procs.start(
            "--run-client",
            url,
            str(concurrency),
            str(args.duration),
            str(args.warmup),
            str(args.tokens),
            stdout=subprocess.PIPE,
        )
        for _ in range(client_count)
    ]
    time.sleep(args.warmup)
    client_pids = [c.pid for c in clients]
    before = {side: cpu_of(pids) for side, pids in (("router", router_pids), ("upstream", upstream_pids))}
    before["clients"] = cpu_of(client_pids)
    started = time.monotonic()
    time.sleep(args.duration)
    elapsed = time.monotonic() - started
    used = {side: cpu_of(pids) for side, pids in (("router", router_pids), ("upstream", upstream_pids))}
    used["clients"] = cpu_of(client_pids)
    counts = {"events": 0, "requests": 0, "failed": 0}
    for client in clients:
        out, _ = client.communicate(timeout=args.duration + args.warmup + 120)
        for key, value in json.loads(out.decode().strip().splitlines()[-1]).items():
            counts[key] += value
    cpu = {side: used[side] - before[side] for side in used}
    # events counted by the clients include the usage/[DONE] lines: one per request each at most
    tokens = counts["events"] - counts["requests"]
    return {
        "router_processes": len(router_pids),
        "streams": client_count * concurrency,
        "tokens_per_s": round(tokens / elapsed),
        "requests": counts["requests"],
        "failed": counts["failed"],
        "router_cpu_us_per_token": round(cpu["router"] / max(tokens, 1) * 1e6, 1),
        "router_cores": round(cpu["router"] / elapsed, 2),
        "upstream_cores": round(cpu["upstream"] / elapsed, 2),
        "client_cores": round(cpu["clients"] / elapsed, 2),
    }


def replica_urls(exp_dir: Path) -> list[str]:
    """The engine replicas' own URLs, from the replica registry of the run in `exp_dir` (for the floor relay in
    front of them)."""
    from flagscale.cluster.ray_node import connect_kv
    from flagscale.cluster.state import RunState
    from flagscale.replica import registry

    state = RunState.load(exp_dir)
    if state is None:
        raise SystemExit(f"no run state in {exp_dir}: no deployment of this exp_dir is running")
    connect_kv(state)
    urls = [record.url for record in registry.list_replicas(state.app_name)]
    if not urls:
        raise SystemExit(f"the replica registry of {state.app_name} ({exp_dir}) lists no engine replica")
    return urls


def floor_pass(args, procs: Processes, upstream_urls: list[str], shape: tuple[int, int]) -> dict[str, Any]:
    """One pass of `shape` through one floor relay process (serve_floor) in front of `upstream_urls`."""
    port = free_port()
    floor = procs.start("--serve-floor", str(port), ",".join(upstream_urls))
    try:
        wait_listening(f"http://127.0.0.1:{port}")  # (the floor passes /health on to an upstream)
        return load(args, f"http://127.0.0.1:{port}", procs, [floor.pid], [], shape)
    finally:
        procs.stop([floor])


GPU_ENV = MULTICAST_OFF  # NVIDIA's family declares it (flagscale/devices/nvidia.py)


class Deployment:
    """The project's own deployment of `replicas` engine replicas, through the CLI, on a private exp_dir and port."""

    def __init__(self, args, work_dir: Path, port: int):
        import yaml

        self.yaml, self.port, self.conf = yaml, port, work_dir / "conf"
        self.exp_dir = work_dir / "exp"
        self.env = {**os.environ, **GPU_ENV, "COLUMNS": "160"}
        if args.size is not None:  # a GPU
            sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))
            from model import ensure_model

            share = round(1 / args.replicas, 4)
            engine_args = {"model": str(ensure_model(args.size)), "max_model_len": 2048, "max_num_seqs": 1024}
            engine_args.update(enforce_eager=True, gpu_memory_utilization=round(0.8 * share, 3))
            resources = {"num_replicas": args.replicas, "num_gpus": share}
        else:
            engine_args = {"model": "${demo_model:}", "max_model_len": 512, "enforce_eager": True, "dtype": "float32"}
            engine_args.update(gpu_memory_utilization=0.2, max_num_seqs=16)  # benchmarks/overhead.py's
            resources = {"num_replicas": args.replicas, "num_cpus": 1}
        engine_args["served_model_name"] = MODEL
        self.node = {"serve_id": MODEL, "engine": "vllm", "engine_args": engine_args, "resources": resources}
        self.node["routing"] = "least_load"

    def configure(self, router_processes: int) -> None:
        deploy = {"host": "127.0.0.1", "port": self.port, "startup_timeout_s": 900}
        deploy["router_processes"] = router_processes
        experiment = {
            "exp_name": "router-capacity",
            "exp_dir": str(self.exp_dir),
            "task": {"type": "serve"},
            "runner": {"hostfile": None, "deploy": deploy},
            "envs": dict(GPU_ENV),
        }
        main = {"defaults": ["_self_", {"serve": "nodes"}], "experiment": experiment, "action": "run"}
        main["hydra"] = {"run": {"dir": "${experiment.exp_dir}/hydra"}}
        (self.conf / "serve").mkdir(parents=True, exist_ok=True)
        (self.conf / "serve.yaml").write_text(self.yaml.safe_dump(main, sort_keys=False))
        (self.conf / "serve" / "nodes.yaml").write_text(self.yaml.safe_dump([self.node], sort_keys=False))

    def cli(self, action: str, timeout_s: float) -> None:
        argv = [sys.executable, str(REPO / "run.py"), "--config-path", str(self.conf), "--config-name", "serve"]
        proc = subprocess.run(
            [*argv, f"action={action}"], capture_output=True, text=True, timeout=timeout_s, cwd=REPO, env=self.env
        )
        print(f"  {action}: exit {proc.returncode}", flush=True)
        if proc.returncode != 0:
            raise RuntimeError(f"action={action} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")

    def routers(self, count: int) -> list[int]:
        """The router processes once `count` of them listen on the port (an update scales them)."""
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            pids = listening_pids(self.port)
            if len(pids) == count:
                return pids
            time.sleep(1)
        raise RuntimeError(f"{count} router processes did not come up on port {self.port} within 300s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", choices=["replay", "deployment", "endpoint"], default="replay")
    parser.add_argument("--replicas", type=int, default=2, help="deployment: engine replicas")
    parser.add_argument("--size", default=None, help="deployment on a GPU: the model size (benchmarks/gpu/model.py)")
    parser.add_argument("--url", help="endpoint: the deployment's URL (its router processes listen on its port)")
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4], help="replay: router processes")
    parser.add_argument(
        "--router",
        choices=["project", "floor"],
        default="project",
        help="replay: the project's Router, or the floor relay (serve_floor: what the kernel and event loop cost)",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="deployment, endpoint: after each pass, the same load through the floor relay in front of the same engines",
    )
    parser.add_argument("--exp-dir", type=Path, help="endpoint with --floor: the deployment's exp_dir")
    parser.add_argument("--upstreams", type=int, default=2, help="replay: upstream processes")
    parser.add_argument("--step-ms", type=float, default=10.0, help="replay: time between a stream's tokens")
    parser.add_argument("--clients", type=int, default=2, help="client processes")
    parser.add_argument("--concurrency", type=int, default=64, help="streams per client process")
    parser.add_argument(
        "--loads",
        nargs="+",
        metavar="CLIENTSxSTREAMS",
        help="several loads, each measured per --processes count (e.g. 1x16 6x128); default: --clients x --concurrency",
    )
    parser.add_argument("--tokens", type=int, default=128, help="tokens per stream (max_tokens)")
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per pass")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    try:
        shapes = [
            tuple(int(n) for n in load.split("x")) for load in args.loads or [f"{args.clients}x{args.concurrency}"]
        ]
    except ValueError:
        parser.error(f"--loads takes CLIENTSxSTREAMS, e.g. 1x16; got {args.loads}")
    if args.floor and args.upstream == "replay":
        parser.error("--floor is for real engines (--upstream deployment or endpoint); on the replay: --router floor")
    if args.floor and args.upstream == "endpoint" and not args.exp_dir:
        parser.error(
            "--upstream endpoint --floor needs --exp-dir, the deployment's (its engine replicas are found there)"
        )

    procs = Processes()
    rows = []
    try:
        if args.upstream == "endpoint":
            if not args.url:
                raise SystemExit("--upstream endpoint needs --url")
            port = int(args.url.rsplit(":", 1)[1].split("/")[0])
            routers = listening_pids(port)
            if not routers:
                raise SystemExit(f"no process of this user listens on port {port}")
            engines = replica_urls(args.exp_dir) if args.floor else []
            for shape in shapes:
                row = load(args, args.url, procs, routers, [], shape)
                rows.append({"upstream": "endpoint (real engines)", **row})
                print(json.dumps(rows[-1]), flush=True)
                if args.floor:
                    row = floor_pass(args, procs, engines, shape)
                    rows.append({"upstream": "endpoint (real engines)", **FLOOR_ROW, **row})
                    print(json.dumps(rows[-1]), flush=True)
        elif args.upstream == "deployment":
            import tempfile

            deployment = Deployment(args, Path(tempfile.mkdtemp(prefix="router-capacity-")), free_port())
            url = f"http://127.0.0.1:{deployment.port}"
            try:
                for index, count in enumerate(args.processes):
                    deployment.configure(count)
                    deployment.cli("run", 1500 if index == 0 else 600)  # the first starts it, then updates
                    routers = deployment.routers(count)
                    upstream = f"deployment ({args.replicas} real engine replicas)"
                    for shape in shapes:
                        row = load(args, url, procs, routers, [], shape)
                        rows.append({"upstream": upstream, **row})
                        print(json.dumps(rows[-1]), flush=True)
                        if args.floor:  # the same load through the floor relay, straight after
                            row = floor_pass(args, procs, replica_urls(deployment.exp_dir), shape)
                            rows.append({"upstream": upstream, **FLOOR_ROW, **row})
                            print(json.dumps(rows[-1]), flush=True)
            finally:
                deployment.cli("stop", 600)
        else:
            upstream_ports = [free_port() for _ in range(args.upstreams)]
            upstreams = [procs.start("--serve-replay", str(p), str(args.step_ms)) for p in upstream_ports]
            urls = [f"http://127.0.0.1:{p}" for p in upstream_ports]
            for url in urls:
                wait_listening(url)
            for count in args.processes:
                port = free_port()
                serve = "--serve-floor" if args.router == "floor" else "--serve-router"
                routers = [procs.start(serve, str(port), ",".join(urls)) for _ in range(count)]
                url = f"http://127.0.0.1:{port}"
                wait_listening(url)
                deadline = time.monotonic() + STARTUP_TIMEOUT_S
                while len(listening_pids(port)) < count and time.monotonic() < deadline:
                    time.sleep(0.2)
                for shape in shapes:
                    row = load(args, url, procs, [r.pid for r in routers], [u.pid for u in upstreams], shape)
                    router = FLOOR_ROW if args.router == "floor" else {}
                    rows.append({"upstream": "replay (not an engine)", **router, **row})
                    print(json.dumps(rows[-1]), flush=True)
                procs.stop(routers)
    finally:
        procs.stop()
    output = args.output or REPO / "benchmarks" / "results" / f"router_capacity-{time.strftime('%Y%m%d-%H%M%S')}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"args": vars(args) | {"output": str(output)}, "rows": rows}, indent=1, default=str))
    print(f"wrote {output}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-replay":
        serve_replay(int(sys.argv[2]), float(sys.argv[3]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--serve-router":
        serve_router(int(sys.argv[2]), sys.argv[3].split(","))
    elif len(sys.argv) > 1 and sys.argv[1] == "--serve-floor":
        serve_floor(int(sys.argv[2]), sys.argv[3].split(","))
    elif len(sys.argv) > 1 and sys.argv[1] == "--run-client":
        _, _, url, c, seconds, warmup, tokens = sys.argv
        run_client(url, int(c), float(seconds), float(warmup), int(tokens), os.environ.get("ROUTER_API_KEY"))
    else:
        main()
