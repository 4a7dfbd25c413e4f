"""All-reduce through shared memory between worker processes on one host.

TensorFlow's CPU collectives go through gRPC even between processes on the
same machine: 4 MB of gradients take ~50 ms there, as long as three
training steps of a 1M-parameter MLP (docs/design.md section 1.2). When every
worker of a job runs on this host, the `"multi_worker"` strategy reduces
gradients here instead, the way NCCL uses shared memory inside a node:

1. every worker copies its tensors into its own slot of a shared segment;
2. barrier; worker `r` sums chunk `r` of every slot into its own slot
   (reduce-scatter: each element is summed by exactly one worker, so all
   workers get bit-identical results);
3. barrier; every worker copies chunk `q` out of slot `q` (all-gather).

Data moves through a memory-mapped file in `/dev/shm` (two alternating
buffers, so a fast worker never overwrites what a slow one still reads);
barriers are one byte per peer through named pipes, whose kernel locks also
order the memory accesses on every architecture. All files are unlinked as
soon as every worker has opened them, so nothing is left behind even if a
process is killed. A worker blocked in a barrier checks every second that
its peers are still alive and fails naming the one that is gone.

The module needs no TensorFlow (NumPy and `keras_distrib.saving` only):
`keras_distrib.strategies.multi_worker` calls it from the training step
through `tf.numpy_function`.
"""

from __future__ import annotations

import mmap
import os
import select
import sys
import tempfile
import time
from typing import Optional, Sequence

import numpy as np

from keras_distrib import saving

_ALIGN = 64  # bytes: each dtype region starts on a cache line
_POLL = 1.0  # seconds between liveness checks of the peers while waiting
MAX_WORKERS = 256  # a barrier token is one byte: the sender's rank


class PeerLostError(RuntimeError):
    """A peer exited, or did not answer within the timeout."""


def supported() -> bool:
    """Whether this platform has what the shared-memory path needs."""
    return sys.platform.startswith("linux") and hasattr(os, "mkfifo")


def default_directory() -> str:
    """/dev/shm (memory-backed) when present, else the temp directory."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return tempfile.gettempdir()


class HostAllReduce:
    """Sums NumPy arrays across the `world_size` worker processes of a host.

    Every worker constructs one with the same `job_id` (unique to the job:
    it names the files) and its own `rank`; construction waits until all
    have joined. Then every worker calls `all_reduce` with arrays of the
    same shapes and dtypes, in the same order.

    Args:
        rank: This worker's index in `[0, world_size)`.
        world_size: Number of workers on this host (2 to 256).
        job_id: A name shared by the job's workers, unique on this host.
        timeout: Seconds an all-reduce may wait for peers (None: no limit;
            a peer that exits is still detected).
        connect_timeout: Seconds to wait for every worker to join.
        directory: Where the job's files live while workers join
            (default: `/dev/shm`, else the temp directory).

    Example:

    ```python
    reducer = HostAllReduce(rank, 2, job_id="job-1234")
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
    ):
        if not supported():
            raise RuntimeError("the shared-memory all-reduce needs Linux (named pipes, /dev/shm).")
        if not 2 <= world_size <= MAX_WORKERS:
            raise ValueError(f"world_size={world_size} must be in [2, {MAX_WORKERS}] for shared memory.")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, {world_size}).")
        if not job_id or os.sep in job_id:
            raise ValueError(f"job_id={job_id!r} must be a non-empty file name.")
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self._prefix = os.path.join(directory or default_directory(), f"kd-{job_id}")
        self._peers = [r for r in range(world_size) if r != rank]
        self._token = bytes([rank])
        self._barriers = 0
        self._received = [0] * world_size
        self._fds: dict = {}
        self._pids: dict = {}
        self._own_files: list = []
        self._segment = None  # mmap of 2 x world_size slots
        self._slots = None  # uint8 view, shape (2, world_size, slot_bytes)
        self._generation = 0
        self._calls = 0
        self._layouts: dict = {}
        try:
            self._connect(connect_timeout)
        except BaseException:
            self.close()
            raise

    # -- joining -------------------------------------------------------------

    def _path(self, kind: str, rank: int) -> str:
        return f"{self._prefix}-{kind}{rank}"

    def _connect(self, timeout: float) -> None:
        fifo = self._path("fifo", self.rank)
        _unlink_quietly(fifo)  # a stale one from a killed run with this id
        os.mkfifo(fifo, 0o600)
        self._own_files.append(fifo)
        self._read_fd = self._fds[self.rank] = os.open(fifo, os.O_RDWR)
        # The pid file appears (atomically) only once our pipe exists.
        pid_file = self._path("pid", self.rank)
        self._own_files.append(pid_file)
        with saving.atomic_path(pid_file) as tmp, open(tmp, "w") as f:
            f.write(str(os.getpid()))
        deadline = time.monotonic() + timeout
        for peer in self._peers:
            path = self._path("pid", peer)
            self._wait_for_file(
                path, peer, deadline - time.monotonic(),
                f"shared-memory all-reduce: worker {peer} did not join within "
                f"{timeout:.0f}s (waiting for {path}); check that every worker "
                "runs on this host with the same cluster.")
            with open(path) as f:
                self._pids[peer] = int(f.read())
            # O_RDWR: opening a pipe for writing alone blocks until it has a reader.
            self._fds[peer] = os.open(self._path("fifo", peer), os.O_RDWR)
        self._barrier(timeout)  # every worker has opened every pipe
        for path in self._own_files:
            _unlink_quietly(path)
        self._own_files = []

    # -- synchronisation -----------------------------------------------------

    def _barrier(self, timeout: Optional[float] = None) -> None:
        """Returns once every worker has entered this (numbered) barrier."""
        self._barriers += 1
        for peer in self._peers:
            os.write(self._fds[peer], self._token)
        timeout = self.timeout if timeout is None else timeout
        start = time.monotonic()
        while True:
            late = [p for p in self._peers if self._received[p] < self._barriers]
            if not late:
                return
            ready, _, _ = select.select([self._read_fd], [], [], _POLL)
            if ready:
                for sender in os.read(self._read_fd, 4096):
                    self._received[sender] += 1
                continue
            for peer in late:
                if not _alive(self._pids.get(peer)):
                    raise PeerLostError(
                        f"shared-memory all-reduce: worker {peer} (pid {self._pids[peer]}) "
                        "exited; see its output for the cause."
                    )
            if timeout is not None and time.monotonic() - start > timeout:
                raise PeerLostError(
                    f"shared-memory all-reduce: workers {late} did not arrive within "
                    f"{timeout:g}s (collective_timeout); a worker is stuck or runs "
                    "different code."
                )

    # -- the shared segment ----------------------------------------------------

    def _reserve(self, nbytes: int) -> None:
        """Makes every slot hold at least `nbytes` (same decision on all workers)."""
        if self._slots is not None and nbytes <= self._slots.shape[2]:
            return
        old = 0 if self._slots is None else self._slots.shape[2]
        slot_bytes = _round_up(max(nbytes, 2 * old), mmap.PAGESIZE)
        size = 2 * self.world_size * slot_bytes
        self._generation += 1
        path = self._path("data", self._generation)
        if self.rank == 0:
            self._own_files.append(path)
            create_segment(path, size)
        else:
            late = "" if self.timeout is None else (
                f"shared-memory all-reduce: worker 0 did not create {path} within "
                f"{self.timeout:g}s (collective_timeout).")
            self._wait_for_file(path, 0, self.timeout, late)
        fd = os.open(path, os.O_RDWR)
        try:
            segment = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._barrier()  # everyone has mapped it: the name can go
        if self.rank == 0:
            _unlink_quietly(path)
            self._own_files.remove(path)
        self._release_segment()
        self._segment = segment
        self._slots = np.frombuffer(segment, np.uint8).reshape(2, self.world_size, slot_bytes)

    def _wait_for_file(self, path: str, worker: int, timeout: Optional[float],
                       late_message: str) -> None:
        """Waits until `worker` creates `path`; fails if it exits or is late."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not os.path.exists(path):
            if not _alive(self._pids.get(worker)):
                raise PeerLostError(
                    f"shared-memory all-reduce: worker {worker} "
                    f"(pid {self._pids[worker]}) exited."
                )
            if deadline is not None and time.monotonic() > deadline:
                raise PeerLostError(late_message)
            time.sleep(0.001)

    def _release_segment(self) -> None:
        self._slots = None
        if self._segment is not None:
            self._segment.close()
            self._segment = None

    # -- the all-reduce ----------------------------------------------------------

    def all_reduce(self, *arrays: np.ndarray) -> list:
        """Element-wise sums over all workers, one array per input.

        Arrays of one dtype travel in one contiguous region; the results are
        new arrays, identical on every worker.
        """
        arrays = [np.asarray(a) for a in arrays]
        groups, nbytes = self._layout(arrays)
        self._reserve(nbytes)
        buffers = self._slots[self._calls % 2]
        self._calls += 1
        mine = buffers[self.rank]
        for dtype, members, offset, count in groups:
            region = mine[offset:offset + count * dtype.itemsize].view(dtype)
            start = 0
            for i in members:
                size = arrays[i].size
                region[start:start + size] = arrays[i].reshape(-1)
                start += size
        self._barrier()
        views = []
        for dtype, members, offset, count in groups:
            views.append([b[offset:offset + count * dtype.itemsize].view(dtype) for b in buffers])
            lo, hi = _chunk(count, self.world_size, self.rank)
            mine_chunk = views[-1][self.rank][lo:hi]
            for peer in self._peers:
                np.add(mine_chunk, views[-1][peer][lo:hi], out=mine_chunk)
        self._barrier()
        results = [None] * len(arrays)
        for (dtype, members, offset, count), per_slot in zip(groups, views):
            total = np.empty(count, dtype)
            for q in range(self.world_size):
                lo, hi = _chunk(count, self.world_size, q)
                total[lo:hi] = per_slot[q][lo:hi]
            start = 0
            for i in members:
                size = arrays[i].size
                results[i] = total[start:start + size].reshape(arrays[i].shape)
                start += size
        return results

    def _layout(self, arrays: Sequence[np.ndarray]):
        key = tuple((a.dtype.str, a.dtype.name, a.size) for a in arrays)
        if key not in self._layouts:
            members: dict = {}
            for i, a in enumerate(arrays):
                members.setdefault(a.dtype, []).append(i)
            groups, offset = [], 0
            for dtype, indices in members.items():
                count = sum(arrays[i].size for i in indices)
                groups.append((dtype, indices, offset, count))
                offset = _round_up(offset + count * dtype.itemsize, _ALIGN)
            self._layouts[key] = (groups, offset)
        return self._layouts[key]

    # -- teardown ---------------------------------------------------------------

    def close(self) -> None:
        """Unmaps the segment and closes the pipes (idempotent)."""
        self._release_segment()
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = {}
        for path in self._own_files:
            _unlink_quietly(path)
        self._own_files = []

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


def create_segment(path: str, size: int) -> None:
    """Creates the file `path` of `size` bytes, its memory allocated now.

    Allocating up front turns a full `/dev/shm` into this error instead of a
    SIGBUS on first write. Peers see the file only at its full size.
    """
    with saving.atomic_path(path) as tmp:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            free = os.statvfs(os.path.dirname(path))
            raise OSError(
                e.errno,
                f"shared-memory all-reduce needs {size / 2**20:.1f} MiB in "
                f"{os.path.dirname(path)}, which has {free.f_bavail * free.f_frsize / 2**20:.1f} "
                "MiB free; enlarge it (docker run --shm-size=...) or use "
                "implementation='ring'.",
            ) from None
        finally:
            os.close(fd)


def _chunk(count: int, parts: int, index: int) -> tuple:
    return count * index // parts, count * (index + 1) // parts


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _alive(pid: Optional[int]) -> bool:
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped by the launcher) still answers kill().
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
