"""All-reduce through shared memory between worker processes on one host.

TensorFlow's CPU collectives go through gRPC even between processes on the
same machine: 4 MB of gradients take ~50 ms there, as long as three
training steps of a 1M-parameter MLP (docs/design.md section 1.2). When every
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

The module needs no TensorFlow (NumPy and `keras_distrib.cluster.launch_contract`
only): `keras_distrib.strategies.multi_worker` calls it from the training
step through `tf.numpy_function`.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import select
import stat
import struct
import sys
import tempfile
import time
from typing import Callable, Optional, Sequence

import numpy as np

from keras_distrib.cluster import launch_contract

_ALIGN = 64  # bytes: each dtype region, and each array in it, starts on a cache line
_RESULT_BUFFERS = 4  # kept for reuse (see HostAllReduce._result_buffer)
_POLL = 1.0  # seconds between liveness checks of the peers in a barrier
_FILE_POLL_MAX = 0.02  # seconds: longest sleep while waiting for a file
MAX_WORKERS = 256  # a barrier token is one byte: the sender's rank
STOPPED_GRACE = 3.0  # seconds a late peer may stay stopped before the wait fails
_JOB_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
# Segment header: magic, generation, st_dev, st_ino, job id (NUL-padded).
_HEADER = struct.Struct("<8sQQQ64s")
_MAGIC = b"KDSHM\x00v1"
_HEADER_BYTES = mmap.PAGESIZE  # the slots start on the next page


class PeerLostError(RuntimeError):
    """A peer exited, stopped, or did not answer within the timeout."""


class SharedMemoryTamperedError(RuntimeError):
    """A file of the job is not the one its worker made (planted or replaced)."""


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
    ):
        if not supported():
            raise RuntimeError("the shared-memory all-reduce needs Linux (named pipes, /dev/shm).")
        if not 2 <= world_size <= MAX_WORKERS:
            raise ValueError(f"world_size={world_size} must be in [2, {MAX_WORKERS}] for shared memory.")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, {world_size}).")
        if not isinstance(job_id, str) or not _JOB_ID.fullmatch(job_id):
            raise ValueError(f"job_id={job_id!r} must be 1 to 64 letters, digits, '_' or '-'.")
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self._job_id = job_id
        self._job_dir = os.path.join(base_directory(directory), f"kd-{job_id}")
        self._job_dir_ours = False  # we made or verified it: close() may remove it
        self._peers = [r for r in range(world_size) if r != rank]
        self._token = bytes([rank])
        self._barriers = 0
        self._received = [0] * world_size
        self._fds: dict = {}
        self._pids: dict = {}
        self._own_files: list = []
        self._segment = None  # mmap of the header page + 2 x world_size slots
        self._slots = None  # uint8 view, shape (2, world_size, slot_bytes)
        self._generation = 0
        self._calls = 0
        self._layouts: dict = {}
        self._results: list = []  # buffers the results are views of (see _result_buffer)
        try:
            self._connect(connect_timeout)
        except BaseException:
            self.close()
            raise

    # -- joining -------------------------------------------------------------

    def _path(self, name: str) -> str:
        return os.path.join(self._job_dir, name)

    def _connect(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self._enter_job_dir(
            timeout,
            f"shared-memory all-reduce: worker 0 did not join within {timeout:.0f}s "
            f"(waiting for it to create {self._job_dir}); check that every worker "
            "runs on this host with the same cluster.")
        fifo = self._path(f"fifo{self.rank}")
        self._own_files.append(fifo)
        _make_fifo(fifo)
        self._read_fd = self._fds[self.rank] = open_verified(fifo, os.O_RDWR, stat.S_ISFIFO)
        # The pid file appears (renamed into place) only once our pipe exists.
        pid_file = self._path(f"pid{self.rank}")
        self._own_files += [pid_file, _temporary(pid_file)]
        write_exclusive(pid_file, lambda fd: os.write(fd, str(os.getpid()).encode()))
        for peer in self._peers:
            path = self._path(f"pid{peer}")
            self._wait_for_file(
                path, peer, deadline - time.monotonic(),
                f"shared-memory all-reduce: worker {peer} did not join within "
                f"{timeout:.0f}s (waiting for {path}); check that every worker "
                "runs on this host with the same cluster.")
            self._pids[peer] = _read_pid(path)
            # O_RDWR: opening a pipe for writing alone blocks until it has a reader.
            self._fds[peer] = open_verified(self._path(f"fifo{peer}"), os.O_RDWR, stat.S_ISFIFO)
        self._barrier(timeout)  # every worker has opened every pipe
        self._remove_own_files()
        self._barrier(timeout)  # every worker has removed its files
        self._leave_job_dir()
        # Nobody looks for the directory again before worker 0 made it anew.
        self._barrier(timeout)

    def _enter_job_dir(self, timeout: Optional[float], late_message: str) -> None:
        """Worker 0 creates the job directory; the others wait for it and verify it."""
        if self.rank == 0:
            try:
                os.mkdir(self._job_dir, 0o700)
            except FileExistsError:
                raise SharedMemoryTamperedError(
                    f"shared-memory all-reduce: {self._job_dir} already exists (another job "
                    "with this id, or planted by another user); remove it and start the "
                    "job again.") from None
            self._job_dir_ours = True
        else:
            self._wait_for_file(self._job_dir, 0, timeout, late_message)
        problem = private_directory_problem(self._job_dir)
        if problem:
            raise SharedMemoryTamperedError(
                f"shared-memory all-reduce: the job directory {self._job_dir} {problem}; "
                "it was not made by worker 0 of this job: remove it and start the job again.")
        self._job_dir_ours = True

    def _leave_job_dir(self) -> None:
        """Worker 0 removes the (now empty) job directory."""
        if self.rank == 0:
            os.rmdir(self._job_dir)
        self._job_dir_ours = False

    # -- synchronisation -----------------------------------------------------

    def _barrier(self, timeout: Optional[float] = None) -> None:
        """Returns once every worker has entered this (numbered) barrier."""
        self._barriers += 1
        for peer in self._peers:
            os.write(self._fds[peer], self._token)
        timeout = self.timeout if timeout is None else timeout
        start = time.monotonic()
        stopped_since: dict = {}
        while True:
            late = [p for p in self._peers if self._received[p] < self._barriers]
            if not late:
                return
            ready, _, _ = select.select([self._read_fd], [], [], _POLL)
            if ready:
                for sender in os.read(self._read_fd, 4096):
                    self._received[sender] += 1
                continue
            self._check_peers(late, stopped_since)
            if timeout is not None and time.monotonic() - start > timeout:
                raise PeerLostError(
                    f"shared-memory all-reduce: workers {late} did not arrive within "
                    f"{timeout:g}s (collective_timeout); a worker is stuck or runs "
                    "different code."
                )

    def _check_peers(self, late: Sequence[int], stopped_since: dict,
                     others: Sequence[int] = ()) -> None:
        """Fails if a peer exited, or a `late` one stayed stopped for STOPPED_GRACE.

        `stopped_since` (one per wait) holds when each late peer was first
        seen stopped; a peer seen running again starts over.
        """
        now = time.monotonic()
        for peer in list(late) + [p for p in others if p not in late]:
            pid = self._pids.get(peer)
            state = _process_state(pid)
            if state == "exited":
                raise PeerLostError(
                    f"shared-memory all-reduce: worker {peer} (pid {pid}) exited; "
                    "see its output for the cause.")
            if peer not in late or state != "stopped":
                stopped_since.pop(peer, None)
                continue
            if now - stopped_since.setdefault(peer, now) >= STOPPED_GRACE:
                raise PeerLostError(
                    f"shared-memory all-reduce: worker {peer} (pid {pid}) is stopped "
                    f"(SIGSTOP or a debugger) and has not arrived for {STOPPED_GRACE:g}s; "
                    "resume it (kill -CONT) or stop the job.")

    def _wait_for_file(self, path: str, worker: int, timeout: Optional[float],
                       late_message: str) -> None:
        """Waits until `worker` creates `path`; fails if a peer exits, or it stops or is late."""
        deadline = None if timeout is None else time.monotonic() + timeout
        stopped_since: dict = {}
        pause = 0.001
        while not os.path.lexists(path):  # a planted link counts: verification rejects it
            self._check_peers([worker], stopped_since, others=list(self._pids))
            if deadline is not None and time.monotonic() > deadline:
                raise PeerLostError(late_message)
            time.sleep(pause)
            pause = min(2 * pause, _FILE_POLL_MAX)

    # -- the shared segment ----------------------------------------------------

    def _reserve(self, nbytes: int) -> None:
        """Makes every slot hold at least `nbytes` (same decision on all workers)."""
        if self._slots is not None and nbytes <= self._slots.shape[2]:
            return
        old = 0 if self._slots is None else self._slots.shape[2]
        slot_bytes = _round_up(max(nbytes, 2 * old), mmap.PAGESIZE)
        size = _HEADER_BYTES + 2 * self.world_size * slot_bytes
        self._generation += 1
        path = self._path(f"data{self._generation}")
        late = "" if self.timeout is None else (
            f"shared-memory all-reduce: worker 0 did not create {path} within "
            f"{self.timeout:g}s (collective_timeout).")
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        self._enter_job_dir(self.timeout, late)
        if self.rank == 0:
            self._own_files += [path, _temporary(path)]
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
        self._slots = np.frombuffer(segment, np.uint8, offset=_HEADER_BYTES).reshape(
            2, self.world_size, slot_bytes)

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

    def _reduce(self, arrays, divide_by_last: bool) -> list:
        arrays = [np.asarray(a) for a in arrays]
        flats = [a.reshape(-1) for a in arrays]
        groups, nbytes = self._layout(arrays)
        self._reserve(nbytes)
        buffers = self._slots[self._calls % 2]
        self._calls += 1
        views = [[b[offset:offset + count * dtype.itemsize].view(dtype) for b in buffers]
                 for dtype, members, offset, count in groups]
        # Copy in what the peers sum: everything but this worker's own chunk,
        # which it sums straight from its inputs (half the copying, with two).
        for (dtype, members, offset, count), per_slot in zip(groups, views):
            region, own = per_slot[self.rank], _chunk(count, self.world_size, self.rank)
            for start, end, flat in _pieces(members, flats):
                for lo, hi in _outside(start, end, own):
                    region[lo:hi] = 0 if flat is None else flat[lo - start:hi - start]
        self._barrier()
        for (dtype, members, offset, count), per_slot in zip(groups, views):
            own_lo, own_hi = _chunk(count, self.world_size, self.rank)
            for start, end, flat in _pieces(members, flats):
                lo, hi = max(start, own_lo), min(end, own_hi)
                if lo >= hi:
                    continue
                out = per_slot[self.rank][lo:hi]
                if flat is None:
                    out[:] = 0
                    continue
                np.add(flat[lo - start:hi - start], per_slot[self._peers[0]][lo:hi], out=out)
                for peer in self._peers[1:]:
                    np.add(out, per_slot[peer][lo:hi], out=out)
        self._barrier()
        scale = None
        if divide_by_last:  # one group (float32); the count is its last element,
            # in the last worker's chunk (`_chunk`'s last part always ends there)
            count = groups[0][3]
            summed = views[0][self.world_size - 1][count - 1]
            scale = np.float32(1.0) / np.maximum(summed, np.float32(1.0))
        results = [None] * len(arrays)
        out = self._result_buffer(nbytes)
        for (dtype, members, offset, count), per_slot in zip(groups, views):
            total = out[offset:offset + count * dtype.itemsize].view(dtype)
            for q in range(self.world_size):
                lo, hi = _chunk(count, self.world_size, q)
                if scale is None:
                    total[lo:hi] = per_slot[q][lo:hi]
                else:
                    np.multiply(per_slot[q][lo:hi], scale, out=total[lo:hi])
            if scale is not None:
                total[-1] = summed
            for i, start in members:
                results[i] = total[start:start + arrays[i].size].reshape(arrays[i].shape)
        return results

    def _result_buffer(self, nbytes: int) -> np.ndarray:
        """`nbytes` bytes starting on a cache line, that no earlier result
        still uses, for this call's results (views of it).

        TensorFlow takes a `numpy_function` result without a copy only when
        its data is aligned (`EIGEN_MAX_ALIGN_BYTES`, at most 64), and memory
        fresh from the system costs a page fault per 4 KB on first write
        (~1 ms for 4 MB); so up to `_RESULT_BUFFERS` buffers are kept and
        reused once nothing refers to them (TensorFlow drops a step's
        results before the next step's `numpy_function` runs).
        """
        for i in range(len(self._results)):
            # A result array, whatever view it is, refers to its buffer as
            # its base: a buffer nothing else refers to has no result alive.
            if _references(self._results, i) == _UNREFERENCED:
                if self._results[i].nbytes < nbytes + _ALIGN:
                    self._results[i] = np.empty(nbytes + _ALIGN, np.uint8)
                raw = self._results[i]
                break
        else:
            raw = np.empty(nbytes + _ALIGN, np.uint8)
            if len(self._results) < _RESULT_BUFFERS:
                self._results.append(raw)
        skip = -raw.ctypes.data % _ALIGN
        return raw[skip:skip + nbytes]

    def _layout(self, arrays: Sequence[np.ndarray]):
        key = tuple((a.dtype.str, a.dtype.name, a.size) for a in arrays)
        if key not in self._layouts:
            members: dict = {}
            for i, a in enumerate(arrays):
                members.setdefault(a.dtype, []).append(i)
            groups, offset = [], 0
            for dtype, indices in members.items():
                # Every array starts on a cache line (padding between them):
                # its result is then a view TensorFlow takes without a copy.
                step = max(1, _ALIGN // dtype.itemsize)
                starts, count = [], 0
                for i in indices:
                    starts.append((i, _round_up(count, step)))
                    count = starts[-1][1] + arrays[i].size
                groups.append((dtype, starts, offset, count))
                offset = _round_up(offset + count * dtype.itemsize, _ALIGN)
            self._layouts[key] = (groups, offset)
        return self._layouts[key]

    # -- teardown ---------------------------------------------------------------

    def _remove_own_files(self) -> None:
        for path in self._own_files:
            _unlink_quietly(path)
        self._own_files = []

    def close(self) -> None:
        """Unmaps the segment, closes the pipes, removes what this worker still owns (idempotent).

        The job directory goes too once empty: worker 0 made it, but the
        last worker to leave a failed join is the one that can remove it.
        """
        self._release_segment()
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = {}
        self._remove_own_files()
        if self._job_dir_ours:
            try:
                os.rmdir(self._job_dir)  # only when empty: a peer may still use it
            except OSError:
                pass
            self._job_dir_ours = False

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown, or a constructor that failed early
            pass


# -- files ---------------------------------------------------------------------


def base_directory(directory: Optional[str] = None) -> str:
    """Where the job directory goes: `directory`, else $KERAS_DISTRIB_SHM_DIR, else /dev/shm.

    The environment variable is verified: the launcher promises a private
    directory there, and a world-writable one would hand our files to others.
    """
    if directory:
        return os.fspath(directory)
    name = launch_contract.SHM_DIR_ENV
    from_env = os.environ.get(name)
    if not from_env:
        return default_directory()
    problem = private_directory_problem(from_env)
    if problem:
        raise SharedMemoryTamperedError(
            f"shared-memory all-reduce: {name}={from_env} {problem}; it must be a "
            "directory of this user with mode 0700 (the launcher makes one per job): "
            f"fix or unset {name}.")
    return from_env


def private_directory_problem(path: str) -> Optional[str]:
    """What makes `path` not a private directory of this user (None: nothing).

    `lstat`, so a symbolic link planted where the directory should be is
    reported as one instead of followed.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "does not exist"
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.getuid():
        return f"belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})"
    if st.st_mode & 0o077:
        return f"has mode {stat.S_IMODE(st.st_mode):04o} (group or others have access; want 0700)"
    return None


def open_verified(path: str, flags: int, is_type: Callable[[int], bool],
                  size: Optional[int] = None) -> int:
    """Opens `path` without following links; checks type, owner and size on the descriptor.

    Checking the open descriptor (not the name) leaves no window in which
    the file could be swapped between the check and the use.
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _tampered(path, "is a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)
        if not is_type(st.st_mode):
            raise _tampered(path, f"has the wrong type ({stat.filemode(st.st_mode)}, "
                                  f"wanted {_TYPE_NAMES.get(is_type, 'another')})")
        if st.st_uid != os.getuid():
            raise _tampered(path, f"belongs to uid {st.st_uid}, not to this user "
                                  f"(uid {os.getuid()})")
        if size is not None and st.st_size != size:
            raise _tampered(path, f"has {st.st_size} bytes instead of {size}")
        if flags & os.O_NONBLOCK == 0:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


_TYPE_NAMES = {stat.S_ISFIFO: "a named pipe", stat.S_ISREG: "a regular file"}


def write_exclusive(path: str, fill: Callable[[int], object]) -> None:
    """Creates `path` (mode 0600) with `fill(fd)` writing it; peers see it only complete.

    The temporary name is created with O_CREAT|O_EXCL|O_NOFOLLOW, so neither
    a file nor a link already there is ever reused; it is renamed into
    place once written, and removed if writing fails.
    """
    tmp = _temporary(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        fill(fd)
        os.rename(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    finally:
        os.close(fd)


def create_segment(path: str, size: int, job_id: str = "", generation: int = 0) -> None:
    """Creates the segment `path` of `size` bytes, its memory allocated now.

    Allocating up front turns a full `/dev/shm` into this error instead of a
    SIGBUS on first write. Peers see the file only at its full size, with
    its header (see `open_segment`) written.
    """

    def fill(fd: int) -> None:
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
        st = os.fstat(fd)
        os.pwrite(fd, _HEADER.pack(_MAGIC, generation, st.st_dev, st.st_ino,
                                   job_id.encode()), 0)

    write_exclusive(path, fill)


def open_segment(path: str, size: int, job_id: str, generation: int) -> mmap.mmap:
    """Maps the segment worker 0 made, after checking it is that very file.

    Besides type, owner and size, the header must name this job and
    generation, and the device/inode worker 0 saw when creating it must be
    the ones of the file we mapped: a copy or a replacement differs.
    """
    fd = open_verified(path, os.O_RDWR, stat.S_ISREG, size)
    try:
        st = os.fstat(fd)
        segment = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    magic, gen, dev, ino, job = _HEADER.unpack_from(segment, 0)
    problem = None
    if magic != _MAGIC:
        problem = "has no segment header"
    elif (dev, ino) != (st.st_dev, st.st_ino):
        problem = (f"is inode {st.st_ino} (device {st.st_dev}) but its header names inode "
                   f"{ino} (device {dev}): it was copied or replaced")
    elif job.rstrip(b"\0") != job_id.encode():
        problem = "belongs to another job"
    elif gen != generation:
        problem = f"is generation {gen}, not {generation}"
    if problem:
        segment.close()
        raise _tampered(path, problem)
    return segment


def _tampered(path: str, problem: str) -> SharedMemoryTamperedError:
    return SharedMemoryTamperedError(
        f"shared-memory all-reduce: {path} {problem}; another user or process planted "
        "or replaced it: stop the job, remove its directory and start again.")


def _temporary(path: str) -> str:
    head, tail = os.path.split(path)
    return os.path.join(head, f".tmp-{tail}")


def _make_fifo(path: str) -> None:
    try:
        os.mkfifo(path, 0o600)  # fails if anything is there
    except FileExistsError:
        raise SharedMemoryTamperedError(
            f"shared-memory all-reduce: {path} already exists: two workers have the same "
            "rank, or it was planted; check the ranks, stop the job and start again.") from None


def _read_pid(path: str) -> int:
    fd = open_verified(path, os.O_RDONLY, stat.S_ISREG)
    try:
        text = os.read(fd, 32)
    finally:
        os.close(fd)
    if not text.isdigit() or int(text) <= 0:
        raise _tampered(path, f"holds {text[:32]!r}, not a process id")
    return int(text)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# -- processes -------------------------------------------------------------------


def _process_state(pid: Optional[int]) -> str:
    """'exited', 'stopped' (SIGSTOP, a debugger) or 'running' (also: unknown)."""
    if pid is None:
        return "running"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "exited"
    except PermissionError:
        pass
    # A zombie (exited, not yet reaped by the launcher) still answers kill().
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "running"
    if state in ("Z", "X"):
        return "exited"
    return "stopped" if state in ("T", "t") else "running"


def _chunk(count: int, parts: int, index: int) -> tuple:
    return count * index // parts, count * (index + 1) // parts


def _pieces(members: list, flats: list):
    """`(start, end, flat)` for each range of a dtype region in order: the
    padding before each member array (`flat` None; zeros, summed like the
    rest), then the array's elements."""
    end = 0
    for i, start in members:
        yield end, start, None
        end = start + flats[i].size
        yield start, end, flats[i]


def _outside(start: int, end: int, chunk: tuple) -> list:
    """The parts of `[start, end)` outside `chunk` (`(lo, hi)`), as ranges."""
    lo, hi = chunk
    parts = [(start, min(end, lo)), (max(start, hi), end)]
    return [(a, b) for a, b in parts if a < b]


def _references(items: list, index: int) -> int:
    """`sys.getrefcount` of `items[index]`."""
    return sys.getrefcount(items[index])


# What `_references` counts for an object only a list refers to, measured
# the same way (so that an interpreter counting temporaries differently
# cannot make a buffer in use look unused).
_UNREFERENCED = _references([object()], 0)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
