"""The hierarchical all-reduce between hosts of several workers each, as a transport.

The engine is `keras_distrib.collectives.hierarchical.HierarchicalAllReduce`
(NumPy only): shared memory among the workers of each host, a TCP ring
among one leader per host. Its collectives run in the step as every NumPy engine's do
(`keras_distrib.collectives.numpy_engine`). A flat ring over every worker sends each
byte over the network once per worker; this sends it once per host, which
is what the network carries when each host runs several workers (one per
GPU): `multi_worker` reduces here when asked
(`implementation="hierarchical"`, one device per worker), or when
`"auto"` measures it fastest (`keras_distrib.collectives.engine_choice`).
The predict step's rows still travel by the transport given as `rows`
(TensorFlow's), and so does whatever ran before the workers joined here.
"""

from __future__ import annotations

import socket
from typing import Optional, Sequence

from keras_distrib.collectives.hierarchical import HierarchicalAllReduce
from keras_distrib.collectives.numpy_engine import NumpyEngineTransport
from keras_distrib.collectives.transport import Transport


class HierarchicalCollectives(NumpyEngineTransport):
    """All-reduces, all-gathers and reduce-scatters: shared memory within
    hosts, a TCP ring between them.

    Every worker makes one with the same `hosts`, `job_id`, `addresses` and
    `secret` and its own `rank`; making it waits until its host's workers
    have joined and, on a leader, its ring neighbours have connected (see
    `HierarchicalAllReduce`).

    Args:
        rows: the transport the predict step's rows travel by.
        rank: this worker's rank; `hosts`: every worker's host, by rank
            (one replica each).
        job_id: a secret shared by the job's workers (names the shared
            memory's files).
        addresses: `(host, port)` of every host leader's listening socket,
            in the leaders' order (ascending rank).
        secret: 16 bytes shared by the job's workers only.
        timeout: seconds a collective may wait for peers (None: no limit).
        connect_timeout: seconds to wait for the peers to join.
        unreachable_after: seconds after which a peer that answers
            nothing at all (a cut link) is lost (see `TcpRing`).
        listener: a leader's listening socket (default: one bound at its address).
        bytes_per_pack: the step's gradients in packs of about this many
            bytes (0: one collective; see `numpy_engine`).
    """

    name = "hierarchical"
    _ops = "kd_hier"

    def __init__(
        self,
        rows: Transport,
        rank: int,
        hosts: Sequence[str],
        job_id: str,
        addresses: Sequence[tuple],
        secret: bytes,
        timeout: Optional[float] = None,
        connect_timeout: float = 120.0,
        listener: Optional[socket.socket] = None,
        unreachable_after: Optional[float] = None,
        bytes_per_pack: int = 0,
    ):
        engine = HierarchicalAllReduce(
            rank,
            hosts,
            job_id,
            addresses,
            secret,
            timeout=timeout,
            connect_timeout=connect_timeout,
            listener=listener,
            unreachable_after=unreachable_after,
        )
        super().__init__(rows, engine, len(hosts), bytes_per_pack)
