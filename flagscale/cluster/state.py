"""The exp_dir state file: what `run` started, so `status` and `stop` act on exactly that."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


def resolve_exp_dir(exp_dir: str | os.PathLike) -> str:
    """The one spelling of a run's exp_dir (state file, logs, token): absolute, `~` expanded, links resolved."""
    return str(Path(exp_dir).expanduser().resolve())


@dataclass
class HostRecord:
    """One host's Ray node as we started it: the session that owns all its processes."""

    host: str
    role: str  # "head", "worker" or "driver" (the CPU-less node on this machine that a multi-host run drives from)
    session: int | None = None
    leader_start_ticks: int | None = (
        None  # the leader's ProcessInfo.start_ticks: stop skips a session whose PID was reused
    )
    temp_dir: str | None = None
    node_id: str | None = None
    remote: bool = False  # reached over SSH (multi-host); False: this machine
    chip: str | None = None
    slots: int | None = None
    node_ip: str | None = None


@dataclass
class RunState:
    app_name: str
    exp_dir: str
    endpoint: str
    ray_address: str
    token_path: str | None
    hosts: list[HostRecord] = field(default_factory=list)
    models: list[str] = field(default_factory=list)
    phase: str = "starting"  # starting -> running
    started_at: float = 0.0
    runner_pid: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def path(exp_dir: str | Path) -> Path:
        return Path(exp_dir) / "state.json"

    def save(self) -> None:
        target = self.path(self.exp_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=target.parent, delete=False, suffix=".tmp") as f:
            json.dump(asdict(self), f, indent=2)
        os.replace(f.name, target)

    @classmethod
    def load(cls, exp_dir: str | Path) -> RunState | None:
        target = cls.path(exp_dir)
        if not target.exists():
            return None
        data = json.loads(target.read_text())
        data.pop("started_cluster", None)  # written by earlier versions: every run starts its own cluster
        data["hosts"] = [HostRecord(**h) for h in data.get("hosts", [])]
        return cls(**data)

    @classmethod
    def remove(cls, exp_dir: str | Path) -> None:
        cls.path(exp_dir).unlink(missing_ok=True)
