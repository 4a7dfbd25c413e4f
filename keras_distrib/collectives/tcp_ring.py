"""A ring all-reduce over plain TCP sockets between worker processes on different hosts.

TensorFlow's gRPC ring carries about a third of a 10 Gbit/s link between
two hosts where plain TCP between the same hosts carries twice that
(docs/design.md, section 1.2, row 16). This engine moves the bytes itself:

1. every worker listens on its own host; worker `r` connects to worker
   `r + 1` and accepts worker `r - 1` (`tcp_links.join_ring`), each
   connection authenticated by the job's secret; two workers share one
   connection, which carries both directions;
2. the arrays of one dtype are packed end to end in one region
   (`shm_layout.layout`), cut into one chunk per worker;
3. reduce-scatter: in `n - 1` steps each worker passes a chunk to the
   right while it receives one from the left and adds its own part to it,
   so chunk `c` is summed in one fixed order, the last addition done by
   worker `c - 1` alone; all-gather: `n - 1` more steps pass each summed
   chunk around unchanged. Every worker ends with bit-identical results.

It is pipelined and full duplex: chunks travel in segments of about
`SEGMENT_BYTES`, a thread of its own sends (one queue of segments, each
queued as soon as it is received and summed) while the calling thread
receives the next one (`recv_into`; a segment to reduce into a buffer that
stays in cache, then one `np.add(..., out=)` into the results); both
release the GIL. This worker's own chunk is sent straight from its inputs,
and the results are views of one reused buffer: on a fast link memory
traffic is the cost, and this is about all a reduction must do beyond what
a plain exchange of the same bytes does. Every call starts with a
header (call number, kind, bytes), so workers that disagree on the
sequence of collectives fail at once instead of summing garbage.

A peer that exits, closes or resets its connection fails the collective
within a second with a `PeerLostError` naming its rank and address; one
that moves no data for `timeout` seconds fails it too, naming it. After a
failure the engine is closed (its peers see their connections close) and
every later call raises the same error.

NumPy and the standard library only (`tcp_links`, `shm_layout`):
`keras_distrib.collectives.tcp_collectives` runs it in the training step
through `tf.numpy_function`.
"""

from __future__ import annotations

import bisect
import json
import socket
import struct
import time
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from keras_distrib.collectives import flight_recorder
from keras_distrib.collectives.shm_layout import ResultBuffers, chunk, layout, layout_key
from keras_distrib.collectives.shm_peers import PeerLostError
from keras_distrib.collectives.tcp_links import POLL, SECRET_BYTES, Sender, join_ring, listen

__all__ = ["PeerLostError", "SEGMENT_BYTES", "TcpRing"]

SEGMENT_BYTES = 1 << 20  # bytes a ring step's chunk is cut into (the pipeline's unit)
_HEADER = struct.Struct("<QQB")  # call number, bytes, kind
_KINDS = {"all_reduce": 1, "all_gather": 2, "reduce_scatter": 3}
_ABORT = 4  # a worker's last words instead of a call: its error (JSON)
_ABORT_BYTES = 4096  # at most this much of it
_ABORT_SECONDS = 2.0  # how long `abort` tries to send them
_WHAT = "tcp all-reduce"
# Seconds a worker whose left neighbour closed waits to see whether its
# right one closed too (and names both): a failure only, never a step.
_CASCADE_SECONDS = 0.25

# What a ring step reads from this worker's own inputs: (lo, hi) of the
# region -> (a, b, source) pieces covering it, source None for padding.
Spans = Callable[[int, int], Iterator[tuple]]


class TcpRing:
    """Sums NumPy arrays across `world_size` worker processes over TCP.

    Every worker constructs one with the same `addresses` and `secret` and
    its own `rank`; construction waits until its ring neighbours have
    connected. Then every worker makes the same calls, with arrays of the
    same shapes and dtypes, in the same order.

    Args:
        rank: This worker's index in `[0, world_size)`.
        world_size: Number of workers (at least 2).
        addresses: `(host, port)` of every worker's listening socket, by rank.
        secret: `SECRET_BYTES` bytes shared by the job's workers only: a
            connection that does not present it is closed.
        timeout: Seconds a collective may wait for a peer that moves no
            data (None: no limit; a peer that exits is still detected).
        connect_timeout: Seconds to wait for the neighbours to connect.
        listener: This worker's listening socket (bound at
            `addresses[rank]`); default: one bound there now. Closed by `close`.
        ranks: How errors name the workers, by index here (default: the
            index): their ranks in a job where only some workers are in
            this ring (`keras_distrib.collectives.hierarchical`).
        unreachable_after: Seconds after which a neighbour that answers
            nothing at all, not even the kernel's keepalive probes (a cut
            link, a host gone), is lost (None: only `timeout` applies).

    Example:

    ```python
    ring = TcpRing(rank, 2, [("10.0.0.1", 7000), ("10.0.0.2", 7000)], secret)
    total, = ring.all_reduce(np.ones(4, np.float32))  # [2, 2, 2, 2]
    ```
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        addresses: Sequence[tuple],
        secret: bytes,
        timeout: Optional[float] = None,
        connect_timeout: float = 120.0,
        listener: Optional[socket.socket] = None,
        ranks: Optional[Sequence[int]] = None,
        unreachable_after: Optional[float] = None,
    ):
        if world_size < 2 or len(addresses) != world_size:
            raise ValueError(
                f"world_size={world_size} must be >= 2 with one address per worker "
                f"(got {len(addresses)})."
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, {world_size}).")
        if not isinstance(secret, bytes) or len(secret) != SECRET_BYTES:
            raise ValueError(f"secret must be {SECRET_BYTES} bytes.")
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self._calls = 0
        self._failed: Optional[BaseException] = None
        self._layouts: dict = {}
        self._results = ResultBuffers()
        self._spare = np.empty(0, np.uint8)
        self._listener: Optional[socket.socket] = listener or listen(*addresses[rank])
        self._left = self._right = self._sender = None
        try:
            self._left, self._right = join_ring(
                self._listener,
                rank,
                [tuple(a) for a in addresses],
                secret,
                connect_timeout,
                _WHAT,
                ranks,
                unreachable_after,
            )
            self._left.timeout = self._right.timeout = timeout
            self._sender = Sender(self._right)
        except BaseException:
            self.close()
            raise

    # -- the collectives ------------------------------------------------------------

    def all_reduce(self, *arrays: np.ndarray) -> list:
        """Element-wise sums over all workers, one array per input, identical
        on every worker (views of one buffer, each on a cache line)."""
        return self._collective(self._reduce, arrays, False)

    def mean_by_count(self, *arrays: np.ndarray) -> list:
        """`all_reduce` of float32 arrays whose last is a sample count, the
        others' sums times `1 / max(summed count, 1)` in float32 (the
        arithmetic of `Strategy.reduce_gradients` and of the shared-memory
        engine). The count comes back summed."""
        if any(np.asarray(a).dtype != np.float32 for a in arrays):
            raise TypeError("mean_by_count takes float32 arrays only")
        return self._collective(self._reduce, arrays, True)

    def all_gather(self, array: np.ndarray) -> np.ndarray:
        """Every worker's `array` (one shape and dtype on all), stacked in
        rank order: `[world_size, *array.shape]`."""
        gathered: np.ndarray = self._collective(self._gather, np.asarray(array))
        return gathered

    def reduce_scatter(self, *tables: np.ndarray) -> list:
        """Row `rank` of the element-wise sum over all workers of each table
        (`[world_size, k]`, of one dtype, shapes the same on all)."""
        tables = tuple(np.asarray(t) for t in tables)
        for t in tables:
            if t.ndim != 2 or t.shape[0] != self.world_size or t.dtype != tables[0].dtype:
                raise ValueError(
                    f"reduce_scatter takes [{self.world_size}, k] tables of one "
                    f"dtype, not {t.dtype} of shape {t.shape}"
                )
        return self._collective(self._scatter, tables)

    def _collective(self, function: Callable, *args):
        """`function(*args)`, or the error of the failure that closed the engine."""
        if self._failed is not None:
            raise self._failed
        if self._sender is None:
            raise RuntimeError(f"{_WHAT}: the engine is closed.")
        try:
            with flight_recorder.in_collective(f"the {_WHAT}", None):
                return function(*args)
        except BaseException as e:
            failure = self._failed = self._both_closed(e)
            if isinstance(failure, PeerLostError):
                flight_recorder.report(f"its collective failed: {failure}", lost=failure.peers)
            self.close()
            if failure is e:
                raise
            raise failure from None

    def _both_closed(self, error: BaseException) -> BaseException:
        """`error`, or, when the left neighbour closed and the right one has
        too, an error naming both (a worker that fails closes its
        connections: the one that failed first is either)."""
        left, right = self._left, self._right
        if not isinstance(error, PeerLostError) or left is None or right is None:
            return error
        if error.peers != (left.rank,) or right.rank == left.rank:
            return error
        try:
            # The right one's close may still be on its way: its process
            # closes one connection after the other while the left
            # neighbour, which saw the first, already failed and closed.
            deadline = time.monotonic() + _CASCADE_SECONDS
            while True:
                right.check_open()
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.01)
        except PeerLostError as also:
            text = str(also).removeprefix(f"{_WHAT}: ")
            return PeerLostError(
                f"{error} {text[:1].upper()}{text[1:]}", peers=[right.rank, left.rank]
            )
        return error

    def _reduce(self, arrays: Sequence[np.ndarray], divide_by_last: bool) -> list:
        arrays = [np.asarray(a) for a in arrays]
        flats = [np.ascontiguousarray(a).reshape(-1) for a in arrays]
        key = layout_key(arrays)
        if key not in self._layouts:
            self._layouts[key] = layout(arrays)
        groups, nbytes = self._layouts[key]
        out = self._results.take(nbytes)
        self._start("all_reduce", nbytes)
        results: list = [None] * len(arrays)
        totals = []
        for dtype, members, offset, count in groups:
            total = out[offset : offset + count * dtype.itemsize].view(dtype)
            bounds = [chunk(count, self.world_size, c) for c in range(self.world_size)]
            spans = _member_spans(members, flats)
            self._ring(total, bounds, spans, self.world_size - 1, self.world_size - 1)
            totals.append(total)
            for i, start in members:
                results[i] = total[start : start + arrays[i].size].reshape(arrays[i].shape)
        self._finish()
        if divide_by_last and totals:
            total = totals[0]  # one group (float32), the count its last element
            summed = total[-1]
            np.multiply(total, np.float32(1.0) / np.maximum(summed, np.float32(1.0)), out=total)
            total[-1] = summed
        return results

    def _gather(self, array: np.ndarray) -> np.ndarray:
        flat = np.ascontiguousarray(array).reshape(-1)
        n, size = self.world_size, flat.size
        out = self._results.take(n * flat.nbytes).view(flat.dtype)
        self._start("all_gather", out.nbytes)
        bounds = [(c * size, (c + 1) * size) for c in range(n)]
        lo = self.rank * size

        def spans(a: int, b: int) -> Iterator[tuple]:
            yield a, b, flat[a - lo : b - lo]

        self._ring(out, bounds, spans, 0, n - 1)
        self._finish()
        return out.reshape((n, *array.shape))

    def _scatter(self, tables: Sequence[np.ndarray]) -> list:
        n = self.world_size
        if not tables:
            return []
        own = np.concatenate([t for t in tables], axis=1)  # row q: every table's row q
        width = own.shape[1]
        flat = own.reshape(-1)
        total = np.empty_like(flat)
        self._start("reduce_scatter", total.nbytes)
        # After n - 1 reduce steps worker r holds chunk r + 1: that chunk is row r.
        bounds = [(((c - 1) % n) * width, ((c - 1) % n + 1) * width) for c in range(n)]

        def spans(a: int, b: int) -> Iterator[tuple]:
            yield a, b, flat[a:b]

        self._ring(total, bounds, spans, n - 1, 0)
        self._finish()
        row = total[self.rank * width : (self.rank + 1) * width]
        edges = np.cumsum([0] + [t.shape[1] for t in tables])
        return [row[lo:hi].copy() for lo, hi in zip(edges[:-1], edges[1:])]

    # -- the ring ---------------------------------------------------------------------

    def _start(self, kind: str, nbytes: int) -> None:
        """Sends this call's header and checks the left neighbour's."""
        assert self._sender is not None and self._left is not None
        self._calls += 1
        mine = (self._calls, nbytes, _KINDS[kind])
        self._sender.put(memoryview(_HEADER.pack(*mine)))
        header = bytearray(_HEADER.size)
        self._left.recv_into(memoryview(header), self._check)
        theirs = _HEADER.unpack(header)
        if theirs[2] == _ABORT and theirs[1] <= _ABORT_BYTES:
            said = bytearray(theirs[1])
            self._left.recv_into(memoryview(said), self._check)
            message, peers = json.loads(bytes(said))
            left = self._left
            raise PeerLostError(
                f"{_WHAT}: worker {left.rank} at {left.address} stopped: {message}",
                peers=peers or [left.rank],
            )
        if theirs != mine:
            names = {v: k for k, v in _KINDS.items()}
            raise RuntimeError(
                f"{_WHAT}: worker {self._left.rank} is at call {theirs[0]} "
                f"({names.get(theirs[2], '?')} of {theirs[1]} bytes), this worker at call "
                f"{mine[0]} ({kind} of {nbytes} bytes): the workers run different code."
            )

    def _ring(
        self,
        work: np.ndarray,
        bounds: list,
        spans: Spans,
        reduce_steps: int,
        gather_steps: int,
    ) -> None:
        """Runs the ring's steps over `work` (1-D), chunk `c` at
        `bounds[c]`: `reduce_steps` that add this worker's part (`spans`)
        to what arrives, then `gather_steps` that pass the sums on.

        Memory traffic is what bounds it on a fast link, so nothing is
        copied that need not be: this worker's own chunk is sent straight
        from its inputs (a segment of several arrays is packed first), and
        a segment to reduce arrives in a buffer that stays in cache, from
        which one `np.add` writes the sum in place.
        """
        assert self._sender is not None and self._left is not None
        n, r = self.world_size, self.rank
        item = work.dtype.itemsize
        raw = work.view(np.uint8)
        step = max(1, SEGMENT_BYTES // item)

        def segments(c: int) -> list:
            lo, hi = bounds[c]
            return [(a, min(a + step, hi)) for a in range(lo, hi, step)]

        for a, b in segments(r):  # (kept in `work` where no all-gather overwrites it)
            self._sender.put(_own_bytes(work, spans, a, b, keep=not reduce_steps))
        steps = reduce_steps + gather_steps
        scratch = self._scratch(min(step, len(work)) * item).view(work.dtype)
        for s in range(steps):
            for a, b in segments((r - s - 1) % n):
                view = raw[a * item : b * item].data
                if s < reduce_steps:
                    self._left.recv_into(scratch[: b - a].view(np.uint8).data, self._check)
                    for x, y, source in spans(a, b):
                        arrived = scratch[x - a : y - a]
                        if source is None:
                            work[x:y] = arrived
                        else:
                            np.add(arrived, source, out=work[x:y])
                else:
                    self._left.recv_into(view, self._check)
                if s + 1 < steps:
                    self._sender.put(view)

    def _scratch(self, nbytes: int) -> np.ndarray:
        """At least `nbytes` of memory reused by every call (for segments
        received before they are summed)."""
        if self._spare.nbytes < nbytes:
            self._spare = np.empty(nbytes, np.uint8)
        return self._spare[:nbytes]

    def _finish(self) -> None:
        """Returns once everything queued is sent (the caller may then
        change or hand over the memory it was sent from)."""
        assert self._sender is not None
        done = self._sender.mark()
        while not done.wait(POLL):
            self._check()
        if self._sender.error is not None:
            raise self._sender.error

    def _check(self) -> None:
        """Raises what stopped the sender, or a right neighbour that closed
        while it still has data to take (once it has all, it may close)."""
        assert self._sender is not None and self._right is not None
        if self._sender.error is not None:
            raise self._sender.error
        if self._sender.pending:
            self._right.check_open()

    def abort(self, error: BaseException) -> None:
        """Tells the right neighbour, in place of this worker's next call,
        why this worker stops (`error`: its message, and the ranks it names
        if a `PeerLostError`), then closes. The neighbour's next call
        raises a `PeerLostError` with that message; a ring already closed
        (by its own failure) tells nothing."""
        if self._sender is None or self._failed is not None:
            self.close()
            return
        peers = list(getattr(error, "peers", ()))
        said = json.dumps([str(error), peers]).encode()
        if len(said) > _ABORT_BYTES:
            said = json.dumps([type(error).__name__, peers]).encode()[:_ABORT_BYTES]
        self._sender.put(memoryview(_HEADER.pack(self._calls + 1, len(said), _ABORT)))
        self._sender.put(memoryview(said))
        self._sender.mark().wait(_ABORT_SECONDS)
        self._failed = error
        self.close()

    def close(self) -> None:
        """Closes the connections and the listener, stops the sending
        thread (idempotent). Peers see the connections close."""
        if self._sender is not None:
            self._sender.stop()
        for link in (self._left, self._right):
            if link is not None:
                link.close()
        if self._listener is not None:
            self._listener.close()
        if self._sender is not None:
            self._sender.join()
        self._sender = self._left = self._right = None
        self._listener = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown, or a constructor that failed early
            pass


def _own_bytes(work: np.ndarray, spans: Spans, a: int, b: int, keep: bool) -> memoryview:
    """The bytes of this worker's own `[a, b)` of `work`'s region: a view of
    the input array holding them all, else (or to `keep` them in `work`)
    packed into `work` there."""
    pieces = list(spans(a, b))
    if not keep and len(pieces) == 1 and pieces[0][2] is not None and pieces[0][2].size:
        return pieces[0][2].view(np.uint8).data
    for x, y, source in pieces:
        work[x:y] = 0 if source is None else source
    return work[a:b].view(np.uint8).data


def _member_spans(members: list, flats: list) -> Spans:
    """`Spans` of a dtype region of `shm_layout.layout`: the pieces of
    `[lo, hi)` that are its member arrays' elements, and the padding."""
    starts = [start for _, start in members]
    ends = [start + flats[i].size for i, start in members]
    sources = [flats[i] for i, _ in members]
    m = len(starts)

    def spans(lo: int, hi: int) -> Iterator[tuple]:
        k, pos = max(bisect.bisect_right(starts, lo) - 1, 0), lo
        while pos < hi:
            while k < m and ends[k] <= pos:
                k += 1
            if k < m and starts[k] <= pos:
                end = min(hi, ends[k])
                yield pos, end, sources[k][pos - starts[k] : end - starts[k]]
            else:
                end = min(hi, starts[k]) if k < m else hi
                yield pos, end, None
            pos = end

    return spans
