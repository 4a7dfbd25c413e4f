"""`optimizer_sharding` under `mirrored` over this process's two logical
CPUs: each device keeps the optimizer's slots of its part of every variable
(a component of 1/2 of the elements) and updates that part, and the model
trains as plain Keras on one device does, for every case of
tests/sharding_cases.py; files hold whole values both ways. Two real
workers: tests/distributed/test_optimizer_sharding_two_workers.py.
"""

import keras
import numpy as np
import pytest

import keras_distrib as kd
import sharding_cases as cases
from helpers import make_data
from pure_helpers import assert_one_line_error

# Stage 2 (the gradients scattered): Adam, the clipping that needs whole
# norms from partial sums, and a sparse gradient.
STAGE2 = ["adam", "rmsprop_global_clipnorm", "sgd_momentum_clipnorm", "embedding_adam"]


def _sharded(case, mode, initial, x, y):
    """The case's model under `mirrored`, sharded (`mode`), trained."""
    model = _compiled(case, mode, initial)
    model.fit(cases.inputs(case, x), y, batch_size=cases.BATCH, epochs=cases.EPOCHS,
              shuffle=False, verbose=0)
    return model


def _whole(model, variable, like) -> np.ndarray:
    """`variable` (an optimizer variable of `model`) whole: its devices'
    parts joined, or its one value."""
    values = model.strategy.local_replica_values(variable)
    if values[0].shape == like.shape:
        return values[0]
    return np.concatenate([v.reshape(-1) for v in values])[:like.size].reshape(like.shape)


@pytest.mark.parametrize("mode, case", [("optimizer", c) for c in cases.CASES] +
                         [("gradients", c) for c in STAGE2])
def test_each_device_updates_its_part_as_plain_keras(mode, case):
    x, y = make_data()
    initial = keras.Model(*cases.graph(case)).get_weights()
    ours = _sharded(case, mode, initial, x, y)
    weights, slots = cases.plain_run(case, initial, x, y)
    for got, want in zip(ours.get_weights(), weights):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    variables = ours.optimizer.variables
    assert len(variables) == len(slots)
    for variable, want in zip(variables, slots):
        parts = ours.strategy.local_replica_values(variable)
        if want.size > 1:  # a slot: each device holds its half
            assert [p.size for p in parts] == [-(-want.size // 2)] * 2, variable.path
        np.testing.assert_allclose(_whole(ours, variable, want), want, atol=1e-6, rtol=0,
                                   err_msg=variable.path)


def test_each_device_holds_half_of_the_optimizers_bytes():
    x, y = make_data()
    initial = keras.Model(*cases.graph("adam")).get_weights()
    whole = _compiled("adam", None, initial)
    whole = whole.strategy.describe(whole)
    half = _sharded("adam", "gradients", initial, x, y)
    half = half.strategy.describe(half)
    assert half.optimizer <= whole.optimizer * (1 / 2 + 0.05), (half, whole)
    assert half.gradients <= whole.gradients * (1 / 2 + 0.05), (half, whole)


def _compiled(case, mode, initial, model_class=None):
    """The case's model, compiled and its optimizer built: a plain
    `model_class`, or sharded (`mode`) under `mirrored`."""
    if model_class is None:
        model = kd.DistributedModel(*cases.graph(case), strategy=kd.strategies.get(
            "mirrored", optimizer_sharding=mode))
    else:
        model = model_class(*cases.graph(case))
    model.set_weights(initial)
    model.compile(**cases.compile_kwargs(case))
    model.optimizer.build(model.trainable_variables)
    return model


def test_a_file_goes_whole_to_plain_keras_and_back_into_the_parts(tmp_path):
    """Written sharded on two devices, a `.keras` file loads into plain
    Keras whole; plain Keras's file loads into a sharded model, whose
    devices take their parts, and training goes on as plain Keras's does."""
    x, y = make_data()
    case = "adamw_decay"
    initial = keras.Model(*cases.graph(case)).get_weights()
    ours = _sharded(case, "optimizer", initial, x, y)
    ours.save(tmp_path / "sharded.keras")
    plain = keras.models.load_model(tmp_path / "sharded.keras")
    want = cases.plain_run(case, initial, x, y)[1]
    for got, value in zip(plain.optimizer.variables, want):
        np.testing.assert_allclose(np.asarray(got), value, atol=1e-6, rtol=0)

    # (Compiled anew, as the file does not keep which variables AdamW decays.)
    plain.save(tmp_path / "plain.keras")
    plain = _compiled(case, None, initial, keras.Model)
    resumed = _compiled(case, "optimizer", initial)
    for model in (plain, resumed):
        model.load_weights(tmp_path / "plain.keras")
        model.fit(x, y, batch_size=cases.BATCH, epochs=1, shuffle=False, verbose=0)
    for got, value in zip(resumed.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, value, atol=1e-6, rtol=0)
    for variable, value in zip(resumed.optimizer.variables, plain.optimizer.variables):
        value = np.asarray(value)
        np.testing.assert_allclose(_whole(resumed, variable, value), value, atol=1e-6, rtol=0,
                                   err_msg=variable.path)


def test_a_resumed_run_ends_as_an_uninterrupted_one(tmp_path):
    """`BackupAndRestore` after the first epoch (its backup kept, as after a
    crash): the next `fit` gives each device its part of the whole slots
    and ends where one `fit` of both epochs ends."""
    x, y = make_data()
    case = "adam"
    initial = keras.Model(*cases.graph(case)).get_weights()
    straight = _sharded(case, "optimizer", initial, x, y)
    resumed = _compiled(case, "optimizer", initial)
    backup = str(tmp_path / "backup")
    resumed.fit(x, y, batch_size=cases.BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[
        kd.callbacks.BackupAndRestore(backup, delete_checkpoint=False)])
    again = _compiled(case, "optimizer", keras.Model(*cases.graph(case)).get_weights())
    again.fit(x, y, batch_size=cases.BATCH, epochs=cases.EPOCHS, shuffle=False, verbose=0,
              callbacks=[kd.callbacks.BackupAndRestore(backup)])
    for got, want in zip(again.get_weights(), straight.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    for got, want in zip(again.optimizer.variables, straight.optimizer.variables):
        for a, b in zip(*(again.strategy.local_replica_values(v) for v in (got, want))):
            np.testing.assert_allclose(a, b, atol=1e-6, rtol=0, err_msg=got.path)


def test_a_worker_with_several_replicas_is_refused_in_one_line():
    from keras_distrib.arithmetic import optimizer_sharding

    with pytest.raises(ValueError) as excinfo:
        optimizer_sharding.check("multi_worker", "optimizer", one_replica_per_process=False)
    assert_one_line_error(excinfo, "needs one replica per worker", "'mirrored'")
