"""A ring all-reduce over plain TCP between worker processes on different hosts, as a transport.

The engine is `keras_distrib.collectives.tcp_ring.TcpRing` (NumPy and
sockets only); its collectives run in the step as every NumPy engine's do
(`keras_distrib.collectives.numpy_engine`). TensorFlow's gRPC ring carries
about half of what plain TCP carries between the same two hosts
(docs/design.md, section 1.2, row 16): `multi_worker` reduces here when
asked (`implementation="tcp"`, one device per worker). The predict step's
rows still travel by the transport given as `rows` (TensorFlow's), and so
does whatever ran before the workers joined here. A peer that exits is
detected within a second, one that moves no data for `timeout` seconds
then.
"""

from __future__ import annotations

import socket
from typing import Optional, Sequence

from keras_distrib.collectives.numpy_engine import NumpyEngineTransport
from keras_distrib.collectives.tcp_ring import TcpRing
from keras_distrib.collectives.transport import Transport


class TcpCollectives(NumpyEngineTransport):
    """All-reduces, all-gathers and reduce-scatters over a TCP ring.

    Every worker makes one with the same `addresses` and `secret` and its
    own `rank`; making it waits until its ring neighbours have connected
    (see `TcpRing`).

    Args:
        rows: the transport the predict step's rows travel by.
        rank: this worker's index; `world_size`: the workers (one replica each).
        addresses: `(host, port)` of every worker's listening socket, by rank.
        secret: 16 bytes shared by the job's workers only.
        timeout: seconds a collective may wait for a peer that moves no
            data (None: no limit).
        connect_timeout: seconds to wait for the ring neighbours to connect.
        unreachable_after: seconds after which a peer that answers
            nothing at all (a cut link) is lost (see `TcpRing`).
        listener: this worker's listening socket (default: one bound at
            `addresses[rank]`).
        bytes_per_pack: the step's gradients in packs of about this many
            bytes (0: one collective; see `numpy_engine`).
    """

    name = "tcp"
    _ops = "kd_tcp"

    def __init__(
        self,
        rows: Transport,
        rank: int,
        world_size: int,
        addresses: Sequence[tuple],
        secret: bytes,
        timeout: Optional[float] = None,
        connect_timeout: float = 120.0,
        listener: Optional[socket.socket] = None,
        unreachable_after: Optional[float] = None,
        bytes_per_pack: int = 0,
    ):
        engine = TcpRing(
            rank,
            world_size,
            addresses,
            secret,
            timeout=timeout,
            connect_timeout=connect_timeout,
            listener=listener,
            unreachable_after=unreachable_after,
        )
        super().__init__(rows, engine, world_size, bytes_per_pack)
