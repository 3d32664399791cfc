"""The project's Router in a process of its own, in front of a fixed list of engines (no Ray): for benchmarks that
start plain engines themselves and put several routing modes in front of the very same ones.

A router process is started with one JSON argument (`router_argv`):

  {"port": 8400, "app": "bench", "replicas": [{"url": ..., "kv_events": {...}}, ...], "models": ["demo"],
   "routing": {"demo": {"policy": "cache_aware", "settings": {"kv_events": true}}},
   "spec": {...further RouterSpec fields...}, "peers_dir": null, "adapter_placement": true}

Each replica is a registry record (flagscale/replica/registry.py) whose `kv_events` is what a replica publishes
(flagscale/engines/vllm_kv_events.py's kv_events_launch: endpoints, tokenizer, hash). `peers_dir`: several router
processes of one app share their reports (and so their routing hints, flagscale/router/peers.py) through files in
that folder, the benchmark's stand-in for Ray's key-value store; none: each process is on its own. A model's routing
{} is the default policy. `adapter_placement` false: LoRA adapters (spec's `adapters`, `max_loras` by the serve_id
"bench") are counted but not placed, as a router oblivious of them routes (benchmarks/lora_bench.py's baseline).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PEER_SECRET = "fixed-router-benchmark"  # routing hints are signed; the processes of one benchmark share this


def wait_healthy(
    url: str, timeout_s: float, what: str, proc: subprocess.Popen | None = None, log: Path | str | None = None
) -> None:
    """Until `url`/health answers 200 (TimeoutError after timeout_s; RuntimeError at once if `proc` died)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = f"; its log ends:\n{Path(log).read_text(errors='replace')[-3000:]}" if log else ""
            raise RuntimeError(f"{what} at {url} exited with {proc.returncode} before it was healthy{tail}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{what} at {url} was not healthy within {timeout_s:g} s")


class Processes:
    """What a benchmark started, each in a session of its own, logging to a file of `log_dir`; stopped by pid."""

    def __init__(self, log_dir: Path) -> None:
        self.procs: list[subprocess.Popen] = []
        self.log_dir = log_dir

    def start(self, argv: list[str], name: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "a")
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, **(env or {})},
        )  # fmt: skip
        log.close()
        self.procs.append(proc)
        return proc

    def stop(self, procs: list[subprocess.Popen] | None = None, sig: int = signal.SIGTERM) -> None:
        chosen = list(procs if procs is not None else self.procs)
        for proc in chosen:
            if proc.poll() is None:
                _signal_group(proc, sig)  # its own session: the engine core and workers it started go too
        for proc in chosen:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
            if proc in self.procs:
                self.procs.remove(proc)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def router_argv(config: dict[str, Any]) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), json.dumps(config)]


class FileKV:
    """Ray's internal key-value calls (flagscale/cluster/ray_compat.py's kv_put / kv_get / kv_del / kv_list) on the
    files of one folder: what router processes share through the GCS, for processes started without Ray."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    def _path(self, key: bytes, namespace: str) -> Path:
        return self.folder / f"{namespace}.{key.hex()}"

    def put(self, key: bytes, value: bytes, namespace: str) -> None:
        path = self._path(key, namespace)
        temporary = path.with_name(path.name + f".{threading.get_ident()}.tmp")
        temporary.write_bytes(value)
        temporary.replace(path)  # atomic: a reader sees the old report or the new one

    def get(self, key: bytes, namespace: str) -> bytes | None:
        try:
            return self._path(key, namespace).read_bytes()
        except FileNotFoundError:
            return None

    def delete(self, key: bytes, namespace: str) -> None:
        self._path(key, namespace).unlink(missing_ok=True)

    def list(self, prefix: bytes, namespace: str) -> list[bytes]:
        start = f"{namespace}."
        keys = [bytes.fromhex(p.name[len(start) :]) for p in self.folder.glob(start + "*") if "tmp" not in p.suffix]
        return [key for key in keys if key.startswith(prefix)]


def records(app: str, replicas: list[dict[str, Any]], models: list[str]) -> list[Any]:
    """The registry records of the fixed replicas, r0, r1, ... (fresh for ever: never stale)."""
    from flagscale.replica import registry

    return [
        registry.ReplicaRecord(
            app=app, serve_id="bench", replica_id=f"r{i}", models=models, url=r["url"], node_id="bench",
            node_ip="127.0.0.1", pid=0, engine_pid=0, log_path="", updated_at=time.time() + 10**9,
            kv_events=r.get("kv_events") or {}, gpus=r.get("gpus", []), family="nvidia" if r.get("gpus") else "",
            worker_cpus=r.get("cpus", []),
        )
        for i, r in enumerate(replicas)
    ]  # fmt: skip


def serve(config: dict[str, Any]) -> None:
    """One router process (blocks): the Router over the config's fixed replicas. Its log (INFO: the KV events'
    replays, say) goes to stderr, the file Processes keeps."""
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("flagscale.router").setLevel(logging.INFO)
    from flagscale.config.routing import RoutingSpec
    from flagscale.replica import registry
    from flagscale.router import peers
    from flagscale.router.router import Router
    from flagscale.router.spec import RouterSpec

    if config.get("adapter_placement") is False:  # the same bookkeeping, no ordering: adapter-oblivious routing
        from flagscale.router.policies import adapters

        adapters.Placement.order = lambda self, adapter, ranked: ranked
    fixed = records(config["app"], config["replicas"], config["models"])
    registry.list_replicas = lambda app, include_stale=False: fixed  # the benchmark's stand-in for the GCS
    extra = dict(config.get("spec") or {})
    if config.get("peers_dir"):
        kv = FileKV(config["peers_dir"])
        peers.kv_put, peers.kv_get, peers.kv_del, peers.kv_list = kv.put, kv.get, kv.delete, kv.list
        extra.setdefault("peer_secret", PEER_SECRET)
        extra.setdefault("refresh_s", 1.0)  # reports (where the others' hints go) each second
    spec = RouterSpec(
        app=config["app"],
        host="127.0.0.1",
        port=int(config["port"]),
        models=dict.fromkeys(config["models"], "bench"),
        pin_cpus=False,
        routing={m: RoutingSpec.from_json(r) if r else RoutingSpec() for m, r in config.get("routing", {}).items()},
        share_with_peers=bool(config.get("peers_dir")),
        processes=int(config.get("processes", 1)),
        **{"refresh_s": 3600.0, **extra},
    )
    Router(spec)
    threading.Event().wait()


if __name__ == "__main__":
    serve(json.loads(sys.argv[1]))
