"""The shared-memory all-reduce between real worker processes (no TensorFlow)."""

import os
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from keras_distrib import host_allreduce

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "workers"))
from host_reduce import inputs  # noqa: E402  (after the real package is imported)

WORKER = os.path.join(HERE, "workers", "host_reduce.py")


def _run(tmp_path, world, mode, timeout=None, ranks=None, connect_timeout=20):
    """Starts the ranks, waits (bounded), kills leftovers; returns exit codes."""
    job = uuid.uuid4().hex[:12]
    procs = []
    try:
        for rank in ranks if ranks is not None else range(world):
            args = [sys.executable, WORKER, str(rank), str(world), job, str(tmp_path),
                    str(tmp_path / f"rank{rank}.npz"), mode]
            args += [str(timeout).lower(), str(connect_timeout)]
            procs.append(subprocess.Popen(args))
        return [p.wait(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _error(tmp_path, rank):
    with open(tmp_path / f"rank{rank}.npz.err") as f:
        return f.read()


@pytest.mark.parametrize("world", [2, 3])
def test_sums_are_exact_identical_and_leave_no_files(tmp_path, world):
    assert _run(tmp_path, world, "sums") == [0] * world
    results = [np.load(tmp_path / f"rank{r}.npz") for r in range(world)]
    for call in range(4):
        per_rank = [inputs(r, call) for r in range(world)]
        for i in range(len(per_rank[0])):
            want = sum(np.asarray(p[i], np.float64) for p in per_rank)
            got = results[0][f"c{call}_{i}"]
            assert got.shape == np.shape(per_rank[0][i]) and got.dtype == np.asarray(per_rank[0][i]).dtype
            tol = 1e-2 if got.dtype == np.float16 else 1e-5
            np.testing.assert_allclose(got.astype(np.float64), want, atol=tol, rtol=tol)
            for other in results[1:]:  # each element is summed by one worker only
                np.testing.assert_array_equal(other[f"c{call}_{i}"], got)
    assert sorted(os.listdir(tmp_path)) == sorted(f"rank{r}.npz" for r in range(world))


def test_a_peer_that_exits_is_named(tmp_path):
    start = time.monotonic()
    codes = _run(tmp_path, 2, "exit1")
    assert codes == [1, 3]
    assert time.monotonic() - start < 20
    assert _error(tmp_path, 0).startswith("PeerLostError")
    assert "worker 1" in _error(tmp_path, 0) and "exited" in _error(tmp_path, 0)


def test_a_stuck_peer_hits_the_collective_timeout(tmp_path):
    codes = _run(tmp_path, 3, "stall1", timeout=2, ranks=[0, 1, 2])
    assert codes == [1, 1, 1]
    for rank in (0, 2):
        assert "workers [1] did not arrive within 2s" in _error(tmp_path, rank)
    assert "exited" in _error(tmp_path, 1)  # it woke up to find its peers gone


def test_a_worker_that_never_joins_is_named(tmp_path):
    codes = _run(tmp_path, 2, "sums", ranks=[0], connect_timeout=2)
    assert codes == [1]
    assert "worker 1 did not join within 2s" in _error(tmp_path, 0)
    assert [f for f in os.listdir(tmp_path) if f.startswith("kd-")] == []


@pytest.mark.parametrize("kwargs,fragment", [
    ({"rank": 0, "world_size": 1}, "world_size=1"),
    ({"rank": 2, "world_size": 2}, "rank=2"),
    ({"rank": 0, "world_size": 2, "job_id": "a/b"}, "job_id='a/b'"),
])
def test_bad_arguments(kwargs, fragment):
    kwargs.setdefault("job_id", "x")
    with pytest.raises(ValueError, match=fragment.replace("[", r"\[")):
        host_allreduce.HostAllReduce(**kwargs)


def test_a_full_shm_directory_is_a_clear_error(tmp_path, monkeypatch):
    import errno

    def no_space(fd, offset, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(OSError, match=r"needs 64.0 MiB in .*MiB free; enlarge it \(docker run "
                                      r"--shm-size=...\) or use implementation='ring'"):
        host_allreduce.create_segment(str(tmp_path / "seg"), 64 * 2**20)
    assert os.listdir(tmp_path) == []


def test_segment_is_allocated_at_full_size(tmp_path):
    host_allreduce.create_segment(str(tmp_path / "seg"), 3 * 4096)
    assert os.path.getsize(tmp_path / "seg") == 3 * 4096
    assert os.stat(tmp_path / "seg").st_blocks * 512 >= 3 * 4096  # allocated, not sparse
    assert os.listdir(tmp_path) == ["seg"]
