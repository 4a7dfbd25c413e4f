"""Hybrid data x model parallelism in one process: the `workers=` option of
`tensor_parallel` and `pipeline` without a cluster, and one process's
identity collectives.

2 workers x 2 logical CPUs through the launcher: tests/distributed/test_hybrid.py.
"""

import numpy as np
import pytest

import keras_distrib as kd
from keras_distrib import cluster


@pytest.mark.parametrize("name", ["tensor_parallel", "pipeline"])
def test_workers_options_without_a_cluster_are_a_clear_error(monkeypatch, name):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(
        cluster.ClusterConfigError,
        match=f"strategy '{name}' got workers=.*found no cluster; start it with",
    ):
        kd.strategies.get(name, workers={"implementation": "ring"})
    with pytest.raises(ValueError, match="workers='ring' must be a dict of multi_worker options"):
        kd.strategies.get(name, workers="ring")


def test_one_process_has_one_replica_and_identity_collectives(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    strategy = kd.strategies.get("tensor_parallel")
    assert (strategy.num_replicas, strategy.world_size, strategy.implementation) == (1, 1, None)
    x = np.arange(6.0).reshape(3, 2)
    assert strategy.gather_rows(x) is x
    assert strategy.sync_sum([x])[0].tolist() == x.tolist()


@pytest.mark.parametrize("name", ["tensor_parallel", "pipeline"])
def test_a_cluster_configured_after_tensorflow_started_is_a_one_line_error(monkeypatch, name):
    monkeypatch.setenv(
        "TF_CONFIG",
        '{"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, '
        '"task": {"type": "worker", "index": 0}}',
    )
    with pytest.raises(
        ValueError,
        match="TensorFlow was used before keras_distrib could start "
        "its multi-worker runtime; "
        "`import keras_distrib` before",
    ) as e:
        kd.strategies.get(name)
    assert "\n" not in str(e.value)
