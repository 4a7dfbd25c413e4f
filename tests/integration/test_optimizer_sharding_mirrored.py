"""`optimizer_sharding` under `mirrored` over this process's two logical
CPUs: each device keeps the optimizer's slots of its part of every variable
(a component of 1/2 of the elements) and updates that part, and the model
trains as plain Keras on one device does, for every case of
tests/sharding_cases.py; files hold whole values both ways. Two real
workers: tests/distributed/test_optimizer_sharding_two_workers.py.
"""

import functools

import keras
import numpy as np
import pytest

import keras_distrib as kd
import sharding_cases as cases
from float_bounds import Reference, assert_within
from helpers import make_data
from pure_helpers import assert_one_line_error

# Stage 2 (the gradients scattered): Adam, the clipping that needs whole
# norms from partial sums, and a sparse gradient.
STAGE2 = ["adam", "rmsprop_global_clipnorm", "sgd_momentum_clipnorm", "embedding_adam"]


def _sharded(case, mode, initial, x, y):
    """The case's model under `mirrored`, sharded (`mode`), trained."""
    model = _compiled(case, mode, initial)
    model.fit(
        cases.inputs(case, x),
        y,
        batch_size=cases.BATCH,
        epochs=cases.EPOCHS,
        shuffle=False,
        verbose=0,
    )
    return model


def _whole(model, variable, like) -> np.ndarray:
    """`variable` (an optimizer variable of `model`) whole: its devices'
    parts joined, or its one value."""
    values = model.strategy.local_replica_values(variable)
    if values[0].shape == like.shape:
        return values[0]
    return np.concatenate([v.reshape(-1) for v in values])[: like.size].reshape(like.shape)


@functools.lru_cache(maxsize=None)
def _plain(case):
    """(initial weights, x, y, `cases.plain_run` from them with its bounds)
    of `case`: one plain run, traced, for both modes' tests of the case (a
    test file runs in one process)."""
    x, y = make_data()
    initial = keras.Model(*cases.graph(case)).get_weights()
    return initial, x, y, cases.plain_run(case, initial, x, y, bounds=True)


@pytest.mark.parametrize(
    "mode, case", [("optimizer", c) for c in cases.CASES] + [("gradients", c) for c in STAGE2]
)
def test_each_device_updates_its_part_as_plain_keras(mode, case):
    initial, x, y, (weights, slots, (weight_bounds, slot_bounds)) = _plain(case)
    ours = _sharded(case, mode, initial, x, y)
    # Within what the mirrored run's other order of sums allows (its
    # gradient is the sum of two half batches'), as the case's optimizer
    # makes it (float_bounds.optimizer_steps_apart: for Adam a fraction of
    # the learning rate per step).
    for i, (got, want, bound) in enumerate(zip(ours.get_weights(), weights, weight_bounds)):
        assert_within(got, want, bound, f"weight {i}")
    variables = ours.optimizer.variables
    assert len(variables) == len(slots)
    for variable, want, bound in zip(variables, slots, slot_bounds):
        parts = ours.strategy.local_replica_values(variable)
        if want.size > 1:  # a slot: each device holds its half
            assert [p.size for p in parts] == [-(-want.size // 2)] * 2, variable.path
        assert_within(_whole(ours, variable, want), want, bound, variable.path)


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
        model = kd.DistributedModel(
            *cases.graph(case), strategy=kd.strategies.get("mirrored", optimizer_sharding=mode)
        )
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
    case = "adamw_decay"
    initial, x, y, (_, want, (_, bounds)) = _plain(case)
    ours = _sharded(case, "optimizer", initial, x, y)
    ours.save(tmp_path / "sharded.keras")
    plain = keras.models.load_model(tmp_path / "sharded.keras")
    for got, value, bound in zip(plain.optimizer.variables, want, bounds):
        assert_within(np.asarray(got), value, bound, got.path)

    # (Compiled anew, as the file does not keep which variables AdamW decays.)
    plain.save(tmp_path / "plain.keras")
    plain = _compiled(case, None, initial, keras.Model)
    resumed = _compiled(case, "optimizer", initial)
    for model in (plain, resumed):
        model.load_weights(tmp_path / "plain.keras")
    reference = Reference.fit(plain, x, y, cases.BATCH, slots=True)
    resumed.fit(x, y, batch_size=cases.BATCH, epochs=1, shuffle=False, verbose=0)
    for i, (got, value, bound) in enumerate(
        zip(resumed.get_weights(), plain.get_weights(), reference.weights)
    ):
        assert_within(got, value, bound, f"weight {i}")
    for variable, value, bound in zip(
        resumed.optimizer.variables, plain.optimizer.variables, reference.slots
    ):
        value = np.asarray(value)
        assert_within(_whole(resumed, variable, value), value, bound, variable.path)


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
    resumed.fit(
        x,
        y,
        batch_size=cases.BATCH,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[kd.callbacks.BackupAndRestore(backup, delete_checkpoint=False)],
    )
    again = _compiled(case, "optimizer", keras.Model(*cases.graph(case)).get_weights())
    again.fit(
        x,
        y,
        batch_size=cases.BATCH,
        epochs=cases.EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=[kd.callbacks.BackupAndRestore(backup)],
    )
    # Exact: both runs are the same sharded steps on the same devices, rows
    # and shapes (the same kernels, so the same sums), and the backup holds
    # the values themselves.
    for got, want in zip(again.get_weights(), straight.get_weights()):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(again.optimizer.variables, straight.optimizer.variables):
        for a, b in zip(*(again.strategy.local_replica_values(v) for v in (got, want))):
            np.testing.assert_array_equal(a, b, err_msg=got.path)


def test_a_worker_with_several_replicas_is_refused_in_one_line():
    from keras_distrib.arithmetic import optimizer_sharding

    with pytest.raises(ValueError) as excinfo:
        optimizer_sharding.check("multi_worker", "optimizer", one_replica_per_process=False)
    assert_one_line_error(excinfo, "needs one replica per worker", "'mirrored'")
