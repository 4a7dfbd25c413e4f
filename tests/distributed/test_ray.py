"""Ray Train: `TensorflowTrainer` runs a training function that uses
`kd.DistributedModel(..., strategy="multi_worker")` on a local Ray cluster
of 2 workers, and the workers end equal to one process.

Ray sets `TF_CONFIG` for its workers; on Keras 3 its own Keras example
fails (ray-project/ray#47464: Ray's `TensorflowConfig` also sets
`TF_USE_LEGACY_KERAS=1`). Ray is an optional extra (`pip install
keras_distrib[ray]`), which `make test` installs.
"""

import os
import shutil
import sys
import tempfile

import numpy as np
import pytest

from helpers import WORKERS
from pure_helpers import CHILD_SITE

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install keras_distrib[ray])")

BATCH, EPOCHS, SAMPLES = 32, 2, 203


def _one_process(initial):
    """One process of the workers' math (plain Keras) from `initial`,
    traced: a run of it in other orders of sums ends within the bounds of
    float32's rounding (`float_bounds.Reference`)."""
    import keras

    import as_reference

    rng = np.random.default_rng(0)  # tests/workers/ray_train.py's data
    x = rng.normal(size=(SAMPLES, 8)).astype("float32")
    y = rng.integers(0, 3, size=SAMPLES).astype("int32")
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3)(hidden))
    model.set_weights(initial)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return as_reference.fit(model, x, y, BATCH, EPOCHS)


@pytest.fixture
def ray_cluster(monkeypatch):
    """A local Ray cluster of 2 CPUs, its files in a short temporary
    directory (Ray's socket paths must stay under 108 bytes), shut down
    and removed after the test. Its processes import pandas (Ray Train
    needs it), so tests/child_site is off their path."""
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p != CHILD_SITE))
    directory = tempfile.mkdtemp(prefix="kdray")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _temp_dir=directory,
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        yield directory
    finally:
        ray.shutdown()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.timeout(300)
def test_tensorflow_trainer_runs_multi_worker_like_one_process(tmp_path, ray_cluster):
    import keras
    from ray import cloudpickle
    from ray.train import RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    sys.path.insert(0, WORKERS)
    import ray_train

    cloudpickle.register_pickle_by_value(ray_train)  # Ray's workers cannot import it
    keras.utils.set_random_seed(1)
    inputs = keras.Input((8,))
    initial = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Dense(16)(inputs)))
    initial = [w.tolist() for w in initial.get_weights()]
    trainer = TensorflowTrainer(
        ray_train.train_loop_per_worker,
        train_loop_config={"initial": initial, "out": str(tmp_path)},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=str(tmp_path / "ray"), name="keras_distrib"),
    )
    result = trainer.fit()
    assert result.error is None, result.error
    import as_reference

    reference = _one_process([np.array(w, "float32") for w in initial])
    finals = []
    for rank in range(2):
        with np.load(os.path.join(tmp_path, f"rank{rank}.npz")) as f:
            assert int(f["iterations"]) == EPOCHS * -(-SAMPLES // BATCH)
            finals.append([f[k] for k in f.files if k != "iterations"])
    for got, mine in zip(finals[1], finals[0]):
        np.testing.assert_array_equal(got, mine)  # the workers agree exactly
    as_reference.assert_weights(reference, finals[1])
