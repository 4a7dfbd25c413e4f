"""How `multi_worker`'s workers join Horovod's Gloo without `horovodrun`.

`horovodrun --gloo` starts an HTTP key-value store (Horovod's
`RendezvousServer`) where the ranks meet, and gives each rank its place
in environment variables, which Horovod reads when `hvd.init()` runs.
Here the chief of a `multi_worker` job starts the store (`Rendezvous`, on
its own address, at a free port the workers learn over TensorFlow's
collectives), and each worker's place comes from the cluster
(`environment`): its rank, its index among the workers on its host, its
host's index among the hosts with a worker at that index, and the
network interface that carries its address (`interface_of`: Gloo binds
there, not where the host name resolves).

Horovod ends the process (`std::terminate`) when its rendezvous fails, so
no worker calls `hvd.init()` before every worker has reached the store
(`reachable`, agreed by one sum). Gloo's own timeout,
`HOROVOD_GLOO_TIMEOUT_SECONDS`, also bounds every collective's wait for a
peer: it is the strategy's `collective_timeout`.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import threading
from typing import Iterator, Mapping, Optional, Sequence

# Gloo's timeout where the strategy sets none: a year, in whole seconds.
_NO_TIMEOUT_SECONDS = 365 * 24 * 3600


def places(hosts: Sequence[str]) -> list[dict[str, int]]:
    """Each worker's place in Horovod's terms, by rank: `local_rank` and
    `local_size` (its index among, and the count of, the workers on its
    host), `cross_rank` and `cross_size` (its host's index among, and the
    count of, the hosts with a worker at that local rank; hosts in order
    of their first worker), as `horovodrun` assigns them."""
    order = list(dict.fromkeys(hosts))
    counts = {h: hosts.count(h) for h in order}
    out = []
    for rank, host in enumerate(hosts):
        local_rank = hosts[:rank].count(host)
        peers = [h for h in order if counts[h] > local_rank]
        out.append(
            dict(
                local_rank=local_rank,
                local_size=counts[host],
                cross_rank=peers.index(host),
                cross_size=len(peers),
            )
        )
    return out


def interface_of(ip: str) -> Optional[str]:
    """The name of the local network interface holding address `ip`
    (None: no interface holds it, or `ip` is "")."""
    if not ip:
        return None
    import psutil  # a dependency of Horovod, which the caller has

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == ip for a in addresses):
            return name
    return None


def environment(
    rank: int,
    hosts: Sequence[str],
    store: tuple[str, int],
    interface: Optional[str],
    timeout: Optional[float],
) -> dict[str, str]:
    """The variables `hvd.init()` reads for worker `rank` of workers on
    `hosts` (by rank), meeting at the store at `store` (host, port)."""
    place = places(hosts)[rank]
    env = {
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": store[0],
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(store[1]),
        "HOROVOD_GLOO_TIMEOUT_SECONDS": str(
            _NO_TIMEOUT_SECONDS if timeout is None else max(1, math.ceil(timeout))
        ),
        "HOROVOD_HOSTNAME": hosts[rank],
        "HOROVOD_RANK": str(rank),
        "HOROVOD_SIZE": str(len(hosts)),
        **{f"HOROVOD_{k.upper()}": str(v) for k, v in place.items()},
    }
    if interface:
        env["HOROVOD_GLOO_IFACE"] = interface
    return env


@contextlib.contextmanager
def environ(env: Mapping[str, str]) -> Iterator[None]:
    """`os.environ` with `env` set while inside, as it was after."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def reachable(address: tuple[str, int], timeout: float) -> bool:
    """Whether `address` (host, port: the store, a worker) accepts a TCP
    connection within `timeout` seconds (False also where the host name
    does not resolve)."""
    try:
        with socket.create_connection(address, timeout=max(timeout, 0.05)):
            return True
    except OSError:
        return False


class Rendezvous:
    """Horovod's rendezvous store for the workers on `hosts`, listening on
    `address` ("" for every interface) at a free port (`port`), until
    `stop`. The chief runs it for as long as the job uses Gloo."""

    def __init__(self, address: str, hosts: Sequence[str]):
        from horovod.runner.common.util.hosts import SlotInfo
        from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

        self._httpd = RendezvousHTTPServer((address, 0), RendezvousHandler, 0)
        self.port: int = self._httpd.server_address[1]
        where = places(hosts)
        self._httpd.init(
            [SlotInfo(hostname=h, rank=r, size=len(hosts), **where[r]) for r, h in enumerate(hosts)]
        )
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="kd-gloo-rendezvous", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()
