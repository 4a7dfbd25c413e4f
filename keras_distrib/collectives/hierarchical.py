"""A hierarchical all-reduce: shared memory within each host, a TCP ring between hosts.

With several workers on each of several hosts (8 GPUs per node, say), a
flat ring sends every byte over the network once per worker; here each
host sends it once:

1. the workers of a host sum their arrays through shared memory
   (`HostAllReduce` among them), every one getting the host's sum;
2. one worker per host, its leader (the lowest rank there), sums the
   hosts' sums over a TCP ring of leaders (`TcpRing`);
3. each leader hands the result to its host's other workers through shared
   memory (`HostAllReduce.broadcast`).

Every sum is taken in a fixed order (each engine's), so every worker of
the job ends with bit-identical results; `mean_by_count` divides on the
leaders with the float32 arithmetic of the other engines
(`sum * (1 / max(count, 1))`). A host with one worker has no shared-memory
group; a job on one host has no ring.

Faults: a worker that exits is named by the engine that sees it (a
`PeerLostError` naming its rank in the job). The third step carries a
status besides the results, so the workers of a leader whose ring failed
fail with the leader's error instead of waiting for it; a leader whose
host lost a worker tells its ring neighbour why before it closes
(`TcpRing.abort`), so that neighbour's host names that worker too. After a
failure the engine is closed and every later call raises the same error.

NumPy and the standard library only: `keras_distrib.collectives.
hierarchical_collectives` runs it in the training step through
`tf.numpy_function`.
"""

from __future__ import annotations

import json
import socket
from typing import Callable, Optional, Sequence

import numpy as np

from keras_distrib.collectives.host_allreduce import HostAllReduce
from keras_distrib.collectives.shm_peers import PeerLostError
from keras_distrib.collectives.tcp_ring import TcpRing

__all__ = ["HierarchicalAllReduce", "Plan", "PeerLostError", "plan"]

# Unsigned integers of each size: what all_gather sums a value's bits as.
_BITS = {n: np.dtype(f"uint{8 * n}") for n in (1, 2, 4, 8)}
STATUS_BYTES = 1024  # what a leader's status may say (its error, JSON, truncated)


class Plan:
    """Who is where: the job's workers grouped by host (`hosts`, every
    worker's host by rank), from this worker's (`rank`) view.

    Attributes:
        local: the ranks on this worker's host, ascending (its leader first).
        leaders: every host's leader, ascending: the TCP ring's members.
        host_index: this host's index in `leaders`.
    """

    def __init__(self, rank: int, hosts: Sequence[str]):
        if not 0 <= rank < len(hosts):
            raise ValueError(f"rank={rank} must be in [0, {len(hosts)}).")
        self.rank = rank
        self.local = [r for r, h in enumerate(hosts) if h == hosts[rank]]
        firsts: dict = {}
        for r, h in enumerate(hosts):
            firsts.setdefault(h, r)
        self.leaders = sorted(firsts.values())
        self.host_index = self.leaders.index(self.local[0])

    @property
    def is_leader(self) -> bool:
        return self.rank == self.local[0]


def plan(rank: int, hosts: Sequence[str]) -> Plan:
    """The `Plan` of worker `rank` among workers on `hosts` (by rank)."""
    return Plan(rank, hosts)


class HierarchicalAllReduce:
    """Sums NumPy arrays across a job's workers: shared memory within a
    host, a TCP ring between the hosts' leaders.

    Every worker constructs one with the same `hosts`, `job_id`, `secret`
    and leaders' `addresses`, and its own `rank`; construction waits until
    its host's workers have joined, and on a leader until its ring
    neighbours have connected. Then every worker makes the same calls, with
    arrays of the same shapes and dtypes, in the same order.

    Args:
        rank: This worker's rank in the job.
        hosts: Every worker's host, by rank (workers of one host share
            memory; the names only need to be equal for one host).
        job_id: A secret shared by the job's workers (see `HostAllReduce`;
            each host's group gets its own name from it).
        addresses: `(host, port)` of every leader's listening socket, by
            the leader's index in `plan(...).leaders`.
        secret: 16 bytes shared by the job's workers (see `TcpRing`).
        timeout: Seconds a collective may wait for peers (None: no limit).
        connect_timeout: Seconds to wait for the peers to join.
        listener: A leader's listening socket (default: one bound at its
            address). Closed by `close`.
        directory: The shared-memory job directory's base (see `HostAllReduce`).
        unreachable_after: see `TcpRing`.
    """

    def __init__(
        self,
        rank: int,
        hosts: Sequence[str],
        job_id: str,
        addresses: Sequence[tuple],
        secret: bytes,
        timeout: Optional[float] = None,
        connect_timeout: float = 120.0,
        listener: Optional[socket.socket] = None,
        directory: Optional[str] = None,
        unreachable_after: Optional[float] = None,
    ):
        self.plan = where = plan(rank, hosts)
        self.rank, self.world_size = rank, len(hosts)
        self._failed: Optional[BaseException] = None
        self.local: Optional[HostAllReduce] = None
        self.ring: Optional[TcpRing] = None
        try:
            if len(where.local) > 1:
                self.local = HostAllReduce(
                    where.local.index(rank),
                    len(where.local),
                    f"{job_id}-h{where.local[0]}",
                    timeout=timeout,
                    connect_timeout=connect_timeout,
                    directory=directory,
                    ranks=where.local,
                )
            if where.is_leader and len(where.leaders) > 1:
                self.ring = TcpRing(
                    where.host_index,
                    len(where.leaders),
                    addresses,
                    secret,
                    timeout=timeout,
                    connect_timeout=connect_timeout,
                    listener=listener,
                    ranks=where.leaders,
                    unreachable_after=unreachable_after,
                )
                listener = None
        except BaseException:
            if listener is not None:
                listener.close()
            self.close()
            raise

    # -- the collectives ------------------------------------------------------------

    def all_reduce(self, *arrays: np.ndarray) -> list:
        """Element-wise sums over all workers, one array per input,
        identical on every worker."""
        return self._collective(arrays, _sum_over(lambda ring: ring.all_reduce))

    def mean_by_count(self, *arrays: np.ndarray) -> list:
        """`all_reduce` of float32 arrays whose last is a sample count, the
        others' sums times `1 / max(summed count, 1)` in float32 (divided
        on the leaders, as `TcpRing.mean_by_count` does). The count comes
        back summed."""
        if any(np.asarray(a).dtype != np.float32 for a in arrays):
            raise TypeError("mean_by_count takes float32 arrays only")
        return self._collective(arrays, _sum_over(lambda ring: ring.mean_by_count, divide=True))

    def all_gather(self, array: np.ndarray) -> np.ndarray:
        """Every worker's `array` (one shape and dtype on all), stacked in
        rank order: `[world_size, *array.shape]`: a sum of zeros but for
        each worker's own row, of the bits as unsigned integers (exact for
        every value, -0.0 and NaNs too)."""
        array = np.ascontiguousarray(array)
        bits = _BITS.get(array.dtype.itemsize)
        mine = array if bits is None else array.view(bits)
        table = np.zeros((self.world_size, *array.shape), mine.dtype)
        table[self.rank] = mine
        (gathered,) = self.all_reduce(table)
        result: np.ndarray = gathered if bits is None else gathered.view(array.dtype)
        return result

    def reduce_scatter(self, *tables: np.ndarray) -> list:
        """Row `rank` of the element-wise sum over all workers of each table
        (`[world_size, k]`, of one dtype, shapes the same on all)."""
        tables = tuple(np.asarray(t) for t in tables)
        for t in tables:
            if t.ndim != 2 or t.shape[0] != self.world_size:
                raise ValueError(
                    f"reduce_scatter takes [{self.world_size}, k] tables, not {t.shape}"
                )
        return [total[self.rank].copy() for total in self.all_reduce(*tables)]

    def _collective(self, arrays: Sequence[np.ndarray], across: Callable) -> list:
        """The three steps, `across(ring, host_sums)` the leaders' (a
        failure there told to the host's other workers)."""
        if self._failed is not None:
            raise self._failed
        arrays = [np.asarray(a) for a in arrays]
        try:
            sums = self.local.all_reduce(*arrays) if self.local is not None else arrays
            if not self.plan.is_leader:
                return self._receive(sums)
            try:
                totals = across(self.ring, sums)
            except BaseException as e:
                self._send(sums, e)
                raise
            return self._send(totals, None)
        except BaseException as e:
            self._fail(e)
            raise

    def _send(self, totals: Sequence[np.ndarray], error: Optional[BaseException]) -> list:
        """A leader's results (or `error`) to its host's other workers."""
        if self.local is None:
            return list(totals)
        status = np.zeros(STATUS_BYTES, np.uint8)
        if error is not None:
            peers = list(getattr(error, "peers", ()))
            said = (
                str(error)
                if isinstance(error, PeerLostError)
                else f"{type(error).__name__}: {error}"
            )
            text = json.dumps([said, peers]).encode()
            if len(text) > STATUS_BYTES:
                text = json.dumps([f"{type(error).__name__}", peers]).encode()[:STATUS_BYTES]
            status[: len(text)] = np.frombuffer(text, np.uint8)
        return self.local.broadcast([status, *totals], 0)[1:]

    def _receive(self, sums: Sequence[np.ndarray]) -> list:
        """The leader's results, or its error raised here."""
        assert self.local is not None  # a worker that is not a leader has a host group
        status, *totals = self.local.broadcast([np.zeros(STATUS_BYTES, np.uint8), *sums], 0)
        if status[0]:
            message, peers = json.loads(bytes(status).rstrip(b"\0"))
            raise PeerLostError(
                f"hierarchical all-reduce: worker {self.plan.local[0]} (this host's "
                f"leader) failed: {message}",
                peers=peers or [self.plan.local[0]],
            )
        return totals

    def _fail(self, error: BaseException) -> None:
        """Remembers `error` for later calls, tells the ring why (when this
        host lost a worker) and closes."""
        self._failed = error
        if self.ring is not None and isinstance(error, PeerLostError):
            self.ring.abort(error)
        self.close()

    def close(self) -> None:
        """Closes both engines (idempotent): the host's workers and the
        ring neighbours see this worker leave."""
        for engine in (self.ring, self.local):
            if engine is not None:
                engine.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown, or a constructor that failed early
            pass


def _sum_over(collective: Callable, divide: bool = False) -> Callable:
    """What a leader does with its host's sums: `collective(ring)(*sums)`
    over the ring, or (one host) only the division of `mean_by_count`."""

    def across(ring: Optional[TcpRing], sums: Sequence[np.ndarray]) -> list:
        if ring is not None:
            result: list = collective(ring)(*sums)
            return result
        if not divide:
            return list(sums)
        *values, count = sums
        scale = np.float32(1.0) / np.maximum(count, np.float32(1.0))
        return [np.multiply(v, scale) for v in values] + [count]

    return across
