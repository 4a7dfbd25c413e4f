"""Saving: round trips, weight interchange with plain Keras, atomic files."""

import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

import keras_distrib as kd
from float_bounds import assert_within, outputs_apart
from helpers import FEATURES, Net, build, plain_model


def _assert_same_weights(a, b):
    wa, wb = a.get_weights(), b.get_weights()
    assert len(wa) == len(wb)
    for x, y in zip(wa, wb):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("form", ["functional", "from_model"])
def test_save_and_load_model(form, data, tmp_path):
    x, y = data
    model = build(form, "mirrored")
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, kd.DistributedModel)
    # Here and below: the same class and strategy, the same weights (and
    # optimizer state), the same batches: the same kernels, the same results.
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    # Training resumes with the optimizer state that was saved.
    assert int(loaded.optimizer.iterations.numpy()) == int(model.optimizer.iterations.numpy())
    loaded.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    _assert_same_weights(loaded, model)


def test_save_and_load_subclassed(data, tmp_path):
    x, y = data
    model = build("subclass", "mirrored")
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    path = tmp_path / "net.keras"
    model.save(path)
    loaded = keras.models.load_model(path, custom_objects={"Net": Net})
    assert isinstance(loaded, Net)
    # The same class and strategy at the same weights on the same batches.
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))


def test_loading_needs_keras_distrib_imported(data, tmp_path):
    """Documented: `import keras_distrib` before `keras.models.load_model`."""
    x, _ = data
    model = build("functional", "single")
    path = tmp_path / "m.keras"
    model.save(path)
    np.save(tmp_path / "x.npy", x[:5])
    code = textwrap.dedent(f"""
        import numpy as np, keras
        import keras_distrib
        m = keras.models.load_model({str(path)!r})
        np.save({str(tmp_path / "p.npy")!r},
                m.predict(np.load({str(tmp_path / "x.npy")!r}), verbose=0))
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=180, capture_output=True)
    # Another process, which may pick other kernels: the same weights, sums
    # in other orders.
    assert_within(
        np.load(tmp_path / "p.npy"),
        model.predict(x[:5], verbose=0),
        outputs_apart(model, x[:5]),
        "predict",
    )


_WITHOUT_KERAS_DISTRIB = textwrap.dedent("""
    import sys

    class NotInstalled:  # the serving box: keras_distrib cannot be imported
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "keras_distrib":
                raise ImportError("keras_distrib is not installed here")

    sys.meta_path.insert(0, NotInstalled())
""")


@pytest.mark.parametrize("strategy", ["mirrored", "tensor_parallel", "pipeline"])
def test_a_file_loads_where_keras_distrib_is_not_installed(strategy, data, tmp_path):
    """A `.keras` file of a Functional or Sequential DistributedModel names
    Keras's own `keras.Model`: plain Keras loads it (as its Functional
    model, same predictions, trainable); with keras_distrib imported it
    loads back on the strategy it was saved with."""
    x, y = data
    sequential = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(16, "relu"),
            keras.layers.Lambda(lambda t: t * 2.0),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )
    model = kd.DistributedModel.from_model(sequential, strategy=strategy)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    path = tmp_path / "m.keras"
    model.save(path)
    np.save(tmp_path / "x.npy", x[:5])
    code = _WITHOUT_KERAS_DISTRIB + textwrap.dedent(f"""
        import numpy as np, keras
        m = keras.models.load_model({str(path)!r}, safe_mode=False)
        assert type(m).__name__ == "Functional", type(m)
        assert "keras_distrib" not in sys.modules
        x = np.load({str(tmp_path / "x.npy")!r})
        np.save({str(tmp_path / "p.npy")!r}, m.predict(x, verbose=0))
        m.fit(x, np.zeros(5), verbose=0)  # its optimizer state loaded too
        print(int(m.optimizer.iterations.numpy()))
    """)
    done = subprocess.run([sys.executable, "-c", code], timeout=180, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) == int(model.optimizer.iterations.numpy()) + 1
    # Plain Keras in another process: the same weights, sums in other orders.
    assert_within(
        np.load(tmp_path / "p.npy"),
        model.predict(x[:5], verbose=0),
        outputs_apart(model, x[:5]),
        "predict",
    )
    loaded = keras.models.load_model(path, safe_mode=False)
    assert isinstance(loaded, kd.DistributedModel) and loaded.strategy.name == strategy
    # The same class and strategy at the same weights on the same batches.
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))


def test_weights_interchange_with_plain_keras(data, tmp_path):
    x, y = data
    model = build("functional", "mirrored")
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    path = tmp_path / "w.weights.h5"
    model.save_weights(path)
    plain = plain_model()
    plain.load_weights(path)
    _assert_same_weights(plain, model)

    plain.set_weights([w * 0.5 for w in plain.get_weights()])
    plain.save_weights(path)
    model.load_weights(path)
    _assert_same_weights(plain, model)


@keras.saving.register_keras_serializable(package="tests")
class ExplodingOnSave(keras.layers.Layer):
    """A real layer whose weight writing fails half-way through a save."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones")

    def call(self, x):
        return x * self.w

    def save_own_variables(self, store):
        if getattr(self, "explode", False):
            raise OSError("disk full")
        super().save_own_variables(store)


def _exploding_model():
    inputs = keras.Input((FEATURES,))
    layer = ExplodingOnSave()
    outputs = keras.layers.Dense(2)(layer(inputs))
    return kd.DistributedModel(inputs, outputs, strategy="single"), layer


@pytest.mark.parametrize("method,name", [("save_weights", "w.weights.h5"), ("save", "m.keras")])
def test_failed_save_keeps_previous_file(method, name, tmp_path):
    model, _ = _exploding_model()
    model.compile(optimizer="sgd", loss="mse")
    path = tmp_path / name
    getattr(model, method)(path)
    before = path.read_bytes()
    layer = next(each for each in model.layers if isinstance(each, ExplodingOnSave))
    layer.explode = True
    with pytest.raises(OSError, match="disk full"):
        getattr(model, method)(path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == [name]  # no temporary file left behind


def test_model_checkpoint_callback_writes_loadable_files(data, tmp_path):
    x, y = data
    model = build("functional", "mirrored")
    path = tmp_path / "ckpt-{epoch}.keras"
    model.fit(
        x,
        y,
        batch_size=32,
        epochs=2,
        verbose=0,
        callbacks=[keras.callbacks.ModelCheckpoint(str(path))],
    )
    assert sorted(os.listdir(tmp_path)) == ["ckpt-1.keras", "ckpt-2.keras"]
    loaded = keras.models.load_model(tmp_path / "ckpt-2.keras")
    # The same class and strategy at the weights of the end, on the same batches.
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
