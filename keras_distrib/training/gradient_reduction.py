"""The one cross-replica reduction of a training step.

`GradientReduction` is a mixin of `DistributedModel`:

* `reduce_gradients`: the step's one all-reduce, through the strategy;
* `reduce_with_statistics`: the same all-reduce, carrying BatchNormalization
  statistics, per-output losses and the preemption vote along;
* `apply_reduced_gradients`: the optimizer applies them without reducing
  again.

Keras's optimizer skips its own sum while `apply_reduced_gradients` runs:
the model installs its `ReductionSwitch` on every optimizer it adopts
(`keras_distrib.arithmetic.reduction_switch`, by
`keras_distrib.training.adoption`).
"""

from __future__ import annotations

from typing import Any, Callable

import keras
import tensorflow as tf

from keras_distrib import _compat
from keras_distrib import preemption
from keras_distrib.arithmetic import optimizer_shards
from keras_distrib.training.step_state import TrainerPart


class GradientReduction(TrainerPart):
    """The reduction of `DistributedModel`'s training step (see module doc).

    Uses the model's `record_output_losses` (`replica_step.ReplicaStep`).
    """

    # The model's: Keras's, and `ReplicaStep`'s.
    trainable_weights: Any
    record_output_losses: Callable[..., None]

    def reduce_with_statistics(
        self, gradients: list, num_samples, output_losses=(), x=None
    ) -> list:
        """`reduce_gradients`, with moving statistics, per-output losses and
        the stop vote riding along.

        Keras updates non-trainable float variables (BatchNormalization's
        moving mean and variance) on each replica from that replica's shard;
        left alone, the copies drift apart and `predict` of a row would
        depend on its replica. Their sample-weighted mean over the replicas
        travels in the gradients' all-reduce (no extra collective) and is
        assigned to every copy, so all replicas and workers keep one value.
        So do the per-output losses of a model with several outputs (the
        replica's values, `_output_losses`), recorded once for the global
        batch (`record_output_losses`). With several processes each
        replica's preemption vote travels in it too (see
        `keras_distrib.preemption`).
        """
        statistics = self._replica_statistics() if self._sums_sample_losses else []
        vote = self._kd_state.vote  # made by fit (several processes)
        output_losses = list(output_losses)
        shards = optimizer_shards.of(self.optimizer)
        scatter = shards is not None and shards.scatters and self._sums_sample_losses
        if not statistics and vote is None and not output_losses and not scatter:
            return self.reduce_gradients(gradients, num_samples)
        count = tf.cast(num_samples, tf.float32)
        extras = [tf.cast(v, tf.float32) * count for v in [*statistics, *output_losses]]
        if vote is not None:
            mine = tf.numpy_function(
                preemption.local_vote, [], tf.float32, stateful=True, name="kd_preemption_vote"
            )
            extras.append(tf.reshape(mine, []))
            vote.carried = True  # at trace time
        if scatter and shards is not None:  # optimizer_sharding="gradients": this replica's parts
            parts, means = shards.reduce_scatter(
                self.trainable_weights, gradients, num_samples, extras
            )
            reduced = [*parts, *means]
        else:
            reduced = self.reduce_gradients([*gradients, *extras], num_samples)
        for variable, value in zip(statistics, reduced[len(gradients) :]):
            variable.assign(tf.cast(value, variable.dtype))
        start = len(gradients) + len(statistics)
        self.record_output_losses(reduced[start : start + len(output_losses)], x, summed=True)
        if vote is not None:
            vote.variable.assign(reduced[-1])
        return reduced[: len(gradients)]

    def _replica_statistics(self) -> list:
        # Only layers known to update statistics per replica: other
        # non-trainable variables (a frozen backbone) are equal everywhere
        # and would only add traffic. `synchronized=True` layers already
        # compute global batch statistics.
        return [
            v
            for layer in _compat.all_layers(self)
            if isinstance(layer, keras.layers.BatchNormalization)
            and layer.trainable
            and not layer.synchronized
            for v in layer.non_trainable_variables
        ]

    def reduce_gradients(self, gradients: list, num_samples) -> list:
        """The one cross-replica reduction of the step.

        Each replica's gradients are of the *sum* of its per-sample losses
        (see `_loss_and_gradients`); the strategy sums them over replicas
        together with the sample counts and divides by the global count
        (`Strategy.reduce_gradients`): exactly the gradient of the mean loss
        over the global batch, whatever the split. Sparse gradients (an
        Embedding's) travel as rows instead (`Strategy.gather_sparse_gradients`).
        `None` entries (variables the loss does not reach) stay `None`.
        """
        if not any(g is not None for g in gradients):
            raise ValueError(
                "No gradients reach any trainable variable; check that the "
                "loss depends on the model's outputs."
            )
        if not self._sums_sample_losses:
            return list(gradients)
        reduced = list(gradients)
        dense = [
            i
            for i, g in enumerate(gradients)
            if g is not None and not isinstance(g, tf.IndexedSlices)
        ]
        sparse = [i for i, g in enumerate(gradients) if isinstance(g, tf.IndexedSlices)]
        if sparse:
            # Only the batch's rows travel, and Keras applies them as on one
            # device (see Strategy.gather_sparse_gradients).
            gathered = self._strategy.gather_sparse_gradients(
                [gradients[i] for i in sparse], num_samples
            )
            for i, g in zip(sparse, gathered):
                reduced[i] = g
        if dense:
            compression = getattr(self.optimizer, "compression", None)
            summed = self._strategy.reduce_gradients(
                [gradients[i] for i in dense], num_samples, compression
            )
            for i, g in zip(dense, summed):
                reduced[i] = g
        return reduced

    def apply_reduced_gradients(self, gradients: list) -> None:
        """Applies already-reduced gradients without Keras reducing again."""
        pairs = [(g, v) for g, v in zip(gradients, self.trainable_weights) if g is not None]
        with self._kd_state.reduction_switch.applying_reduced():
            self.optimizer.apply_gradients(pairs)
