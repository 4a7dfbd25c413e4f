"""The transports strategies compose (keras_distrib.collectives): every
registered one implements the whole interface, the strategies hold theirs,
and the collectives give what they promise: TensorFlow's between the two
replicas of `mirrored`'s engine, one process's, and shared memory and the
TCP ring between two workers (threads of this process).

The registry's table without TensorFlow: tests/unit/test_transport_registry.py.
Between real processes: tests/distributed (multi_worker, hybrid, horovod).
"""

import inspect
import os
import subprocess
import sys
import threading
import uuid

import numpy as np
import pytest
import tensorflow as tf

import keras_distrib as kd
from keras_distrib.cluster import free_ports, launch_contract
from keras_distrib.collectives import numpy_engine, registry
from keras_distrib.collectives.across_processes import AcrossProcesses
from keras_distrib.collectives.transport import Transport
from pure_helpers import CHILD_PYTHONPATH, ROOT

INTERFACE = [
    "all_gather",
    "all_reduce",
    "all_reduce_across_processes",
    "broadcast",
    "close",
    "explain",
    "gather_rows",
    "mean_by_count",
    "reduce_scatter",
    "sum_over_processes",
]


def test_the_interface_is_the_collectives_strategies_call():
    assert (
        sorted(
            name
            for name, member in vars(Transport).items()
            if callable(member) and not name.startswith("_")
        )
        == INTERFACE
    )


@pytest.mark.parametrize("name", registry.names())
def test_each_registered_transport_implements_the_whole_interface(name):
    cls = registry.transport_class(name)
    assert issubclass(cls, Transport) and cls.name == name
    assert not inspect.isabstract(cls), sorted(cls.__abstractmethods__)
    assert not inspect.isabstract(AcrossProcesses)


@pytest.mark.parametrize("name", ["horovod", "gloo"])
def test_the_horovod_transports_import_horovod_only_when_made(name):
    code = (
        "import sys\n"
        "from keras_distrib.collectives import registry\n"
        "import keras_distrib.strategies.multi_worker\n"
        f"print(registry.transport_class({name!r}).__name__,\n"
        "      sorted(m for m in sys.modules if m.split('.')[0] == 'horovod'))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": CHILD_PYTHONPATH},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == f"{name.capitalize()}Collectives []"


@pytest.mark.parametrize(
    "strategy,transport",
    [
        ("single", "one_process"),
        ("mirrored", "tensorflow"),
        ("central_storage", "tensorflow"),
        ("pipeline", "one_process"),
        ("tensor_parallel", "one_process"),
    ],
)
def test_each_strategy_composes_one_transport(strategy, transport):
    assert kd.strategies.get(strategy).transport.name == transport


def _collectives(transport, index, value):
    """What each collective of `transport` gives this replica (index
    `index`, holding `value`), as arrays."""
    (summed,) = transport.all_reduce([value])
    (mean,) = transport.all_reduce([value], "mean")
    (by_count,) = transport.mean_by_count([value], tf.cast(index + 1, tf.float32))
    table = transport.all_gather(value)
    (row,) = transport.reduce_scatter([tf.stack([value, 2 * value])])
    return summed, mean, by_count, table, row


def _assert_two_replicas(got, index):
    summed, mean, by_count, table, row = (np.asarray(v) for v in got)
    np.testing.assert_array_equal(summed, [3.0, 3.0])  # [1, 1] + [2, 2]
    np.testing.assert_array_equal(mean, [1.5, 1.5])
    np.testing.assert_array_equal(by_count, [1.0, 1.0])  # [3, 3] / (1 + 2) samples
    np.testing.assert_array_equal(table, [[1.0, 1.0], [2.0, 2.0]])
    np.testing.assert_array_equal(row, [[3.0, 3.0], [6.0, 6.0]][index])


def test_tensorflow_collectives_between_two_replicas():
    strategy = kd.strategies.get("mirrored")  # two logical CPUs
    transport, engine = strategy.transport, strategy.tf_strategy

    @tf.function
    def step():
        def replica(_):
            index = strategy.replica_index()
            value = tf.fill([2], tf.cast(index, tf.float32) + 1.0)
            return (*_collectives(transport, index, value), value[None])

        outputs = strategy.run(replica, tf.zeros([2, 1]))
        return [engine.experimental_local_results(v) for v in outputs[:-1]], transport.gather_rows(
            outputs[-1]
        )

    per_replica, rows = step()
    for index in (0, 1):
        _assert_two_replicas([v[index] for v in per_replica], index)
    np.testing.assert_array_equal(rows, [[1.0, 1.0], [2.0, 2.0]])
    np.testing.assert_array_equal(transport.sum_over_processes(np.arange(3.0)), [0, 1, 2])
    with pytest.raises(ValueError, match=r"Unknown reduce op 'max'; use one of \['mean', 'sum'\]"):
        strategy.run(lambda _: transport.all_reduce([tf.ones([1])], "max"), tf.zeros([2, 1]))


@pytest.mark.parametrize("across", [False, True])
def test_one_process_collectives_are_the_identity(across):
    transport = registry.create("one_process")
    if across:  # pipeline and tensor_parallel with one worker
        transport = AcrossProcesses(transport, rank=0, size=1)
    value = tf.constant([[1.0, 2.0], [3.0, 4.0]])
    (summed,) = transport.all_reduce([value])
    np.testing.assert_array_equal(summed, value)
    np.testing.assert_array_equal(transport.mean_by_count([value], 4)[0], value / 4)
    np.testing.assert_array_equal(transport.all_gather(value), value[None])
    np.testing.assert_array_equal(transport.reduce_scatter([value[:1]])[0], [1.0, 2.0])
    np.testing.assert_array_equal(transport.gather_rows({"y": value})["y"], value)
    np.testing.assert_array_equal(transport.sum_over_processes(np.arange(3)), [0, 1, 2])
    assert transport.broadcast([value]) == [value]


@pytest.mark.parametrize("name", ["shm", "tcp"])
def test_our_engines_between_two_workers(tmp_path, monkeypatch, name):
    directory = tmp_path / "shm"
    directory.mkdir(mode=0o700)
    monkeypatch.setenv(launch_contract.SHM_DIR_ENV, str(directory))
    got, failed = {}, []
    if name == "shm":
        options = {"job_id": uuid.uuid4().hex}
    else:
        ports = free_ports(2)
        options = {"addresses": [("127.0.0.1", p) for p in ports], "secret": os.urandom(16)}

    def worker(rank):
        try:
            transport = registry.create(
                name,
                rows=registry.create("one_process"),
                rank=rank,
                world_size=2,
                timeout=60,
                connect_timeout=60,
                **options,
            )
            value = tf.fill([2], float(rank + 1))
            # Traced, as a step calls them.
            in_step = tf.function(lambda: _collectives(transport, rank, value))
            got[rank] = (
                in_step(),
                transport.sum_over_processes(np.arange(3.0) * (rank + 1)),
                transport.gather_rows(value),
            )
        except BaseException as e:  # reported by the test's thread
            failed.append(e)

    threads = [threading.Thread(target=worker, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not failed and sorted(got) == [0, 1], failed
    for rank in (0, 1):
        collectives, eager, rows = got[rank]
        _assert_two_replicas(collectives, rank)
        np.testing.assert_array_equal(eager, [0, 3, 6])
        np.testing.assert_array_equal(rows, [rank + 1.0] * 2)  # the `rows` transport's
    assert os.listdir(directory) == []


@pytest.mark.parametrize(
    "sizes,bytes_per_pack,want",
    [
        ([4, 8, 4, 16], 0, [[0, 1, 2, 3]]),  # one pack, in order
        ([4, 8, 4, 16], 1, [[3], [2], [1], [0]]),  # each alone, the last first
        ([4, 8, 4, 16], 16, [[3], [2, 1, 0]]),  # at least 16 bytes, the rest last
        ([4, 8, 4, 16], 20, [[3, 2], [1, 0]]),
        ([], 16, []),
    ],
)
def test_engine_packs_take_the_gradients_last_first(sizes, bytes_per_pack, want):
    assert numpy_engine.packs(sizes, bytes_per_pack) == want
