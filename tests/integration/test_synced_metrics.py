"""Metric variables synced on read (tf.distribute engines): Keras's reads
and resets between steps cost one batched reduction, not one per variable,
and give the values TensorFlow's own per-variable reads give."""

import keras
import numpy as np
import pytest

import keras_distrib as kd


class MeanOfMeans(keras.metrics.Metric):
    """A user's metric whose variable averages over replicas when read."""

    def __init__(self, name="mean_of_means"):
        super().__init__(name=name)
        self.value_sum = self.add_variable(shape=(), initializer="zeros", aggregation="mean")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.value_sum.assign_add(keras.ops.mean(y_pred))

    def result(self):
        return self.value_sum

    def reset_state(self):
        self.value_sum.assign(0.0)


class _Counted:
    """Counts the calls of `engine.extended.<name>`."""

    def __init__(self, monkeypatch, extended, name):
        self.calls = 0
        original = getattr(extended, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(extended, name, counted)


# Batched reductions a read makes: one per aggregation kind ("sum", "mean")
# under mirrored; none under central_storage, whose metric variables are
# one copy on the parameter device.
@pytest.mark.parametrize("strategy, reductions", [("mirrored", 2), ("central_storage", 0)])
def test_reads_and_resets_are_batched_and_read_what_tensorflow_reads(
    strategy, reductions, monkeypatch
):
    inputs = keras.Input((4,))
    model = kd.DistributedModel(inputs, keras.layers.Dense(3)(inputs), strategy=strategy)
    model.compile(
        "sgd",
        "mse",
        metrics=[
            "mae",
            "categorical_accuracy",
            keras.metrics.F1Score(average="macro"),
            MeanOfMeans(),
        ],
    )
    x = np.random.random((10, 4)).astype("float32")
    y = np.random.random((10, 3)).astype("float32")
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    # TensorFlow's reads, one variable at a time (Keras's method, not ours).
    expected = keras.Model.get_metrics_result(model)

    extended = model.strategy.tf_strategy.extended
    one_by_one = _Counted(monkeypatch, extended, "reduce_to")
    batched = _Counted(monkeypatch, extended, "batch_reduce_to")
    got = model.get_metrics_result()
    model.reset_metrics()
    assert one_by_one.calls == 0
    assert batched.calls == reductions
    assert got.keys() == expected.keys()
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    for metric in model.metrics:
        for variable in metric.variables:
            assert not np.any(np.asarray(variable)), variable.path
