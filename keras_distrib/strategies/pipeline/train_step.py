"""The pipeline's train step: the schedule's passes over the micro-batches,
then one update.

A forward pass of stage `s` on micro-batch `i` runs under
`tf.device(devices[s])` inside its own `tf.GradientTape`; its backward pass
is `tape.gradient(stage outputs, variables + stage inputs,
output_gradients=the gradients from stage s+1)`, summed over micro-batches.
The passes of one stage are chained with control dependencies in the
schedule's order (`schedule.emission_order`), so the schedule is what
TensorFlow runs. Each pass is built under the name scope
`stage_{s}_{F|B}_{i}`, by which tests find it in the graph.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Optional

import tensorflow as tf

from keras_distrib import _compat
from keras_distrib.input import data as data_lib
from keras_distrib.strategies.pipeline import schedule as pipeline_schedule
from keras_distrib.strategies.pipeline.stages import (
    Stages,
    batch_rows,
    concat_micro_batches,
    row_share,
)
from keras_distrib.arithmetic.gradients import scaled_gradient, summed_gradients


def run(strategy, model, stages: Stages, data):
    """One training step of `model` under the `Pipeline` `strategy`: its
    logs (the metrics of the whole batch, as `DistributedModel.train_step`)."""
    import keras

    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    step = _ScheduledStep(strategy, model, stages, x, y, sample_weight)
    step.run_passes()
    step.apply_gradients(x)
    return step.logs(x, y, sample_weight)


@dataclasses.dataclass
class _MicroBatch:
    """One micro-batch's state through the step."""

    x: Any
    y: Any
    sample_weight: Any
    # Stage -> the outputs of the stage before, which it takes.
    entering: dict = dataclasses.field(default_factory=dict)
    # Stage -> (tape, target, sources) of its forward, until its backward.
    tapes: dict = dataclasses.field(default_factory=dict)
    # Stage -> the gradients of its inputs, until the stage before's backward.
    upstream: dict = dataclasses.field(default_factory=dict)
    # Losses earlier stages added (activity regularizers).
    added: list = dataclasses.field(default_factory=list)
    # From the last stage: the outputs, the loss (this micro-batch's share of
    # the global mean, with the added losses), each output's loss times rows.
    outputs: Optional[list] = None
    loss: Any = None
    output_sums: list = dataclasses.field(default_factory=list)


class _ScheduledStep:
    """The passes of one train step, and the gradients they sum."""

    def __init__(self, strategy, model, stages: Stages, x, y, sample_weight):
        self.strategy, self.model, self.stages = strategy, model, stages
        self.last = strategy.num_stages - 1
        self.rows = batch_rows(x)
        self.micro_batches = [
            _MicroBatch(*part)
            for part in data_lib.split_batch((x, y, sample_weight), strategy.num_micro_batches)
        ]
        self.variables = list(model.trainable_weights)
        self.gradients: list = [[] for _ in self.variables]  # per variable, to be summed
        self.last_pass: list = [None] * strategy.num_stages  # what a stage's next pass waits for

    def run_passes(self) -> None:
        strategy = self.strategy
        orders = pipeline_schedule.stage_orders(
            strategy.schedule, strategy.num_micro_batches, strategy.num_stages
        )
        for _, s, kind, i in pipeline_schedule.emission_order(orders):
            # The scope names each pass in the graph (tests find them there).
            with (
                tf.device(strategy.devices[s]),
                _after(self.last_pass[s]),
                tf.name_scope(f"stage_{s}_{kind}_{i}"),
            ):
                run_pass = self._forward if kind == "F" else self._backward
                self.last_pass[s] = run_pass(s, self.micro_batches[i])

    # -- forward ----------------------------------------------------------------------

    def _forward(self, s: int, micro_batch: _MicroBatch) -> list:
        """Stage `s`'s forward pass, recorded on a tape for its backward;
        returns what the stage's next pass waits for."""
        inputs = micro_batch.x if s == 0 else micro_batch.entering[s]
        sources = [] if s == 0 else _differentiable(inputs)
        with tf.GradientTape() as tape:
            tape.watch(sources)
            outputs = self.stages.forward(s, inputs, training=True)
            if s == self.last:
                target = self._loss(micro_batch, outputs)
            else:
                target = self._hand_over(s, micro_batch, outputs)
        micro_batch.tapes[s] = (tape, target, sources)
        return tf.nest.flatten(outputs) + ([target] if s == self.last else [])

    def _loss(self, micro_batch: _MicroBatch, outputs: list):
        """The last stage's target: the micro-batch's share of the global
        mean loss, scaled as the optimizer scales it."""
        model = self.model
        y_pred = self.stages.pack_outputs(outputs)
        # Counts the losses this stage added in this pass.
        with _compat.captured_output_losses(model) as per_output:
            loss = _compat.compute_loss(
                model,
                x=micro_batch.x,
                y=micro_batch.y,
                y_pred=y_pred,
                sample_weight=micro_batch.sample_weight,
                training=True,
            )
        rows = tf.cast(batch_rows(micro_batch.x), tf.float32)
        # An empty micro-batch's mean is NaN (0/0); its sum is 0.
        micro_batch.output_sums = [
            tf.where(rows > 0, tf.cast(v, tf.float32) * rows, 0.0) for v in per_output
        ]
        # This micro-batch's share of the global mean loss. A batch with
        # fewer rows than micro-batches leaves some empty: Keras's loss of
        # no rows has shape [0], whose sum is their share, 0.
        loss = (
            tf.reduce_sum(loss)
            * tf.cast(batch_rows(micro_batch.x), loss.dtype)
            / tf.cast(self.rows, loss.dtype)
        )
        target = model.optimizer.scale_loss(loss)
        micro_batch.loss = tf.add_n([loss, *(tf.cast(a, loss.dtype) for a in micro_batch.added)])
        micro_batch.outputs = outputs
        return target

    def _hand_over(self, s: int, micro_batch: _MicroBatch, outputs: list) -> list:
        """An inner stage's targets: its outputs, for the next stage, and
        the losses it added."""
        micro_batch.entering[s + 1] = outputs
        target = _differentiable(outputs)
        # Losses this stage added (activity regularizers): differentiated in
        # this stage's tape, one more target with its own output gradient.
        extra = self.stages.take_added_losses(s, row_share(micro_batch.x, self.rows))
        if extra is not None:
            micro_batch.added.append(extra)
            target = [*target, self.model.optimizer.scale_loss(extra)]
        return target

    # -- backward ---------------------------------------------------------------------

    def _backward(self, s: int, micro_batch: _MicroBatch) -> list:
        """Stage `s`'s backward pass: the gradients of its variables (added
        to the step's) and of its inputs (for the stage before); returns
        what the stage's next pass waits for."""
        tape, target, sources = micro_batch.tapes.pop(s)
        output_gradients = self._output_gradients(s, micro_batch, target)
        found = tape.gradient(target, self.variables + sources, output_gradients=output_gradients)
        micro_batch.upstream[s] = found[len(self.variables) :]
        self._add_gradients(found[: len(self.variables)])
        return [g for g in found if g is not None] or [tf.constant(0)]

    def _output_gradients(self, s: int, micro_batch: _MicroBatch, target: list):
        """The gradients arriving at stage `s`'s targets from the stage after
        (None for the last stage, whose target is the loss)."""
        if s == self.last:
            return None
        arriving = list(micro_batch.upstream.pop(s + 1))
        # An added loss's target (after the outputs) gets 1.
        arriving += [tf.ones_like(t) for t in target[len(arriving) :]]
        return [tf.zeros_like(t) if g is None else g for t, g in zip(target, arriving)]

    def _add_gradients(self, found: list) -> None:
        for k, g in enumerate(found):
            if g is not None:
                self.gradients[k].append(g)
                if self.strategy.schedule == "1f1b":
                    # A running sum: one gradient per variable is kept, as
                    # 1F1B bounds memory. GPipe holds every micro-batch
                    # anyway; one sum at the end saves it m-2 passes over
                    # the gradients.
                    self.gradients[k] = [summed_gradients(self.gradients[k])]

    # -- the update and the logs -----------------------------------------------------------

    def apply_gradients(self, x) -> None:
        """Applies the summed gradients (reduced with every worker's first,
        under a cluster) and records the per-output losses."""
        model, rows = self.model, self.rows
        gradients = [summed_gradients(g) if g else None for g in self.gradients]
        # Per-output losses (a model with several outputs): the batch's
        # means, recorded once as one device records them.
        output_losses = [
            tf.add_n(list(sums)) / tf.cast(rows, tf.float32)
            for sums in zip(*(mb.output_sums for mb in self.micro_batches))
        ]
        if self.strategy.world_size > 1:
            # The sum over micro-batches is this worker's mean-loss gradient;
            # as a sum over its rows it reduces with every worker's (and the
            # row counts, statistics, per-output losses and stop vote) in one
            # all-reduce.
            gradients = model.reduce_with_statistics(
                [scaled_gradient(g, rows) for g in gradients], rows, output_losses, x
            )
        else:
            model.record_output_losses(output_losses, x, summed=True)
        model.apply_reduced_gradients(gradients)

    def logs(self, x, y, sample_weight):
        """The loss and metrics of the whole batch, on the last stage's device."""
        model = self.model
        with tf.device(self.strategy.devices[-1]):
            y_pred = self.stages.pack_outputs(
                concat_micro_batches([mb.outputs for mb in self.micro_batches])
            )
            _compat.loss_tracker(model).update_state(
                tf.add_n([mb.loss for mb in self.micro_batches]), sample_weight=self.rows
            )
            return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def _differentiable(tensors: list) -> list:
    return [t for t in tensors if t.dtype.is_floating or t.dtype.is_complex]


def _after(tensors):
    """Runs what is built inside after `tensors` (graph mode; eager runs in
    program order anyway)."""
    if not tensors or tf.executing_eagerly():
        return contextlib.nullcontext()
    return tf.control_dependencies(tensors)
