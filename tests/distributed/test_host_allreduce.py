"""The shared-memory all-reduce between real worker processes (no TensorFlow).

What needs no second process (arguments, the job directory's and the
segments' checks) is in tests/unit/test_host_allreduce_segments.py.
"""

import contextlib
import os
import stat
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from helpers import WORKERS
from keras_distrib.collectives import host_allreduce  # noqa: F401  (imports the real package first)
from keras_distrib.cluster import launch_contract

sys.path.insert(0, WORKERS)
from host_reduce import inputs, mean_inputs, sum_bound  # noqa: E402  (after the real package is imported)

WORKER = os.path.join(WORKERS, "host_reduce.py")
OTHER_UID = 65534  # "nobody": stands for another user where we may chown (root)


@contextlib.contextmanager
def _processes():
    """A list to put started workers in; whatever still runs at the end is killed."""
    procs = []
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                # SIGKILL ends a stopped process too; a SIGCONT first would let it
                # run on for a moment and create files the test then finds.
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                p.wait()


def _start(
    tmp_path,
    rank,
    world,
    job,
    mode="sums",
    directory=None,
    timeout=None,
    connect_timeout=20,
    env=None,
):
    """One worker of tests/workers/host_reduce.py; directory "" means the default base."""
    directory = str(tmp_path) if directory is None else directory
    args = [
        sys.executable,
        WORKER,
        str(rank),
        str(world),
        job,
        directory,
        str(tmp_path / f"rank{rank}.npz"),
        mode,
        str(timeout).lower(),
        str(connect_timeout),
    ]
    return subprocess.Popen(args, env=env)


def _run(tmp_path, world, mode, timeout=None, ranks=None, connect_timeout=20, job=None):
    """Starts the ranks, waits (bounded), kills leftovers; returns exit codes."""
    job = job or uuid.uuid4().hex[:12]
    with _processes() as procs:
        for rank in ranks if ranks is not None else range(world):
            procs.append(
                _start(
                    tmp_path,
                    rank,
                    world,
                    job,
                    mode,
                    timeout=timeout,
                    connect_timeout=connect_timeout,
                )
            )
        return [p.wait(timeout=60) for p in procs]


def _wait_until(condition, seconds=15):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.005)


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
            assert (
                got.shape == np.shape(per_rank[0][i])
                and got.dtype == np.asarray(per_rank[0][i]).dtype
            )
            if got.dtype.kind == "f":
                bound = sum_bound([p[i] for p in per_rank])
                assert np.all(np.abs(got.astype(np.float64) - want) <= bound), (call, i)
            else:
                np.testing.assert_array_equal(got, want)
            for other in results[1:]:  # each element is summed by one worker only
                np.testing.assert_array_equal(other[f"c{call}_{i}"], got)
            # On a cache line: TensorFlow takes a numpy_function's result
            # without a copy only then (4 MB less copying per step).
            assert all(result[f"a{call}_{i}"] == 0 for result in results), (call, i)
    assert sorted(os.listdir(tmp_path)) == sorted(f"rank{r}.npz" for r in range(world))


@pytest.mark.parametrize("world", [2, 3])
def test_a_slow_reader_never_sees_the_next_calls_data(tmp_path, world):
    # A fast worker must not write its next call's data into a slot a slow
    # one still reads (the two alternating sets of slots are what prevents
    # it: with one set this fails), all-reduces, all-gathers and
    # reduce-scatters (one barrier each) in turn. The last rank sleeps after every barrier.
    assert _run(tmp_path, world, "skewed") == [0] * world
    for rank in range(world):
        assert np.load(tmp_path / f"rank{rank}.npz")["bad"].tolist() == [], rank


def test_results_reuse_memory_nothing_refers_to_any_more(tmp_path):
    # Fresh memory costs a page fault per 4 KB on first write (~1 ms for the
    # 4 MB of gradients of the weak-scaling MLP, every step); a result still
    # held is never overwritten (the "sums" test holds all of them).
    assert _run(tmp_path, 2, "reuse") == [0, 0]
    for rank in range(2):
        result = np.load(tmp_path / f"rank{rank}.npz")
        addresses = result["addresses"]
        assert (addresses == addresses[0]).all(), addresses
        for i in range(len(inputs(0, 0))):
            terms = [inputs(0, 0)[i], inputs(1, 0)[i]]
            want = np.asarray(terms[0], np.float64) + terms[1]
            if want.dtype.kind == "f" and np.asarray(terms[0]).dtype.kind == "f":
                bound = sum_bound(terms)
                assert np.all(np.abs(result[f"c0_{i}"] - want) <= bound), i
            else:
                np.testing.assert_array_equal(result[f"c0_{i}"], want)


@pytest.mark.parametrize("world", [2, 3])
def test_mean_by_count_is_the_sum_times_the_inverse_count_bit_for_bit(tmp_path, world):
    # What Strategy.reduce_gradients computes after a plain all-reduce, in
    # float32: sum * (1 / max(total, 1)); the fused path must not differ.
    assert _run(tmp_path, world, "means") == [0] * world
    results = [np.load(tmp_path / f"rank{r}.npz") for r in range(world)]
    for call in range(3):
        total = np.float32(sum(mean_inputs(r, call)[-1] for r in range(world)))
        scale = np.float32(1.0) / np.maximum(total, np.float32(1.0))
        for i in range(2):
            summed = results[0][f"s{call}_{i}"]  # the plain all-reduce's sum
            terms = [mean_inputs(r, call)[i] for r in range(world)]
            want = sum(np.asarray(t, np.float64) for t in terms)
            assert np.all(np.abs(summed - want) <= sum_bound(terms)), (call, i)
            for result in results:  # identical on every worker
                np.testing.assert_array_equal(result[f"c{call}_{i}"], summed * scale)
        for result in results:
            assert result[f"c{call}_2"] == total


def test_a_peer_that_exits_is_named(tmp_path):
    codes = _run(tmp_path, 2, "exit1")
    assert codes == [1, 3]
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


# -- a private job directory -------------------------------------------------------


def _job_dir(base, job):
    return os.path.join(base, f"kd-{job}")


def _plant(path, mode=0o777):
    """A directory as another user would plant it (owned by them where we can chown)."""
    os.mkdir(path)
    os.chmod(path, mode)
    if os.getuid() == 0:
        os.chown(path, OTHER_UID, OTHER_UID)


def test_a_planted_job_directory_is_refused_and_left_untouched(tmp_path):
    job = uuid.uuid4().hex
    planted = _job_dir(tmp_path, job)
    _plant(planted)
    bait = os.path.join(planted, "pid0")
    with open(bait, "w") as f:
        f.write("1")
    # Refused at once: the errors below are the refusals, not join timeouts.
    codes = _run(tmp_path, 2, "sums", job=job, connect_timeout=10)
    assert codes == [1, 1]
    assert _error(tmp_path, 0) == (
        f"SharedMemoryTamperedError: shared-memory all-reduce: {planted} already exists "
        "(another job with this id, or planted by another user); remove it and start "
        "the job again."
    )
    assert _error(tmp_path, 1).startswith(
        f"SharedMemoryTamperedError: shared-memory all-reduce: the job directory {planted} "
    )
    assert "\n" not in _error(tmp_path, 1)
    assert os.listdir(planted) == ["pid0"] and open(bait).read() == "1"  # nothing read or written
    assert stat.S_IMODE(os.stat(planted).st_mode) == 0o777


def test_the_launcher_directory_holds_the_job_and_nothing_after(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    env = dict(os.environ, **{launch_contract.SHM_DIR_ENV: str(shm)})
    job = uuid.uuid4().hex
    job_dir = _job_dir(shm, job)
    with _processes() as procs:
        procs.append(_start(tmp_path, 0, 3, job, directory="", env=env))
        _wait_until(
            lambda: (
                {"fifo0", "pid0"} <= set(os.listdir(job_dir)) if os.path.isdir(job_dir) else False
            )
        )
        assert stat.S_IMODE(os.lstat(job_dir).st_mode) == 0o700
        procs += [_start(tmp_path, r, 3, job, directory="", env=env) for r in (1, 2)]
        assert [p.wait(timeout=60) for p in procs] == [0, 0, 0]
    assert os.listdir(shm) == []
    default = os.listdir(launch_contract.default_shm_directory())
    assert not any(f.startswith(f"kd-{job}") for f in default)


def test_a_worker_killed_mid_join_is_named_and_the_survivor_leaves_nothing(tmp_path):
    job = uuid.uuid4().hex[:12]
    job_dir = _job_dir(tmp_path, job)
    with _processes() as procs:
        procs += [_start(tmp_path, r, 3, job) for r in (0, 1)]  # rank 2 never comes
        _wait_until(lambda: os.path.exists(os.path.join(job_dir, "pid1")))
        procs[1].kill()
        procs[1].wait()
        assert procs[0].wait(timeout=20) == 1  # the exit is named, not rank 2's absence
    assert _error(tmp_path, 0) == (
        f"PeerLostError: shared-memory all-reduce: worker 1 (pid {procs[1].pid}) exited; "
        "see its output for the cause."
    )
    assert set(os.listdir(job_dir)) <= {"fifo1", "pid1"}  # only the dead worker's


# -- a stopped peer ---------------------------------------------------------------

_STOPPING_WORKER = r"""
import os, signal, sys
sys.path.insert(0, sys.argv[1])
import host_reduce  # noqa: F401  registers keras_distrib without TensorFlow
import numpy as np
from keras_distrib.collectives import host_allreduce

rank, job, directory, out = int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
stopped = int(sys.argv[6])
reducer = host_allreduce.HostAllReduce(rank, 2, job, timeout=None, connect_timeout=20,
                                       directory=directory)
if rank == stopped:
    os.kill(os.getpid(), signal.SIGSTOP)
try:
    reducer.all_reduce(np.ones(3, np.float32))
except host_allreduce.PeerLostError as e:
    reducer.close()
    with open(out, "w") as f:
        f.write(str(e))
    sys.exit(1)
"""


# 1: seen from a barrier; 0: seen while waiting for the segment it should make.
@pytest.mark.parametrize("stopped", [0, 1])
def test_a_stopped_peer_is_named_without_a_timeout(tmp_path, stopped):
    job = uuid.uuid4().hex[:12]
    out = tmp_path / "waiter.txt"
    with _processes() as procs:
        for rank in (0, 1):
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-c",
                        _STOPPING_WORKER,
                        WORKERS,
                        str(rank),
                        job,
                        str(tmp_path),
                        str(out),
                        str(stopped),
                    ]
                )
            )
        assert procs[1 - stopped].wait(timeout=30) == 1
        stopped_pid = procs[stopped].pid
        assert procs[stopped].poll() is None  # still there, stopped
    message = out.read_text()
    assert message == (
        f"shared-memory all-reduce: worker {stopped} (pid {stopped_pid}) is stopped (SIGSTOP "
        "or a debugger) and has not arrived for 3s; resume it (kill -CONT) or stop the job."
    )
    assert sorted(os.listdir(tmp_path)) == ["waiter.txt"]  # the waiter removed what it made
