"""The hierarchical all-reduce between real worker processes (NumPy only, no TensorFlow).

"Hosts" are names: the workers of one share memory (a group of their own),
and the hosts' leaders form a TCP ring on 127.0.0.1 (tests/workers/
hier_reduce.py). Whatever still runs at the end is killed. The strategy
over it across two hosts of the namespace bed: tests/distributed/
test_multi_worker.py ("2x2hosts-hierarchical").
"""

import contextlib
import os
import secrets
import subprocess
import sys
import uuid

import numpy as np
import pytest

from helpers import WORKERS
from keras_distrib.cluster import free_ports

sys.path.insert(0, WORKERS)
from host_reduce import inputs, mean_inputs  # noqa: E402
from tcp_reduce import tables  # noqa: E402

WORKER = os.path.join(WORKERS, "hier_reduce.py")


@contextlib.contextmanager
def _workers(tmp_path, hosts, mode, timeout="none"):
    """Starts one worker per entry of `hosts`; yields the processes."""
    ports = free_ports(len(set(hosts)))
    job, secret = uuid.uuid4().hex[:12], secrets.token_hex(16)
    procs = []
    try:
        for rank in range(len(hosts)):
            args = [str(rank), ",".join(hosts), job, ",".join(map(str, ports)), secret]
            args += [str(tmp_path), str(tmp_path / f"rank{rank}.npz"), mode, str(timeout)]
            procs.append(subprocess.Popen([sys.executable, WORKER, *args]))
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def _run(tmp_path, hosts, mode):
    with _workers(tmp_path, hosts, mode) as procs:
        return [p.wait(timeout=60) for p in procs]


def _error(tmp_path, rank):
    with open(tmp_path / f"rank{rank}.npz.err") as f:
        message, seconds = f.read().rsplit("\n", 1)
    return message, float(seconds)


def _in_order(hosts, values):
    """The sum of `values` (one per rank) in the engine's order: each
    host's workers in rank order, then the hosts in their leaders' order,
    in the values' own dtype."""
    per_host = {}
    for host, value in zip(hosts, values):
        per_host[host] = value if host not in per_host else per_host[host] + value
    total = None
    for value in per_host.values():
        total = value if total is None else total + value
    return total


# 2 hosts of 2 workers; a host of one worker (no shared memory there) and
# one of two.
@pytest.mark.parametrize("hosts", [["a", "a", "b", "b"], ["a", "b", "b"]], ids=["2x2", "1+2"])
def test_sums_are_exact_and_identical_on_every_worker(tmp_path, hosts):
    world = len(hosts)
    assert _run(tmp_path, hosts, "sums") == [0] * world
    results = [np.load(tmp_path / f"rank{r}.npz") for r in range(world)]
    for call in range(3):  # mixed dtypes, odd sizes, a scalar, an empty array
        per_rank = [inputs(r, call) for r in range(world)]
        for i, mine in enumerate(per_rank[0]):
            want = _in_order(hosts, [np.asarray(p[i]) for p in per_rank])
            got = results[0][f"c{call}_{i}"]
            assert got.dtype == np.asarray(mine).dtype and got.shape == np.shape(mine)
            np.testing.assert_array_equal(got, want)
    for call in range(3):  # counts 0 on some ranks, and in total on the last call
        per_rank = [mean_inputs(r, call) for r in range(world)]
        count = _in_order(hosts, [p[-1] for p in per_rank])
        scale = np.float32(1.0) / np.maximum(count, np.float32(1.0))
        for i in range(2):
            want = _in_order(hosts, [p[i] for p in per_rank]) * scale
            np.testing.assert_array_equal(results[0][f"m{call}_{i}"], want)
        assert results[0][f"m{call}_2"] == count
    want = np.stack([np.arange(2 * 1500 + r)[-1500:] for r in range(world)])
    np.testing.assert_array_equal(results[0]["gather"], want)
    bits = np.stack([np.array([-0.0, np.nan, r], np.float32) for r in range(world)])
    assert results[0]["gather_bits"].tobytes() == bits.tobytes()  # -0.0 and NaN as they were
    for rank, result in enumerate(results):
        for i in range(2):  # each worker its own row of the sum
            total = sum(tables(r, world)[i] for r in range(world))
            np.testing.assert_array_equal(result[f"rs_{i}"], total[rank])
    for other in results[1:]:  # bit for bit the same everywhere
        for key in results[0].files:
            if not key.startswith("rs_"):
                np.testing.assert_array_equal(other[key], results[0][key])


# Rank 1 shares host "a" with the leader 0; rank 2 leads host "b", rank 3
# is its other worker. Every survivor's error names the worker that
# exited: its host's engine saw it, and the leader told the ring why.
@pytest.mark.parametrize("lost", [1, 2, 3])
def test_a_lost_local_or_remote_worker_is_named_everywhere(tmp_path, lost):
    hosts = ["a", "a", "b", "b"]
    codes = _run(tmp_path, hosts, f"exit{lost}")
    assert codes == [3 if r == lost else 1 for r in range(4)], codes
    for rank in range(4):
        if rank == lost:
            continue
        message, seconds = _error(tmp_path, rank)
        assert message.startswith("PeerLostError: "), message
        assert "\n" not in message and seconds < 5, (message, seconds)
        assert f"worker {lost} " in message, (rank, message)
        assert "exited" in message or "closed the connection" in message, message
