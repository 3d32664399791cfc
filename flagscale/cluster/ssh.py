"""SSH to the hosts of a hostfile with paramiko: connect, run an argv, copy a small file.

Commands cross as one string only at the last step, built with shlex.join from an argv list, so
no value (env var, path, user snippet) is ever re-parsed by the remote shell.
"""

from __future__ import annotations

import logging
import os
import shlex
import socket
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import paramiko

from flagscale.errors import ClusterError

_known_hosts_lock = threading.Lock()
logging.getLogger("paramiko").setLevel(logging.WARNING)  # its INFO lines are per-connection noise


@dataclass(frozen=True)
class SshSettings:
    port: int = 22
    user: str | None = None
    key: str | None = None
    timeout_s: float = 10.0
    accept_new_host_keys: bool = False
    known_hosts: str | None = None  # default ~/.ssh/known_hosts

    @classmethod
    def from_runner(cls, runner) -> "SshSettings":
        return cls(port=runner.ssh_port, user=runner.ssh_user, key=runner.ssh_key, timeout_s=runner.ssh_timeout_s,
                   accept_new_host_keys=runner.ssh_accept_new_host_keys,
                   known_hosts=getattr(runner, "ssh_known_hosts", None))  # fmt: skip

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def known_hosts_path(self) -> Path:
        return Path(os.path.expanduser(self.known_hosts or "~/.ssh/known_hosts"))


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str


class _SaveNewKeyPolicy(paramiko.MissingHostKeyPolicy):
    """Accept a host seen for the first time and remember it in the known_hosts file (like `accept-new`)."""

    def __init__(self, path: Path):
        self.path = path

    def missing_host_key(self, client, hostname, key):
        with _known_hosts_lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            keys = paramiko.HostKeys()
            if self.path.exists():
                keys.load(str(self.path))
            keys.add(hostname, key.get_name(), key)
            keys.save(str(self.path))


def connect(host: str, settings: SshSettings) -> paramiko.SSHClient:
    """An open SSH session to `host`, or a ClusterError naming the host and why."""
    client = paramiko.SSHClient()
    known = settings.known_hosts_path
    if known.exists():
        client.load_host_keys(str(known))
    if settings.accept_new_host_keys:
        client.set_missing_host_key_policy(_SaveNewKeyPolicy(known))
    else:
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
    key = os.path.expanduser(settings.key) if settings.key else None
    try:
        client.connect(
            host, port=settings.port, username=settings.user, key_filename=key,
            look_for_keys=key is None, allow_agent=key is None,
            timeout=settings.timeout_s, banner_timeout=settings.timeout_s, auth_timeout=settings.timeout_s,
        )  # fmt: skip
    except paramiko.BadHostKeyException:
        raise ClusterError(f"host key of {host} does not match {known}: possible impostor, refusing", host) from None
    except paramiko.SSHException as exc:
        if "not found in known_hosts" in str(exc):
            raise ClusterError(
                f"{host} is not in {known}; add its key (ssh-keyscan) or set "
                "experiment.runner.ssh_accept_new_host_keys=true", host) from None  # fmt: skip
        raise ClusterError(f"SSH to {host}:{settings.port} failed: {exc}", host) from None
    except (socket.timeout, TimeoutError):
        raise ClusterError(f"SSH to {host}:{settings.port} timed out after {settings.timeout_s:g}s", host) from None
    except OSError as exc:
        raise ClusterError(f"SSH to {host}:{settings.port} failed: {exc.strerror or exc}", host) from None
    return client


def remote_command(argv: list[str], env: dict[str, str] | None = None) -> str:
    """The one string sent over SSH: `env K=V ... argv`, every word quoted."""
    prefix = ["env", *(f"{k}={v}" for k, v in (env or {}).items())] if env else []
    return shlex.join([*prefix, *argv])


def run(client: paramiko.SSHClient, argv: list[str], env: dict[str, str] | None = None,
        timeout_s: float | None = None) -> Result:  # fmt: skip
    _, stdout, stderr = client.exec_command(remote_command(argv, env), timeout=timeout_s)
    stdout.channel.shutdown_write()
    try:
        out = stdout.read().decode(errors="replace")
        err = stderr.read().decode(errors="replace")
    except socket.timeout:
        raise ClusterError(f"remote command did not finish within {timeout_s:g}s: {argv[0]}") from None
    return Result(stdout.channel.recv_exit_status(), out, err)


def put_file(client: paramiko.SSHClient, local: Path, remote: str, mode: int = 0o600) -> None:
    """Copy a small file, created with `mode` before any byte is written (for secrets)."""
    with client.open_sftp() as sftp:
        with sftp.open(remote, "wb") as f:
            f.chmod(mode)
            f.write(local.read_bytes())


def make_dir(client: paramiko.SSHClient, path: str, mode: int = 0o700) -> None:
    result = run(client, ["mkdir", "-p", "-m", oct(mode)[2:], path])
    if result.code != 0:
        raise ClusterError(f"cannot create {path}: {result.stderr.strip()}")
