"""The exp_dir state file: what `run` started, so `status` and `stop` act on exactly that."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import TypeAdapter, ValidationError

from flagscale.errors import FlagScaleError, write_error

# The state file's layout; a file written by a newer runner (a higher number) is refused, never half-read.
STATE_FORMAT = 1


class StateFileError(FlagScaleError):
    """The state file cannot be read: not JSON, or wrong types."""


class NewerStateFormat(StateFileError):
    """The state file was written by a newer runner; no action reads it."""


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
    format_version: int = STATE_FORMAT

    @staticmethod
    def path(exp_dir: str | Path) -> Path:
        return Path(exp_dir) / "state.json"

    def save(self) -> None:
        """Written aside, then renamed: a failed write (a full disk) leaves the previous file and is one clear
        WriteError naming the file."""
        target = self.path(self.exp_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, aside = tempfile.mkstemp(dir=target.parent, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                _write_file(f, json.dumps(asdict(self), indent=2))
            os.replace(aside, target)
        except OSError as exc:
            Path(aside).unlink(missing_ok=True)
            raise write_error(target, exc) from None

    @classmethod
    def load(cls, exp_dir: str | Path) -> RunState | None:
        """None when there is no state file; StateFileError naming the file when it cannot be read."""
        target = cls.path(exp_dir)
        if not target.exists():
            return None
        data = _read_json(target)
        version = data.get("format_version", 1)
        if not isinstance(version, int) or version > STATE_FORMAT:
            raise NewerStateFormat(
                f"written by a newer version of this runner (state format {version}; this one reads up to "
                f"{STATE_FORMAT}): use that version for status and stop",
                str(target),
            )
        data.pop("started_cluster", None)  # written by earlier versions: every run starts its own cluster
        try:
            return _STATE.validate_python(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise StateFileError(f"unreadable: {where}: {first['msg']}; {_WHAT_TO_DO}", str(target)) from None

    @property
    def endpoint_address(self) -> tuple[str, int]:
        """The endpoint's (host, port); StateFileError naming the file when the recorded endpoint lacks either."""
        address = _host_port(self.endpoint)
        if address is None:
            raise StateFileError(
                f"unreadable: endpoint: {self.endpoint!r} is not http://<host>:<port>; {_WHAT_TO_DO}",
                str(self.path(self.exp_dir)),
            )
        return address

    @classmethod
    def recorded_hosts(cls, exp_dir: str | Path) -> tuple[list[HostRecord], dict]:
        """What an unreadable state file still tells: the host records that parse (each a session `stop` can end)
        and the SSH settings. ([], {}) when nothing does."""
        try:
            data = _read_json(cls.path(exp_dir))
        except StateFileError:
            return [], {}
        hosts = []
        for entry in data.get("hosts") if isinstance(data.get("hosts"), list) else []:
            try:
                hosts.append(_HOST.validate_python(entry))
            except ValidationError:
                continue
        extra = data.get("extra") if isinstance(data.get("extra"), dict) else {}
        ssh = extra.get("ssh") if isinstance(extra.get("ssh"), dict) else {}
        return [h for h in hosts if h.session is not None], ssh

    @classmethod
    def remove(cls, exp_dir: str | Path) -> None:
        cls.path(exp_dir).unlink(missing_ok=True)


_STATE = TypeAdapter(RunState)
_HOST = TypeAdapter(HostRecord)
_WHAT_TO_DO = "action=stop stops the Ray sessions it still names"


def _host_port(endpoint: str) -> tuple[str, int] | None:
    try:
        parts = urlsplit(endpoint)
        port = parts.port
    except ValueError:  # a port that is not a number in 0-65535
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        return None
    return parts.hostname, port


def _write_file(f, text: str) -> None:
    f.write(text)
    f.flush()  # a full disk shows here, not in a close that the with statement would make


def _read_json(target: Path) -> dict:
    try:
        data = json.loads(target.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise StateFileError(f"unreadable ({exc}); {_WHAT_TO_DO}", str(target)) from None
    if not isinstance(data, dict):
        raise StateFileError(f"unreadable (not a JSON object); {_WHAT_TO_DO}", str(target))
    return data
