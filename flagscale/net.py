"""Port and HTTP probes, in one place: is something listening, can a port be bound, a free port, `/health`.

Two port questions with different answers, kept apart on purpose:
- `port_open`: does something accept a TCP connection at host:port (works for remote hosts; `endpoint_in_use`
  asks it of a bind address);
- `port_is_free`: can this machine bind host:port (local only; SO_REUSEADDR, so TIME_WAIT does not count).
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import random
import socket
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from flagscale.paths import UnsafeDirectory, ensure_private_dir, user_tmp_root


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address) is this machine's loopback: reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def port_open(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether something accepts a TCP connection at host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def endpoint_in_use(host: str, port: int) -> bool:
    """Whether something already answers at host:port, a wildcard bind address asked at loopback (the router binds
    on a remote head, so no local bind test)."""
    target = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return port_open(target, port, timeout_s=2)


def wait_for_port(host: str, port: int, timeout_s: float, interval_s: float = 0.2) -> bool:
    """Poll `port_open` (1 s per try) until it answers or timeout_s passes; False on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if port_open(host, port, timeout_s=1):
            return True
        time.sleep(interval_s)
    return False


def port_is_free(host: str, port: int) -> bool:
    """Whether this machine can bind host:port right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


# Ports handed to processes that bind them later are drawn from below the kernel's ephemeral range: a port from
# bind(0) lies inside that range, where any outgoing connection on the machine (ZMQ, HTTP clients, Ray's own) can take
# it between this probe and the owner's bind. Ray's worker ports (cluster/ray_node.py) end at 29999.
_PICK_RANGE = (30000, 32767)
# How long a port handed out stays reserved: its owner binds it within this (an engine's server binds its port before
# it loads the model), after which a bound port is seen as not free anyway.
PORT_HOLD_S = 300.0
LEDGER = "ports.ledger"  # in the user's private directory under /tmp (paths.user_tmp_root)


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port this machine can bind on host now, for a process that binds it later, reserved host-wide for
    PORT_HOLD_S: no other process of this user on the machine is given it meanwhile (replicas that start at once on
    one host, each in its own Ray worker, get different ports).

    The reservation is a ledger file, `<user_tmp_root>/ports.ledger` ("<port> <until>" a line), read and rewritten
    under an exclusive flock by whoever picks a port; expired lines are dropped. A ledger rather than a bound socket
    handed to the engine: vLLM, SGLang and llama-server each take a port number, not a socket, and the ledger needs
    nothing of them. Every process that hands out ports for this user's runs on this machine shares it (they run as
    this user); another user's processes keep to their own (a port they bind is still seen as not free).

    Drawn at random from below the ephemeral range, where no outgoing connection is given it meanwhile; the OS's
    choice (bind to port 0) when that range holds none free and unreserved."""
    return free_ports(host, 1)


def free_ports(host: str = "127.0.0.1", count: int = 1) -> int:
    """The first of `count` consecutive ports, each as free_port hands one out (free now, reserved together): for
    a server whose processes bind a base port plus their rank (vLLM's data-parallel ranks publish their KV events
    on the base port + rank). Above one port, no OS fallback: OSError when the range holds no such run."""
    low, high = _PICK_RANGE[0], min(_PICK_RANGE[1], _ephemeral_low() - 1)
    starts = range(low, high - count + 2)
    try:
        with _ledger() as held:
            port = _pick(host, [p for p in starts if all(p + i not in held for i in range(count))], count)
            if port is not None:
                held.update(dict.fromkeys(range(port, port + count), time.time() + PORT_HOLD_S))
                return port
    except (
        OSError,
        UnsafeDirectory,
    ):  # no private directory to keep the ledger in: this process's own choice, unreserved
        port = _pick(host, list(starts), count)
        if port is not None:
            return port
    if count > 1:
        raise OSError(f"no {count} consecutive free ports on {host} in {low}-{high}")
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _pick(host: str, candidates: list[int], count: int = 1) -> int | None:
    for port in random.sample(candidates, min(len(candidates), 64)):
        if all(port_is_free(host, port + i) for i in range(count)):
            return port
    return None


@contextlib.contextmanager
def _ledger() -> Iterator[dict[int, float]]:
    """The unexpired reservations (port -> until), under the ledger's lock; what the body leaves in the dict is
    written back. OSError or UnsafeDirectory when the private directory cannot be had."""
    directory = Path(user_tmp_root(tempfile.gettempdir()))
    ensure_private_dir(str(directory))
    fd = os.open(directory / LEDGER, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # held for a read, a few probes and a write: milliseconds
        now = time.time()
        held: dict[int, float] = {}
        for line in f.read().splitlines():
            words = line.split()
            if len(words) == 2 and words[0].isdigit():
                with contextlib.suppress(ValueError):
                    if float(words[1]) > now:
                        held[int(words[0])] = float(words[1])
        yield held
        f.seek(0)
        f.truncate()
        f.write("".join(f"{port} {until:.0f}\n" for port, until in held.items()))


def health_ok(base_url: str, timeout_s: float, path: str = "/health") -> bool:
    """Whether GET base_url + path answers 200."""
    return health_problem(base_url, timeout_s, path) is None


def health_problem(base_url: str, timeout_s: float, path: str = "/health", api_key: str | None = None) -> str | None:
    """None when GET base_url + path answers 200, else what went wrong: "HTTP <code>[: <body>]" or
    "unreachable (<error>)". With the deployment's key, the router's /health says which models lack a replica."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(
            urllib.request.Request(base_url + path, headers=headers), timeout=timeout_s
        ) as resp:
            return None if resp.status == 200 else f"HTTP {resp.status}"
    except urllib.error.HTTPError as exc:  # before OSError, which it is too (as are refused/reset connections)
        try:
            body = exc.read().decode(errors="replace").strip()
        except OSError:  # the connection went while the error body was read
            body = ""
        return f"HTTP {exc.code}: {body}"
    except OSError as exc:
        return f"unreachable ({exc})"
    except ValueError as exc:  # not a URL (a state file's endpoint without host or port)
        return f"not a URL: {base_url!r} ({exc})"
