"""Checks a multi-GPU host can show, shared by bench_gpu.py and tests/gpu/: NVLink multicast off in every process
(engine ranks included), which GPUs each replica and rank holds (the orchestrator's `status` against nvidia-smi),
and no process left on any GPU after stop.

nvidia-smi's compute apps are the ground truth for "which process holds which GPU": a process appears there once it
has a CUDA context on that GPU. `status output=json` gives each replica's GPU ids (what Ray gave it) and each rank's
pid and GPU; both name GPUs by index here (Ray's ids are the indices nvidia-smi prints when CUDA_VISIBLE_DEVICES
was unset when Ray started).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil

from flagscale.devices.nvidia import MULTICAST_OFF

# NVLink multicast off: a program that uses it can put the host's GPUs out of service (../shared/gpu/README.md).
GPU_SAFE_ENV = MULTICAST_OFF  # NVIDIA's family declares it (flagscale/devices/nvidia.py)


def nvidia_smi(*query: str) -> list[list[str]]:
    """Rows of `nvidia-smi <query> --format=csv,noheader,nounits`, cells stripped; [] without nvidia-smi."""
    try:
        out = subprocess.run(
            ["nvidia-smi", *query, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [[cell.strip() for cell in line.split(",")] for line in out.splitlines() if line.strip()]


def gpu_count() -> int:
    return len(nvidia_smi("--query-gpu=index"))


def gpu_apps() -> list[dict[str, Any]]:
    """Every process with a CUDA context: {"pid", "gpu" (index, as a string), "uuid", "used_mb"}."""
    index = {row[1]: row[0] for row in nvidia_smi("--query-gpu=index,uuid") if len(row) == 2}
    apps = []
    for row in nvidia_smi("--query-compute-apps=pid,gpu_uuid,used_memory"):
        with contextlib.suppress(ValueError, IndexError):
            apps.append(
                {"pid": int(row[0]), "gpu": index.get(row[1], row[1]), "uuid": row[1], "used_mb": float(row[2])}
            )
    return apps


def gpus_of(pids: set[int], apps: list[dict[str, Any]]) -> list[str]:
    return sorted({app["gpu"] for app in apps if app["pid"] in pids}, key=lambda g: (len(g), g))


def tree(pid: int) -> set[int]:
    """`pid` and every process under it."""
    try:
        root = psutil.Process(pid)
        return {pid, *(child.pid for child in root.children(recursive=True))}
    except psutil.Error:
        return set()


def wait_no_gpu_apps(timeout_s: float = 60.0, interval_s: float = 1.0) -> list[dict[str, Any]]:
    """After stop: what is still on any GPU once `timeout_s` passed ([] = nothing, the goal). This process is left
    out: a benchmark or test that wrote its random-weight model on the GPU holds a CUDA context of its own."""
    deadline = time.monotonic() + timeout_s
    while True:
        apps = [app for app in gpu_apps() if app["pid"] != os.getpid()]
        if not apps or time.monotonic() >= deadline:
            return [{**app, "cmd": _cmd(app["pid"])} for app in apps]
        time.sleep(interval_s)


def _cmd(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())[:160]
    except psutil.Error:
        return "?"


# ---------------------------------------------------------------------------------------------------- environment


def _readable_env(proc: psutil.Process) -> dict[str, str] | None:
    """The process's environment, or None when it cannot be read from /proc: a process that rewrote its title
    (vLLM's EngineCore and workers, Ray's agents: setproctitle reuses the memory /proc/PID/environ shows)."""
    try:
        env = proc.environ()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return env if "PATH" in env else None


def env_of(pid: int) -> tuple[dict[str, str] | None, int | None]:
    """(environment, pid it was read from): the process's own, else its nearest ancestor's whose environment is
    readable (a process that retitled itself inherited it: vLLM starts its engine core and workers with
    multiprocessing's spawn, which passes the parent's os.environ)."""
    try:
        proc: psutil.Process | None = psutil.Process(pid)
    except psutil.Error:
        return None, None
    while proc is not None:
        env = _readable_env(proc)
        if env is not None:
            return env, proc.pid
        try:
            proc = proc.parent()
        except psutil.Error:
            return None, None
    return None, None


def env_check(groups: dict[str, list[psutil.Process]], extra_pids: list[int] = ()) -> dict[str, Any]:
    """For each group of processes (a system's), and for `extra_pids` (every process nvidia-smi shows on a GPU):
    which lack one of GPU_SAFE_ENV. `inherited` counts processes checked through an ancestor (env_of)."""
    report: dict[str, Any] = {}
    named = {name: [p.pid for p in procs] for name, procs in groups.items()}
    if extra_pids:
        named["gpu processes (nvidia-smi)"] = list(extra_pids)
    for name, pids in named.items():
        checked, inherited, unknown, missing = 0, 0, [], []
        for pid in pids:
            if not psutil.pid_exists(pid):
                continue
            env, source = env_of(pid)
            if env is None:
                unknown.append(pid)
                continue
            checked += 1
            inherited += source != pid
            lacking = {k: env.get(k) for k, v in GPU_SAFE_ENV.items() if env.get(k) != v}
            if lacking:
                missing.append({"pid": pid, "read_from": source, "lacking": lacking, "cmd": _cmd(pid)[:120]})
        report[name] = {"checked": checked, "inherited": inherited, "unknown": unknown, "missing": missing}
    return report


def env_problems(report: dict[str, Any], gpu_group_required: bool = True) -> list[str]:
    """What makes an env_check report fail: a process without the variables, or a GPU process whose environment
    could not be read at all."""
    problems = []
    for name, entry in report.items():
        for item in entry["missing"]:
            problems.append(f"{name}: pid {item['pid']} ({item['cmd']}) lacks {item['lacking']}")
        if gpu_group_required and name == "gpu processes (nvidia-smi)" and entry["unknown"]:
            problems.append(f"{name}: environment of pids {entry['unknown']} unreadable")
    return problems


# ------------------------------------------------------------------------------------------------------ placement


def status_json(argv: list[str], cwd: str | None = None, env: dict[str, str] | None = None) -> dict[str, Any]:
    """`run.py ... action=status output=json` (argv without output=json): the report, log lines before it skipped."""
    proc = subprocess.run([*argv, "output=json"], cwd=cwd, env=env, capture_output=True, text=True, timeout=180)
    out = proc.stdout
    if "{" not in out:
        raise RuntimeError(f"status gave no JSON (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return json.JSONDecoder().raw_decode(out[out.index("{") :])[0]


def placement(report: dict[str, Any], devices_per_replica: int, whole_gpus: bool = True) -> dict[str, Any]:
    """The replicas' and ranks' GPUs as `status` shows them, against nvidia-smi, and the problems found:
    - a replica of TP x PP x DP = n whole GPUs holds n distinct GPUs (status) and its processes use only those;
    - with whole GPUs per replica, no two replicas share one;
    - each rank's pid is on the GPU status names for it (nvidia-smi), and a replica's ranks are on distinct GPUs."""
    apps = gpu_apps()
    replicas, problems = [], []
    for replica in report.get("replicas", []):
        if replica.get("state") != "READY":
            continue
        rid = replica["replica_id"]
        status_gpus = [str(g) for g in replica.get("gpus") or []]
        used = gpus_of(tree(replica["engine_pid"]), apps)
        ranks = []
        for rank in replica.get("ranks") or []:
            pid = rank.get("pid")
            ranks.append(
                {
                    "rank": rank["rank"],
                    "pid": pid,
                    "status_gpus": [str(g) for g in rank.get("gpus") or []],
                    "smi_gpus": gpus_of({pid}, apps) if pid else [],
                }
            )
        replicas.append({"replica_id": rid, "status_gpus": status_gpus, "smi_gpus": used, "ranks": ranks})
        if whole_gpus and len(set(status_gpus)) != devices_per_replica:
            problems.append(f"replica {rid}: status shows GPUs {status_gpus}, expected {devices_per_replica} distinct")
        if not used:
            problems.append(f"replica {rid}: no process of its engine (pid {replica['engine_pid']}) is on a GPU")
        elif not set(used) <= set(status_gpus):
            problems.append(f"replica {rid}: its processes use GPUs {used}, status gave it {status_gpus}")
        if devices_per_replica > 1:
            if len(ranks) != devices_per_replica:
                problems.append(f"replica {rid}: {len(ranks)} ranks in status, expected {devices_per_replica}")
            rank_gpus = [tuple(r["status_gpus"]) for r in ranks]
            if len(set(rank_gpus)) != len(rank_gpus):
                problems.append(f"replica {rid}: ranks share GPUs {rank_gpus}")
            for r in ranks:
                if not r["pid"]:
                    problems.append(f"replica {rid} rank {r['rank']}: no worker pid in status")
                elif r["smi_gpus"] != r["status_gpus"]:
                    problems.append(
                        f"replica {rid} rank {r['rank']} (pid {r['pid']}): nvidia-smi shows it on {r['smi_gpus']}, "
                        f"status says {r['status_gpus']}"
                    )
    if whole_gpus:
        seen: dict[str, str] = {}
        for rep in replicas:
            for gpu in rep["status_gpus"]:
                if gpu in seen:
                    problems.append(f"GPU {gpu} held by replicas {seen[gpu]} and {rep['replica_id']}")
                seen[gpu] = rep["replica_id"]
    return {"replicas": replicas, "gpu_apps": apps, "problems": problems}


# ------------------------------------------------------------------------------------------------ NIXL / UCX


def ucx_kv_reads(log_paths: list[Path]) -> dict[str, Any]:
    """What UCX picked for the KV reads, from the engines' UCX_PROTO_INFO tables: each table that starts with
    "remote memory read by ucp_get* ... into cuda/... from cuda/..." (GPU memory pulled from a peer's GPU memory)
    names the transport of each message-size range on its rows ("zero-copy | cuda_ipc/cuda" = CUDA IPC over
    NVLink; "tcp/..." = a fallback through the host)."""
    picked: dict[str, int] = {}
    tables: list[str] = []
    for path in log_paths:
        with contextlib.suppress(OSError):
            in_gpu_read = False
            for line in path.read_text(errors="replace").splitlines():
                if "|" not in line:
                    continue
                cells = [c.strip() for c in line.split("|")[1:-1]]
                if len(cells) == 1:  # a table's title row
                    title = cells[0]
                    in_gpu_read = "remote memory read" in title and title.count("cuda") >= 2
                    if in_gpu_read and len(tables) < 4:
                        tables.append(f"{path.name}: {title}")
                elif in_gpu_read and len(cells) >= 3 and "/" in cells[-1]:
                    transport = cells[-1].split("/")[0]
                    picked[transport] = picked.get(transport, 0) + 1
                    if len(tables) < 8:
                        tables.append(f"{path.name}:   {' | '.join(cells)}")
    return {"gpu_read_transports": picked, "lines": tables}
