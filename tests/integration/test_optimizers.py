"""DistributedOptimizer: compression and gradient accumulation, in one process.

Across 2 processes: tests/distributed/test_optimizers_two_processes.py.
"""

import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

import as_reference
from keras_distrib.optimizers import DistributedOptimizer
from float_bounds import outputs_apart, assert_within
from helpers import build, collective_dtypes, plain_model

DATA_SAMPLES = 192  # the `data` fixture's size (tests/conftest.py)


@pytest.mark.parametrize("strategy", ["single", "mirrored"])
def test_four_steps_of_16_equal_one_step_of_64(strategy, data):
    x, y = data
    # The big steps traced: the 4 accumulated gradients of 16 rows add the
    # same 64 rows' in another order, within the big step's bound.
    big = as_reference.fit(build("functional", strategy), x, y, 64)
    accumulated = build(
        "functional",
        strategy,
        optimizer=DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=4),
    )
    accumulated.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert int(accumulated.optimizer.iterations.numpy()) == 3
    as_reference.assert_weights(big, accumulated)


def test_accumulation_across_fit_calls_and_with_momentum(data):
    x, y = data
    big = as_reference.fit(
        build("functional", "mirrored", optimizer=keras.optimizers.SGD(0.1, momentum=0.9)),
        x,
        y,
        64,
    )
    accumulated = build(
        "functional",
        "mirrored",
        optimizer=DistributedOptimizer(
            keras.optimizers.SGD(0.1, momentum=0.9), backward_passes_per_step=2
        ),
    )
    for start in range(0, 192, 64):  # each fit call ends mid-way... and resumes
        accumulated.fit(
            x[start : start + 64], y[start : start + 64], batch_size=32, shuffle=False, verbose=0
        )
    as_reference.assert_weights(big, accumulated)


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_compressed_allreduce_trains_close_to_fp32(compression, data):
    x, y = data
    reference = build("functional", "mirrored")
    traced = as_reference.fit(reference, x, y, 64)
    model = build(
        "functional",
        "mirrored",
        optimizer=DistributedOptimizer(keras.optimizers.SGD(0.1), compression=compression),
    )
    model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    # Within float32's rounding and the gradients' roundings to the
    # compressed dtype (`float_bounds.Reference.compressed`).
    as_reference.assert_weights(traced.compressed(compression), model)
    assert not np.allclose(model.get_weights()[0], plain_model().get_weights()[0])
    # The gradients really travel in the compressed dtype (the sample count
    # stays float32 in its own collective).
    wanted = {"fp16": "float16", "bf16": "bfloat16"}[compression]
    assert collective_dtypes(model, x[:64], y[:64]) == sorted([wanted, "float32"])
    assert collective_dtypes(reference, x[:64], y[:64]) == ["float32"]


def test_wrapper_keeps_class_name_and_config():
    inner = keras.optimizers.Adam(0.003, beta_1=0.8)
    wrapped = DistributedOptimizer(inner, compression="bf16", backward_passes_per_step=3)
    assert isinstance(wrapped, keras.optimizers.Adam)
    assert type(wrapped).__name__ == "Adam"
    assert wrapped.get_config() == inner.get_config()
    assert wrapped.compression.name == "bf16" and wrapped.backward_passes_per_step == 3
    rewrapped = DistributedOptimizer(wrapped, compression="fp16")
    assert type(rewrapped).__mro__[2] is keras.optimizers.Adam


def test_saved_model_loads_without_keras_distrib(data, tmp_path):
    x, y = data
    model = plain_model()
    model.compile(
        optimizer=DistributedOptimizer("adam", compression="fp16"),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    path = tmp_path / "m.keras"
    model.save(path)
    np.save(tmp_path / "x.npy", x)
    code = textwrap.dedent(f"""
        import sys, numpy as np, keras
        m = keras.models.load_model({str(path)!r})
        assert "keras_distrib" not in sys.modules, "keras_distrib was imported"
        assert type(m.optimizer) is keras.optimizers.Adam, type(m.optimizer)
        assert int(m.optimizer.iterations.numpy()) == 6
        np.save({str(tmp_path / "p.npy")!r},
                m.predict(np.load({str(tmp_path / "x.npy")!r}), verbose=0))
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=180, cwd=tmp_path, env=env)
    # Another process's plain Keras model at the same weights: within what
    # its other kernels' orders of sums may change (float_bounds.outputs_apart).
    assert_within(
        np.load(tmp_path / "p.npy"), model.predict(x, verbose=0), outputs_apart(model, x), "predict"
    )


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"compression": "int8"}, "Unknown compression='int8'"),
        ({"backward_passes_per_step": 0}, "backward_passes_per_step=0 must be an int >= 1"),
    ],
)
def test_bad_options(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        DistributedOptimizer("sgd", **kwargs)


def test_accumulation_needs_steps_per_execution_1(data):
    x, y = data
    model = build(
        "functional",
        "single",
        steps_per_execution=2,
        optimizer=DistributedOptimizer("sgd", backward_passes_per_step=2),
    )
    with pytest.raises(ValueError, match="needs steps_per_execution=1"):
        model.fit(x, y, verbose=0)
