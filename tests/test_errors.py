"""Bad input: one clear line naming the problem and the fix."""

import keras
import numpy as np
import pytest

import keras_distrib as kd
from helpers import build, make_data


def _one_line(excinfo):
    assert "\n" not in str(excinfo.value)


@pytest.mark.parametrize("method", ["fit", "evaluate", "predict"])
def test_indivisible_batch_size(method):
    x, y = make_data()
    model = build("functional", "mirrored")
    args = (x,) if method == "predict" else (x, y)
    with pytest.raises(ValueError, match=r"batch_size=33 is not divisible by the 2 replicas.*32 or 34") as e:
        getattr(model, method)(*args, batch_size=33, verbose=0)
    _one_line(e)


def test_indivisible_validation_batch_size():
    x, y = make_data()
    model = build("functional", "mirrored")
    with pytest.raises(ValueError, match="batch_size=5 is not divisible"):
        model.fit(x, y, batch_size=32, validation_data=(x, y), validation_batch_size=5, verbose=0)


def test_single_accepts_any_batch_size():
    x, y = make_data()
    build("functional", "single").fit(x, y, batch_size=33, verbose=0)


def test_subclass_with_functional_arguments():
    class Loose(kd.DistributedModel):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, strategy="single", **kwargs)

    inputs = keras.Input((8,))
    # A functional variant of the subclass (the Keras guide's form) ...
    model = Loose(inputs, keras.layers.Dense(3)(inputs))
    assert isinstance(model, Loose) and model.strategy.name == "single"
    # ... which did not turn DistributedModel or the subclass functional.
    assert keras.src.models.functional.Functional not in kd.DistributedModel.__mro__
    assert keras.src.models.functional.Functional not in Loose.__mro__


def test_from_model_rejects_subclassed_models():
    class Plain(keras.Model):
        def __init__(self):
            super().__init__()
            self.d = keras.layers.Dense(1)

        def call(self, x):
            return self.d(x)

    with pytest.raises(ValueError, match="subclass keras_distrib.DistributedModel") as e:
        kd.DistributedModel.from_model(Plain(), strategy="single")
    _one_line(e)


def test_optimizer_used_elsewhere():
    x, y = make_data()
    optimizer = keras.optimizers.SGD()
    plain = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
    plain.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    plain.fit(x, y, verbose=0)
    model = build("functional", "mirrored", compile_model=False)
    with pytest.raises(ValueError, match="pass a new optimizer") as e:
        model.compile(optimizer=optimizer, loss="mse")
    _one_line(e)


def test_optimizer_made_outside_scope_is_recreated_inside():
    model = build("functional", "mirrored", compile_model=False)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    assert model.strategy.holds(model.optimizer.iterations)
    assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(0.05)


def test_sparse_input_is_refused_clearly():
    import tensorflow as tf

    model = build("functional", "mirrored")
    sparse = tf.sparse.from_dense(np.eye(4, 8, dtype="float32"))
    with pytest.raises(Exception, match="Sparse and ragged inputs cannot be split"):
        model.predict_on_batch(sparse)
