"""Keras's TensorFlow optimizer internals: its gradient sum across
replicas, its variable index and strategy, loss-scaled and sharded
updates, the learning rate as given and the names of its slots. Verified
on Keras 3.15.1 / TensorFlow 2.21.0."""

from __future__ import annotations

import contextlib
import threading

import tensorflow as tf

_TF_OPTIMIZER = "keras.src.backend.tensorflow.optimizer:TFOptimizer"
_BASE_OPTIMIZER = "keras.src.optimizers.base_optimizer:BaseOptimizer"

# Private names the shims below use (checked at import, see `versions`).
PRIVATE = (
    # wrap_optimizer_all_reduce, sum_gradients_across_replicas
    f"{_TF_OPTIMIZER}._all_reduce_sum_gradients",
    # apply_loss_scaled
    "keras.src.optimizers.loss_scale_optimizer:LossScaleOptimizer._common_apply",
    # optimizer_trainable_variables, optimizer_strategy, reindex_optimizer,
    # set_optimizer_strategy
    f"{_BASE_OPTIMIZER}._trainable_variables",
    f"{_BASE_OPTIMIZER}._trainable_variables_indices",
    f"{_TF_OPTIMIZER}._var_key",
    f"{_TF_OPTIMIZER}._distribution_strategy",
    # route_sharded_updates
    f"{_TF_OPTIMIZER}._distributed_tf_update_step",
    f"{_TF_OPTIMIZER}._apply_weight_decay",
    f"{_BASE_OPTIMIZER}._use_weight_decay",
    "tensorflow:__internal__.distribute.interim.maybe_merge_call",
    # learning_rate_or_schedule
    f"{_BASE_OPTIMIZER}._learning_rate",
    # clip_gradients, clipping_off
    f"{_BASE_OPTIMIZER}._clip_gradients",
    # moving_averages
    f"{_BASE_OPTIMIZER}._model_variables_moving_average",
)


def wrap_optimizer_all_reduce(optimizer, wrapper) -> None:
    """Replaces `optimizer._all_reduce_sum_gradients` by `wrapper(original)`.

    Keras 3's TF optimizer sums gradients across replicas inside
    `apply_gradients` (keras/src/backend/tensorflow/optimizer.py); our step
    has already reduced them, so the sum must be skippable. Idempotent.
    """
    original = optimizer._all_reduce_sum_gradients
    if getattr(original, "_kd_wrapped", False):
        return
    replaced = wrapper(original)
    replaced._kd_wrapped = True
    optimizer._all_reduce_sum_gradients = replaced


def sum_gradients_across_replicas(optimizer, grads_and_vars) -> list:
    """Keras's own sum of gradients across the replicas of a replica context
    (`TFOptimizer._all_reduce_sum_gradients`, with `wrap_optimizer_all_reduce`'s
    switch: our step's already reduced gradients pass through unchanged)."""
    return optimizer._all_reduce_sum_gradients(grads_and_vars)


def apply_loss_scaled(optimizer, grads, variables) -> None:
    """A `LossScaleOptimizer`'s update in a cross-replica context.

    Its `apply` refuses that context (keras/src/optimizers/loss_scale_optimizer.py,
    `_tf_apply`) for strategies whose replicas update variables themselves;
    `_common_apply` is the backend-neutral update it runs without one:
    skip or apply, then adjust the scale.
    """
    optimizer._common_apply(grads, trainable_variables=variables)


def optimizer_trainable_variables(optimizer) -> list:
    """The weights a built optimizer updates (`optimizer._trainable_variables`;
    Keras has no public accessor)."""
    return list(optimizer._trainable_variables)


def optimizer_strategy(optimizer):
    """The tf.distribute strategy a Keras TF optimizer was made under
    (`optimizer._distribution_strategy`), in whose scope its slots live."""
    return optimizer._distribution_strategy


def reindex_optimizer(optimizer) -> None:
    """Makes a built optimizer find its trainable variables again after
    the TensorFlow variables under them were made anew (`set_variable_value`).

    Keras's TF optimizer finds a variable's slots through
    `_trainable_variables_indices`, keyed by the TensorFlow variable's
    `_unique_id` (`TFOptimizer._var_key`), not by the Keras variable.
    """
    optimizer._trainable_variables_indices = {
        optimizer._var_key(variable): i for i, variable in enumerate(optimizer._trainable_variables)
    }


def set_optimizer_strategy(optimizer, tf_strategy) -> None:
    """Makes a Keras TF optimizer made outside `tf_strategy` act under it.

    The optimizer records the strategy current at its construction
    (`TFOptimizer._distribution_strategy`) and makes its slots and updates
    through it; one adopted by a model on another strategy must use that
    model's.
    """
    if hasattr(optimizer, "_distribution_strategy"):
        optimizer._distribution_strategy = tf_strategy


def route_sharded_updates(optimizer, is_sharded) -> None:
    """Keras's TF optimizer updates `is_sharded` variables without
    `strategy.extended.update`.

    Keras 3 applies every gradient through
    `distribution.extended.update(var, ...)`
    (`TFOptimizer._distributed_tf_update_step` and `_apply_weight_decay`,
    keras/src/backend/tensorflow/optimizer.py); ParameterServerStrategy's
    `update` colocates with `var`, which a ShardedVariable refuses
    ("doesn't support being used as a reference"). For a sharded variable
    (`is_sharded(v)`) the optimizer's own `update_step` is called directly,
    in the same cross-replica (merge-call) context: its `assign_sub` /
    `scatter_sub` / `assign` on the ShardedVariable are TensorFlow's
    shard-by-shard ops (slices of a dense delta, rows of an `IndexedSlices`
    delta). Other variables take Keras's own path unchanged. Idempotent.

    Verified on Keras 3.15.1 / TensorFlow 2.21.0 (no public hook exists
    between "gradients" and "per-variable update").
    """
    if getattr(optimizer._distributed_tf_update_step, "_kd_sharded", False):
        return
    _route_update_step(optimizer, is_sharded)
    _route_weight_decay(optimizer, is_sharded)


def _route_update_step(optimizer, is_sharded) -> None:
    update = optimizer._distributed_tf_update_step

    def distributed_update_step(distribution, grads_and_vars, learning_rate):
        grads_and_vars = list(grads_and_vars)
        plain = [(g, v) for g, v in grads_and_vars if not is_sharded(v)]
        if plain:
            update(distribution, plain, learning_rate)
        # What `extended.update` passes its function: one local value (workers
        # with several replicas hand the merge call mirrored values).
        [learning_rate] = distribution.experimental_local_results(learning_rate)[:1]
        for gradient, variable in grads_and_vars:
            if is_sharded(variable):
                [gradient] = distribution.experimental_local_results(gradient)[:1]
                optimizer.update_step(gradient, variable, learning_rate)

    setattr(distributed_update_step, "_kd_sharded", True)
    optimizer._distributed_tf_update_step = distributed_update_step


def _route_weight_decay(optimizer, is_sharded) -> None:
    weight_decay = optimizer._apply_weight_decay

    def apply_weight_decay(variables):
        variables = list(variables)
        weight_decay([v for v in variables if not is_sharded(v)])
        sharded = [v for v in variables if is_sharded(v)]
        if optimizer.weight_decay is None or not sharded:
            return

        def decay(distribution, sharded):
            del distribution
            for variable in sharded:
                if optimizer._use_weight_decay(variable):
                    lr = tf.cast(optimizer.learning_rate, variable.dtype)
                    wd = tf.cast(optimizer.weight_decay, variable.dtype)
                    variable.value.assign_sub(variable * wd * lr)

        tf.__internal__.distribute.interim.maybe_merge_call(
            decay, optimizer._distribution_strategy, sharded
        )

    optimizer._apply_weight_decay = apply_weight_decay


def clip_gradients(optimizer, grads: list) -> list:
    """`grads` clipped as the optimizer clips what it applies (`clipnorm`,
    `global_clipnorm` or `clipvalue`: `BaseOptimizer._clip_gradients`, which
    `apply` runs; Keras has no public entry to it)."""
    # The class's: another replica may be inside `clipping_off`.
    return type(optimizer)._clip_gradients(optimizer, grads)


_CLIPPING_OFF = threading.Lock()


@contextlib.contextmanager
def clipping_off(optimizer):
    """The optimizer applies gradients unclipped inside the block (at trace
    time): they were clipped whole before it updates parts of variables.
    MirroredStrategy traces its replicas in threads that run together, so
    the block counts who is inside."""
    with _CLIPPING_OFF:
        inside = optimizer.__dict__.get("_kd_clipping_off", 0)
        if not inside:
            optimizer._clip_gradients = lambda grads: grads
        optimizer.__dict__["_kd_clipping_off"] = inside + 1
    try:
        yield
    finally:
        with _CLIPPING_OFF:
            optimizer.__dict__["_kd_clipping_off"] -= 1
            if not optimizer.__dict__["_kd_clipping_off"]:
                del optimizer._clip_gradients


def moving_averages(optimizer) -> list:
    """The moving averages of `use_ema=True`, one per variable the optimizer
    was built on, in that order (`BaseOptimizer._model_variables_moving_average`)."""
    return list(optimizer._model_variables_moving_average)


def variable_key(optimizer, variable):
    """The key the optimizer finds `variable`'s slots by (`TFOptimizer._var_key`:
    the TensorFlow variable's id, the same for a Keras variable and its
    `.value`)."""
    return optimizer._var_key(variable)


def decide_weight_decay_by(optimizer, whole_of) -> None:
    """The optimizer decays a variable `v` when it would decay `whole_of(v)`
    (`BaseOptimizer._use_weight_decay`: by `exclude_from_weight_decay`'s
    variables and names)."""
    use_weight_decay = optimizer._use_weight_decay
    optimizer._use_weight_decay = lambda variable: use_weight_decay(whole_of(variable))


def learning_rate_or_schedule(optimizer):
    """The optimizer's rate as given: a variable, or the schedule object.

    The public `learning_rate` property evaluates a schedule; the warmup
    callbacks need the schedule itself (`optimizer._learning_rate`).
    """
    return optimizer._learning_rate


def optimizer_slot_prefix(variable) -> str:
    """How the name of an optimizer slot made for `variable` starts.

    Keras names a slot `f"{variable.path.replace('/', '_')}_{slot}"`
    (`BaseOptimizer.add_variable_from_reference`, Keras 3.15.1; no public
    map from a variable to its slots, each optimizer keeps its own lists).
    The tensor-parallel optimizer files gather a split weight's slots by it.
    """
    return variable.path.replace("/", "_") + "_"
