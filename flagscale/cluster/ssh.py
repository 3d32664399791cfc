"""SSH to the hosts of a hostfile with paramiko: connect, run an argv, copy a small file.

Commands cross as one string only at the last step, built with shlex.join from an argv list, so
no value (env var, path, user snippet) is ever re-parsed by the remote shell.

A host is looked up in the ssh config file (`~/.ssh/config` unless runner.ssh_config says otherwise) as
OpenSSH would: Host aliases (HostName), User, Port, IdentityFile, IdentitiesOnly and ProxyJump (the next hop
reached through a direct-tcpip channel of the previous one). Explicit runner.ssh_user / ssh_port / ssh_key win
over the file.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

import paramiko

from flagscale.errors import ClusterError

_known_hosts_lock = threading.Lock()
logging.getLogger("paramiko").setLevel(logging.WARNING)  # its INFO lines are per-connection noise
DEFAULT_PORT = 22


@dataclass(frozen=True)
class SshSettings:
    port: int | None = None  # None: the host's Port in the ssh config file, else 22
    user: str | None = None  # None: the ssh config file's User, else the current user
    key: str | None = None  # None: the ssh config file's IdentityFile, else the agent's and ~/.ssh's keys
    timeout_s: float = 10.0
    accept_new_host_keys: bool = False
    known_hosts: str | None = None  # default ~/.ssh/known_hosts
    config: str | None = None  # ssh config file; default ~/.ssh/config (a missing file is no config)

    @classmethod
    def from_runner(cls, runner) -> SshSettings:
        return cls(
            port=runner.ssh_port,
            user=runner.ssh_user,
            key=runner.ssh_key,
            timeout_s=runner.ssh_timeout_s,
            accept_new_host_keys=runner.ssh_accept_new_host_keys,
            known_hosts=getattr(runner, "ssh_known_hosts", None),
            config=getattr(runner, "ssh_config", None),
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def known_hosts_path(self) -> Path:
        return Path(os.path.expanduser(self.known_hosts or "~/.ssh/known_hosts"))

    @property
    def config_path(self) -> Path:
        return Path(os.path.expanduser(self.config or "~/.ssh/config"))


@dataclass(frozen=True)
class Target:
    """Where `host` (as the hostfile names it) is reached, after the ssh config file and the explicit settings."""

    host: str
    hostname: str
    port: int
    user: str | None
    keys: list[str] = field(default_factory=list)
    explicit_key: bool = False
    identities_only: bool = False
    proxy_jump: list[str] = field(default_factory=list)  # hops, first one first ([user@]host[:port])


def _lookup(host: str, settings: SshSettings) -> dict:
    path = settings.config_path
    if not path.is_file():
        return {}
    try:
        return dict(paramiko.SSHConfig.from_path(str(path)).lookup(host))
    except Exception as exc:  # noqa: BLE001 - a config paramiko cannot read must name the file
        raise ClusterError(f"cannot read ssh config {path} for {host}: {exc}", host) from None


def resolve(host: str, settings: SshSettings) -> Target:
    """The ssh config file's answer for `host`, explicit settings winning (OpenSSH's -p/-l/-i over the file)."""
    found = _lookup(host, settings)
    port = settings.port if settings.port is not None else int(found.get("port", DEFAULT_PORT))
    if settings.key:
        keys, explicit = [os.path.expanduser(settings.key)], True
    else:
        keys = [k for k in map(os.path.expanduser, found.get("identityfile", [])) if os.path.isfile(k)]
        explicit = False
    jump = found.get("proxyjump", "")
    hops = [] if not jump or jump.lower() == "none" else [h.strip() for h in jump.split(",") if h.strip()]
    return Target(
        host=host,
        hostname=found.get("hostname", host),
        port=port,
        user=settings.user or found.get("user"),
        keys=keys,
        explicit_key=explicit,
        identities_only=found.get("identitiesonly", "no").lower() == "yes",
        proxy_jump=hops,
    )


def _hop_target(spec: str, settings: SshSettings) -> Target:
    """A ProxyJump hop `[user@]host[:port]` (or ssh://...): its own ssh config entry, the spec's user/port on top."""
    spec = spec.removeprefix("ssh://")
    user, _, rest = spec.rpartition("@")
    name, port = rest, None
    if rest.startswith("["):  # [v6]:port
        name, _, tail = rest[1:].partition("]")
        port = tail.removeprefix(":") or None
    elif rest.count(":") == 1:
        name, port = rest.split(":")
    own = SshSettings(
        timeout_s=settings.timeout_s,
        accept_new_host_keys=settings.accept_new_host_keys,
        known_hosts=settings.known_hosts,
        config=settings.config,
    )
    hop = resolve(name, own)
    return Target(
        host=name,
        hostname=hop.hostname,
        port=int(port) if port else hop.port,
        user=user or hop.user,
        keys=hop.keys,
        identities_only=hop.identities_only,
    )


class Client(paramiko.SSHClient):
    """An SSH client that also closes the ProxyJump hops it was reached through."""

    jumps: list[paramiko.SSHClient]

    def close(self) -> None:
        super().close()
        for hop in reversed(getattr(self, "jumps", [])):
            hop.close()


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str


class _SaveNewKeyPolicy(paramiko.MissingHostKeyPolicy):
    """Accept a host seen for the first time and remember it in the known_hosts file (like `accept-new`): one line
    appended in one write, so the user's other entries and a concurrent writer's lines are never rewritten."""

    def __init__(self, path: Path):
        self.path = path

    def missing_host_key(self, client, hostname, key):
        with _known_hosts_lock:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            append_line(self.path, known_hosts_line(hostname, key))


def known_hosts_line(hostname: str, key: paramiko.PKey) -> str:
    return f"{hostname} {key.get_name()} {key.get_base64()}\n"


def append_line(path: Path, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size and _last_byte(path) != b"\n":
            line = "\n" + line
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _last_byte(path: Path) -> bytes:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1)


def connect(host: str, settings: SshSettings) -> paramiko.SSHClient:
    """An open SSH session to `host` (through its ProxyJump hops, if any), or a ClusterError naming the host and why."""
    target = resolve(host, settings)
    hops = [_hop_target(spec, settings) for spec in target.proxy_jump]
    jumps: list[paramiko.SSHClient] = []
    sock = None
    try:
        for i, hop in enumerate(hops):
            jumps.append(_connect_one(hop, settings, sock, via=host))
            nxt = hops[i + 1] if i + 1 < len(hops) else target
            try:
                sock = (
                    jumps[-1]
                    .get_transport()
                    .open_channel(
                        "direct-tcpip", (nxt.hostname, nxt.port), ("127.0.0.1", 0), timeout=settings.timeout_s
                    )
                )
            except (paramiko.SSHException, OSError) as exc:
                raise ClusterError(
                    f"SSH jump host {hop.host} cannot reach {nxt.hostname}:{nxt.port}: {exc}", host
                ) from None
        client = _connect_one(target, settings, sock)
    except BaseException:
        for hop in reversed(jumps):
            hop.close()
        raise
    client.jumps = jumps
    return client


def _connect_one(target: Target, settings: SshSettings, sock=None, via: str | None = None) -> Client:
    host = target.host
    named = host if via is None else via  # errors name the hostfile's host
    hop = "" if via is None else f" (jump host {host})"
    client = Client()
    known = settings.known_hosts_path
    if known.exists():
        client.load_host_keys(str(known))
    if settings.accept_new_host_keys:
        client.set_missing_host_key_policy(_SaveNewKeyPolicy(known))
    else:
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
    agent = not target.explicit_key and not target.identities_only
    try:
        client.connect(
            target.hostname,
            port=target.port,
            username=target.user,
            key_filename=target.keys or None,
            look_for_keys=not target.keys,
            allow_agent=agent,
            sock=sock,
            timeout=settings.timeout_s,
            banner_timeout=settings.timeout_s,
            auth_timeout=settings.timeout_s,
        )
    except paramiko.BadHostKeyException:
        raise ClusterError(
            f"host key of {host}{hop} does not match {known}: possible impostor, refusing", named
        ) from None
    except paramiko.SSHException as exc:
        if "not found in known_hosts" in str(exc):
            raise ClusterError(
                f"{host}{hop} is not in {known}; add its key (ssh-keyscan) or set "
                "experiment.runner.ssh_accept_new_host_keys=true",
                named,
            ) from None
        raise ClusterError(f"SSH to {host}:{target.port}{hop} failed: {exc}", named) from None
    except TimeoutError:
        raise ClusterError(f"SSH to {host}:{target.port}{hop} timed out after {settings.timeout_s:g}s", named) from None
    except OSError as exc:
        raise ClusterError(f"SSH to {host}:{target.port}{hop} failed: {exc.strerror or exc}", named) from None
    return client


# Over SSH an env var given as `env K=V argv` is in the remote argv, which every user of that host can read in `ps`.
# Instead the env crosses as one JSON line on the channel's stdin: this launcher (the hosts of a run share one
# Python install, as ray_node.ray_cli assumes) reads it, puts /dev/null on stdin, and execs argv with it.
ENV_FROM_STDIN = (
    "import json, os, sys; os.environ.update(json.loads(sys.stdin.readline())); "
    "os.dup2(os.open(os.devnull, os.O_RDONLY), 0); os.execvp(sys.argv[1], sys.argv[1:])"
)


def remote_command(argv: list[str], env: dict[str, str] | None = None) -> str:
    """The one string sent over SSH, every word quoted; with `env`, argv behind ENV_FROM_STDIN (start() sends the
    values on stdin), so no value is in it."""
    if env:
        argv = [sys.executable, "-c", ENV_FROM_STDIN, *argv]
    return shlex.join(argv)


def env_line(env: dict[str, str]) -> bytes:
    """What start() writes on the channel's stdin for ENV_FROM_STDIN."""
    return (json.dumps({str(k): str(v) for k, v in env.items()}) + "\n").encode()


def start(
    client: paramiko.SSHClient, argv: list[str], env: dict[str, str] | None = None, timeout_s: float | None = None
):
    """Start argv on the host; (stdout, stderr) channel files to read as it runs (reads time out after timeout_s)."""
    stdin, stdout, stderr = client.exec_command(remote_command(argv, env), timeout=timeout_s)
    if env:
        stdin.write(env_line(env))
        stdin.flush()
    stdout.channel.shutdown_write()
    return stdout, stderr


def run(
    client: paramiko.SSHClient, argv: list[str], env: dict[str, str] | None = None, timeout_s: float | None = None
) -> Result:
    stdout, stderr = start(client, argv, env, timeout_s)
    try:
        out = stdout.read().decode(errors="replace")
        err = stderr.read().decode(errors="replace")
    except TimeoutError:
        raise ClusterError(f"remote command did not finish within {timeout_s:g}s: {argv[0]}") from None
    return Result(stdout.channel.recv_exit_status(), out, err)


def put_file(client: paramiko.SSHClient, local: Path, remote: str, mode: int = 0o600) -> None:
    """Copy a small file, created with `mode` before any byte is written (for secrets)."""
    with client.open_sftp() as sftp:
        with sftp.open(remote, "wb") as f:
            f.chmod(mode)
            f.write(local.read_bytes())
