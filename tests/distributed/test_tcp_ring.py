"""The TCP ring all-reduce between real worker processes (NumPy only, no TensorFlow).

Each test starts 2 or 3 workers (tests/workers/tcp_reduce.py) on
127.0.0.1 at ports `free_ports` picks; whatever still runs at the end is
killed. The strategy over it across two hosts: tests/distributed/
test_multi_worker.py ("2hosts-tcp").
"""

import contextlib
import os
import secrets
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers import WORKERS
from keras_distrib.cluster import free_ports

sys.path.insert(0, WORKERS)
from host_reduce import inputs, mean_inputs, sum_bound  # noqa: E402
from tcp_reduce import tables  # noqa: E402

WORKER = os.path.join(WORKERS, "tcp_reduce.py")


@contextlib.contextmanager
def _workers(tmp_path, world, mode, timeout="none", connect_timeout=20, secrets_=None, ranks=None):
    """Starts the workers of one ring (those of `ranks`); yields (procs, ports)."""
    ports = free_ports(world)
    secret = secrets.token_hex(16)
    procs = []
    try:
        for rank in range(world) if ranks is None else ranks:
            key = secret if secrets_ is None else secrets_[rank]
            args = [str(rank), ",".join(map(str, ports)), key, str(tmp_path / f"rank{rank}.npz")]
            procs.append(
                subprocess.Popen(
                    [sys.executable, WORKER, *args, mode, str(timeout), str(connect_timeout)]
                )
            )
        yield procs, ports
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def _run(tmp_path, world, mode, **kwargs):
    with _workers(tmp_path, world, mode, **kwargs) as (procs, _):
        return [p.wait(timeout=60) for p in procs]


def _error(tmp_path, rank):
    with open(tmp_path / f"rank{rank}.npz.err") as f:
        message, seconds = f.read().rsplit("\n", 1)
    return message, float(seconds)


@pytest.mark.parametrize("world", [2, 3])
def test_sums_are_right_and_identical_on_every_worker(tmp_path, world):
    assert _run(tmp_path, world, "sums") == [0] * world
    results = [np.load(tmp_path / f"rank{r}.npz") for r in range(world)]
    got = results[0]
    for call in range(3):  # mixed dtypes, odd sizes, a scalar, an empty array
        per_rank = [inputs(r, call) for r in range(world)]
        for i, mine in enumerate(per_rank[0]):
            want = sum(np.asarray(p[i], np.float64) for p in per_rank)
            value = got[f"c{call}_{i}"]
            assert value.shape == np.shape(mine) and value.dtype == np.asarray(mine).dtype
            if value.dtype.kind == "i":
                np.testing.assert_array_equal(value, want)
            else:
                bound = sum_bound([p[i] for p in per_rank])
                assert np.all(np.abs(value.astype(np.float64) - want) <= bound), (call, i)
    per_rank = [mean_inputs(r, 0) for r in range(world)]
    count = np.float32(sum(p[-1] for p in per_rank))
    for i in range(len(per_rank[0]) - 1):
        summed = sum(np.asarray(p[i], np.float64) for p in per_rank)
        # The sum, then times 1 / count: two roundings more.
        bound = sum_bound([p[i] for p in per_rank], extra_roundings=2) / max(count, 1)
        assert np.all(np.abs(got[f"m_{i}"] - summed / max(count, 1)) <= bound), i
    assert got[f"m_{len(per_rank[0]) - 1}"] == count
    np.testing.assert_array_equal(
        got["strided"], np.arange(40)[::3] * world * (world + 1) // 2
    )  # a view with strides
    want = np.stack([np.arange(2 * 1500 + r)[-1500:] for r in range(world)])
    np.testing.assert_array_equal(got["gather"], want)
    assert got["gather_empty"].shape == (world, 0, 3)
    for rank, result in enumerate(results):
        for i in range(2):  # each worker its own row of the sum, exactly
            total = sum(tables(r, world)[i] for r in range(world))
            np.testing.assert_array_equal(result[f"rs_{i}"], total[rank])
    for other in results[1:]:  # every element is summed by one worker only
        for key in got.files:
            if not key.startswith("rs_"):
                np.testing.assert_array_equal(other[key], got[key])


@pytest.mark.parametrize("world", [2, 3])
def test_a_peer_that_exits_is_named_within_seconds(tmp_path, world):
    # No collective timeout: its connections close, which the others see.
    last = world - 1
    codes = _run(tmp_path, world, "exit")
    assert codes == [1] * last + [3], codes
    for rank in range(last):
        # With 3, worker 1 may see worker 0 (failed with it) close first:
        # its error then names both.
        message, seconds = _error(tmp_path, rank)
        assert message.startswith("PeerLostError: tcp all-reduce: worker "), message
        assert f"orker {last} at 127.0.0.1:" in message, message
        assert "closed the connection" in message and seconds < 3, (message, seconds)


def test_a_peer_that_sends_nothing_times_out_naming_it(tmp_path):
    codes = _run(tmp_path, 2, "stall", timeout=1)
    assert codes[0] == 1, codes
    message, seconds = _error(tmp_path, 0)
    assert message.startswith("PeerLostError: tcp all-reduce: worker 1 at 127.0.0.1:"), message
    assert "sent nothing for 1s (collective_timeout)" in message and 1 <= seconds < 3, seconds


@pytest.mark.parametrize("world", [2, 3])
def test_a_worker_with_another_secret_is_refused(tmp_path, world):
    keys = [secrets.token_hex(16) for _ in range(world)]
    assert _run(tmp_path, world, "sums", connect_timeout=2, secrets_=keys) == [1] * world
    for rank in range(world):  # each refused its left's connection, and was refused
        message, _ = _error(tmp_path, rank)
        right, left = (rank + 1) % world, (rank - 1) % world
        if rank == 0 or world > 2:  # it dialed its right (two share one connection)
            assert f"worker {right} at 127.0.0.1:" in message, message
            assert "refused this worker's connection" in message, message
        else:
            assert message.startswith(
                f"PeerLostError: tcp all-reduce: worker {left} at 127.0.0.1:"
            ), message
            assert message.endswith(
                "connected with another secret and this worker refused its connection: "
                "not a worker of this job."
            ), message


@pytest.mark.parametrize("world", [2, 3])
def test_a_stranger_is_disconnected_and_the_ring_still_forms(tmp_path, world):
    # Worker 1 takes worker 0's connection (in a ring of two, the only one).
    with _workers(tmp_path, world, "sums", ranks=[1]) as (procs, ports):
        stranger = _connect_when_listening(ports[1])
        stranger.sendall(b"kd-ring1" + bytes(16) + bytes(4))  # worker 0's index, a wrong secret
        stranger.settimeout(10)
        assert stranger.recv(1) == b""  # closed without an answer
        stranger.close()
        key = _secret_of(procs[0])
        for rank in [0, *range(2, world)]:
            args = [str(rank), ",".join(map(str, ports)), key, str(tmp_path / f"rank{rank}.npz")]
            procs.append(subprocess.Popen([sys.executable, WORKER, *args, "sums"]))
        assert [p.wait(timeout=60) for p in procs] == [0] * world


def _secret_of(proc):
    """The secret worker `proc` was started with (its argv)."""
    return proc.args[4]


def _connect_when_listening(port, seconds=15):
    deadline = time.monotonic() + seconds
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=5)
        except ConnectionRefusedError:
            assert time.monotonic() < deadline, "the worker never listened"
            time.sleep(0.02)


def test_a_cut_link_is_named_once_the_peer_answers_nothing(tmp_path, hosts):
    # No FIN ever comes over a cut link, and the collective timeout is off:
    # the kernel's keepalive probes go unanswered for `unreachable_after`.
    bed = hosts(2)
    ports, secret = free_ports(2), secrets.token_hex(16)
    procs = []
    try:
        for rank in range(2):
            args = [str(rank), ",".join(map(str, ports)), secret, str(tmp_path / f"rank{rank}.npz")]
            args += ["pause", "none", "20", ",".join(bed.addresses), "2"]
            procs.append(subprocess.Popen(bed.on(rank, [sys.executable, WORKER, *args])))
        deadline = time.monotonic() + 30
        while not all(os.path.exists(tmp_path / f"rank{r}.npz.ready") for r in range(2)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.02)
        bed.cut(1)
        (tmp_path / "go").touch()
        assert [p.wait(timeout=30) for p in procs] == [1, 1]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    for rank in range(2):
        message, seconds = _error(tmp_path, rank)
        peer = bed.addresses[1 - rank]
        assert message.startswith(
            f"PeerLostError: tcp all-reduce: worker {1 - rank} at {peer}:{ports[1 - rank]} "
            "is unreachable: the connection got no answer for 2s"
        ), message
        assert seconds < 8, (message, seconds)
