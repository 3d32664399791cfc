"""benchmarks/auto_tune.py --gpu's watch over the GPU processes' environment (pure logic: nvidia-smi and /proc
are faked)."""

from __future__ import annotations

from benchmarks import auto_tune
from benchmarks.gpu import checks


def fake_gpu(monkeypatch, apps: list[int], readable: dict[int, list[bool]], lacking: set[int] = frozenset()):
    """nvidia-smi lists `apps`; pid -> whether its environment reads, call after call (once its list is used up,
    the pid is gone and env_check skips it); `lacking`: pids without the variables."""
    monkeypatch.setattr(checks, "gpu_apps", lambda: [{"pid": pid, "gpu": "0", "used_mb": 1.0} for pid in apps])

    def env_check(groups, pids):
        unknown, missing = [], []
        for pid in pids:
            if not readable.get(pid):
                continue
            if not readable[pid].pop(0):
                unknown.append(pid)
            elif pid in lacking:
                missing.append({"pid": pid, "read_from": pid, "lacking": {"NCCL_NVLS_ENABLE": None}, "cmd": "x"})
        return {"gpu processes (nvidia-smi)": {"checked": 0, "inherited": 0, "unknown": unknown, "missing": missing}}

    monkeypatch.setattr(checks, "env_check", env_check)


def test_a_process_unreadable_while_it_stops_passes_once_gone(monkeypatch):
    fake_gpu(monkeypatch, [1, 2], {1: [True], 2: [False]})  # 2 is gone when asked again
    watch = auto_tune.GpuEnvWatch(recheck_s=0)
    assert watch.check() == []
    assert watch.checked == {1, 2}


def test_a_process_still_unreadable_when_asked_again_stops_the_run(monkeypatch):
    fake_gpu(monkeypatch, [1, 2], {1: [True], 2: [False, False]})
    assert auto_tune.GpuEnvWatch(recheck_s=0).check() == [
        "gpu processes (nvidia-smi): environment of pids [2] unreadable"
    ]


def test_a_process_without_the_variables_stops_the_run_beside_an_unreadable_one(monkeypatch):
    fake_gpu(monkeypatch, [1, 2], {1: [True], 2: [False]}, lacking={1})
    problems = auto_tune.GpuEnvWatch(recheck_s=0).check()
    assert len(problems) == 1 and "pid 1" in problems[0] and "lacks" in problems[0]


def test_a_process_checked_once_is_not_read_again(monkeypatch):
    fake_gpu(monkeypatch, [1], {1: [True, False]})  # a second read would find it unreadable
    watch = auto_tune.GpuEnvWatch(recheck_s=0)
    assert watch.check() == [] and watch.check() == []
