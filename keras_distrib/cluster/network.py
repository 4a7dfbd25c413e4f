"""Network checks: is a host this machine, is my port free, are my peers up.

Tasks are named in messages as `TF_CONFIG` names them, `"<type> <index>"`:
`worker 2`, `chief 0`, `ps 1` (for a cluster of workers only, `worker N`
is rank N).

Listening: TensorFlow's gRPC server listens on every interface whatever
host the cluster names (see docs/security.md); the sockets this module
and `runtime` open themselves listen only on the address the cluster names
for this task (`listen_address`).
"""

from __future__ import annotations

import errno
import ipaddress
import random
import socket
import time
from typing import Optional

from . import roles
from .addresses import parse_address
from .errors import ClusterConfigError, PeersMissingError
from .info import ClusterInfo

__all__ = [
    "UNRESOLVED_GRACE",
    "check_own_port_free",
    "free_ports",
    "is_local_host",
    "listen_address",
    "wait_for_peers",
]

# Tasks that run a server others connect to; evaluators run none.
_SERVER_TYPES = (roles.CHIEF, roles.WORKER, roles.PS)

# Seconds a peer's host name may fail to resolve before `wait_for_peers`
# gives up on it: names in Kubernetes (headless services) or Slurm can
# appear shortly after the task starts, but a typo never will, and waiting
# the whole peer timeout for it hides the cause.
UNRESOLVED_GRACE = 10.0


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
    return ip.is_loopback or _is_own_ip(host)


def _is_own_ip(ip: str) -> bool:
    """True when `ip` is an address of a local interface (binding it works)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((ip, 0))
    except OSError:
        return False  # EADDRNOTAVAIL: not an address of this machine
    return True


def listen_address(host: str) -> str:
    """The local IP to listen on for a task at `host`; "" for every interface.

    Our own sockets (the probe peers wait for, the ports `free_ports`
    picks) then bind only where the cluster says this task is, not on
    every interface. `localhost` is 127.0.0.1;
    an IP literal of this machine is itself; another name is resolved and
    its first non-loopback local address is used.

    Every interface ("") is the answer when narrowing could hide this task
    from its peers, which TensorFlow's server (listening on every interface
    anyway) would not: the wildcards `0.0.0.0` / `::`; an address of
    another machine (NAT, a Kubernetes service IP); a name that does not
    resolve here or maps to no local address; and a name other than
    `localhost` that maps only to loopback here (Debian's `127.0.1.1
    <hostname>` line), since peers on other machines resolve it to this
    machine's routable address.

    Example:

    ```python
    listen_address("localhost"), listen_address("[::1]")  # ("127.0.0.1", "::1")
    listen_address("0.0.0.0")                              # ""
    ```
    """
    host = host.strip("[]")
    if host.lower() == "localhost":
        return "127.0.0.1"
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return _own_address_of_name(host)
    if ip.is_unspecified or not _is_own_ip(host):
        return ""
    return host


def _own_address_of_name(name: str) -> str:
    """The first non-loopback local address `name` resolves to, else ""."""
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return ""  # TensorFlow's server listens on every interface anyway
    for _, _, _, _, sockaddr in infos:
        ip = str(sockaddr[0])  # (host, port, ...): the host is a str for IP families
        if not ipaddress.ip_address(ip.split("%")[0]).is_loopback and _is_own_ip(ip):
            return ip
    return ""


def _bind_target(ip: str) -> tuple[int, str]:
    """(family, address) to bind for `listen_address`'s answer `ip`."""
    if ip:
        return (socket.AF_INET6 if ":" in ip else socket.AF_INET), ip
    if socket.has_dualstack_ipv6():
        return socket.AF_INET6, "::"  # with IPV6_V6ONLY off: IPv4 too
    return socket.AF_INET, "0.0.0.0"


def _own_label(info: ClusterInfo) -> str:
    return f"{info.task_type} {info.task_index}"


def _kind(task_type: str) -> str:
    return "worker" if task_type in roles.TRAINING_TASK_TYPES else f"{task_type} task"


def check_own_port_free(info: ClusterInfo) -> None:
    """Fails early when this process's own port is already taken here.

    TensorFlow's gRPC server listens on every interface (`[::]:port`)
    whatever host the address names, so a port taken on any local address
    makes it fail: the port is therefore probed on the wildcard address.
    The probe only binds, never listens, and is closed at once, so it
    accepts no connection. Skipped when the own host is not this machine.
    Works for any role (a ps task's server needs its port as much as a
    worker's).

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
    """Tries to bind (not listen on) `port` on all interfaces, as TensorFlow's
    server will; returns the errno, if any."""
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
    run none and are not waited for. A peer whose host name does not
    resolve fails after `UNRESOLVED_GRACE` seconds (or the timeout, if
    shorter) instead of the whole timeout: that is a wrong name, not a
    slow start.

    Args:
        info: the cluster.
        timeout: seconds to wait in all; None or <= 0 waits forever.
        poll: seconds between connection attempts.

    Raises:
        ClusterConfigError: a peer's host name stayed unresolvable, naming
            it; or on timeout (`PeersMissingError`, with the ranks of the
            training tasks missing), naming the first peer (lowest rank,
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
    # label -> (monotonic time of the first failed lookup, the last error)
    unresolved: dict[str, tuple[float, socket.gaierror]] = {}
    while True:
        pending = [
            (label, a) for label, a in pending if not _answers_or_track(label, a, poll, unresolved)
        ]
        if not pending:
            return
        now = time.monotonic()
        for label, address in pending:
            if label in unresolved and now - unresolved[label][0] >= UNRESOLVED_GRACE:
                raise _unresolved_error(label, address, unresolved[label][1])
        if deadline is not None and now >= deadline:
            label, address = pending[0]
            if label in unresolved:
                raise _unresolved_error(label, address, unresolved[label][1])
            _, port = parse_address(address, label)
            raise PeersMissingError(
                f"{label} at {address} did not answer within {timeout:g}s; "
                f"is it started? Check that it runs and that port {port} is "
                "reachable from this host (firewall, --bind address).",
                ranks=[info.workers.index(a) for _, a in pending if a in info.workers],
            )
        time.sleep(poll)


def _answers_or_track(
    label: str, address: str, timeout: float, unresolved: dict[str, tuple[float, socket.gaierror]]
) -> bool:
    """`_answers`, recording in `unresolved` since when the host name fails."""
    try:
        answered = _answers(address, timeout)
    except socket.gaierror as e:
        since = unresolved[label][0] if label in unresolved else time.monotonic()
        unresolved[label] = (since, e)
        return False
    unresolved.pop(label, None)  # it resolves now (a name that appeared late)
    return answered


def _unresolved_error(label: str, address: str, error: socket.gaierror) -> ClusterConfigError:
    host, _ = parse_address(address, label)
    return ClusterConfigError(
        f"{label} at {address}: host name {host!r} does not resolve "
        f"({error.strerror or error}); check the cluster's host names "
        "(TF_CONFIG, --hosts, the Slurm node list)."
    )


def _answers(address: str, timeout: float) -> bool:
    """True when `address` accepts a TCP connection.

    Raises:
        socket.gaierror: its host name does not resolve (a different
            problem from a peer that is not up yet).
    """
    host, port = parse_address(address)
    try:
        with socket.create_connection((host, port), timeout=max(timeout, 0.05)):
            return True
    except socket.gaierror:
        raise
    except OSError:
        return False


# Ports a task listens on are drawn below the kernel's ephemeral range
# (`ip_local_port_range`, 32768-60999 by default), where no outgoing
# connection takes its local port. A port inside it can be taken meanwhile
# by any connection, including one of the job's own clients dialling the
# task before it listens: Linux may then connect that client to itself
# (TCP simultaneous open) on the very port, and the task's server cannot
# bind it for as long as the client keeps the connection ("Could not start
# gRPC server", the task restarted again and again).
_LOWEST_PORT = 10000
_EPHEMERAL = "/proc/sys/net/ipv4/ip_local_port_range"
_DRAWS = 64


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (32768 if unknown)."""
    try:
        with open(_EPHEMERAL) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bind_listening_port(sock: socket.socket, address: str, top: int, draw: random.Random) -> None:
    """Binds `sock` to a free port in [_LOWEST_PORT, top] (the OS's pick
    when none of a few random draws is free, or the range is empty)."""
    if top > _LOWEST_PORT:
        for _ in range(_DRAWS):
            try:
                sock.bind((address, draw.randint(_LOWEST_PORT, top)))
                return
            except OSError as error:
                if error.errno not in (errno.EADDRINUSE, errno.EACCES):
                    raise
    sock.bind((address, 0))


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """Asks the OS for `n` distinct free TCP ports on `host`.

    The ports are picked on the address a task at `host` listens on
    (`listen_address`: `localhost` and names resolved to a local address,
    every interface when there is none), so they are free where they will
    be used, and below the kernel's ephemeral range, so no outgoing
    connection takes one meanwhile (`_LOWEST_PORT`). All sockets stay open
    until every port is chosen, so the ports differ; they are free when
    this returns, though another process could still bind one before it is
    used. The sockets only bind, never listen.

    Example:

    ```python
    ports = free_ports(2)  # e.g. [21235, 18817]
    workers = [f"127.0.0.1:{p}" for p in ports]
    ```
    """
    if n < 0:
        raise ValueError(f"n={n} must be >= 0.")
    family, address = _bind_target(listen_address(host))
    top = _ephemeral_start() - 1
    draw = random.SystemRandom()  # not the seeded module state: ranks seed alike
    sockets = []
    try:
        for _ in range(n):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            if address == "::":
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            _bind_listening_port(sock, address, top, draw)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()
