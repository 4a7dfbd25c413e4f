"""All-reduce through shared memory between worker processes on one host.

TensorFlow's CPU collectives go through gRPC even between processes on the
same machine, at a small fraction of memory's speed (docs/design.md, section
1.2, row 4). When every
worker of a job runs on this host, the `"multi_worker"` strategy reduces
gradients here instead, the way NCCL uses shared memory inside a node:

1. every worker copies its tensors into its own slot of a shared segment,
   except its own chunk (chunk `r` of worker `r`: only `r` reads it);
2. barrier; worker `r` sums its tensors' chunk `r` and chunk `r` of every
   other slot into its own slot (reduce-scatter: each element is summed by
   exactly one worker, so all workers get bit-identical results);
3. barrier; every worker copies chunk `q` out of slot `q` (all-gather).

Data moves through a memory-mapped file (two alternating buffers, so a fast
worker never overwrites what a slow one still reads); barriers are one byte
per peer through named pipes, whose kernel locks also order the memory
accesses on every architecture.

Files are private to the job. They live in the job directory
`<base>/kd-<job_id>`, where base is the `directory` argument, else
`$KERAS_DISTRIB_SHM_DIR` (made by the launcher with mode 0700 for each job,
and checked to be so), else `/dev/shm`. The job id is a secret drawn by
worker 0, so no other user can predict the name. Worker 0 creates the
directory with `mkdir(0700)` and fails if it already exists (a plant, or
another job with the same id); the others wait for it and check with `lstat`
that it is a real directory, ours, with no group or other access. Inside,
every file is created exclusively (`mkfifo`; `O_CREAT|O_EXCL|O_NOFOLLOW`,
mode 0600, renamed into place once complete), and every file a worker opens
is opened with `O_NOFOLLOW` and checked with `fstat` on the open descriptor:
type, owner, size. The data segment starts with a header page holding a
magic, the job id, the generation and the device/inode of the file worker 0
created; every worker compares it with its own `fstat` after mapping. Any
mismatch is a `SharedMemoryTamperedError` naming the file, never a result
computed from someone else's memory.

The directory exists only while files are handed over (at join, and when
worker 0 makes a larger segment): each file is unlinked as soon as every
worker has opened it, then worker 0 removes the directory. A worker removes
whatever it still owns when it fails or closes; what a worker killed by
SIGKILL leaves stays in the job directory, which the launcher removes with
its own.

A worker waiting for its peers (in a barrier, or for a file) checks them
regularly: a peer that exited fails the wait naming it, and so does a late
peer that has been stopped (SIGSTOP, a debugger) for `STOPPED_GRACE` seconds,
even with `timeout=None`.

The pieces live in their own modules: `shm_files` (the job's files, their
checks, the segment header), `shm_peers` (`PeerGroup`: joining, barriers,
watching the peers) and `shm_layout` (where the arrays sit in a slot, the
chunks, the result buffers); this module holds `HostAllReduce`, its data
segment and the reduce-scatter/all-gather, and re-exports their public names.

None of these modules needs TensorFlow (NumPy, and of
`keras_distrib.cluster` `launch_contract` and `process_state` only):
`keras_distrib.strategies.multi_worker` calls `HostAllReduce` from the
training step through `tf.numpy_function`.
"""

from __future__ import annotations

import mmap
import re
import time
from typing import Optional, Sequence

import numpy as np

from keras_distrib.collectives.shm_files import (
    HEADER_BYTES,
    SharedMemoryTamperedError,
    base_directory,
    create_segment,
    open_segment,
    open_verified,
    private_directory_problem,
    supported,
    temporary,
    write_exclusive,
)
from keras_distrib.collectives.shm_layout import (
    ResultBuffers,
    chunk,
    layout,
    layout_key,
    outside,
    pieces,
    round_up,
)
from keras_distrib.collectives.shm_peers import MAX_WORKERS, STOPPED_GRACE, PeerGroup, PeerLostError

__all__ = [
    "HostAllReduce",
    "MAX_WORKERS",
    "PeerLostError",
    "STOPPED_GRACE",
    "SharedMemoryTamperedError",
    "base_directory",
    "create_segment",
    "open_segment",
    "open_verified",
    "private_directory_problem",
    "supported",
    "write_exclusive",
]

_JOB_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


class HostAllReduce(PeerGroup):
    """Sums NumPy arrays across the `world_size` worker processes of a host.

    Every worker constructs one with the same `job_id` and its own `rank`;
    construction waits until all have joined. Then every worker calls
    `all_reduce` with arrays of the same shapes and dtypes, in the same order.

    The job id names the private job directory `<base>/kd-<job_id>`; it must
    be unpredictable to other users (the strategy uses 128 random bits drawn
    by worker 0), since whoever knows it can at least make the job fail by
    creating that name first. A foreign, replaced or badly protected file or
    directory is a `SharedMemoryTamperedError`; a peer that exits, or stays
    stopped for `STOPPED_GRACE` seconds while late, a `PeerLostError`.

    Args:
        rank: This worker's index in `[0, world_size)`.
        world_size: Number of workers on this host (2 to 256).
        job_id: A secret shared by the job's workers, unique on this host:
            1 to 64 characters among letters, digits, `_` and `-`.
        timeout: Seconds an all-reduce may wait for peers (None: no limit;
            a peer that exits or stays stopped is still detected).
        connect_timeout: Seconds to wait for every worker to join.
        directory: The base directory of the job directory (default:
            `$KERAS_DISTRIB_SHM_DIR`, else `/dev/shm`, else the temp
            directory).
        ranks: How errors name the workers, by index here (default: the
            index): their ranks in a job that spans several hosts.

    Example:

    ```python
    reducer = HostAllReduce(rank, 2, job_id=secrets.token_hex(16))
    total, = reducer.all_reduce(np.ones(4, np.float32))  # [2, 2, 2, 2]
    ```
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        job_id: str,
        timeout: Optional[float] = None,
        connect_timeout: float = 120.0,
        directory: Optional[str] = None,
        ranks: Optional[Sequence[int]] = None,
    ):
        if not supported():
            raise RuntimeError("the shared-memory all-reduce needs Linux (named pipes, /dev/shm).")
        if not 2 <= world_size <= MAX_WORKERS:
            raise ValueError(
                f"world_size={world_size} must be in [2, {MAX_WORKERS}] for shared memory."
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, {world_size}).")
        if not isinstance(job_id, str) or not _JOB_ID.fullmatch(job_id):
            raise ValueError(f"job_id={job_id!r} must be 1 to 64 letters, digits, '_' or '-'.")
        super().__init__(rank, world_size, job_id, timeout, directory, ranks)
        # The mmap of the header page + 2 x world_size slots, and its uint8
        # view of shape (2, world_size, slot_bytes).
        self._segment: Optional[mmap.mmap] = None
        self._slots: Optional[np.ndarray] = None
        self._generation = 0
        self._calls = 0
        self._layouts: dict = {}
        self._results = ResultBuffers()  # what the results are views of
        try:
            self._connect(connect_timeout)
        except BaseException:
            self.close()
            raise

    # -- the shared segment ----------------------------------------------------

    def _reserve(self, nbytes: int) -> None:
        """Makes every slot hold at least `nbytes` (same decision on all workers)."""
        if self._slots is not None and nbytes <= self._slots.shape[2]:
            return
        old = 0 if self._slots is None else self._slots.shape[2]
        slot_bytes = round_up(max(nbytes, 2 * old), mmap.PAGESIZE)
        size = HEADER_BYTES + 2 * self.world_size * slot_bytes
        self._generation += 1
        path = self._path(f"data{self._generation}")
        late = (
            ""
            if self.timeout is None
            else (
                f"shared-memory all-reduce: worker {self._names[0]} did not create {path} within "
                f"{self.timeout:g}s (collective_timeout)."
            )
        )
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        self._enter_job_dir(self.timeout, late)
        if self.rank == 0:
            self._own_files += [path, temporary(path)]
            create_segment(path, size, self._job_id, self._generation)
        else:
            left = None if deadline is None else deadline - time.monotonic()
            self._wait_for_file(path, 0, left, late)
        segment = open_segment(path, size, self._job_id, self._generation)
        try:
            self._barrier()  # everyone has mapped it: the name and directory can go
            self._remove_own_files()
            self._leave_job_dir()
        except BaseException:
            segment.close()
            raise
        self._release_segment()
        self._segment = segment
        self._slots = np.frombuffer(segment, np.uint8, offset=HEADER_BYTES).reshape(
            2, self.world_size, slot_bytes
        )

    def _release_segment(self) -> None:
        self._slots = None
        if self._segment is not None:
            try:
                self._segment.close()
            except BufferError:
                # A view is still alive (a failed call's frame in a
                # traceback): the mapping goes with the last one.
                pass
            self._segment = None

    # -- the all-reduce ----------------------------------------------------------

    def all_reduce(self, *arrays: np.ndarray) -> list:
        """Element-wise sums over all workers, one array per input.

        Arrays of one dtype travel in one contiguous region; the results are
        new arrays, identical on every worker.
        """
        return self._reduce(arrays, divide_by_last=False)

    def mean_by_count(self, *arrays: np.ndarray) -> list:
        """`all_reduce` of float32 arrays whose last is a sample count, the
        others' sums divided by the summed count (at least 1).

        The division rides in the copy that gathers the results (no extra
        pass over the gradients), with the same float32 operations as
        `Strategy.reduce_gradients`: `sum * (1 / max(count, 1))`. The count
        comes back summed.
        """
        if any(np.asarray(a).dtype != np.float32 for a in arrays):
            raise TypeError("mean_by_count takes float32 arrays only")
        return self._reduce(arrays, divide_by_last=True)

    def all_gather(self, array: np.ndarray) -> np.ndarray:
        """Every worker's `array` (one shape and dtype on all), stacked in
        rank order: `[world_size, *array.shape]`, identical on every worker.

        Each worker copies its array into its slot; after one barrier each
        copies every slot out. One barrier is enough: the next call writes
        the other buffer, and the one after waits in its barrier for every
        worker to be done with this one.
        """
        array = np.ascontiguousarray(array)
        flat = array.reshape(-1)
        self._reserve(flat.nbytes)
        assert self._slots is not None  # made by _reserve
        buffers = self._slots[self._calls % 2]
        self._calls += 1
        buffers[self.rank][: flat.nbytes].view(flat.dtype)[:] = flat
        self._barrier(nbytes=flat.nbytes)
        out = np.empty((self.world_size, flat.size), flat.dtype)
        for q in range(self.world_size):
            out[q] = buffers[q][: flat.nbytes].view(flat.dtype)
        return out.reshape((self.world_size, *array.shape))

    def broadcast(self, arrays: Sequence[np.ndarray], root: int) -> list:
        """Worker `root`'s `arrays` on every worker (shapes and dtypes the
        same on all: the others' values are not read), as new arrays (on
        `root`, `arrays` themselves).

        `root` copies its arrays into its slot; after one barrier the others
        copy them out. One barrier is enough, as in `all_gather`.
        """
        if not 0 <= root < self.world_size:
            raise ValueError(f"root={root} must be in [0, {self.world_size}).")
        arrays = [np.asarray(a) for a in arrays]
        groups, nbytes = self._layout(arrays)
        self._reserve(nbytes)
        assert self._slots is not None  # made by _reserve
        region = self._slots[self._calls % 2][root]
        self._calls += 1
        if self.rank == root:
            flats = [np.ascontiguousarray(a).reshape(-1) for a in arrays]
            for dtype, members, offset, count in groups:
                view = region[offset : offset + count * dtype.itemsize].view(dtype)
                for i, start in members:
                    view[start : start + flats[i].size] = flats[i]
        self._barrier(nbytes=nbytes)
        if self.rank == root:
            return arrays
        out = self._results.take(nbytes)
        out[:] = region[:nbytes]
        results: list = [None] * len(arrays)
        for dtype, members, offset, count in groups:
            total = out[offset : offset + count * dtype.itemsize].view(dtype)
            for i, start in members:
                results[i] = total[start : start + arrays[i].size].reshape(arrays[i].shape)
        return results

    def reduce_scatter(self, *tables: np.ndarray) -> list:
        """Row `rank` of the element-wise sum over all workers of each table
        (`[world_size, k]`, of one dtype, shapes the same on all): the
        reduce-scatter half of `all_reduce`, each worker getting only its own
        rows.

        Each worker copies the others' rows into its slot (the tables end to
        end); after one barrier it sums its rows from its own input and every
        peer's slot, in the order `all_reduce` sums a chunk. One barrier is
        enough, as in `all_gather`.
        """
        tables = tuple(np.ascontiguousarray(t) for t in tables)
        dtype = tables[0].dtype
        for t in tables:
            if t.ndim != 2 or t.shape[0] != self.world_size or t.dtype != dtype:
                raise ValueError(
                    f"reduce_scatter takes [{self.world_size}, k] tables of one "
                    f"dtype, not {t.dtype} of shape {t.shape}"
                )
        offsets = np.cumsum([0] + [t.size for t in tables])
        self._reserve(int(offsets[-1]) * dtype.itemsize)
        assert self._slots is not None  # made by _reserve
        buffers = self._slots[self._calls % 2]
        self._calls += 1
        slots = [b[: int(offsets[-1]) * dtype.itemsize].view(dtype) for b in buffers]
        for t, start in zip(tables, offsets):
            mine = slots[self.rank][start : start + t.size].reshape(t.shape)
            for q in range(self.world_size):
                if q != self.rank:
                    mine[q] = t[q]
        self._barrier(nbytes=int(offsets[-1]) * dtype.itemsize)
        rows = []
        for t, start in zip(tables, offsets):
            k = t.shape[1]
            lo = start + self.rank * k
            out = t[self.rank].copy()
            for peer in self._peers:
                np.add(out, slots[peer][lo : lo + k], out=out)
            rows.append(out)
        return rows

    def _reduce(self, arrays, divide_by_last: bool) -> list:
        arrays = [np.asarray(a) for a in arrays]
        flats = [a.reshape(-1) for a in arrays]
        groups, nbytes = self._layout(arrays)
        self._reserve(nbytes)
        assert self._slots is not None  # made by _reserve
        buffers = self._slots[self._calls % 2]
        self._calls += 1
        views = [
            [b[offset : offset + count * dtype.itemsize].view(dtype) for b in buffers]
            for dtype, members, offset, count in groups
        ]
        # Copy in what the peers sum: everything but this worker's own chunk,
        # which it sums straight from its inputs (half the copying, with two).
        for (_dtype, members, _offset, count), per_slot in zip(groups, views):
            region, own = per_slot[self.rank], chunk(count, self.world_size, self.rank)
            for start, end, flat in pieces(members, flats):
                for lo, hi in outside(start, end, own):
                    region[lo:hi] = 0 if flat is None else flat[lo - start : hi - start]
        self._barrier(nbytes=nbytes)
        for (_dtype, members, _offset, count), per_slot in zip(groups, views):
            own_lo, own_hi = chunk(count, self.world_size, self.rank)
            for start, end, flat in pieces(members, flats):
                lo, hi = max(start, own_lo), min(end, own_hi)
                if lo >= hi:
                    continue
                out = per_slot[self.rank][lo:hi]
                if flat is None:
                    out[:] = 0
                    continue
                np.add(flat[lo - start : hi - start], per_slot[self._peers[0]][lo:hi], out=out)
                for peer in self._peers[1:]:
                    np.add(out, per_slot[peer][lo:hi], out=out)
        self._barrier(nbytes=nbytes)
        scale = None
        if divide_by_last:  # one group (float32); the count is its last element,
            # in the last worker's chunk (`chunk`'s last part always ends there)
            count = groups[0][3]
            summed = views[0][self.world_size - 1][count - 1]
            scale = np.float32(1.0) / np.maximum(summed, np.float32(1.0))
        results = [None] * len(arrays)
        out = self._results.take(nbytes)
        for (dtype, members, offset, count), per_slot in zip(groups, views):
            total = out[offset : offset + count * dtype.itemsize].view(dtype)
            for q in range(self.world_size):
                lo, hi = chunk(count, self.world_size, q)
                if scale is None:
                    total[lo:hi] = per_slot[q][lo:hi]
                else:
                    np.multiply(per_slot[q][lo:hi], scale, out=total[lo:hi])
            if scale is not None:
                total[-1] = summed
            for i, start in members:
                results[i] = total[start : start + arrays[i].size].reshape(arrays[i].shape)
        return results

    def _layout(self, arrays: Sequence[np.ndarray]):
        key = layout_key(arrays)
        if key not in self._layouts:
            self._layouts[key] = layout(arrays)
        return self._layouts[key]

    def close(self) -> None:
        """Unmaps the segment, closes the pipes, removes what this worker still owns (idempotent).

        The job directory goes too once empty: worker 0 made it, but the
        last worker to leave a failed join is the one that can remove it.
        """
        self._release_segment()
        super().close()
