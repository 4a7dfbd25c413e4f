"""The global-batch split rule (keras_distrib.input.data)."""

import types

import numpy as np
import pytest
import tensorflow as tf

import keras_distrib as kd
from keras_distrib.input import data
from keras_distrib.input import sharding
from keras_distrib.topology import Topology


@pytest.mark.parametrize(
    "n,num,sizes",
    [
        (32, 2, [16, 16]),
        (11, 2, [6, 5]),
        (10, 4, [3, 3, 2, 2]),
        (1, 2, [1, 0]),
    ],
)
def test_split_sizes_and_order(n, num, sizes):
    x = np.arange(n * 2, dtype="float32").reshape(n, 2)
    shards = data.split_batch((x, None, {"w": np.arange(n)}), num)
    assert [int(s[0].shape[0]) for s in shards] == sizes
    assert all(s[1] is None for s in shards)
    np.testing.assert_array_equal(np.concatenate([s[0] for s in shards]), x)
    np.testing.assert_array_equal(np.concatenate([s[2]["w"] for s in shards]), np.arange(n))


def test_split_inside_tf_function_with_unknown_batch():
    @tf.function(input_signature=[tf.TensorSpec([None, 3])])
    def sizes(x):
        shards = data.split_batch(x, 3)
        return [tf.shape(s)[0] for s in shards]

    assert [int(s) for s in sizes(tf.zeros((7, 3)))] == [3, 2, 2]


def test_check_batch_size():
    data.check_batch_size(None)
    data.check_batch_size(33)
    data.check_batch_size(3)
    data.check_batch_size(1)
    for bad in (0, -4, 2.5, "32", True):
        with pytest.raises(ValueError, match=r"must be a positive integer \(the global batch\)"):
            data.check_batch_size(bad)


def test_repeated_array_shards_cover_every_sample_once_per_epoch():
    # What fit feeds Keras under several workers: one endless iterator whose
    # consecutive array_steps() batches are one epoch, reshuffled each time.
    x = np.arange(10, dtype=np.float32)[:, None]
    steps = sharding.array_steps(x, 4)
    assert steps == 3  # 4 + 4 + 2: the short batch is kept
    dataset, _ = sharding.shard(
        kd.strategies.get("single"), x, x[:, 0], None, 4, shuffle=True, seed=7, repeat=True
    )
    batches = iter(dataset)
    epochs = []
    for _ in range(3):
        rows = [next(batches)[1].numpy() for _ in range(steps)]
        assert [len(r) for r in rows] == [4, 4, 2]
        epoch = np.concatenate(rows).tolist()
        assert sorted(epoch) == list(range(10))
        epochs.append(epoch)
    assert epochs[0] != epochs[1] != epochs[2]
    assert sharding.array_steps(tf.data.Dataset.range(3), 4) is None


@pytest.mark.parametrize("n", [10, 8, 3])
@pytest.mark.parametrize("shuffle", [False, True])
def test_array_shards_of_two_workers_make_each_global_batch(n, shuffle):
    """Worker k of 2 gets its rows of every global batch (the split rule),
    the short last batch included, in order or in the agreed shuffle."""
    x = np.arange(n, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
    per_worker = []
    for rank in range(2):
        worker = types.SimpleNamespace(
            topology=Topology.data_parallel(("/cpu:0",), num_processes=2, process_index=rank)
        )
        dataset, _ = sharding.shard(worker, x, np.arange(n), None, 4, shuffle=shuffle, seed=3)
        per_worker.append([(b[0].numpy(), b[1].numpy()) for b in dataset])
    expected_batches = -(-n // 4)
    assert [len(batches) for batches in per_worker] == [expected_batches] * 2
    seen = []
    for (x0, y0), (x1, y1) in zip(*per_worker):
        ids = np.concatenate([y0, y1])
        assert [len(y0), len(y1)] == [len(ids) - len(ids) // 2, len(ids) // 2]
        np.testing.assert_array_equal(np.concatenate([x0, x1]), x[ids])
        seen.extend(ids.tolist())
    assert sorted(seen) == list(range(n))
    assert (seen == list(range(n))) != (shuffle and n > 1)


@pytest.mark.parametrize("shuffle", [False, True])
def test_an_optional_input_given_as_none_stays_none_in_each_workers_share(shuffle):
    """Keras takes `x={"x": arrays, "o": None}` for an optional input; each
    of 2 workers gets its rows of the arrays and None for it."""
    x = np.arange(10, dtype=np.float32)[:, None]
    shares = []
    for rank in range(2):
        worker = types.SimpleNamespace(
            topology=Topology.data_parallel(("/cpu:0",), num_processes=2, process_index=rank)
        )
        dataset, _ = sharding.shard(
            worker, {"x": x, "o": None}, np.arange(10), None, 4, shuffle=shuffle, seed=3
        )
        batches = list(dataset)
        assert all(b[0]["o"] is None for b in batches)
        shares.append([b[1].numpy() for b in batches])
    assert [len(b) for b in shares[0]] == [2, 2, 1] and [len(b) for b in shares[1]] == [2, 2, 1]
    assert sorted(np.concatenate(shares[0] + shares[1]).tolist()) == list(range(10))
