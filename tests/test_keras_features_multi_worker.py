"""Keras behaviours that must survive `multi_worker` (issue 9), real processes.

One `keras-distrib launch -n 2` run of tests/workers/keras_features.py runs
every probe (shared by the tests below); each rank writes its results, and
the tests compare the ranks with each other and with the plain Keras twin
each rank trained on the whole data from the same initial weights.
"""

import json
import os

import numpy as np
import pytest

from helpers import ROOT, launch

WORKER = os.path.join(ROOT, "tests", "workers", "keras_features.py")
PROBES = ("metric_objects", "unseeded_shuffle", "load_model", "batch_norm", "seeded_shuffle",
          "sparse_input", "pydataset_workers", "ragged_input")

pytestmark = pytest.mark.slow


def _results(out, probe):
    return [json.load(open(out / f"{probe}-rank{r}.json")) for r in range(2)]


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    out = tmp_path_factory.mktemp("keras_features")
    launch(out, 2, WORKER, "--out", str(out), "--probes", ",".join(PROBES))
    return out


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


def test_sparse_input_trains_like_plain_keras(probes):
    # Each global batch of a `tf.SparseTensor` dataset is cut to the
    # worker's rows with `tf.sparse.slice`.
    ranks = _results(probes, "sparse_input")
    assert ranks[0] == ranks[1]
    result = ranks[0]
    assert result["sparse"]
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(result["ours"][key], result["twin"][key], atol=1e-5)
    assert result["gap"] < 1e-5


def test_ragged_input_trains_like_plain_keras(probes):
    # Each worker takes its rows of every ragged batch: a row slice of a
    # dataset's batch, or gathered from a ragged tensor passed as x.
    ranks = _results(probes, "ragged_input")
    assert ranks[0] == ranks[1]
    for feed in ("dataset", "tensor"):
        for key in ("loss", "accuracy"):
            np.testing.assert_allclose(ranks[0][f"{feed}_ours"][key], ranks[0][f"{feed}_twin"][key],
                                       atol=1e-5, err_msg=f"{feed} {key}")
        assert ranks[0][f"{feed}_gap"] < 1e-5, feed


def test_a_pydataset_with_workers_shows_every_sample_once_per_epoch(probes):
    # Sum and count of the sample ids trained on, over both workers.
    ranks = _results(probes, "pydataset_workers")
    assert ranks[0] == ranks[1]
    assert ranks[0]["ids"] == [sum(range(101)) * 1000.0 + 101] * 4
