"""The workers of a shared-memory all-reduce job: joining, barriers, liveness.

`PeerGroup` is what `HostAllReduce` (`keras_distrib.collectives.host_allreduce`,
whose docstring describes the whole protocol) builds on: worker 0 makes the
private job directory, every worker adds its named pipe and pid file and
opens everyone else's (`_connect`); a barrier is one byte (the sender's
rank) to every peer through those pipes (`_barrier`). While it waits,
a worker checks its peers' processes: one that exited fails the wait, and
so does a late one stopped for `STOPPED_GRACE` seconds.

Standard library and `keras_distrib.collectives.shm_files` only.
"""

from __future__ import annotations

import os
import select
import stat
import time
from typing import Optional, Sequence

from keras_distrib.cluster.process_state import process_state
from keras_distrib.collectives import flight_recorder
from keras_distrib.collectives.shm_files import (
    SharedMemoryTamperedError,
    base_directory,
    make_fifo,
    open_verified,
    private_directory_problem,
    read_pid,
    temporary,
    unlink_quietly,
    write_exclusive,
)

_POLL = 1.0  # seconds between liveness checks of the peers in a barrier
_FILE_POLL_MAX = 0.02  # seconds: longest sleep while waiting for a file
MAX_WORKERS = 256  # a barrier token is one byte: the sender's rank
STOPPED_GRACE = 3.0  # seconds a late peer may stay stopped before the wait fails


class PeerLostError(RuntimeError):
    """A peer exited, stopped, or did not answer within the timeout;
    `peers`: the ranks that did not arrive, when known."""

    def __init__(self, message: str, peers: Sequence[int] = ()):
        super().__init__(message)
        self.peers = tuple(peers)


class PeerGroup:
    """This worker's place among the `world_size` workers of one job on this host.

    Construction only records who is who (`base_directory(directory)`
    may already fail); `_connect` joins the others. A subclass owns
    whatever it shares through the job directory, and extends `close`.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        job_id: str,
        timeout: Optional[float],
        directory: Optional[str],
        ranks: Optional[Sequence[int]] = None,
    ):
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        # How errors name each worker: its rank in the job (`ranks`, by
        # index here), else its index here.
        self._names = list(range(world_size)) if ranks is None else [int(r) for r in ranks]
        if len(self._names) != world_size:
            raise ValueError(f"ranks={ranks!r} must name {world_size} workers.")
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

    # -- joining -------------------------------------------------------------

    def _path(self, name: str) -> str:
        return os.path.join(self._job_dir, name)

    def _connect(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self._enter_job_dir(
            timeout,
            f"shared-memory all-reduce: worker {self._names[0]} did not join within {timeout:.0f}s "
            f"(waiting for it to create {self._job_dir}); check that every worker "
            "runs on this host with the same cluster.",
        )
        fifo = self._path(f"fifo{self.rank}")
        self._own_files.append(fifo)
        make_fifo(fifo)
        self._read_fd = self._fds[self.rank] = open_verified(fifo, os.O_RDWR, stat.S_ISFIFO)
        # The pid file appears (renamed into place) only once our pipe exists.
        pid_file = self._path(f"pid{self.rank}")
        self._own_files += [pid_file, temporary(pid_file)]
        write_exclusive(pid_file, lambda fd: os.write(fd, str(os.getpid()).encode()))
        for peer in self._peers:
            path = self._path(f"pid{peer}")
            self._wait_for_file(
                path,
                peer,
                deadline - time.monotonic(),
                f"shared-memory all-reduce: worker {self._names[peer]} did not join within "
                f"{timeout:.0f}s (waiting for {path}); check that every worker "
                "runs on this host with the same cluster.",
            )
            self._pids[peer] = read_pid(path)
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
                    "job again."
                ) from None
            self._job_dir_ours = True
        else:
            self._wait_for_file(self._job_dir, 0, timeout, late_message)
        problem = private_directory_problem(self._job_dir)
        if problem:
            raise SharedMemoryTamperedError(
                f"shared-memory all-reduce: the job directory {self._job_dir} {problem}; "
                "it was not made by worker 0 of this job: remove it and start the job again."
            )
        self._job_dir_ours = True

    def _leave_job_dir(self) -> None:
        """Worker 0 removes the (now empty) job directory."""
        if self.rank == 0:
            os.rmdir(self._job_dir)
        self._job_dir_ours = False

    # -- synchronisation -----------------------------------------------------

    def _barrier(self, timeout: Optional[float] = None, nbytes: int = 0) -> None:
        """Returns once every worker has entered this (numbered) barrier
        (of a collective of `nbytes`, for the flight recorder)."""
        self._barriers += 1
        for peer in self._peers:
            os.write(self._fds[peer], self._token)
        timeout = self.timeout if timeout is None else timeout
        start = time.monotonic()
        stopped_since: dict = {}
        with flight_recorder.in_collective("the shared-memory all-reduce", nbytes):
            while True:
                late = [p for p in self._peers if self._received[p] < self._barriers]
                if not late:
                    return
                ready, _, _ = select.select([self._read_fd], [], [], _POLL)
                if ready:
                    for sender in os.read(self._read_fd, 4096):
                        self._received[sender] += 1
                    continue
                try:
                    self._check_peers(late, stopped_since)
                    if timeout is not None and time.monotonic() - start > timeout:
                        named = [self._names[p] for p in late]
                        raise PeerLostError(
                            f"shared-memory all-reduce: workers {named} did not arrive within "
                            f"{timeout:g}s (collective_timeout); a worker is stuck or runs "
                            "different code.",
                            peers=named,
                        )
                except PeerLostError as e:
                    flight_recorder.report(f"its collective failed: {e}", lost=e.peers)
                    raise

    def _check_peers(
        self, late: Sequence[int], stopped_since: dict, others: Sequence[int] = ()
    ) -> None:
        """Fails if a peer exited, or a `late` one stayed stopped for STOPPED_GRACE.

        `stopped_since` (one per wait) holds when each late peer was first
        seen stopped; a peer seen running again starts over.
        """
        now = time.monotonic()
        for peer in list(late) + [p for p in others if p not in late]:
            pid = self._pids.get(peer)
            state = process_state(pid)
            if state == "exited":
                raise PeerLostError(
                    f"shared-memory all-reduce: worker {self._names[peer]} (pid {pid}) exited; "
                    "see its output for the cause.",
                    peers=[self._names[peer]],
                )
            if peer not in late or state != "stopped":
                stopped_since.pop(peer, None)
                continue
            if now - stopped_since.setdefault(peer, now) >= STOPPED_GRACE:
                raise PeerLostError(
                    f"shared-memory all-reduce: worker {self._names[peer]} (pid {pid}) is stopped "
                    f"(SIGSTOP or a debugger) and has not arrived for {STOPPED_GRACE:g}s; "
                    "resume it (kill -CONT) or stop the job.",
                    peers=[self._names[peer]],
                )

    def _wait_for_file(
        self, path: str, worker: int, timeout: Optional[float], late_message: str
    ) -> None:
        """Waits until `worker` creates `path`; fails if a peer exits, or it stops or is late."""
        deadline = None if timeout is None else time.monotonic() + timeout
        stopped_since: dict = {}
        pause = 0.001
        while not os.path.lexists(path):  # a planted link counts: verification rejects it
            self._check_peers([worker], stopped_since, others=list(self._pids))
            if deadline is not None and time.monotonic() > deadline:
                raise PeerLostError(late_message, peers=[self._names[worker]])
            time.sleep(pause)
            pause = min(2 * pause, _FILE_POLL_MAX)

    # -- teardown ---------------------------------------------------------------

    def _remove_own_files(self) -> None:
        for path in self._own_files:
            unlink_quietly(path)
        self._own_files = []

    def close(self) -> None:
        """Closes the pipes, removes what this worker still owns (idempotent).

        The job directory goes too once empty: worker 0 made it, but the
        last worker to leave a failed join is the one that can remove it.
        """
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
