"""keras_distrib.callbacks: in-process on "single"/"mirrored" (2 logical CPUs).

Across 2 worker processes through the launcher:
tests/distributed/test_callbacks_two_workers.py.
"""

import glob

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src.utils import python_utils

from float_bounds import EPS, assert_within
from helpers import build, plain_model, warmup_rate

from keras_distrib import callbacks as kdc
from keras_distrib.callbacks import _common
from keras_distrib.callbacks.replica_consistency_check import verdict
from keras_distrib.strategies.single import SingleDevice

N, BATCH = 64, 16  # 4 steps per epoch
DATA_SAMPLES = N  # the `data` fixture's size (tests/conftest.py)
LR = 0.1


def _assert_rates(got, want, roundings: int, err_msg: str = "rate") -> None:
    """`got`, learning rates whose computation rounds `roundings` times in
    float32 (a float32 rate read or assigned, or an operation of a schedule
    in float32), against `want`, the same formula in float64 from the same
    inputs. Each float32 rounding is within EPS/2 of its result; the rates
    and the factors are positive, so the relative errors add up; `want`'s
    few float64 operations round by far less than EPS/2 and count as one
    more rounding."""
    want = np.asarray(want, np.float64)
    assert_within(got, want, (roundings + 1) * EPS / 2 * np.abs(want), err_msg)


class Record(keras.callbacks.Callback):
    """Keeps what later callbacks see: batch lrs, the optimizer's rate, epoch logs."""

    def __init__(self):
        super().__init__()
        self.batch_lr, self.optimizer_lr, self.epoch_logs = [], [], []

    def on_train_batch_end(self, batch, logs=None):
        self.batch_lr.append(logs.get("lr"))
        self.optimizer_lr.append(float(np.asarray(self.model.optimizer.learning_rate)))

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_logs.append(dict(logs))


class AtBatch(keras.callbacks.Callback):
    """Runs `action(model)` after training batch `at_batch` of the first epoch."""

    def __init__(self, at_batch, action):
        super().__init__()
        self.at_batch, self.action, self.epoch = at_batch, action, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == 0 and batch == self.at_batch:
            self.action(self.model)


class TwoRanks(SingleDevice):
    """Pretends to be rank 0 of 2; the other rank's values are given."""

    def __init__(self, other=None):
        super().__init__()
        self.other, self.calls, self.broadcasts = other, [], []

    @property
    def world_size(self):
        return 2

    def sync_sum(self, values):
        self.calls.append([np.array(v) for v in values])
        return [np.asarray(v) + np.asarray(o) for v, o in zip(values, self.other)]

    def broadcast_variables(self, variables, root=0):
        self.broadcasts.append((list(variables), root))


@pytest.fixture
def two_ranks(monkeypatch):
    """Makes every callback see a `TwoRanks` strategy."""

    def use(other=None):
        strategy = TwoRanks(other)
        monkeypatch.setattr(_common, "strategy_of", lambda callback: strategy)
        return strategy

    return use


# -- LearningRateWarmup / LearningRateScaling ---------------------------------


@pytest.mark.parametrize("strategy,multiplier", [("single", 4.0), ("mirrored", None)])
def test_warmup_constant_rate_follows_the_formula(data, strategy, multiplier):
    x, y = data
    model = build("functional", strategy)
    expected_multiplier = multiplier or 2.0  # mirrored: 2 replicas
    warmup = kdc.LearningRateWarmup(warmup_epochs=1.5, target_multiplier=multiplier)
    record = Record()
    model.fit(
        x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0, callbacks=[warmup, record]
    )
    warmup_steps = 6  # 1.5 epochs * 4 steps
    assert [s for s, _ in warmup.lr_history] == list(range(warmup_steps + 1))
    # The rate warmed up in float64 from the optimizer's float32 rate (one
    # rounding); the optimizer's own, assigned that, in float32 (one more).
    for step in (0, 3, 6):  # start, middle, end
        want = warmup_rate(step, expected_multiplier, warmup_steps, LR)
        _assert_rates(warmup.lr_history[step][1], want, 1)
        _assert_rates(record.batch_lr[step], want, 1)
        _assert_rates(record.optimizer_lr[step], want, 2)
    # ... then it stays at the scaled rate.
    _assert_rates(record.batch_lr[7:], [LR * expected_multiplier] * 5, 2)
    _assert_rates(record.optimizer_lr[-1], LR * expected_multiplier, 2)


class _Reference(keras.optimizers.schedules.LearningRateSchedule):
    """The warmed-up schedule written out by hand."""

    def __init__(self, inner, multiplier, warmup_steps):
        self.inner, self.multiplier, self.warmup_steps = inner, multiplier, warmup_steps

    def __call__(self, step):
        progress = tf.minimum(tf.cast(step, "float32") / self.warmup_steps, 1.0)
        return self.inner(step) * (1.0 + (self.multiplier - 1.0) * progress)


def test_warmup_wraps_a_schedule_and_trains_with_it(data):
    x, y = data
    decay = keras.optimizers.schedules.ExponentialDecay(LR, decay_steps=4, decay_rate=0.5)
    model = build("functional", "single", optimizer=keras.optimizers.SGD(decay))
    warmup = kdc.LearningRateWarmup(warmup_epochs=1, target_multiplier=3)
    record = Record()
    model.fit(
        x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[warmup, record]
    )

    schedule = model.optimizer._learning_rate
    assert isinstance(schedule, kdc.ScaledSchedule) and schedule.schedule is decay
    want = [float(decay(s)) * (1 + 2 * min(s / 4, 1)) for s in range(8)]
    # The schedule's own rate, times the warmup's factor in float32: its
    # division, product and sum, and the product of the two, round.
    _assert_rates(record.batch_lr, want, 4)
    assert [s for s, _ in warmup.lr_history] == list(range(5))
    _assert_rates([lr for _, lr in warmup.lr_history], want[:5], 4)

    # The optimizer really trained with it.
    reference = build(
        "functional", "single", optimizer=keras.optimizers.SGD(_Reference(decay, 3.0, 4))
    )
    reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    # The same model and strategy on the same batches, and rates of the same
    # float32 operations in the same order (schedule times 1 + 2 * progress):
    # the same kernels, the same weights.
    for got, ref in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_array_equal(got, ref)

    # Registered and serializable: the optimizer's config round-trips.
    restored = type(model.optimizer).from_config(model.optimizer.get_config())
    assert isinstance(restored._learning_rate, kdc.ScaledSchedule)
    for step in (0, 2, 4, 7):
        _assert_rates(float(restored._learning_rate(step)), want[step], 4)


@pytest.mark.parametrize(
    "strategy,multiplier,want", [("mirrored", None, 2.0), ("single", 3.0, 3.0)]
)
def test_scaling_multiplies_once(data, strategy, multiplier, want):
    x, y = data
    model = build("functional", strategy)
    scaling = kdc.LearningRateScaling(multiplier)
    for callback in (scaling, scaling, kdc.LearningRateScaling(multiplier)):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[callback])
        # The float32 rate read, scaled in float64 and assigned in float32.
        _assert_rates(float(np.asarray(model.optimizer.learning_rate)), LR * want, 2)
    assert scaling.applied_multiplier == want


def test_scaling_wraps_a_schedule(data):
    x, y = data
    decay = keras.optimizers.schedules.ExponentialDecay(LR, decay_steps=4, decay_rate=0.5)
    model = build("functional", "single", optimizer=keras.optimizers.SGD(decay))
    record = Record()
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[kdc.LearningRateScaling(3), record],
    )
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[kdc.LearningRateScaling(3), record],
    )
    schedule = model.optimizer._learning_rate
    assert isinstance(schedule, kdc.ScaledSchedule) and schedule.schedule is decay
    # The schedule's rate times 3 in float32: one rounding.
    _assert_rates([float(schedule(s)) for s in (0, 5)], [3 * float(decay(s)) for s in (0, 5)], 1)
    _assert_rates(record.optimizer_lr, [3 * float(decay(s + 1)) for s in range(8)], 1)


def test_warmup_and_scaling_together_is_an_error(data):
    x, y = data
    model = build("functional", "single")
    with pytest.raises(ValueError, match="already ends at the scaled rate"):
        model.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=1,
            verbose=0,
            callbacks=[kdc.LearningRateScaling(2), kdc.LearningRateWarmup(1, target_multiplier=2)],
        )


def test_bad_arguments():
    with pytest.raises(ValueError, match="warmup_epochs=0"):
        kdc.LearningRateWarmup(0)
    with pytest.raises(ValueError, match="every_n_steps=0"):
        kdc.ReplicaConsistencyCheck(every_n_steps=0)
    with pytest.raises(ValueError, match="global_batch_size=0"):
        kdc.ThroughputMonitor(0)
    with pytest.raises(TypeError, match="LearningRateSchedule"):
        kdc.ScaledSchedule(0.1, 2)


# -- ThroughputMonitor --------------------------------------------------------


@pytest.mark.parametrize("strategy", ["single", "mirrored"])
def test_throughput_keys_are_present_and_sane(data, tmp_path, strategy):
    x, y = data
    model = build("functional", strategy)
    monitor = kdc.ThroughputMonitor(
        BATCH, single_worker_throughput=1000.0, log_dir=str(tmp_path / "tb")
    )
    history = model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, callbacks=[monitor])
    h = history.history
    for key in ("samples_per_sec", "samples_per_sec_per_worker", "step_time", "scaling_efficiency"):
        assert len(h[key]) == 2 and all(np.isfinite(v) and v > 0 for v in h[key]), key
    for total, per_worker, step_time, efficiency in zip(
        h["samples_per_sec"],
        h["samples_per_sec_per_worker"],
        h["step_time"],
        h["scaling_efficiency"],
    ):
        # One process: the same float64 operations (divided by 1, by 1 * 1000.0).
        assert per_worker == total
        assert efficiency == total / 1000.0
        assert step_time < 10.0
        assert 0.1 < total * step_time / BATCH < 10.0  # median vs mean step
    assert len(glob.glob(str(tmp_path / "tb" / "events.*"))) == 1


# -- MetricAverage --------------------------------------------------------------


def test_metric_average_one_collective_in_sorted_order_in_place(two_ranks):
    strategy = two_ranks(other=[np.array([3.0, 10.0, 5.0])])  # accuracy, loss, z on rank 1
    average = kdc.MetricAverage()
    logs = {"z": 1.0, "loss": 2.0, "note": "text", "accuracy": np.float32(1.0)}
    average.on_train_begin()
    average.on_epoch_end(0, logs)
    assert len(strategy.calls) == 1
    np.testing.assert_array_equal(strategy.calls[0][0], [1.0, 2.0, 1.0])
    assert logs == {"z": 3.0, "loss": 6.0, "note": "text", "accuracy": 2.0}
    # Only per_batch=True hooks batch ends (which makes Keras call them in order).
    assert python_utils.is_default(kdc.MetricAverage().on_train_batch_end)
    assert not python_utils.is_default(kdc.MetricAverage(per_batch=True).on_train_batch_end)


def test_metric_average_is_a_noop_on_one_process(data):
    x, y = data
    model = build("functional", "mirrored")

    class Value(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            logs["value"] = 7.0 + epoch

    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=2,
        verbose=0,
        callbacks=[Value(), kdc.MetricAverage(per_batch=True)],
    )
    assert history.history["value"] == [7.0, 8.0]


# -- BroadcastInitialWeights ------------------------------------------------------


@pytest.mark.parametrize("strategy", ["single", "mirrored"])
def test_broadcast_is_a_noop_on_one_process(data, strategy):
    x, y = data
    model = build("functional", strategy)
    broadcast = kdc.BroadcastInitialWeights()
    history = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[broadcast])
    assert broadcast.broadcast_done
    assert np.isfinite(history.history["loss"][0])


def test_broadcast_builds_the_optimizer_and_sends_everything_once(two_ranks):
    model = build("functional", "single")
    strategy = two_ranks()
    broadcast = kdc.BroadcastInitialWeights(root=1)
    broadcast.set_model(model)
    assert not model.optimizer.built
    broadcast.on_train_begin()
    broadcast.on_train_begin()
    assert model.optimizer.built
    assert len(strategy.broadcasts) == 1
    variables, root = strategy.broadcasts[0]
    assert root == 1
    ids = {id(v) for v in variables}
    assert ids >= {id(v) for v in model.variables} | {id(v) for v in model.optimizer.variables}
    assert len(ids) == len(variables)


# -- ReplicaConsistencyCheck ------------------------------------------------------


def _drift_replica_1(model):
    variable = model.trainable_variables[0]
    parts = model.strategy.tf_strategy.experimental_local_results(variable.value)
    parts[1].assign(parts[1] + 1e-3)


def test_consistency_check_passes_clean_mirrored_training(data):
    x, y = data
    check = kdc.ReplicaConsistencyCheck(every_n_steps=2)
    build("functional", "mirrored").fit(
        x, y, batch_size=BATCH, epochs=2, verbose=0, callbacks=[check]
    )
    assert check.step == 8


def test_consistency_check_names_the_drifted_mirrored_replica(data):
    x, y = data
    model = build("functional", "mirrored")
    with pytest.raises(kdc.ReplicaDivergenceError) as error:
        model.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=2,
            verbose=0,
            callbacks=[AtBatch(2, _drift_replica_1), kdc.ReplicaConsistencyCheck(every_n_steps=2)],
        )
    message = str(error.value)
    assert message.startswith("step 4: replica 1 (rank 0) weights differ from replica 0 (rank 0)")
    assert "\n" not in message


def test_consistency_check_catches_a_nan_sample(data):
    x, y = data
    x = x.copy()
    x[20] = np.nan  # second batch
    model = build("functional", "single")
    model.check_finite = False  # fit would refuse the NaN input before training
    # ReLU turns the NaN input into 0, so the loss may stay finite; the
    # gradient of the first kernel (x^T delta) cannot.
    with pytest.raises(
        kdc.ReplicaDivergenceError,
        match=r"^step 2: (non-finite loss on rank 0; )?"
        r"non-finite weights on replica 0 \(rank 0\)$",
    ):
        model.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[kdc.ReplicaConsistencyCheck(every_n_steps=2)],
        )


def _row(first, loss_bad, *replicas):
    return [first, loss_bad, len(replicas), *[v for r in replicas for v in r]]


def test_verdict_names_replica_and_rank_and_honours_atol():
    ok = (0.0, 1.5, 2.25)
    gathered = np.array([_row(0, 0, ok, ok), _row(2, 0, ok, (0.0, 1.5 + 1e-4, 2.25))])
    assert verdict(gathered, 40, atol=0.0) == (
        "step 40: replica 3 (rank 1) weights differ from replica 0 (rank 0): "
        "checksum (sum, sum of squares) (1.5001, 2.25) vs (1.5, 2.25)"
    )
    assert verdict(gathered, 40, atol=1e-3) is None
    gathered = np.array([_row(0, 1, ok), _row(1, 1, (1.0, np.nan, np.nan))])
    assert verdict(gathered, 7, 0.0) == (
        "step 7: non-finite loss on rank 0, rank 1; non-finite weights on replica 1 (rank 1)"
    )


def test_step_counter_with_steps_per_execution():
    counter = _common.StepCounter()
    counter.new_epoch()
    assert [counter.advance(b) for b in (1, 3, 4)] == [2, 2, 1]
    counter.new_epoch()
    counter.advance(1)
    assert counter.total == 7


# -- plain keras.Model ------------------------------------------------------------


def test_plain_keras_model_gets_single_process_behaviour(data, tmp_path):
    x, y = data
    model = plain_model()
    model.compile(
        optimizer=keras.optimizers.SGD(LR),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    warmup = kdc.LearningRateWarmup(1)
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=2,
        verbose=0,
        callbacks=[
            kdc.MetricAverage(),
            kdc.BroadcastInitialWeights(),
            warmup,
            kdc.ThroughputMonitor(BATCH),
            kdc.ReplicaConsistencyCheck(every_n_steps=1),
        ],
    )
    assert "samples_per_sec" in history.history
    # 1 replica: the optimizer's float32 rate, times 1.
    _assert_rates([lr for _, lr in warmup.lr_history], [LR] * 5, 1)


def test_plain_keras_model_under_a_replicating_tf_strategy_is_a_clear_error():
    tf_strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with tf_strategy.scope():
        model = plain_model()
    callback = kdc.ReplicaConsistencyCheck()
    callback.set_model(model)
    with pytest.raises(
        ValueError,
        match=r"ReplicaConsistencyCheck needs a "
        r"keras_distrib.DistributedModel, got a plain Functional under "
        r"MirroredStrategy with 2 replicas; wrap it",
    ):
        callback.on_train_begin()
