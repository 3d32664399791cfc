"""An engine node's replica: a Ray Serve replica that owns one engine server process (vLLM's OpenAI server,
llama.cpp's llama-server, ...: whatever its engine kind launches, flagscale/engines/).

Ray Serve places, counts, health-checks and restarts the replica; the replica starts the engine's own
OpenAI server with the argv the plan validated, waits until it is healthy, and publishes its URL
so the router streams bytes to it directly (see docs/design.md for why this is the data path).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from flagscale import devices, engines
from flagscale.adaptors import ray, serve
from flagscale.cluster.node_logs import engine_log_dir
from flagscale.cluster.tempdirs import UnsafeDirectory
from flagscale.engines.metrics import engine_metrics, engine_metrics_and_buckets
from flagscale.net import free_port, free_ports, health_ok
from flagscale.replica import registry, runtime_adapters
from flagscale.replica.adapters import AdapterSet, poster, running
from flagscale.replica.autoscaling import ENGINE_REQUESTS
from flagscale.replica.cores import RankStartError
from flagscale.replica.cpu_layout import pin_engine
from flagscale.replica.process import (
    NODE_LOG_DIR,
    LogWatch,
    cause_from_log,
    engine_env,
    listens_on,
    start_watched,
    terminate_engine,
)
from flagscale.replica.ranks import ReplicaRanks
from flagscale.replica.sleep import SleepController
from flagscale.replica.slo_signals import replica_stats
from flagscale.replica.startup_lock import gpu_start_lock


@dataclass
class EngineSpec:
    app: str
    serve_id: str
    model_names: list[str]
    argv: list[str]
    bind_host: str  # "127.0.0.1" (one machine); "node-ip" (multi-host): the replica binds its own Ray node's IP
    log_dir: str
    env: dict[str, str]
    startup_timeout_s: float
    pin_cpus: bool = True  # deploy.cpu_affinity == "auto" (see flagscale/replica/cpu_layout.py)
    host_argv: dict[str, list[str]] = field(default_factory=dict)  # node IP -> argv there (experiment.node_args)
    role: str | None = None  # "prefill" / "decode": a pool of a disaggregated node (KV side channel needed)
    drain_timeout_s: float = 30.0  # Serve's graceful shutdown bound for this replica (deploy.drain_timeout_s)
    engine: str = engines.DEFAULT_ENGINE
    api_key: str | None = field(default=None, repr=False)  # engines require it on every path but health
    parallel: tuple[int, int, int] = (1, 1, 1)  # TP, PP, DP: above one rank, flagscale/replica/ranks.py places them
    expert_parallel: bool = False  # the DP x TP ranks share the experts: each rank's record names its EP index
    sleep_delay_s: float | None = None  # resources.sleep_delay_s: idle this long, the engine sleeps (replica/sleep.py)
    kv_events: bool = False  # the server publishes KV-cache events on ports of its own (router/kv_events.py)
    family: str = "cpu"  # the device family it runs on (flagscale/devices): which of Ray's devices it holds

    @property
    def kind(self) -> engines.EngineKind:
        return engines.get(self.engine)

    @property
    def version(self) -> str:
        """What the server runs: the bounds on start and drain change without restarting it."""
        spec = {k: v for k, v in asdict(self).items() if k not in ("startup_timeout_s", "drain_timeout_s")}
        return registry.version_of(spec)

    @property
    def fingerprint(self) -> str:
        """What its answers are made by: the engine, its args (the model, its dtype, ...) and the names it serves;
        not where it logs, its key or its bounds. Streams resume only on a replica of the same (router/failover.py)."""
        return registry.version_of([self.engine, self.argv, self.host_argv, self.model_names])


HEALTH_PROBE_TIMEOUT_S = 10.0  # one /health probe (Serve's own bound on check_health is 30 s: app.py)
HEALTH_GRACE_S = 60.0  # a server that answers no /health probe for this long is taken for hung
DRAIN_MARGIN_S = 12.0  # of deploy.drain_timeout_s, kept for the server's own exit (SIGTERM, then SIGKILL after 10 s)


# what a health probe found (EngineReplica._health)
HEALTHY, NO_ANSWER, NOT_OURS = "healthy", "no answer", "answered by another process"


class EngineStartError(RuntimeError):
    pass


class EngineReplica:
    """One replica = one engine server process (and the processes it starts)."""

    adapters: AdapterSet | None = None  # the LoRA adapters its engine has loaded (reconfigure), for nodes with some
    _configured_adapters: dict[str, str] | None = None  # its config's set (user_config); None: a node without LoRA
    _synced_adapters: dict[str, str] | None = None  # the set it last loaded/unloaded to
    _adapter_sync: threading.Thread | None = None  # a sync check_health began (runtime_adapters.py)

    def __init__(self, spec: EngineSpec):
        self.spec = spec
        self._server = f"{spec.kind.display} server"
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        host = spec.bind_host
        if host != "127.0.0.1":  # "node-ip": known only here, on the node Serve placed this replica on
            host = ray.util.get_node_ip_address()
        log_dir = Path(spec.log_dir)
        if spec.log_dir == NODE_LOG_DIR:
            log_dir = Path(engine_log_dir(spec.app))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"engine-{spec.serve_id}-{self.replica_id}.log"
        self.family = devices.get(spec.family)
        self.gpu_ids = self.family.assigned_ids()  # its family's devices Ray assigned it: GPUs, NPUs, ...
        self.ranks: ReplicaRanks | None = None
        began = time.monotonic()
        self.adapters = AdapterSet()
        self._adapter_lock = threading.Lock()  # reconfigure (Serve) and check_health's sync take turns
        try:
            self._start(spec, host, self.gpu_ids)
        except (TimeoutError, UnsafeDirectory, RankStartError) as exc:  # GPU start-up lock, cores, other hosts
            self._terminate()
            raise EngineStartError(f"{self._server} for '{spec.serve_id}' could not start: {exc}") from None
        except BaseException:
            self._terminate()
            raise
        self.start_s = time.monotonic() - began  # the SLO planner's horizon, the router's hold bound at zero
        self._after_start(spec)

    def _start(self, spec: EngineSpec, host: str, gpu_ids: list[str]) -> None:
        engine_argv = spec.host_argv.get(ray.util.get_node_ip_address(), spec.argv)
        # engines sharing a GPU start in turn, unless this one's KV cache has a size of its own
        measures = spec.kind.measures_device_at_start(engine_argv)
        with gpu_start_lock(gpu_ids if measures else [], spec.startup_timeout_s, self._note):
            port = free_port(host)
            self.url = f"http://{host}:{port}"
            launch = spec.kind.launch(engine_argv, host, port, spec.api_key, spec.role)
            if math.prod(spec.parallel) > 1:
                cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0)
                self.ranks = ReplicaRanks(spec.engine, spec.parallel, host, cpus, spec.expert_parallel, self.family)
                share = self.ranks.start(
                    engine_argv, gpu_ids, lambda: free_port(host), self.log_path, spec.env, self._note
                )
                self._note(f"ranks {list(share.ranks)} here (node rank 0 of {share.nnodes}), cores {share.rank_cpus}")
                launch = spec.kind.bind_ranks(launch, share)
            visible = self.family.visible(gpu_ids)  # as Ray assigned them (Ray sets it in this actor too)
            env = {**engine_env({**launch.env_defaults, **spec.env}), **visible, **launch.env, **launch.secret_env}
            launch = self._with_kv_events(spec, launch, host, env)
            self.proc = start_watched(launch.argv, env, launch.env, self.log_path)
            self._wait_healthy(spec.startup_timeout_s)

    def _with_kv_events(self, spec: EngineSpec, launch: engines.ServerLaunch, host: str, env: dict[str, str]):
        """The launch with the engine publishing its KV-cache events on two ports of this host planned like its
        others (free_ports: reserved host-wide), when the node routes on them; a server of several data-parallel
        engines (all on this host: the plan says so) gets two runs of ports, rank r publishing on each first port
        + r. self.kv_events: what the record tells the router of them ({}: none)."""
        self.kv_events: dict = {}
        if not spec.kv_events:
            return launch
        topic, ranks = f"kv@{self.replica_id}", spec.parallel[2]
        pub, replay = free_ports(host, ranks), free_ports(host, ranks)
        made = spec.kind.kv_events_launch(launch.argv, host, pub, replay, topic, env, ranks)
        if made is None:
            self._note("publishes no KV-cache events (its args rule them out): routed on the approximate table")
            return launch
        extra_argv, self.kv_events = made
        where = f"{self.kv_events['endpoint']} (replays {self.kv_events['replay_endpoint']})"
        self._note(
            f"KV-cache events on {where}" + (f", DP rank r on both ports + r (r < {ranks})" if ranks > 1 else "")
        )
        return dataclasses.replace(launch, argv=[*launch.argv, *extra_argv])

    def _after_start(self, spec: EngineSpec) -> None:
        layout = pin_engine(self.proc.pid) if spec.pin_cpus and spec.kind.capabilities.cpu_worker_binding else None
        rank_cores = self.ranks.cores() if self.ranks else []
        if layout:
            with open(self.log_path, "a") as log:
                log.write(
                    f"flagscale: CPU layout: worker(s) on cores {layout.worker_cpus}, engine core(s) "
                    f"{layout.engine_core_pids} joined them; API server on cores {layout.frontend_cpus}\n"
                )
        self.record = registry.ReplicaRecord(
            app=spec.app,
            serve_id=spec.serve_id,
            replica_id=self.replica_id,
            models=spec.model_names,
            url=self.url,
            node_id=ray.get_runtime_context().get_node_id(),
            node_ip=ray.util.get_node_ip_address(),
            pid=os.getpid(),
            engine_pid=self.proc.pid,
            log_path=str(self.log_path),
            updated_at=time.time(),
            worker_cpus=layout.worker_cpus if layout else rank_cores,
            gpus=self.gpu_ids,
            family=self.family.name,
            role=spec.role or "",
            version=spec.version,
            fingerprint=spec.fingerprint,
            engine=spec.engine,
            ranks=self.ranks.records(self.proc.pid) if self.ranks else [],
            kv_events=self.kv_events,
        )
        registry.publish(self.record)
        self._last_healthy = time.monotonic()
        if spec.sleep_delay_s is not None:
            self.sleeper = SleepController(
                spec.kind, self.url, spec.api_key, spec.sleep_delay_s, self._publish_asleep, self._note
            )
            self.sleeper.start()

    def _publish_asleep(self, asleep: bool) -> None:
        self.record.asleep = asleep
        self.record.sleeps += int(asleep)
        registry.publish(self.record)

    def _note(self, line: str) -> None:
        with open(self.log_path, "a") as log:
            log.write(f"flagscale: {line}\n")

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        said_not_ours = False
        failures = LogWatch(self.log_path, self.spec.kind.start_failure_lines)
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                raise EngineStartError(
                    f"{self._server} for '{self.spec.serve_id}' exited with code {code} during start-up; "
                    f"log {self.log_path}:\n{cause_from_log(self.log_path)}"
                )
            failure = failures.found()
            if failure:
                self._terminate()
                raise EngineStartError(
                    f"{self._server} for '{self.spec.serve_id}' cannot become healthy: its log says {failure!r}; "
                    f"log {self.log_path}:\n{cause_from_log(self.log_path)}"
                )
            if self.ranks:
                try:
                    self.ranks.check()
                except RankStartError as exc:
                    self._terminate()
                    raise EngineStartError(f"{self._server} for '{self.spec.serve_id}': {exc}") from None
            health = self._health(timeout_s=2)
            if health == HEALTHY:
                return
            if health == NOT_OURS and not said_not_ours:  # the engine then fails to bind the port, and exits
                self._note(f"{self.url} answers, but not from the server this replica started; waiting for it")
                said_not_ours = True
            time.sleep(0.5)
        self._terminate()
        raise EngineStartError(
            f"{self._server} for '{self.spec.serve_id}' was not healthy within {timeout_s:.0f}s; "
            f"log {self.log_path}:\n{cause_from_log(self.log_path)}"
        )

    def _health(self, timeout_s: float) -> str:
        """HEALTHY when the server this replica started answers its health path; NO_ANSWER; or NOT_OURS when the
        answer comes from a process that holds the port but is not the started one (nor a child of it): a process
        that took the port first is never taken for the engine, and never sent the key."""
        if not health_ok(self.url, timeout_s=timeout_s, path=self.spec.kind.health_path):
            return NO_ANSWER
        return HEALTHY if listens_on(self.proc.pid, int(self.url.rpartition(":")[2])) else NOT_OURS

    def check_health(self) -> None:
        """Called by Ray Serve periodically; raising marks the replica unhealthy and Serve replaces it.

        A server that exited is unhealthy at once. One that does not answer /health is unhealthy only after
        HEALTH_GRACE_S without an answer: a server saturated by streams (vLLM's, seen on an H100 at 1,024
        streams) answers /health late, and replacing it then fails every request it holds."""
        code = self.proc.poll()
        if code is not None:
            raise RuntimeError(f"{self._server} exited with code {code}; log {self.log_path}")
        if self.ranks:
            self.ranks.check()  # a rank on another host that died fails the replica as a whole
        now = time.monotonic()
        health = self._health(timeout_s=HEALTH_PROBE_TIMEOUT_S)
        if health == NOT_OURS:
            raise RuntimeError(f"{self.url} is answered by a process this replica did not start; replacing it")
        if health == HEALTHY:
            self._last_healthy = now
        elif now - self._last_healthy > HEALTH_GRACE_S:
            raise RuntimeError(
                f"{self._server} at {self.url} has not answered /health for {now - self._last_healthy:.0f}s"
            )
        else:
            self._note(f"/health did not answer within {HEALTH_PROBE_TIMEOUT_S:g}s (busy?); not replaced yet")
        if self._configured_adapters is not None:  # a node with LoRA: its set may have been changed at run time
            self._sync_adapters_aside()
        if (
            self.adapters is not None and self.adapters.loaded
        ):  # what the router places adapters by, besides its own record (docs/routing.md)
            self.record.adapters_running = running(self.spec.kind, self.url, self.spec.api_key) or []
        registry.publish(self.record)

    def reconfigure(self, config: dict) -> None:
        """Serve's user_config of a node with LoRA adapters ({"adapters": {name: directory}}), at start before the
        replica is READY and on every update that changes it: the engine loads and unloads adapters in place
        (flagscale/replica/adapters.py), and the replica's record names those loaded as its models. A set given
        at run time (the router's admin call: runtime_adapters.py) stands in for the config's while there is one."""
        self._configured_adapters = dict(config.get("adapters", {}))
        self._sync_adapters()

    def _sync_adapters(self) -> None:
        """Load/unload to the node's set, where it differs from the one synced last (check_health looks again)."""
        with self._adapter_lock:
            given = runtime_adapters.get(self.spec.app, self.spec.serve_id)
            desired = self._configured_adapters if given is None else given
            if desired == self._synced_adapters:
                return
            self._synced_adapters = desired
            done = self.adapters.sync(self.spec.kind, desired, poster(self.url, self.spec.api_key))
            for line in done:
                self._note(line)
            self.record.models = [*self.spec.model_names, *sorted(self.adapters.loaded)]
            self.record.adapter_errors = dict(self.adapters.errors)
            if getattr(
                self, "kv_events", None
            ):  # the engine hashes an adapter's blocks with (name, path): the router's keys too
                self.kv_events["loras"] = dict(self.adapters.loaded)
            registry.publish(self.record)

    def _sync_adapters_aside(self) -> None:
        """_sync_adapters off the health check's thread (loads may outlast Serve's health check timeout)."""
        if self._adapter_sync is None or not self._adapter_sync.is_alive():
            self._adapter_sync = threading.Thread(target=self._sync_adapters, name="adapter-sync", daemon=True)
            self._adapter_sync.start()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Called by Serve when the node autoscales: this replica's load as its engine counts it
        (flagscale/replica/autoscaling.py), and what the SLO planner reads (slo_signals.py)."""
        metrics, buckets = await asyncio.get_running_loop().run_in_executor(
            None, engine_metrics_and_buckets, self.url, 2.0, self.spec.api_key
        )
        sleeper = getattr(self, "sleeper", None)
        stats = replica_stats(self.spec.kind, metrics, buckets, self.start_s, asleep=bool(sleeper and sleeper.asleep))
        return {ENGINE_REQUESTS: self.spec.kind.load(metrics), **stats}

    async def wake(self) -> str:
        """The router's call for a pool at zero replicas that holds a request (flagscale/router/cold_start.py):
        queued at Serve's handle, it is what makes Serve start this replica; it answers once the replica serves."""
        return self.url

    def _terminate(self, grace_s: float = 10.0) -> None:
        if getattr(self, "sleeper", None):
            self.sleeper.stop()
        if hasattr(self, "proc"):
            terminate_engine(self.proc, grace_s)
        if getattr(self, "ranks", None):
            self.ranks.stop()

    def __del__(self):
        """Serve's graceful shutdown (stop, an update replacing this replica, a downscale): leave the registry,
        let the requests the router already sent here finish (bounded by deploy.drain_timeout_s, less a margin
        for the server's own exit before Serve kills the replica), then stop the server. Under `stop`, which
        drained the routers first (registry.stopping), the server is stopped at once."""
        drained_by_stop = False
        try:
            registry.withdraw(self.spec.app, self.replica_id)
            drained_by_stop = registry.stopping(self.spec.app)
        except Exception:
            pass
        if hasattr(self, "proc") and self.proc.poll() is None and hasattr(self, "record") and not drained_by_stop:
            self._drain(deadline=time.monotonic() + max(0.0, self.spec.drain_timeout_s - DRAIN_MARGIN_S))
        self._terminate()

    def _drain(self, deadline: float) -> None:
        time.sleep(min(registry.ROUTER_REFRESH_S + 1.0, max(0.0, deadline - time.monotonic())))
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                metrics = engine_metrics(self.url, timeout_s=2, api_key=self.spec.api_key)
            except OSError:
                return
            if self.spec.kind.load(metrics) == 0:
                return
            time.sleep(0.5)
        self._note("drain: requests still running at the drain deadline; stopping the server anyway")
