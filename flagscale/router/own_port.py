"""Whether the router's port is its deployment's alone, checked right after it binds.

Every router process of a deployment binds the endpoint's port with SO_REUSEPORT, so the kernel would just as well
let a second deployment (same user, another exp_dir) bind it too, and then split the clients' connections between
the two. The run action checks the port before it starts anything, but that is tens of seconds before the router
binds. So each router process also looks at who listens on the port once its own socket is bound: every other
listener must be a router of the same deployment, which Serve starts with DEPLOYMENT_ENV set to the same value.
"""

from __future__ import annotations

import ipaddress
import os
import time

import psutil

# Set in every router process's environment by the Serve app (flagscale/serve/app.py): "<app>@<exp_dir>".
DEPLOYMENT_ENV = "FLAGSCALE_ROUTER_DEPLOYMENT"
# psutil maps sockets to processes by reading every process's fds first and the socket table after: a socket
# bound in between (a sibling router process starting at the same moment) shows with no owner. A listener
# without one is looked at again this many times, this far apart, before it counts as someone else's.
OWNERLESS_RESCANS = 5
OWNERLESS_RESCAN_S = 0.2


def _overlaps(host: str, other: str) -> bool:
    """Whether sockets bound to these two addresses take the same connections (either is a wildcard, or equal)."""
    try:
        if ipaddress.ip_address(host).is_unspecified or ipaddress.ip_address(other).is_unspecified:
            return True
    except ValueError:  # a host name: compared as written
        pass
    return host == other


def _deployment_of(pid: int) -> str | None:
    try:
        return psutil.Process(pid).environ().get(DEPLOYMENT_ENV)
    except psutil.Error:  # gone meanwhile, or not ours to read
        return None


def foreign_listeners(host: str, port: int, deployment: str | None) -> list[str]:
    """The listeners on host:port other than this process and the routers of `deployment`, each as a phrase that
    names it ("pid 123 (deployment x@/exp)", "pid 77 (python3)"). Empty: the port is this deployment's."""
    for look in range(OWNERLESS_RESCANS + 1):
        found, ownerless = _listeners(host, port, deployment)
        if not ownerless:
            return found
        if look < OWNERLESS_RESCANS:
            time.sleep(OWNERLESS_RESCAN_S)  # (start-up only, and only while a listener shows no owner)
    # Still none: a process this one cannot read (only the same user may share the port; another PID namespace)
    return sorted([*found, "a process whose owner cannot be read"])


def _listeners(host: str, port: int, deployment: str | None) -> tuple[list[str], bool]:
    """One look: the foreign listeners with an owner, and whether some listener showed none."""
    found, ownerless = [], False
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status != psutil.CONN_LISTEN or not conn.laddr or conn.laddr.port != port:
            continue
        if not _overlaps(host, conn.laddr.ip) or conn.pid == os.getpid():
            continue
        if conn.pid is None:
            ownerless = True
            continue
        theirs = _deployment_of(conn.pid)
        if deployment is not None and theirs == deployment:
            continue
        try:
            name = psutil.Process(conn.pid).name()
        except psutil.Error:
            name = "exited"
        found.append(f"pid {conn.pid} ({f'deployment {theirs}' if theirs else name})")
    return sorted(set(found)), ownerless
