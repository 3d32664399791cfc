"""Real test hosts on this machine: network namespaces on a private bridge, each with its own sshd.

Host i (1-based) is netns `fs77h<i>` with address 10.213.77.<i+1>/24; the root namespace has 10.213.77.1 on
the bridge `fs77br`, so the runner reaches every host as a remote machine. Each sshd has its own host key,
config, pidfile and log, listens on SSH_PORT inside its namespace, and accepts only a key generated for the
test run. All hosts share this machine's filesystem and process table (hence per-host Ray temp dirs).
Teardown ends every process inside the namespaces (all started by these tests), then deletes them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

SUBNET = "10.213.77"
BRIDGE = "fs77br"
SSH_PORT = 18822
SSHD = "/usr/sbin/sshd"
# The test hosts share this machine's cores, which real hosts never do. Each host's Ray node runs in a session of
# its own, and with the kernel's session autogroups on, a vLLM CPU worker pinned to a core and spinning there
# starved another host's process pinned to that core: measured 2026-11-25, an engine starting on a second test host
# got 0.6 s of CPU in 10 minutes and never came up. Off while the hosts exist, restored when they are torn down.
AUTOGROUP = Path("/proc/sys/kernel/sched_autogroup_enabled")


@dataclass
class TestHost:
    index: int
    netns: str
    ip: str


@dataclass
class TestHosts:
    hosts: list[TestHost]
    key: Path
    known_hosts: Path
    root_ip: str = f"{SUBNET}.1"

    def runner(self, hostfile: Path, **extra) -> dict:
        return {
            "hostfile": str(hostfile),
            "ssh_port": SSH_PORT,
            "ssh_user": "root",
            "ssh_key": str(self.key),
            "ssh_known_hosts": str(self.known_hosts),
            "ssh_timeout_s": 5,
            **extra,
        }

    def netns_pids(self, host: TestHost) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def ray_pids(self, host: TestHost) -> list[int]:
        """Processes in the host's namespace other than its sshd (and the sshd's own session children)."""
        sshd = _read_pid(self._pidfile(host))
        return [p for p in self.netns_pids(host) if p != sshd and not _is_sshd(p)]

    def _pidfile(self, host: TestHost) -> Path:
        return self.key.parent / host.netns / "sshd.pid"


def _is_sshd(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() in ("sshd", "sshd-session")
    except OSError:
        return True  # gone


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _sshd_config(workdir: Path, ip: str, authorized: Path) -> str:
    return "\n".join(
        [
            f"ListenAddress {ip}",
            f"Port {SSH_PORT}",
            f"HostKey {workdir / 'host_key'}",
            f"PidFile {workdir / 'sshd.pid'}",
            f"AuthorizedKeysFile {authorized}",
            "PermitRootLogin prohibit-password",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",
            "PrintMotd no",
            "Subsystem sftp internal-sftp",
            "LogLevel VERBOSE",
            "MaxStartups 50",
            "",
        ]
    )


def available() -> str | None:
    """Why these hosts cannot be built here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not shutil.which("ip"):
        return "iproute2 (`ip`) is missing"
    if not os.path.exists(SSHD):
        return f"{SSHD} is missing: `apt-get install -y openssh-server` (make test does it)"
    return None


def build(count: int, workdir: Path) -> TestHosts:
    teardown(count, workdir)  # leftovers of an interrupted earlier session
    workdir.mkdir(parents=True, exist_ok=True)
    if AUTOGROUP.exists():
        (workdir / "autogroup").write_text(AUTOGROUP.read_text())
        AUTOGROUP.write_text("0\n")
    key = workdir / "client_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    authorized = workdir / "authorized_keys"
    authorized.write_text(Path(f"{key}.pub").read_text())
    known_lines = []
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory
    _ip("link", "add", BRIDGE, "type", "bridge")
    _ip("addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE)
    _ip("link", "set", BRIDGE, "up")
    hosts = []
    for i in range(1, count + 1):
        host = TestHost(index=i, netns=f"fs77h{i}", ip=f"{SUBNET}.{i + 1}")
        outer, inner = f"fs77v{i}", f"fs77p{i}"
        _ip("netns", "add", host.netns)
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", host.netns)
        _ip("link", "set", outer, "master", BRIDGE, "up")
        _ip("-n", host.netns, "addr", "add", f"{host.ip}/24", "dev", inner)
        _ip("-n", host.netns, "link", "set", inner, "up")
        _ip("-n", host.netns, "link", "set", "lo", "up")
        host_dir = workdir / host.netns
        host_dir.mkdir()
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host_dir / "host_key")], check=True)
        (host_dir / "sshd_config").write_text(_sshd_config(host_dir, host.ip, authorized))
        subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                host.netns,
                SSHD,
                "-f",
                str(host_dir / "sshd_config"),
                "-E",
                str(host_dir / "sshd.log"),
            ],
            check=True,
        )
        public = (host_dir / "host_key.pub").read_text().split()
        known_lines.append(f"[{host.ip}]:{SSH_PORT} {public[0]} {public[1]}")
        hosts.append(host)
    known = workdir / "known_hosts"
    known.write_text("\n".join(known_lines) + "\n")
    _wait_listening(hosts)
    return TestHosts(hosts=hosts, key=key, known_hosts=known)


def _wait_listening(hosts: list[TestHost], timeout_s: float = 10) -> None:
    import socket

    for host in hosts:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                socket.create_connection((host.ip, SSH_PORT), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def teardown(count: int, workdir: Path) -> None:
    """End every process inside the test namespaces (all started by these tests), then delete them and the bridge."""
    existing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for i in range(1, count + 1):
        netns = f"fs77h{i}"
        if netns not in existing.split():
            continue
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 10
            while pids and time.monotonic() < deadline:
                time.sleep(0.2)
                pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout.split()
        subprocess.run(["ip", "netns", "del", netns], capture_output=True)
    subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)
    saved = workdir / "autogroup"
    if saved.exists():
        AUTOGROUP.write_text(saved.read_text())
    shutil.rmtree(workdir, ignore_errors=True)
