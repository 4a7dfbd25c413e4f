"""Keras behaviours that must survive `multi_worker`, real processes
(the `BY_STRATEGY` tests under `horovod` too).

One `keras-distrib launch -n 2` run of tests/workers/keras_features.py runs
every probe (shared by the tests below); each rank writes its results, and
the tests compare the ranks with each other and with the probe's plain
Keras twin, trained here on the whole data from the same initial weights and
traced: within the bounds of float32's rounding of its math in other orders
(tests/float_bounds.py).
"""

import functools
import json
import sys

import keras
import numpy as np
import pytest

import as_reference
from float_bounds import assert_within, outputs_apart
from helpers import (
    KERAS_FEATURES_WORKER as WORKER,
    WORKERS,
    assert_kept_counts_from_own_masks,
    assert_replicas_drop_alike_only_by_chance,
    launch,
)

sys.path.insert(0, WORKERS)
import keras_features as features  # noqa: E402  (the probes' data and models)

pytestmark = pytest.mark.slow


def _results(out, probe):
    return [json.load(open(out / f"{probe}-rank{r}.json")) for r in range(2)]


def _arrays(weights):
    """Weights written as lists, as float32 arrays."""
    return [np.asarray(w, "float32") for w in weights]


def _traced_twin(graph, x, y, optimizer, initial=None, **compile_kwargs):
    """The probe's plain Keras twin (`graph()`, from `initial` or the
    worker's `fixed_start`), trained here on all the rows, 2 epochs, traced:
    a worker's run of its math ends within its bounds (float32's rounding
    in other orders, tests/float_bounds.py)."""
    twin = keras.Model(*graph())
    twin.set_weights(features.fixed_start(twin) if initial is None else _arrays(initial))
    twin.compile(optimizer=optimizer, loss=features._loss(), **compile_kwargs)
    return as_reference.fit(twin, x, y, features.BATCH, 2)


@functools.lru_cache(maxsize=None)
def _fixed_start_twin(probe):
    """The traced twin of `probe` (whose runs start from `fixed_start`): one
    for both strategies' runs."""
    if probe == "sparse_input":
        import tensorflow as tf

        dense, y = features.sparse_data()
        x, graph = tf.sparse.from_dense(dense), features.sparse_graph
        return _traced_twin(graph, x, y, keras.optimizers.SGD(0.5), metrics=["accuracy"])
    if probe == "ragged_input":
        x, y = features.ragged_data()
        graph = features.ragged_graph
        return _traced_twin(graph, x, y, keras.optimizers.SGD(0.5), metrics=["accuracy"])
    assert probe == "remat", probe
    x, y = features._data()
    return _traced_twin(features.remat_graph, x, y, keras.optimizers.Adam(0.01))


def _assert_predicts_as_twin(graph, dense, x, got, err_msg):
    """`got` (a worker's predictions on `x`) against a plain model of
    `graph` holding the worker's Dense weights `dense`: two models at the
    same weights, within what other kernels' orders of sums change
    (`float_bounds.outputs_apart`)."""
    twin = keras.Model(*graph)
    twin.layers[-1].set_weights(_arrays(dense))
    assert_within(got, twin.predict(x, verbose=0), outputs_apart(twin, x), err_msg)


# `probes` and `horovod_probes` (tests/conftest.py) are one launch each for
# these tests and the model zoo's (tests/zoo/test_zoo_processes.py).


@pytest.fixture(scope="module")
def hybrid_probes(tmp_path_factory):
    """The `replica_dropout` probe under `pipeline` across 2 workers (hybrid:
    one replica of the split model per worker)."""
    out = tmp_path_factory.mktemp("keras_features_hybrid")
    launch(
        out, 2, WORKER, "--out", str(out), "--probes", "replica_dropout", "--strategy", "pipeline"
    )
    return out


# Tests run for both strategies (by fixture).
BY_STRATEGY = pytest.mark.parametrize(
    "runs", ["probes", "horovod_probes"], ids=["multi_worker", "horovod"]
)


def test_metric_objects_made_outside_scope_report_global_values(probes):
    ranks = _results(probes, "metric_objects")
    assert ranks[0] == ranks[1]
    history = ranks[0]["history"]
    x, y = features._data()
    twin = _traced_twin(
        features._graph,
        x,
        y,
        keras.optimizers.SGD(0.1),
        initial=ranks[0]["initial"],
        metrics=features.metric_objects_metrics(),
    )
    as_reference.assert_history(twin, history, ("accuracy", "acc_object", "top2", "loss"))
    assert history["acc_object"] == history["accuracy"]
    assert ranks[0]["evaluate"]["acc_object"] == ranks[0]["evaluate"]["accuracy"]


def test_unseeded_tf_data_shuffle_shows_every_sample_once_per_epoch(probes):
    ranks = _results(probes, "unseeded_shuffle")
    for epoch in range(2):
        seen = ranks[0]["epochs"][epoch] + ranks[1]["epochs"][epoch]
        assert sorted(seen) == list(range(96)), f"epoch {epoch}"
    # Still reshuffled every epoch, and fit trains on such a pipeline.
    assert ranks[0]["epochs"][0] != ranks[0]["epochs"][1]
    assert [r["iterations"] for r in ranks] == [10, 10]


def test_set_random_seed_makes_shuffled_runs_repeat(probes, tmp_path):
    launch(tmp_path, 2, WORKER, "--out", str(tmp_path), "--probes", "seeded_shuffle")
    first, again = _results(probes, "seeded_shuffle"), _results(tmp_path, "seeded_shuffle")
    for r in range(2):
        for a, b in zip(first[r]["weights"], again[r]["weights"]):
            np.testing.assert_array_equal(a, b)
    for a, b in zip(first[0]["weights"], first[1]["weights"]):
        np.testing.assert_array_equal(a, b)


def test_load_model_inside_strategy_scope_uses_that_strategy(probes):
    for rank in _results(probes, "load_model"):
        assert rank["same_strategy"]
        # Exact: the restored model is the saved one's class under the same
        # strategy in the same process, holding the saved values themselves;
        # it evaluates the same batches, and trains the same steps, with the
        # same kernels.
        np.testing.assert_array_equal(rank["after"], rank["before"])
        assert rank["trained_gap"] == 0.0


def test_batch_norm_moving_statistics_agree_across_workers(probes):
    ranks = _results(probes, "batch_norm")
    for key in ("moving_mean", "moving_variance", "predict"):
        np.testing.assert_array_equal(ranks[0][key], ranks[1][key], err_msg=key)
    assert np.any(np.asarray(ranks[0]["moving_mean"]) != 0.0)


@BY_STRATEGY
def test_sparse_input_trains_like_plain_keras(runs, request):
    # Each global batch of a `tf.SparseTensor` dataset is cut to the
    # worker's rows with `tf.sparse.slice`.
    ranks = _results(request.getfixturevalue(runs), "sparse_input")
    assert ranks[0] == ranks[1]
    result = ranks[0]
    assert result["sparse"]
    twin = _fixed_start_twin("sparse_input")
    as_reference.assert_history(twin, result["ours"], ("loss", "accuracy"))
    as_reference.assert_weights(twin, _arrays(result["weights"]))


@BY_STRATEGY
def test_remat_scope_trains_as_plain_keras_without_it(runs, request):
    # Each worker's backward pass recomputes the layer's forward pass
    # (TensorFlow's recompute_grad, mended by _compat.remat_in_graphs).
    ranks = _results(request.getfixturevalue(runs), "remat")
    assert ranks[0] == ranks[1]
    result = ranks[0]
    twin = _fixed_start_twin("remat")
    as_reference.assert_history(twin, result["ours"], ("loss",))
    as_reference.assert_weights(twin, _arrays(result["weights"]))
    assert result["ours_forward_passes"] > result["twin_forward_passes"], result


@BY_STRATEGY
def test_ragged_input_trains_like_plain_keras(runs, request):
    # Each worker takes its rows of every ragged batch: a row slice of a
    # dataset's batch, or gathered from a ragged tensor passed as x.
    ranks = _results(request.getfixturevalue(runs), "ragged_input")
    assert ranks[0] == ranks[1]
    twin = _fixed_start_twin("ragged_input")  # the same steps for both feeds
    for feed in ("dataset", "tensor"):
        as_reference.assert_history(twin, ranks[0][f"{feed}_ours"], ("loss", "accuracy"))
        as_reference.assert_weights(
            twin, _arrays(ranks[0][f"{feed}_weights"]), err_msg=f"{feed} weight"
        )


@BY_STRATEGY
def test_custom_metric_variables_are_read_by_their_aggregation(runs, request):
    # 203 samples, shared 102 / 101: a "sum" variable reads as one device's
    # count, a "mean" one as the workers' mean (as tf.distribute reads
    # them). Each metric's `result()` returns its variable itself: under
    # horovod that reported each worker's own count (102 and 101).
    ranks = _results(request.getfixturevalue(runs), "metric_aggregation")
    for rank in ranks:
        for logs in (rank["evaluate"], {k: v[0] for k, v in rank["history"].items()}):
            assert (logs["seen_sum"], logs["seen_mean"]) == (203, 101.5), logs
    first = [
        [r["evaluate"]["seen_only_first_replica"], r["history"]["seen_only_first_replica"][0]]
        for r in ranks
    ]
    if runs == "horovod_probes":  # worker 0's, on every worker
        assert first == [[102, 102], [102, 102]]
    else:  # TensorFlow's read: each worker's own first replica
        assert first == [[102, 102], [101, 101]]


@BY_STRATEGY
def test_a_normalization_adapted_per_worker_takes_worker_0s_statistics(runs, request):
    # Worker 0's weights reach every worker (a broadcast of the variables);
    # a Normalization's mean and variance are computed from its variables
    # when they load, so worker 1 normalized with its own statistics.
    # The same after `BroadcastInitialWeights` (adapted again once built),
    # and after `BackupAndRestore` resumed from statistics of another run.
    ranks = _results(request.getfixturevalue(runs), "adapted_per_worker")
    x, _ = features.adapted_data()
    # Worker 0's statistics: of its data shifted by 0, 5 and 7.
    for prefix, shift in (("", 0.0), ("callback_", 5.0), ("restored_", 7.0)):
        assert ranks[0][f"{prefix}predict"] == ranks[1][f"{prefix}predict"], prefix
        for rank, r in enumerate(ranks):
            _assert_predicts_as_twin(
                features.adapted_graph(x, shift),
                r[f"{prefix}dense"],
                x,
                r[f"{prefix}predict"],
                f"{prefix}predict, rank {rank}",
            )


@BY_STRATEGY
def test_a_vocabulary_adapted_per_worker_is_worker_0s(runs, request):
    # Vocabularies of one size in another order passed every check, and a
    # word had another id on the other worker.
    ranks = _results(request.getfixturevalue(runs), "vocabulary_per_worker")
    assert [r["vocabulary"] for r in ranks] == [["[UNK]", "a", "b", "c"]] * 2
    assert ranks[0]["predict"] == ranks[1]["predict"]
    words, _ = features.vocabulary_data()
    for rank, r in enumerate(ranks):  # with worker 0's vocabulary
        graph = features.vocabulary_graph("abc")
        _assert_predicts_as_twin(graph, r["dense"], words, r["predict"], f"rank {rank}")


def test_a_pydataset_with_workers_shows_every_sample_once_per_epoch(probes):
    # Sum and count of the sample ids trained on, over both workers.
    ranks = _results(probes, "pydataset_workers")
    assert ranks[0] == ranks[1]
    assert ranks[0]["ids"] == [sum(range(101)) * 1000.0 + 101] * 4


@pytest.mark.parametrize(
    "runs", ["probes", "horovod_probes", "hybrid_probes"], ids=["multi_worker", "horovod", "hybrid"]
)
def test_dropout_masks_differ_between_workers(runs, request):
    """Each worker held an equal copy of every layer's seed state (worker
    0's broadcast) and drew the same dropout masks: both workers' rows of
    the global batch repeated one mask (see
    tests/integration/test_replica_seeds.py)."""
    ranks = _results(request.getfixturevalue(runs), "replica_dropout")
    assert ranks[0] == ranks[1]  # the gathered predictions, the trained weights
    assert_replicas_drop_alike_only_by_chance(ranks[0]["masks"])  # rank 0's rows, rank 1's
    assert_kept_counts_from_own_masks(ranks[0]["kept"])
