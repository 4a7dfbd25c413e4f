"""Network checks: is a host this machine, is my port free, are my peers up.

Tasks are named in messages as `TF_CONFIG` names them, `"<type> <index>"`:
`worker 2`, `chief 0`, `ps 1` (for a cluster of workers only, `worker N`
is rank N).
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import time
from typing import Optional

from . import roles
from .addresses import parse_address
from .errors import ClusterConfigError
from .info import ClusterInfo

__all__ = ["check_own_port_free", "free_ports", "is_local_host", "wait_for_peers"]

# Tasks that run a server others connect to; evaluators run none.
_SERVER_TYPES = (roles.CHIEF, roles.WORKER, roles.PS)


def is_local_host(host: str) -> bool:
    """True when `host` names this machine (loopback, wildcard, own name or IP).

    IP literals are tested by binding to them, so any address of a local
    interface counts; other names count only when they are `localhost` or
    this machine's host name (no DNS lookup, which could hang).

    Example:

    ```python
    is_local_host("127.0.0.1"), is_local_host("localhost")  # (True, True)
    is_local_host("10.255.255.1")                            # False (usually)
    ```
    """
    host = host.strip("[]").lower()
    if host in ("localhost", "0.0.0.0", "::", ""):
        return True
    hostname = socket.gethostname().lower()
    if host in (hostname, hostname.split(".")[0]):
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if ip.is_loopback:
        return True
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, 0))
        except OSError:
            return False  # EADDRNOTAVAIL: not an address of this machine
    return True


def _own_label(info: ClusterInfo) -> str:
    return f"{info.task_type} {info.task_index}"


def _kind(task_type: str) -> str:
    return "worker" if task_type in roles.TRAINING_TASK_TYPES else f"{task_type} task"


def check_own_port_free(info: ClusterInfo) -> None:
    """Fails early when this process's own port is already taken here.

    TensorFlow's gRPC server listens on every interface (`[::]:port`)
    whatever host the address names, so the port is probed on the wildcard
    address. Skipped when the own host is not this machine. Works for any
    role (a ps task's server needs its port as much as a worker's).

    Raises:
        ClusterConfigError: naming the task, address and the fix.

    Example:

    ```python
    info = resolve()
    check_own_port_free(info)  # before starting TensorFlow's server
    ```
    """
    label = _own_label(info)
    host, port = parse_address(info.address, label)
    if not is_local_host(host):
        return
    error = _probe_port(port)
    kind = _kind(info.task_type)
    if error == errno.EACCES:
        raise ClusterConfigError(
            f"{label} at {info.address}: this user may not listen on "
            f"port {port} (EACCES); give this {kind} a port >= 1024."
        )
    if error is not None:
        raise ClusterConfigError(
            f"{label} at {info.address}: port {port} is already in "
            f"use on this machine ({errno.errorcode.get(error, error)}); stop "
            f"the process holding it or give this {kind} another port."
        )


def _probe_port(port: int) -> Optional[int]:
    """Tries to bind `port` on all interfaces; returns the errno, if any."""
    error = None
    # Dual-stack first, as gRPC listens; IPv4 when this host has no IPv6.
    for family, address in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue
        with probe:
            # gRPC sets SO_REUSEADDR too; without it lingering TIME_WAIT
            # connections from a previous run would look like a conflict.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                if family == socket.AF_INET6:
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                probe.bind((address, port))
                return None
            except OSError as e:
                error = e.errno
                if e.errno in (errno.EADDRINUSE, errno.EACCES):
                    return e.errno
    return error


def wait_for_peers(info: ClusterInfo, timeout: Optional[float], poll: float = 0.2) -> None:
    """Blocks until every peer accepts a TCP connection.

    Useful before the first collective: a peer that never started then
    gives a clear error instead of a gRPC hang. The peers are every task
    that runs a server (chief, workers, ps) but this process; evaluators
    run none and are not waited for.

    Args:
        info: the cluster.
        timeout: seconds to wait in all; None or <= 0 waits forever.
        poll: seconds between connection attempts.

    Raises:
        ClusterConfigError: on timeout, naming the first peer (lowest rank,
            then ps tasks) that did not answer.

    Example:

    ```python
    wait_for_peers(info, timeout=60)
    ```
    """
    own = (info.task_type, info.task_index)
    pending = [
        (f"{task_type} {index}", address)
        for task_type, index, address in info.tasks
        if task_type in _SERVER_TYPES and (task_type, index) != own
    ]
    deadline = time.monotonic() + timeout if timeout and timeout > 0 else None
    while True:
        pending = [(label, a) for label, a in pending if not _answers(a, poll)]
        if not pending:
            return
        if deadline is not None and time.monotonic() >= deadline:
            label, address = pending[0]
            _, port = parse_address(address, label)
            raise ClusterConfigError(
                f"{label} at {address} did not answer within {timeout:g}s; "
                f"is it started? Check that it runs and that port {port} is "
                "reachable from this host (firewall, --bind address)."
            )
        time.sleep(poll)


def _answers(address: str, timeout: float) -> bool:
    host, port = parse_address(address)
    try:
        with socket.create_connection((host, port), timeout=max(timeout, 0.05)):
            return True
    except OSError:
        return False


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """Asks the OS for `n` distinct free TCP ports on `host`.

    All sockets stay open until every port is chosen, so the ports differ;
    they are free when this returns, though another process could take one
    before it is used.

    Example:

    ```python
    ports = free_ports(2)  # e.g. [41235, 38817]
    workers = [f"127.0.0.1:{p}" for p in ports]
    ```
    """
    if n < 0:
        raise ValueError(f"n={n} must be >= 0.")
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sockets = []
    try:
        for _ in range(n):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((host.strip("[]"), 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()
