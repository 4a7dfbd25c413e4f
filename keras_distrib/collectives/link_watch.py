"""Finding a cut link under an engine that cannot: Horovod's Gloo.

Gloo waits for a peer's bytes until its timeout (the strategy's
`collective_timeout`, minutes, so that a chief writing a checkpoint does
not fail the others), and a cut link or a host gone sends it nothing, not
even a reset: the step would hang that long. TensorFlow's coordination
service finds such a peer within its heartbeat timeout but only aborts
TensorFlow's own collectives.

`LinkWatch` is a thread that asks each ring neighbour's server (its
address in the cluster) for a TCP connection every `POLL` seconds. A
refusal is an answer (the host is there; a process that exited closed its
connections, which Gloo sees itself); a neighbour whose host answers
nothing for `unreachable_after` seconds is lost: the watch records one
line naming it (`lost`) and shuts down this process's connections to that
host, so that Gloo's wait ends at once, with an error the strategy
replaces by that line. Standard library and psutil (Horovod's
dependency).
"""

from __future__ import annotations

import errno
import os
import socket
import threading
import time
from typing import Optional, Sequence

from keras_distrib.cluster.addresses import parse_address

POLL = 1.0  # seconds between asks, and how long one ask waits
# What a host that is there answers when nothing listens at the port.
_THERE = (errno.ECONNREFUSED,)


class LinkWatch:
    """Watches the ring neighbours of worker `rank` among `workers`
    (`host:port` of each, by rank) until `stop`."""

    def __init__(self, workers: Sequence[str], rank: int, unreachable_after: float):
        n = len(workers)
        self._peers = sorted({(rank - 1) % n, (rank + 1) % n} - {rank})
        self._workers = list(workers)
        self._after = unreachable_after
        self.lost: Optional[str] = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kd-link-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()

    def _run(self) -> None:
        silent_since: dict[int, float] = {}
        while not self._stopped.wait(POLL):
            for peer in self._peers:
                if answers(self._workers[peer]):
                    silent_since.pop(peer, None)
                    continue
                since = silent_since.setdefault(peer, time.monotonic())
                if time.monotonic() - since >= self._after:
                    self._lose(peer)
                    return

    def _lose(self, peer: int) -> None:
        address = self._workers[peer]
        self.lost = (
            f"worker {peer} at {address} is unreachable: its host answered nothing for "
            f"{self._after:g}s (KERAS_DISTRIB_HEARTBEAT_TIMEOUT)"
        )
        host, _ = parse_address(address)
        cut_connections_to(host)


def answers(address: str) -> bool:
    """Whether the host of `address` answers a connection to it within
    `POLL` seconds (taking it, or refusing it)."""
    host, port = parse_address(address)
    try:
        with socket.create_connection((host, port), timeout=POLL):
            return True
    except OSError as e:
        return e.errno in _THERE


def cut_connections_to(host: str) -> int:
    """Shuts down every TCP connection of this process to `host` (its
    addresses); how many. Whoever waits on one sees it end."""
    import psutil

    try:
        ips = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return 0
    cut = 0
    for conn in psutil.Process().net_connections(kind="tcp"):
        if conn.raddr and conn.raddr.ip in ips and conn.fd >= 0:
            try:
                with socket.socket(fileno=os.dup(conn.fd)) as sock:
                    sock.shutdown(socket.SHUT_RDWR)
                cut += 1
            except OSError:
                pass  # closed meanwhile
    return cut
