"""The per-replica math of `DistributedModel`'s training and test steps.

`ReplicaStep` is a mixin of `DistributedModel`: `train_step` / `test_step`
on one replica's shard of the global batch (forward pass, loss as a sum over
the replica's samples, gradients, then the step's one reduction
(`gradient_reduction.GradientReduction`), or accumulation with
`DistributedOptimizer(backward_passes_per_step=k)`); the per-output losses
of a model with several outputs, recorded once for the global batch; and
XLA compiling each replica's math where the strategy asks for it
(`replica_compiled`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import keras
import tensorflow as tf

from keras_distrib import _compat
from keras_distrib.arithmetic.gradients import scaled_gradient
from keras_distrib.training.step_state import TrainerPart


class ReplicaStep(TrainerPart):
    """The per-replica steps of `DistributedModel` (see module doc).

    Uses the model's reduction (`reduce_with_statistics`,
    `apply_reduced_gradients`: `gradient_reduction.GradientReduction`).
    """

    # The model's: Keras's (a layer: called on its input), and
    # `GradientReduction`'s.
    __call__: Callable[..., Any]
    trainable_weights: Any
    compute_metrics: Callable[..., Any]
    reduce_with_statistics: Callable[..., list]
    apply_reduced_gradients: Callable[[list], None]

    def train_step(self, data):
        """One optimizer step on this replica's shard of the global batch.

        The gradient path is: per-replica loss and gradients ->
        `reduce_gradients` (the one all-reduce) -> `apply_reduced_gradients`.
        With `DistributedOptimizer(backward_passes_per_step=k)` the local
        gradients are accumulated and reduced/applied every k-th step.
        """
        return self._train_step(data, apply_gradients=True)

    def _train_step(self, data, apply_gradients: bool):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        loss_and_gradients = self.replica_compiled(self._loss_and_gradients)
        loss, y_pred, gradients, output_losses = loss_and_gradients(x, y, sample_weight)
        num_samples = _batch_size(x)
        _compat.loss_tracker(self).update_state(
            _unless_empty(loss, num_samples), sample_weight=num_samples
        )
        if gradients and self._accumulation_steps == 1:
            gradients = self.reduce_with_statistics(gradients, num_samples, output_losses, x)
            self.apply_reduced_gradients(gradients)
        elif gradients:
            self.record_output_losses(output_losses, x)  # this replica's, as Keras does
            self.optimizer.accumulate(gradients, num_samples)
            if apply_gradients:
                gradients, num_samples = self.optimizer.take_accumulated(gradients)
                gradients = self.reduce_with_statistics(gradients, num_samples)
                self.apply_reduced_gradients(gradients)
        else:
            self.record_output_losses(output_losses, x)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _output_losses(self):
        """Within it, the per-output loss values Keras's compiled loss
        computes (a model with several outputs logs `<output>_loss` for
        each) are collected, not recorded: with several replicas each would
        be one replica's mean, recorded once per replica, so the logs held
        another average than one device's (1.4124 for 1.4062). Recorded by
        `record_output_losses` once the replicas' values are combined."""
        if not self._sums_sample_losses:
            return contextlib.nullcontext([])
        return _compat.captured_output_losses(self)

    def record_output_losses(self, values, x, summed: bool = False) -> None:
        """Records per-output loss values in Keras's per-output metrics.

        `summed`: the global batch's means (combined over the replicas),
        recorded once, as one device records them: with weight the global
        batch's static size (Keras weighs each batch by
        `y_pred.shape[0]`, 1 where unknown), by the first replica. Else:
        this replica's own values, as Keras would.
        """
        metrics = _compat.output_loss_metrics(self)
        if not metrics or not values:
            return
        if not summed:
            rows = _static_rows(x)
            for metric, value in zip(metrics, values):
                metric.update_state(value, sample_weight=rows)
            return
        rows = _static_rows(x)
        weight = 1.0 if rows is None else float(rows * self._strategy.num_replicas)
        first = tf.equal(self._strategy.replica_index(), 0)
        for metric, value in zip(metrics, values):
            metric.update_state(value, sample_weight=tf.where(first, weight, 0.0))

    def _loss_and_gradients(self, x, y, sample_weight):
        # Gradients of the sum of per-sample losses (see reduce_gradients):
        # without float16 layers the tape gives them directly, the count
        # multiplying the loss; otherwise the backward pass runs on the
        # replica's mean loss, as Keras would on one device (a sum over
        # samples could overflow float16 there), and the gradients, in the
        # variables' float32, are multiplied afterwards (one more pass over
        # all of them).
        count_in_loss = self._sums_sample_losses and not _has_float16_layers(self)
        with tf.GradientTape() as tape, self._output_losses() as output_losses:
            y_pred = self._forward(x, training=True)
            loss = _compat.compute_loss(
                self, x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
            )
            scaled = loss
            if count_in_loss:
                scaled = scaled * tf.cast(_batch_size(x), scaled.dtype)
            if self.optimizer is not None:  # a loss-scale optimizer's scale
                scaled = self.optimizer.scale_loss(scaled)
        gradients = None
        if self.trainable_weights:
            multiply = self._sums_sample_losses and not count_in_loss
            gradients = self._weight_gradients(
                tape, scaled, factor=_batch_size(x) if multiply else None
            )
        return loss, y_pred, gradients, list(output_losses)

    def _weight_gradients(self, tape, target, factor=None) -> list:
        """The gradients of `target` for `trainable_weights`, each put
        together as the strategy lays its variable out (`Strategy.gradients`)
        and multiplied by `factor` unless it is None."""
        gradients = self._strategy.gradients(tape, target, self.trainable_weights)
        if factor is None:
            return gradients
        return [scaled_gradient(g, factor) for g in gradients]

    def test_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = self.replica_compiled(self._forward)(x, training=False)
        with self._output_losses() as output_losses:
            loss = _compat.compute_loss(
                self, x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False
            )
        rows = _batch_size(x)
        _compat.loss_tracker(self).update_state(_unless_empty(loss, rows), sample_weight=rows)
        if output_losses:
            count = tf.cast(rows, tf.float32)
            *sums, total = self._strategy.all_reduce(
                [tf.cast(v, tf.float32) * count for v in output_losses] + [count]
            )
            self.record_output_losses([s / total for s in sums], x, summed=True)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _forward(self, x, training):
        if _compat.call_has_training_arg(self):
            return self(x, training=training)
        return self(x)

    def compile_replicas_separately(self, enabled: bool) -> None:
        """Whether `replica_compiled` compiles each replica's math with XLA.

        Strategies whose step holds collectives call this when they make the
        step function (collectives cannot run inside one XLA cluster, so XLA
        compiles the per-replica math instead of the whole step).
        """
        self._kd_state.jit_replicas = bool(enabled)
        self._kd_state.jit_cache.clear()

    def replica_compiled(self, fn):
        """`fn`, compiled with XLA per replica when the strategy asked for it.

        Each replica's function captures that replica's copies of the
        variables, so the replicas cannot share one traced function.
        """
        if not self._kd_state.jit_replicas:
            return fn
        ctx = tf.distribute.get_replica_context()
        replica = tf.get_static_value(getattr(ctx, "replica_id_in_sync_group", 0))
        cache = self._kd_state.jit_cache
        key = (fn.__name__, int(replica or 0))
        if key not in cache:
            cache[key] = tf.function(fn, jit_compile=True, reduce_retracing=True)
        return cache[key]


def _has_float16_layers(model) -> bool:
    return any(layer.compute_dtype == "float16" for layer in _compat.all_layers(model))


def _static_rows(x):
    """The static number of rows of `x` (None when unknown)."""
    for t in tf.nest.flatten(x):
        if t is not None:
            return t.shape[0]
    return None


def _batch_size(x):
    return tf.shape(next(t for t in tf.nest.flatten(x) if t is not None))[0]


def _unless_empty(loss, rows):
    """`loss` for the `loss` log, or 0 where the replica got no rows (a
    batch smaller than the replica count leaves some empty). Keras's loss of
    no rows is NaN, or its values, none (`reduce_values` keeps shape (0,)),
    and Keras's `Mean` of either, even weighed by 0, is NaN."""
    if tuple(loss.shape) == (0,):
        return tf.zeros([], loss.dtype)
    return tf.where(tf.cast(rows, tf.int32) > 0, loss, tf.zeros_like(loss))
