"""Keras's Trainer and Model internals: the step-function and build hooks
`DistributedModel` overrides, the build's input, compile arguments, the
compiled loss and its trackers, a loss function's arguments, `fit`'s
validation call, and the strategy and XLA switches Keras's trainer reads.
Verified on Keras 3.15.1 / TensorFlow 2.21.0."""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Iterator

import keras
import tensorflow as tf

from keras_distrib._compat import versions

# DistributedModel overrides or calls these private Trainer methods. Keras 3
# exposes no public hook between "a step function" and "the function fit
# calls", nor for the build that fit/evaluate/predict run before the first
# step (keras/src/backend/tensorflow/trainer.py, keras/src/trainers/trainer.py).
# They are the only private Keras names the model's code outside _compat
# uses, on `self` and `super()`.
KERAS_HOOKS = (
    "_make_function",  # step function -> train/test function (TF trainer)
    "_maybe_symbolic_build",  # builds model, metrics and optimizer before fit
    "_symbolic_build",
    "_compute_loss",  # compute_loss, adapted to overrides without `training`
    "_resolve_auto_jit_compile",  # jit_compile="auto", off where XLA cannot compile
)
_TRAINER = "keras.src.backend.tensorflow.trainer:TensorFlowTrainer"
_ADAPTERS = "keras.src.trainers.data_adapters"

# Private names the shims below use (checked at import, see `versions`).
PRIVATE = (
    *(f"{_TRAINER}.{hook}" for hook in KERAS_HOOKS),
    # build_source, build_forward
    "keras.src.backend:compute_output_spec",
    "keras.src.trainers.epoch_iterator:EpochIterator.data_adapter",
    f"{_ADAPTERS}.py_dataset_adapter:PyDatasetAdapter.enqueuer",
    f"{_ADAPTERS}.py_dataset_adapter:PyDatasetAdapter.py_dataset",
    f"{_ADAPTERS}.py_dataset_adapter:PyDatasetAdapter._standardize_batch",
    # class_weight_as_sample_weight
    f"{_ADAPTERS}.data_adapter_utils:class_weight_to_sample_weights",
    # compile_arguments
    "keras.src.trainers.trainer:Trainer._compile_config",
    "keras.src.saving.serialization_lib:SerializableDict.config",
    # output_loss_metrics, captured_output_losses
    "keras.src.trainers.trainer:Trainer._compile_loss",
    "keras.src.trainers.compile_utils:CompileLoss.metrics",
    # unscaled_losses_where
    "keras.src.losses.loss:scale_loss_for_distribution",
    "keras.src.losses.loss:unscale_loss_for_distribution",
    # loss_tracker, jit_compile_off, hide_distribute_strategy
    "keras.src.trainers.trainer:Trainer._loss_tracker",
    "keras.src.trainers.trainer:Trainer._jit_compile",
    f"{_TRAINER}._distribute_strategy",
    # loss_function_arguments
    "keras.src.losses.losses:LossFunctionWrapper._fn_kwargs",
    # validation_in_fit: what the keyword it reads makes `evaluate` use
    f"{_TRAINER}._eval_epoch_iterator",
    # epoch_iterator, train_validation_split
    "keras.src.backend.tensorflow.trainer:TFEpochIterator",
    f"{_ADAPTERS}.array_slicing:train_validation_split",
)


def check_hooks() -> None:
    """One-line error when a Keras method DistributedModel hooks into is gone
    (a method on the class itself, not an instance attribute)."""
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    missing = [name for name in KERAS_HOOKS if not hasattr(TensorFlowTrainer, name)]
    if missing:
        raise ImportError(versions.missing_message(f"{_TRAINER}.{missing[0]}", "keras_trainer"))


class EmptyInput(Exception):
    """The input gave no batch to build the model from (see `build_source`)."""


def build_source(iterator):
    """What Keras's `_symbolic_build` reads its one batch from in place of its
    epoch `iterator`: the same first batch, read only if the build reads it
    (a model already built reads nothing), shaped as `_symbolic_build`
    iterates an epoch iterator, `(begin, end, [batch])`. Two things differ:

    - A `keras.utils.PyDataset` fed through Keras's enqueuer (`workers > 0`)
      is read as `dataset[0]`. Reading through the epoch iterator would start
      the enqueuer, which queues the whole epoch; `on_epoch_end` then stops
      it and keeps the batches not yet read for "the next run"
      (`PyDatasetEnqueuer.stop(drain_queue_and_join=True)` in
      `keras/src/trainers/data_adapters/py_dataset_adapter.py`), and every
      later epoch starts with the previous one's leftovers and ends early
      (batches seen twice or never).
    - Absent elements (a generator's `(x, y, None)`, an empty
      `tf.experimental.Optional`) are None, as the step sees them
      (`absent_as_none`); Keras's build would read the Optional's shape.

    Raises `EmptyInput` (not a StopIteration, which would end the build's
    loop silently) when the input has no batch.
    """
    adapter = getattr(iterator, "data_adapter", None)

    def first_batch():
        if getattr(adapter, "enqueuer", None) is not None:
            return adapter._standardize_batch(adapter.py_dataset[0])
        for _, _, batches in iterator:
            if isinstance(batches, (list, tuple)):  # as `_symbolic_build` reads them
                return batches[0]
            try:
                return next(batches)
            except StopIteration:
                break
        raise EmptyInput

    return ((0, 0, [absent_as_none(first_batch())]) for _ in range(1))


def build_forward(model, iterator=None, data_batch=None) -> None:
    """The first half of Keras's `Trainer._symbolic_build`: the model's
    layers built from one batch (`data_batch`, or the first of `iterator`
    as `build_source` gives it) by a symbolic call, nothing else."""
    from keras.src.backend import compute_output_spec

    if data_batch is None:
        for _, _, batches in iterator:
            data_batch = batches[0]
            break

    def symbolic(value):
        if value is None:
            return None
        return keras.KerasTensor(value.shape, keras.backend.standardize_dtype(value.dtype))

    x, _, _ = keras.utils.unpack_x_y_sample_weight(keras.tree.map_structure(symbolic, data_batch))
    compute_output_spec(model, x, training=False)


def class_weight_as_sample_weight(y, sample_weight, class_weight):
    """The per-sample weights Keras's array input makes of `class_weight`.

    Keras weighs arrays with `class_weight.get(label, 1.0)` (any label), but
    a `tf.data` input through a lookup table that ends at the largest key,
    so a label without a weight fails deep in the input pipeline. Array
    input fed to Keras as our pipeline keeps the array rule, with its checks
    (`keras/src/trainers/data_adapters/array_data_adapter.py`).
    """
    from keras.src.trainers.data_adapters import data_adapter_utils

    if sample_weight is not None:
        raise ValueError("You cannot `class_weight` and `sample_weight` at the same time.")
    if keras.tree.is_nested(y):
        raise ValueError("`class_weight` is only supported for Models with a single output.")
    return data_adapter_utils.class_weight_to_sample_weights(y, class_weight)


_OUTPUT_LOSSES = threading.local()


def compile_arguments(model) -> dict:
    """The arguments `model.compile` was called with, as given (Keras keeps
    them to serialize `get_compile_config`: `Trainer._compile_config`)."""
    return dict(model._compile_config.config)


def output_loss_metrics(model) -> list:
    """The per-output loss metrics of `model`'s compiled loss
    (`CompileLoss.metrics`: one `Mean` per output, logged as
    `<output>_loss`, when the model has several)."""
    compile_loss = getattr(model, "_compile_loss", None)
    return list(getattr(compile_loss, "metrics", None) or [])


@contextlib.contextmanager
def captured_output_losses(model) -> Iterator[list]:
    """Yields a list that collects, in order, the values Keras's compiled
    loss hands its per-output loss metrics in this thread while inside,
    instead of recording them (`CompileLoss.call` updates each metric
    itself, keras/src/trainers/compile_utils.py; no hook sees the value
    first). Each metric's `update_state` is wrapped once."""
    for metric in output_loss_metrics(model):
        if not getattr(metric.update_state, "_kd_wrapped", False):
            metric.update_state = _collected_or_recorded(metric.update_state)
    stack = _OUTPUT_LOSSES.__dict__.setdefault("stack", [])
    stack.append([])
    try:
        yield stack[-1]
    finally:
        stack.pop()


def _collected_or_recorded(keras_update_state):
    @functools.wraps(keras_update_state)
    def update_state(values, sample_weight=None):
        stack = getattr(_OUTPUT_LOSSES, "stack", None)
        if stack:
            stack[-1].append(values)
            return None
        return keras_update_state(values, sample_weight=sample_weight)

    update_state._kd_wrapped = True
    return update_state


def unscaled_losses_where(is_ours) -> None:
    """Keras's losses stay per-replica means wherever `is_ours()` says the
    current tf.distribute strategy is one of keras_distrib's engines.

    Under a tf.distribute strategy Keras divides every reduced loss by the
    number of replicas (`keras.src.losses.loss.scale_loss_for_distribution`,
    called by `reduce_values`, the TF trainer's `_aggregate_additional_loss`,
    and undone for the loss logs by `unscale_loss_for_distribution`), so
    that its optimizer's sum over replicas is the mean. Our engines hide
    from Keras (see `hide_distribute_strategy`) but are current inside each
    replica's step: there a custom `train_step`'s loss, and the values it
    logs, would come out divided (a GAN's `d_loss` would log half of one
    device's over 2 replicas). Ours reduce gradients themselves (the mean over
    replicas for a custom step's `apply_gradients`, see
    `Strategy.reduce_applied_gradients`), so Keras's division is skipped
    under them; under a user's own tf.distribute strategy Keras's code runs
    as it is. Idempotent.
    """
    from keras.src.losses import loss as loss_module

    for name in ("scale_loss_for_distribution", "unscale_loss_for_distribution"):
        keras_function = getattr(loss_module, name)
        if getattr(keras_function, "_kd_wrapped", False):
            continue

        def unless_ours(value, keras_function=keras_function):
            return value if is_ours() else keras_function(value)

        setattr(unless_ours, "_kd_wrapped", True)
        functools.update_wrapper(unless_ours, keras_function)
        setattr(loss_module, name, unless_ours)


def loss_function_arguments(loss) -> dict:
    """The keyword arguments a Keras loss made from a loss function passes
    it (`LossFunctionWrapper._fn_kwargs`: e.g. `axis`, `from_logits`,
    `ignore_class` of `SparseCategoricalCrossentropy`), `{}` for any other.
    Only some of them have public attributes."""
    return getattr(loss, "_fn_kwargs", {})


def validation_in_fit(evaluate_kwargs: dict) -> bool:
    """Whether `evaluate` was called by Keras's `fit` for its validation:
    the TF trainer's `fit` passes the private keyword
    `_use_cached_eval_dataset=True`, and `evaluate` then reads the batches
    `fit` prepared (`_eval_epoch_iterator`) instead of its `x`."""
    return bool(evaluate_kwargs.get("_use_cached_eval_dataset"))


def compute_loss(model, **kwargs):
    """`model._compute_loss`: calls a user's `compute_loss` override with or
    without `training=`, as Keras's own train step does."""
    return model._compute_loss(**kwargs)


def loss_tracker(model):
    """The `Mean` metric behind the `loss` log (`model._loss_tracker`).

    Our train step computes the loss itself, so it feeds Keras's tracker as
    Keras's own train step does.
    """
    return model._loss_tracker


@contextlib.contextmanager
def jit_compile_off(model) -> Iterator[None]:
    """Keras's whole-function XLA compilation off while a function is made.

    Collectives cannot run inside one XLA cluster, so replicated steps compile
    the per-replica math instead. The public `jit_compile` setter would warn
    and resolve "auto"; the private attribute is what `_make_function` reads.
    """
    saved = model._jit_compile
    model._jit_compile = False
    try:
        yield
    finally:
        model._jit_compile = saved


def hide_distribute_strategy(model) -> None:
    """Makes Keras see the default (no-op) tf.distribute strategy.

    Keras 3's own tf.distribute paths are broken for multi-worker training
    (keras-team/keras#20585: `reduce_per_replica` on scalars fails under
    MultiWorkerMirroredStrategy), so Keras must never run them: our strategy
    does all distribution. `Trainer.distribute_strategy` reads this attribute.
    """
    model._distribute_strategy = None


def epoch_iterator(x, batch_size):
    """Keras's TF input iterator, used to build a model from `predict` input."""
    from keras.src.backend.tensorflow.trainer import TFEpochIterator

    return TFEpochIterator(
        x=x,
        batch_size=batch_size,
        shuffle=False,
        distribute_strategy=tf.distribute.get_strategy(),
    )


def train_validation_split(arrays, validation_split: float):
    """Keras's own `validation_split` slicing (last fraction of the arrays).

    Multi-process input is sharded after the split, so we split first, the
    way `fit` would.
    """
    from keras.src.trainers.data_adapters import array_slicing

    return array_slicing.train_validation_split(arrays, validation_split=validation_split)


def absent_as_none(batch: Any) -> Any:
    """`batch` with each absent element as None, as Keras's step receives it.

    Keras's generator input turns a `None` in a batch (`(x, y, None)`) into
    an empty `tf.experimental.Optional`, and its train function turns that
    back into None before the step (`TensorFlowTrainer._autoconvert_optionals`).
    """
    return keras.tree.map_structure(
        lambda t: None if isinstance(t, tf.experimental.Optional) else t, batch
    )
