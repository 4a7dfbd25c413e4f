"""The shared-memory all-reduce's checks, in this process (NumPy, no TensorFlow).

Arguments, the shared-memory directory, the private job directory and the
segment files: what another user could plant or replace is refused with one
line. All-reduces between real worker processes are in
tests/distributed/test_host_allreduce.py.
"""

import os
import re
import stat
import threading
import uuid

import numpy as np
import pytest

from keras_distrib.collectives import host_allreduce
from keras_distrib.cluster import launch_contract

OTHER_UID = 65534  # "nobody": stands for another user where we may chown (root)


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"rank": 0, "world_size": 1}, "world_size=1"),
        ({"rank": 2, "world_size": 2}, "rank=2"),
        ({"rank": 0, "world_size": 2, "job_id": "a/b"}, "job_id='a/b'"),
        ({"rank": 0, "world_size": 2, "job_id": ""}, "job_id=''"),
        ({"rank": 0, "world_size": 2, "job_id": ".."}, "job_id='..'"),
        ({"rank": 0, "world_size": 2, "job_id": "x" * 65}, "must be 1 to 64 letters"),
    ],
)
def test_bad_arguments(kwargs, fragment):
    kwargs.setdefault("job_id", "x")
    with pytest.raises(ValueError, match=fragment.replace("[", r"\[")):
        host_allreduce.HostAllReduce(**kwargs)


def test_a_full_shm_directory_is_a_clear_error(tmp_path, monkeypatch):
    import errno

    def no_space(fd, offset, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(
        OSError,
        match=r"needs 64.0 MiB in .*MiB free; enlarge it \(docker run "
        r"--shm-size=...\) or use implementation='ring'",
    ):
        host_allreduce.create_segment(str(tmp_path / "seg"), 64 * 2**20)
    assert os.listdir(tmp_path) == []


def test_segment_is_allocated_at_full_size(tmp_path):
    host_allreduce.create_segment(str(tmp_path / "seg"), 3 * 4096)
    assert os.path.getsize(tmp_path / "seg") == 3 * 4096
    assert os.stat(tmp_path / "seg").st_blocks * 512 >= 3 * 4096  # allocated, not sparse
    assert os.listdir(tmp_path) == ["seg"]


# -- a private job directory -------------------------------------------------------


def _job_dir(base, job):
    return os.path.join(base, f"kd-{job}")


def test_a_job_directory_open_to_others_is_refused(tmp_path):
    job = uuid.uuid4().hex[:8]
    os.mkdir(_job_dir(tmp_path, job))
    os.chmod(_job_dir(tmp_path, job), 0o755)  # ours, but others may read it
    with pytest.raises(
        host_allreduce.SharedMemoryTamperedError,
        match=r"kd-\w+ has mode 0755 \(group or others have access; want 0700\)",
    ):
        host_allreduce.HostAllReduce(1, 2, job, connect_timeout=2, directory=str(tmp_path))
    assert os.listdir(_job_dir(tmp_path, job)) == []


@pytest.mark.parametrize(
    "rank,fragment",
    [
        (0, "already exists"),
        (1, "is a symbolic link"),
    ],
)
def test_a_link_in_place_of_the_job_directory_is_refused(tmp_path, rank, fragment):
    job = uuid.uuid4().hex[:8]
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    os.symlink(target, _job_dir(tmp_path, job))
    with pytest.raises(host_allreduce.SharedMemoryTamperedError, match=fragment):
        host_allreduce.HostAllReduce(rank, 2, job, connect_timeout=2, directory=str(tmp_path))
    assert os.listdir(target) == [] and os.path.islink(_job_dir(tmp_path, job))


@pytest.mark.parametrize(
    "how,fragment",
    [
        ("mode", "has mode 0777"),
        ("link", "is a symbolic link"),
        ("missing", "does not exist"),
    ],
)
def test_the_launcher_directory_must_be_private(tmp_path, monkeypatch, how, fragment):
    shm = tmp_path / "shm"
    if how == "mode":
        shm.mkdir()
        os.chmod(shm, 0o777)
    elif how == "link":
        (tmp_path / "real").mkdir(mode=0o700)
        os.symlink(tmp_path / "real", shm)
    monkeypatch.setenv(launch_contract.SHM_DIR_ENV, str(shm))
    with pytest.raises(
        host_allreduce.SharedMemoryTamperedError,
        match=f"KERAS_DISTRIB_SHM_DIR={shm} {fragment}.*fix or unset KERAS_DISTRIB_SHM_DIR",
    ):
        host_allreduce.HostAllReduce(0, 2, "x", connect_timeout=1)
    assert [f for f in os.listdir(tmp_path) if f.startswith("kd-")] == []


# -- a segment is the file worker 0 made -----------------------------------------------


def _copy_over(path):
    with open(path, "rb") as f:
        data = f.read()
    with open(path + ".copy", "wb") as f:  # a new inode while the old one lives
        f.write(data)
    os.replace(path + ".copy", path)


def _symlink_to_a_real_segment(path):
    os.rename(path, path + ".real")
    os.symlink(path + ".real", path)


def _fifo(path):
    os.unlink(path)
    os.mkfifo(path, 0o600)


def _zeros(path):
    os.unlink(path)
    with open(path, "wb") as f:
        f.write(bytes(3 * 4096))


def _other_owner(path):
    if os.getuid() != 0:
        pytest.skip("needs root to give the file to another user")
    os.chown(path, OTHER_UID, OTHER_UID)


@pytest.mark.parametrize(
    "tamper,expect,fragment",
    [
        (
            _copy_over,
            {},
            r"is inode \d+ \(device \d+\) but its header names inode \d+ "
            r"\(device \d+\): it was copied or replaced",
        ),
        (_symlink_to_a_real_segment, {}, "is a symbolic link"),
        (_fifo, {}, r"has the wrong type \(prw-------, wanted a regular file\)"),
        (_zeros, {}, "has no segment header"),
        (_other_owner, {}, f"belongs to uid {OTHER_UID}, not to this user"),
        (None, {"size": 4 * 4096}, "has 12288 bytes instead of 16384"),
        (None, {"job_id": "other"}, "belongs to another job"),
        (None, {"generation": 2}, "is generation 1, not 2"),
    ],
)
def test_a_foreign_or_replaced_segment_is_refused(tmp_path, tamper, expect, fragment):
    path = str(tmp_path / "data1")
    host_allreduce.create_segment(path, 3 * 4096, "job", 1)
    if tamper is not None:
        tamper(path)
    args = dict({"size": 3 * 4096, "job_id": "job", "generation": 1}, **expect)
    with pytest.raises(host_allreduce.SharedMemoryTamperedError) as e:
        host_allreduce.open_segment(path, **args)
    assert str(e.value).startswith(f"shared-memory all-reduce: {path} ")
    assert re.search(fragment, str(e.value)) and "\n" not in str(e.value)


def test_the_segment_worker_0_made_is_accepted(tmp_path):
    path = str(tmp_path / "data1")
    host_allreduce.create_segment(path, 3 * 4096, "job", 1)
    segment = host_allreduce.open_segment(path, 3 * 4096, "job", 1)
    segment[4096:4100] = b"abcd"  # the slots, after the header page
    segment.close()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_a_segment_replaced_between_creation_and_mapping_stops_every_worker(tmp_path, monkeypatch):
    create = host_allreduce.create_segment

    def create_then_replace(path, *args):
        # Made aside and copied into place, so no worker can map the original
        # before the copy replaces it (a race the test would then lose).
        create(path + ".made", *args)
        os.rename(path + ".made", path + ".copy")
        _copy_over(path + ".copy")
        os.rename(path + ".copy", path)

    open_segment = host_allreduce.open_segment
    both_tried = threading.Barrier(2, timeout=10)

    def open_then_wait(*args):
        try:
            return open_segment(*args)
        finally:
            both_tried.wait()  # worker 0 would remove the file once it failed

    monkeypatch.setattr(host_allreduce, "create_segment", create_then_replace)
    monkeypatch.setattr(host_allreduce, "open_segment", open_then_wait)
    errors = {}

    def worker(rank):
        try:
            reducer = host_allreduce.HostAllReduce(
                rank, 2, "swap", timeout=5, connect_timeout=5, directory=str(tmp_path)
            )
            try:
                reducer.all_reduce(np.ones(3, np.float32))
            finally:
                reducer.close()
        except Exception as e:  # noqa: BLE001 - checked below
            errors[rank] = e

    threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert all(isinstance(errors.get(r), host_allreduce.SharedMemoryTamperedError) for r in (0, 1))
    assert "copied or replaced" in str(errors[1])
    assert os.listdir(tmp_path) == []
