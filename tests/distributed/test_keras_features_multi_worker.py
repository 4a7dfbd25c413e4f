"""Keras behaviours that must survive `multi_worker`, real processes
(the `BY_STRATEGY` tests under `horovod` too).

One `keras-distrib launch -n 2` run of tests/workers/keras_features.py runs
every probe (shared by the tests below); each rank writes its results, and
the tests compare the ranks with each other and with the plain Keras twin
each rank trained on the whole data from the same initial weights.
"""

import json

import numpy as np
import pytest

from helpers import (
    KERAS_FEATURES_WORKER as WORKER,
    assert_kept_counts_from_own_masks,
    assert_replicas_drop_alike_only_by_chance,
    launch,
)

pytestmark = pytest.mark.slow


def _results(out, probe):
    return [json.load(open(out / f"{probe}-rank{r}.json")) for r in range(2)]


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
    history, twin = ranks[0]["history"], ranks[0]["twin"]
    for key in ("accuracy", "acc_object", "top2", "loss"):
        np.testing.assert_allclose(history[key], twin[key], atol=1e-5, err_msg=key)
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
        np.testing.assert_allclose(rank["after"], rank["before"], atol=1e-6)
        assert rank["trained_gap"] < 1e-6


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
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(result["ours"][key], result["twin"][key], atol=1e-5)
    assert result["gap"] < 1e-5


@BY_STRATEGY
def test_remat_scope_trains_as_plain_keras_without_it(runs, request):
    # Each worker's backward pass recomputes the layer's forward pass
    # (TensorFlow's recompute_grad, mended by _compat.remat_in_graphs).
    ranks = _results(request.getfixturevalue(runs), "remat")
    assert ranks[0] == ranks[1]
    result = ranks[0]
    np.testing.assert_allclose(result["ours"]["loss"], result["twin"]["loss"], atol=1e-5)
    assert result["gap"] < 1e-5
    assert result["ours_forward_passes"] > result["twin_forward_passes"], result


@BY_STRATEGY
def test_ragged_input_trains_like_plain_keras(runs, request):
    # Each worker takes its rows of every ragged batch: a row slice of a
    # dataset's batch, or gathered from a ragged tensor passed as x.
    ranks = _results(request.getfixturevalue(runs), "ragged_input")
    assert ranks[0] == ranks[1]
    for feed in ("dataset", "tensor"):
        for key in ("loss", "accuracy"):
            np.testing.assert_allclose(
                ranks[0][f"{feed}_ours"][key],
                ranks[0][f"{feed}_twin"][key],
                atol=1e-5,
                err_msg=f"{feed} {key}",
            )
        assert ranks[0][f"{feed}_gap"] < 1e-5, feed


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
    for prefix in ("", "callback_", "restored_"):
        assert ranks[0][f"{prefix}predict"] == ranks[1][f"{prefix}predict"], prefix
        assert max(r[f"{prefix}gap"] for r in ranks) < 1e-5, prefix


@BY_STRATEGY
def test_a_vocabulary_adapted_per_worker_is_worker_0s(runs, request):
    # Vocabularies of one size in another order passed every check, and a
    # word had another id on the other worker.
    ranks = _results(request.getfixturevalue(runs), "vocabulary_per_worker")
    assert [r["vocabulary"] for r in ranks] == [["[UNK]", "a", "b", "c"]] * 2
    assert ranks[0]["predict"] == ranks[1]["predict"]
    assert max(r["gap"] for r in ranks) < 1e-5


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
