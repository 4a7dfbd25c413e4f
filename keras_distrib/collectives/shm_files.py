"""The files of a shared-memory all-reduce job, and how they are checked.

`HostAllReduce` (`keras_distrib.collectives.host_allreduce`, whose
docstring describes the whole protocol) keeps its pipes, pid files and
data segments in a private job directory. This module makes those files
so that peers only ever see them complete (`write_exclusive`), opens them
without following links and checks the open descriptor (`open_verified`),
and writes and verifies the data segment's header (`create_segment`,
`open_segment`). Anything that is not the file its worker made is a
`SharedMemoryTamperedError` naming the file.

Standard library and `keras_distrib.cluster.launch_contract` only.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import struct
import sys
from typing import Callable, Optional

from keras_distrib.cluster import launch_contract

# Segment header: magic, generation, st_dev, st_ino, job id (NUL-padded).
_HEADER = struct.Struct("<8sQQQ64s")
_MAGIC = b"KDSHM\x00v1"
HEADER_BYTES = mmap.PAGESIZE  # the slots start on the next page


class SharedMemoryTamperedError(RuntimeError):
    """A file of the job is not the one its worker made (planted or replaced)."""


def supported() -> bool:
    """Whether this platform has what the shared-memory path needs."""
    return sys.platform.startswith("linux") and hasattr(os, "mkfifo")


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
        return launch_contract.default_shm_directory()
    problem = private_directory_problem(from_env)
    if problem:
        raise SharedMemoryTamperedError(
            f"shared-memory all-reduce: {name}={from_env} {problem}; it must be a "
            "directory of this user with mode 0700 (the launcher makes one per job): "
            f"fix or unset {name}."
        )
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


def open_verified(
    path: str, flags: int, is_type: Callable[[int], bool], size: Optional[int] = None
) -> int:
    """Opens `path` without following links; checks type, owner and size on the descriptor.

    Checking the open descriptor (not the name) leaves no window in which
    the file could be swapped between the check and the use.
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise tampered(path, "is a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)
        if not is_type(st.st_mode):
            raise tampered(
                path,
                f"has the wrong type ({stat.filemode(st.st_mode)}, "
                f"wanted {_TYPE_NAMES.get(is_type, 'another')})",
            )
        if st.st_uid != os.getuid():
            raise tampered(
                path, f"belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})"
            )
        if size is not None and st.st_size != size:
            raise tampered(path, f"has {st.st_size} bytes instead of {size}")
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
    tmp = temporary(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        fill(fd)
        os.rename(tmp, path)
    except BaseException:
        unlink_quietly(tmp)
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
        os.pwrite(fd, _HEADER.pack(_MAGIC, generation, st.st_dev, st.st_ino, job_id.encode()), 0)

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
        problem = (
            f"is inode {st.st_ino} (device {st.st_dev}) but its header names inode "
            f"{ino} (device {dev}): it was copied or replaced"
        )
    elif job.rstrip(b"\0") != job_id.encode():
        problem = "belongs to another job"
    elif gen != generation:
        problem = f"is generation {gen}, not {generation}"
    if problem:
        segment.close()
        raise tampered(path, problem)
    return segment


def tampered(path: str, problem: str) -> SharedMemoryTamperedError:
    """The error for a file of the job that is not what its worker made."""
    return SharedMemoryTamperedError(
        f"shared-memory all-reduce: {path} {problem}; another user or process planted "
        "or replaced it: stop the job, remove its directory and start again."
    )


def temporary(path: str) -> str:
    """The name `path` is written under before it is renamed into place."""
    head, tail = os.path.split(path)
    return os.path.join(head, f".tmp-{tail}")


def make_fifo(path: str) -> None:
    """A new named pipe (mode 0600) at `path`; anything already there is an error."""
    try:
        os.mkfifo(path, 0o600)  # fails if anything is there
    except FileExistsError:
        raise SharedMemoryTamperedError(
            f"shared-memory all-reduce: {path} already exists: two workers have the same "
            "rank, or it was planted; check the ranks, stop the job and start again."
        ) from None


def read_pid(path: str) -> int:
    """The process id a peer wrote to its pid file, verified."""
    fd = open_verified(path, os.O_RDONLY, stat.S_ISREG)
    try:
        text = os.read(fd, 32)
    finally:
        os.close(fd)
    if not text.isdigit() or int(text) <= 0:
        raise tampered(path, f"holds {text[:32]!r}, not a process id")
    return int(text)


def unlink_quietly(path: str) -> None:
    """Removes `path` if it is still there."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
