"""strategy='multi_worker' in one process: its options and its one-line errors
(no cluster, bad options, created too late, shared memory across hosts).

Real worker processes: tests/distributed/test_multi_worker.py.
"""

import os
import subprocess
import sys

import pytest

import keras_distrib as kd
from keras_distrib import cluster
from keras_distrib.collectives import registry as transports


def test_no_cluster_is_a_clear_error(monkeypatch):
    import keras_distrib as kd

    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(
        ValueError, match="found no cluster; start the workers with `keras-distrib launch"
    ):
        kd.strategies.get("multi_worker")


@pytest.mark.parametrize(
    "options,fragment",
    [
        ({"implementation": "carrier"}, "Unknown implementation"),
        ({"bytes_per_pack": -1}, "bytes_per_pack=-1"),
        ({"collective_timeout": 0}, "collective_timeout=0"),
    ],
)
def test_bad_options(options, fragment):
    import keras_distrib as kd

    with pytest.raises(ValueError, match=fragment):
        kd.strategies.get(
            "multi_worker", cluster=["127.0.0.1:1", "127.0.0.1:2"], task_index=0, **options
        )


def test_created_after_tensorflow_started_is_a_clear_error():
    code = (
        "import tensorflow as tf, keras_distrib as kd\n"
        "tf.Variable(1.0)\n"
        "kd.strategies.get('multi_worker', cluster=['127.0.0.1:1', '127.0.0.1:2'], "
        "task_index=0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert (
        "TensorFlow was used before keras_distrib could start its multi-worker runtime"
        in (proc.stderr.strip().splitlines()[-1])
    )


def _info(*workers):
    return cluster.ClusterInfo(workers, task_index=0)


def test_auto_picks_shared_memory_only_when_every_worker_is_here():
    from keras_distrib.strategies import multi_worker

    local = _info("127.0.0.1:2222", "localhost:2223")
    assert multi_worker._wants_shared_memory("auto", local)
    assert multi_worker._wants_shared_memory("shm", local)
    assert not multi_worker._wants_shared_memory("ring", local)
    assert not multi_worker._wants_shared_memory("auto", _info("127.0.0.1:2222"))
    assert not multi_worker._wants_shared_memory("auto", _info("127.0.0.1:2222", "192.0.2.7:2222"))


def test_shm_across_hosts_is_a_clear_error():
    with pytest.raises(
        cluster.ClusterConfigError,
        match=r"implementation='shm' needs every worker on this host, but "
        r"worker 1 at 192.0.2.7:2222 is not",
    ):
        kd.strategies.get(
            "multi_worker",
            cluster=["127.0.0.1:2222", "192.0.2.7:2222"],
            task_index=0,
            implementation="shm",
        )


def test_an_engines_lost_peer_raised_in_a_step_is_its_one_line():
    # What fit sees when a numpy_function of our engines raises in the step:
    # TensorFlow's multi-line error around the engine's.
    import types

    import tensorflow as tf

    from keras_distrib.collectives.shm_peers import PeerLostError
    from keras_distrib.strategies.multi_worker import MultiWorker

    said = "tcp all-reduce: worker 2 at 10.0.0.2:7000 closed the connection: it exited."

    def fail(x):
        raise PeerLostError(said, peers=[2])

    step = tf.function(lambda x: tf.numpy_function(fail, [x], [tf.float32], stateful=True))
    with pytest.raises(tf.errors.OpError) as raised:
        step(tf.constant(1.0))
    assert "\n" in str(raised.value)
    info = cluster.ClusterInfo(("10.0.0.1:1", "10.0.0.2:2"), task_index=0)
    strategy = types.SimpleNamespace(
        _watchdog=None, _info=info, transport=transports.create("one_process")
    )
    clearer = MultiWorker.failure(strategy, raised.value)
    assert isinstance(clearer, PeerLostError)
    assert str(clearer) == f"multi_worker: {said}"
    assert MultiWorker.failure(strategy, PeerLostError(said)) is None  # already one line


def test_one_inter_op_thread_keeps_our_engines_to_one_pack(monkeypatch):
    """A worker with a core spare packs its gradients, unless TensorFlow has
    one inter-op thread (which a pack's collective would hold)."""
    from keras_distrib.cluster import ClusterInfo
    from keras_distrib.strategies import multi_worker

    monkeypatch.setenv("TF_NUM_INTRAOP_THREADS", "1")
    info = ClusterInfo(["10.0.0.1:2222", "10.0.0.2:2222"], 0)  # one worker on this host
    monkeypatch.setenv("TF_NUM_INTEROP_THREADS", "1")
    one = multi_worker._packing(None, info)
    assert one.bytes_per_pack == 0
    assert "one inter-op thread" in str(one)
    if len(os.sched_getaffinity(0)) > 1:  # then a core is spare: packs
        monkeypatch.delenv("TF_NUM_INTEROP_THREADS")
        assert multi_worker._packing(None, info).bytes_per_pack > 0
