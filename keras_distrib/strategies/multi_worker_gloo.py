"""`multi_worker`'s workers joining Horovod's Gloo (`"gloo"`, or `"auto"`'s candidate).

Horovod ends a process whose Gloo cannot join (`std::terminate`, after
its timeout when a peer's port is firewalled), so nothing calls
`hvd.init()` before the workers know it will join: every worker can load
Horovod, every worker reaches the chief's rendezvous store, and every
worker reaches every other at a port the kernel gave it (as Gloo's own
listeners will be), each probed with a connection and agreed by one sum.
Otherwise `join` raises one line naming a worker, or, for `"auto"`,
leaves Gloo out. Called by `keras_distrib.strategies.multi_worker_engines`,
whose one sum shares the store's port, the probe ports and which workers
can load Horovod.
"""

from __future__ import annotations

import socket
from typing import Any, Optional

import numpy as np

from keras_distrib import cluster as cluster_lib
from keras_distrib.cluster.network import listen_address
from keras_distrib.collectives import gloo_rendezvous, heartbeats
from keras_distrib.collectives import registry as transports
from keras_distrib.collectives.engine_choice import GLOO
from keras_distrib.collectives.tcp_links import address_text
from keras_distrib.collectives.transport import Transport
from keras_distrib.strategies import horovod as horovod_strategy

_NO_ONE = -1
# Seconds a probe waits for a connection: every listener was up before the
# workers met in the sum that shared its port, and the kernel answers for
# a listener however busy its process is; a port silent this long is
# firewalled.
PROBE_SECONDS = 10.0


class Start:
    """What joining Gloo needs before the workers share their ports: this
    worker's `horovod.tensorflow` (`hvd`, or None and `why` not), and on
    the chief the rendezvous store (`store`, when Horovod loads here)."""

    def __init__(self, strategy: Any):
        self.hvd: Any = None
        self.why = ""
        self.store: Optional[gloo_rendezvous.Rendezvous] = None
        try:
            self.hvd = horovod_strategy.import_horovod("implementation='gloo'")
        except horovod_strategy.HorovodUnavailableError as e:
            self.why = str(e)
            return
        if strategy.is_chief:
            hosts = strategy.cluster.worker_hosts
            self.store = gloo_rendezvous.Rendezvous(listen_address(hosts[0]), hosts)

    def stop(self) -> None:
        if self.store is not None:
            self.store.stop()
            self.store = None


def listen(host: str, world_size: int) -> socket.socket:
    """The probe's listener on `host` at a port the kernel picks, with room
    for every other worker's connection at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, 0), family=family, backlog=max(world_size, 16))


def join(
    strategy: Any,
    start: Start,
    shared: dict,
    timeout: Optional[float],
    connect_timeout: float,
    keep_going: bool,
) -> Optional[Transport]:
    """Gloo's transport once every worker can join it; else raises, or
    with `keep_going` None (the same on every worker)."""
    info = strategy.cluster
    without = [r for r, ok in enumerate(shared["horovod"]) if not ok]
    if without:
        if keep_going:
            return None
        raise horovod_strategy.HorovodUnavailableError(
            start.why
            or f"implementation='gloo' needs Horovod on every worker; worker {without[0]} "
            "cannot load it (scripts/install_horovod.sh builds it)"
        )
    store = _store(info.worker_hosts[0], shared["store_port"])
    problem = _unreached(
        strategy, store, shared["ports"][GLOO], min(connect_timeout, PROBE_SECONDS)
    )
    if problem is not None:
        if keep_going:
            return None
        raise cluster_lib.ClusterConfigError(
            f"implementation='gloo': {problem}; open the ports the kernel gives (Gloo's "
            "and its rendezvous store's) between the workers, or use implementation='tcp'."
        )
    return transports.create(
        GLOO,
        hvd=start.hvd,
        rank=info.rank,
        hosts=info.worker_hosts,
        store=store,
        interface=gloo_rendezvous.interface_of(listen_address(info.worker_hosts[info.rank])),
        timeout=timeout,
        rendezvous=start.store,
        bytes_per_pack=strategy.packing.bytes_per_pack,
        workers=info.workers,
        unreachable_after=heartbeats.timeout(),
    )


def _unreached(strategy: Any, store: tuple, ports: Any, seconds: float) -> Optional[str]:
    """What this worker or another cannot reach (one line, the same on
    every worker), or None: the store, then every other worker's probe
    port; one sum of each worker's first failure."""
    info = strategy.cluster
    hosts = info.worker_hosts
    mine = _NO_ONE
    if not gloo_rendezvous.reachable(store, seconds):
        mine = info.world_size  # the store
    else:
        for peer, port in enumerate(ports):
            if peer != info.rank and not gloo_rendezvous.reachable(
                (hosts[peer], int(port)), seconds
            ):
                mine = peer
                break
    table = np.zeros(info.world_size, np.int64)
    table[info.rank] = mine - _NO_ONE
    (firsts,) = strategy.sync_sum([table])
    for rank, first in enumerate(int(f) + _NO_ONE for f in firsts):
        if first == info.world_size:
            return (
                f"worker {rank} cannot reach Gloo's rendezvous store at "
                f"{address_text(*store)} (on the chief, at a free port)"
            )
        if first != _NO_ONE:
            where = address_text(hosts[first], int(ports[first]))
            return f"worker {rank} cannot reach worker {first} at {where}"
    return None


def _store(host: str, port: int) -> tuple[str, int]:
    """The store's address as Horovod's client takes it (IPv4)."""
    host = host.strip("[]")
    if host.lower() == "localhost":
        return "127.0.0.1", port
    try:
        return socket.gethostbyname(host), port
    except OSError:  # found unreachable, and named, by `_unreached`
        return host, port
