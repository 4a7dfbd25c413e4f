"""Shared memory between the worker processes of one host, as a transport.

The engine is `keras_distrib.collectives.host_allreduce.HostAllReduce`
(NumPy only); its collectives run in the step as every NumPy engine's do
(`keras_distrib.collectives.numpy_engine`). TensorFlow's gRPC collectives
are slow even between local processes (docs/design.md, section 1.2, row 4):
`multi_worker` reduces here when every worker is on this host and has one
device (`implementation="shm"`). The
predict step's rows still travel by the transport given as `rows`
(TensorFlow's), and so does whatever ran before the workers joined here.
A peer that exits is detected within a second, one stopped (SIGSTOP) within
seconds, whatever the timeout.
"""

from __future__ import annotations

from typing import Optional

from keras_distrib.collectives.host_allreduce import HostAllReduce
from keras_distrib.collectives.numpy_engine import NumpyEngineTransport
from keras_distrib.collectives.transport import Transport


class SharedMemory(NumpyEngineTransport):
    """All-reduces, all-gathers and reduce-scatters through shared memory.

    Every worker makes one with the same `job_id` and its own `rank`;
    making it waits until all have joined (see `HostAllReduce`).

    Args:
        rows: the transport the predict step's rows travel by.
        rank: this worker's index; `world_size`: the workers (one replica each).
        job_id: a secret shared by the job's workers (names its files).
        timeout: seconds a collective may wait for peers (None: no limit).
        connect_timeout: seconds to wait for every worker to join.
        bytes_per_pack: the step's gradients in packs of about this many
            bytes (0: one collective; see `numpy_engine`).
    """

    name = "shm"
    _ops = "kd_host"

    def __init__(
        self,
        rows: Transport,
        rank: int,
        world_size: int,
        job_id: str,
        timeout: Optional[float] = None,
        connect_timeout: float = 120.0,
        bytes_per_pack: int = 0,
    ):
        engine = HostAllReduce(
            rank, world_size, job_id, timeout=timeout, connect_timeout=connect_timeout
        )
        super().__init__(rows, engine, world_size, bytes_per_pack)
