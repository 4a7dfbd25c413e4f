"""`DistributedModel`: a `keras.Model` whose fit/evaluate/predict are distributed.

The split follows Keras: `train_step` / `test_step` are the per-replica math
(forward, loss, gradients, one reduction, apply), and the function-making
layer is distribution, which the model hands to its strategy
(`keras_distrib.strategies.base.Strategy`): the strategy turns the user's
input into what each step consumes, the per-replica step into the function
Keras's loop calls, and per-replica results into plain numbers for the
callbacks. The model never asks what kind of strategy it holds.

Keras itself only ever sees the default (no-op) `tf.distribute` strategy, so
its input pipeline yields plain batches and none of its broken distribution
paths run (keras-team/keras#20585; see `keras_distrib._compat`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import os
import threading
import warnings
import weakref
from typing import Optional, Union

import keras
import numpy as np
import tensorflow as tf

from keras_distrib import _compat
from keras_distrib.training import chief_only
from keras_distrib.input import data as data_lib
from keras_distrib.input.fit_input import FitInput
from keras_distrib.training import fit_checks
from keras_distrib.training import fit_state as fit_state_lib
from keras_distrib import placement
from keras_distrib import preemption
from keras_distrib.strategies.parameter_server import sharded_variables
from keras_distrib.training import saving
from keras_distrib.training import step_call
from keras_distrib import strategies
from keras_distrib.strategies import registry
from keras_distrib.strategies import tf_distribute
from keras_distrib.strategies.base import Step, Strategy, optimizers_in, scaled_gradient

_compat.warn_if_untested()
_compat.check_hooks()
_compat.unscaled_losses_where(lambda: tf_distribute.entered() is not None)
Functional = _compat.functional_class()

StrategyLike = Union[str, Strategy]

# Trace-time state: how many replica threads are applying gradients that
# `train_step` already reduced. Not thread-local: a loss-scale optimizer
# under MirroredStrategy applies them from `merge_call`, in other threads
# than the replicas' (see `_install_reduction_switch`).
_reduced_applies = [0]
_reduced_applies_lock = threading.Lock()

_COMPILE_SIGNATURE = inspect.signature(keras.Model.compile)

# Optimizer -> the strategy that adopted it (see `_adopt_optimizer`).
_ADOPTED: "weakref.WeakKeyDictionary[keras.optimizers.Optimizer, Strategy]" = (
    weakref.WeakKeyDictionary())


def _outside_scopes(method):
    """`method`, run outside any tf.distribute scope the caller is in (see
    `_compat.outside_strategy_scopes`): the model distributes itself."""

    @functools.wraps(method)
    def run_outside(self, *args, **kwargs):
        if tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context():
            with _compat.outside_strategy_scopes():
                return method(self, *args, **kwargs)
        return method(self, *args, **kwargs)

    return run_outside


@keras.saving.register_keras_serializable(package="keras_distrib")
class DistributedModel(keras.Model):
    """A `keras.Model` trained on the strategy named by `strategy=`.

    Usable three ways:

    Example:

    ```python
    import keras, keras_distrib as kd

    # 1. Functional.
    inputs = keras.Input((8,))
    outputs = keras.layers.Dense(1)(inputs)
    model = kd.DistributedModel(inputs, outputs, strategy="mirrored")

    # 2. Subclass.
    class Net(kd.DistributedModel):
        def __init__(self, **kwargs):
            super().__init__(strategy="mirrored", **kwargs)
            self.dense = keras.layers.Dense(1)

        def call(self, x):
            return self.dense(x)

    # 3. Wrap an existing (even trained) model, keeping its weights.
    model = kd.DistributedModel.from_model(keras_model, strategy="mirrored")

    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=64)   # batch_size is the global batch
    ```

    Args:
        strategy: A name from `keras_distrib.strategies.available()` or a
            `keras_distrib.strategies.Strategy` object. Default `"auto"`.
    """

    # Only the chief prints and writes files (see keras_distrib.training.chief_only).
    chief_only_side_effects = True
    # `fit` refuses float numpy input holding NaN/Inf and stops, naming the
    # step, when the training loss is NaN/Inf (see `fit_checks.FiniteLossCheck`).
    # Set `model.check_finite = False` to train on such input anyway.
    check_finite = True

    def __new__(cls, *args, **kwargs):
        if _compat.is_functional_call(args, kwargs) and not issubclass(cls, Functional):
            # `Net(inputs, outputs)` for a subclass `Net` (the Keras guide's
            # custom train_step on a functional model): an instance of a
            # functional variant of `Net`. Keras would instead rewrite the
            # bases of every class up to keras.Model, turning all
            # DistributedModel subclasses functional.
            return super().__new__(_functional_variant(cls))
        return super().__new__(cls)

    def __init__(self, *args, strategy: StrategyLike = "auto", **kwargs):
        resolved = strategies.get(strategy)
        registry.check_not_model_options(kwargs, resolved)
        super().__init__(*args, **kwargs)
        self._init_distribution(resolved)

    def _init_distribution(self, strategy: Strategy) -> None:
        self._strategy = strategy
        # Whether XLA compiles each replica's math separately (set by the
        # strategy when it makes the step function; see `replica_compiled`).
        self._jit_replicas = False
        # Keras must only ever see the default strategy (see module doc).
        _compat.hide_distribute_strategy(self)

    # -- public surface -------------------------------------------------------

    @property
    def strategy(self) -> Strategy:
        """The strategy this model trains on."""
        return self._strategy

    def _resolve_auto_jit_compile(self):
        """Keras's `jit_compile="auto"` (True on GPU machines, in `compile` and
        for `predict` before it), but False where the strategy's step cannot
        be compiled by XLA (`Strategy.without_xla`)."""
        strategy = getattr(self, "_strategy", None)
        if strategy is not None and strategy.without_xla():
            return False
        return super()._resolve_auto_jit_compile()

    def _set_jit_compile(self, value):
        # Keras's setter, also reached from `compile`: an explicit True where
        # XLA cannot compile the step warns with the reason and stays off.
        reason = value is True and self._strategy.without_xla()
        if reason:
            warnings.warn(f"jit_compile=True is not possible with strategy="
                          f"{self._strategy.name!r}: {reason}; proceeding with "
                          "jit_compile=False.", stacklevel=2)
            value = False
        keras.Model.jit_compile.fset(self, value)

    jit_compile = property(keras.Model.jit_compile.fget, _set_jit_compile,
                           doc=keras.Model.jit_compile.__doc__)

    @classmethod
    def from_model(
        cls, model: keras.Model, strategy: StrategyLike = "auto"
    ) -> "DistributedModel":
        """Wraps a copy of a Functional or Sequential Keras model, keeping its state.

        Each layer is copied as it is (not re-created from its config, so
        `Lambda` layers and layers without `get_config` copy too), its
        variables made under the strategy with the same values; the model
        passed in is left as it was. If it was compiled, the copy is
        compiled the same way and the optimizer's state (step count,
        slots) is carried over too.

        Raises:
            ValueError: for subclassed or unbuilt models.
        """
        graph = getattr(model, "_functional", model)
        if isinstance(model, keras.Sequential) and not isinstance(graph, Functional):
            raise ValueError(
                f"from_model needs a built model, but Sequential {model.name!r} has no "
                "input shape yet; start it with keras.Input(shape=...) (e.g. "
                "keras.Sequential([keras.Input((8,)), ...])) or call model.build(shape)."
            )
        if not isinstance(graph, Functional):
            raise ValueError(
                f"from_model needs a built Functional or Sequential model, got "
                f"{type(model).__name__}; for a subclassed model, subclass "
                "keras_distrib.DistributedModel instead of keras.Model."
            )
        copied = placement.copy_functional(model)
        wrapped = FunctionalDistributedModel(
            copied.input, copied.output, name=model.name, strategy=strategy
        )
        if model.compiled:
            _compile_like(model, wrapped)
            _copy_optimizer_state(model, wrapped)
        return wrapped

    # -- construction under the strategy ------------------------------------

    def __call__(self, *args, **kwargs):
        # Lazily built (subclassed) models create their variables on the first
        # call; make sure that happens under the strategy.
        if not self.built and not tf.distribute.has_strategy():
            with self._strategy.scope(), fit_checks.same_model_or_error(self._strategy):
                outputs = super().__call__(*args, **kwargs)
            if self.built:
                self._take_variables()
            return outputs
        return super().__call__(*args, **kwargs)

    @_outside_scopes
    def _take_variables(self) -> None:
        """Makes the variables of the model's layers this strategy's, in
        place (`Strategy.place`): layers built outside the strategy (the
        graph a Functional model is made from, sub-models a subclass was
        given) keep their objects and values, and no layer is re-created
        from its config. With several processes the moved variables then
        hold worker 0's values (initializers are unseeded by default, so
        each process drew its own), as at creation under the strategy.
        """
        unheld = [v for v in self.variables if not self._strategy.holds(v)]
        if unheld:
            fit_checks.check_same_model(self._strategy, unheld)
        moved = {id(v) for v in self._strategy.place(self)}
        placement.claim(self.variables, self._strategy, self)
        moved = [v for v in self.variables if id(v) in moved]
        if moved:
            self._strategy.broadcast_variables(moved)
            self._strategy.broadcast_derived_state(self)

    def _adopt_state(self) -> None:
        """Everything the model trains with becomes the strategy's before
        `fit`, `evaluate` or `predict` builds: its layers (`_take_variables`),
        its metrics (those a custom `compile` or `__init__` made, as Keras's
        guides write them) and every optimizer it holds (one passed to
        `compile`, and others set as attributes, as a GAN's `d_optimizer`
        and `g_optimizer`)."""
        self._take_variables()
        metric_variables = [v for metric in self.metrics for v in metric.variables]
        placement.remake(placement.unheld(self._strategy, metric_variables, self),
                         self._strategy, self)
        for optimizer in _optimizer_attributes(self):
            _adopt_optimizer(optimizer, self._strategy, self)

    @_outside_scopes
    def compile(self, optimizer="rmsprop", *args, **kwargs):
        arguments = _COMPILE_SIGNATURE.bind(self, optimizer, *args, **kwargs).arguments
        arguments.pop("self")
        arguments.update(arguments.pop("kwargs", {}))
        _check_steps_per_execution(arguments.get("steps_per_execution", 1))
        with self._strategy.scope():
            arguments["optimizer"] = _adopt_optimizer(
                self._loss_scaled_if_mixed(keras.optimizers.get(arguments["optimizer"]),
                                           arguments.get("auto_scale_loss", True)),
                self._strategy, self)
            for key in ("metrics", "weighted_metrics"):
                arguments[key] = _adopt_metrics(arguments.get(key), self._strategy, self)
            super().compile(**arguments)

    def _loss_scaled_if_mixed(self, optimizer, auto_scale_loss: bool):
        """`optimizer` in a LossScaleOptimizer where Keras's `compile` would
        wrap it (policy "mixed_float16"), so that the strategy adopts the
        optimizer that applies the updates: wrapped after `adopt_optimizer`,
        its loss-scale update ran unadopted (under central_storage it failed:
        "`merge_call` called while defining a new graph")."""
        if (auto_scale_loss and optimizer and self.dtype_policy.name == "mixed_float16"
                and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer)):
            return keras.optimizers.LossScaleOptimizer(optimizer, name="loss_scale_optimizer")
        return optimizer

    def compile_from_config(self, config):
        # Keras skips compiling on load when `compile` is overridden.
        self.compile(**keras.saving.deserialize_keras_object(config))
        if self.built:
            with self._strategy.scope():
                self.optimizer.build(self.trainable_variables)

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        if iterator is not None:
            iterator = _compat.build_source(iterator)
        self._adopt_state()
        if not _defines_call(self):
            # A model with no `call` (the keras-io GAN): nothing to run
            # forward, and Keras itself builds nothing before the first step
            # (without a tf.distribute strategy it skips this build). Its
            # sub-models were built by their inputs and adopted above; the
            # optimizers build their slots at their first `apply_gradients`.
            _check_built_without_call(self)
            self._strategy.sync_initial_state(self)
            return
        with self._strategy.scope(), fit_checks.same_model_or_error(self._strategy):
            try:
                self._symbolic_build(iterator=iterator, data_batch=data_batch)
            except _compat.EmptyInput:
                # Keras reads one batch to build; an empty input has none.
                raise ValueError(
                    "The input data is empty: it gave no batch; check its source and "
                    "any filter/take/skip/shard that could remove every element."
                ) from None
        self._strategy.sync_initial_state(self)

    def get_metrics_result(self):
        return self._strategy.read_metrics(self, super().get_metrics_result)

    def reset_metrics(self):
        super().reset_metrics()
        self._strategy.metrics_reset(self)

    # -- the per-replica math -------------------------------------------------

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
        _compat.loss_tracker(self).update_state(loss, sample_weight=num_samples)
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

    def reduce_with_statistics(self, gradients: list, num_samples, output_losses=(),
                               x=None) -> list:
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
        vote = self.__dict__.get("_vote")  # made by fit (several processes)
        output_losses = list(output_losses)
        if not statistics and vote is None and not output_losses:
            return self.reduce_gradients(gradients, num_samples)
        count = tf.cast(num_samples, tf.float32)
        extras = [tf.cast(v, tf.float32) * count for v in [*statistics, *output_losses]]
        if vote is not None:
            mine = tf.numpy_function(preemption.local_vote, [], tf.float32, stateful=True,
                                     name="kd_preemption_vote")
            extras.append(tf.reshape(mine, []))
            vote.carried = True  # at trace time
        reduced = self.reduce_gradients([*gradients, *extras], num_samples)
        for variable, value in zip(statistics, reduced[len(gradients):]):
            variable.assign(tf.cast(value, variable.dtype))
        start = len(gradients) + len(statistics)
        self.record_output_losses(reduced[start:start + len(output_losses)], x, summed=True)
        if vote is not None:
            vote.variable.assign(reduced[-1])
        return reduced[: len(gradients)]

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

    def _replica_statistics(self) -> list:
        # Only layers known to update statistics per replica: other
        # non-trainable variables (a frozen backbone) are equal everywhere
        # and would only add traffic. `synchronized=True` layers already
        # compute global batch statistics.
        return [
            v
            for layer in _compat.all_layers(self)
            if isinstance(layer, keras.layers.BatchNormalization)
            and layer.trainable and not layer.synchronized
            for v in layer.non_trainable_variables
        ]

    @property
    def _accumulation_steps(self) -> int:
        return getattr(self.optimizer, "backward_passes_per_step", 1)

    @property
    def _sums_sample_losses(self) -> bool:
        # Gradients of summed (not averaged) per-sample losses are what can be
        # added across replicas and steps and divided by the sample count.
        # With one replica and no accumulation the step is Keras's own.
        return self._strategy.num_replicas > 1 or self._accumulation_steps > 1

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
            # Variables split over parameter servers need their parts'
            # gradients put together (see sharded_variables).
            gradients = sharded_variables.gradients(tape, scaled, self.trainable_weights)
            if self._sums_sample_losses and not count_in_loss:
                gradients = [scaled_gradient(g, _batch_size(x)) for g in gradients]
        return loss, y_pred, gradients, list(output_losses)

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
        dense = [i for i, g in enumerate(gradients)
                 if g is not None and not isinstance(g, tf.IndexedSlices)]
        sparse = [i for i, g in enumerate(gradients) if isinstance(g, tf.IndexedSlices)]
        if sparse:
            # Only the batch's rows travel, and Keras applies them as on one
            # device (see Strategy.gather_sparse_gradients).
            gathered = self._strategy.gather_sparse_gradients(
                [gradients[i] for i in sparse], num_samples)
            for i, g in zip(sparse, gathered):
                reduced[i] = g
        if dense:
            compression = getattr(self.optimizer, "compression", None)
            summed = self._strategy.reduce_gradients(
                [gradients[i] for i in dense], num_samples, compression)
            for i, g in zip(dense, summed):
                reduced[i] = g
        return reduced

    def apply_reduced_gradients(self, gradients: list) -> None:
        """Applies already-reduced gradients without Keras reducing again."""
        pairs = [(g, v) for g, v in zip(gradients, self.trainable_weights) if g is not None]
        with _reduced_applies_lock:
            _reduced_applies[0] += 1
        try:
            self.optimizer.apply_gradients(pairs)
        finally:
            with _reduced_applies_lock:
                _reduced_applies[0] -= 1

    def test_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = self.replica_compiled(self._forward)(x, training=False)
        with self._output_losses() as output_losses:
            loss = _compat.compute_loss(
                self, x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False
            )
        rows = _batch_size(x)
        _compat.loss_tracker(self).update_state(loss, sample_weight=rows)
        if output_losses:
            count = tf.cast(rows, tf.float32)
            *sums, total = self._strategy.all_reduce(
                [tf.cast(v, tf.float32) * count for v in output_losses] + [count])
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
        self._jit_replicas = bool(enabled)
        self.__dict__.pop("_kd_jit_cache", None)

    def replica_compiled(self, fn):
        """`fn`, compiled with XLA per replica when the strategy asked for it.

        Each replica's function captures that replica's copies of the
        variables, so the replicas cannot share one traced function.
        """
        if not self._jit_replicas:
            return fn
        ctx = tf.distribute.get_replica_context()
        replica = tf.get_static_value(getattr(ctx, "replica_id_in_sync_group", 0))
        cache = self.__dict__.setdefault("_kd_jit_cache", {})
        key = (fn.__name__, int(replica or 0))
        if key not in cache:
            cache[key] = tf.function(fn, jit_compile=True, reduce_retracing=True)
        return cache[key]

    # -- the function-making layer: the strategy's ---------------------------

    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return self.train_function
        self.train_function = _with_resume_and_preemption(self, self._make_train_function())
        return self.train_function

    def make_test_function(self, force=False):
        if self.test_function is not None and not force:
            return self.test_function
        self.test_function = self._strategy_function(self._step("test"))
        return self.test_function

    def _step(self, kind: str, applies: bool = True) -> Step:
        """The per-replica step of `kind` ("train", "test", "predict") as the
        strategy gets it: the model's method, and whether the user overrode
        it. `applies=False`: a train step that only accumulates gradients."""
        name = f"{kind}_step"
        fn = getattr(self, name)
        if not applies:
            fn = functools.partial(self._train_step, apply_gradients=False)
        return Step(fn, kind, custom=getattr(type(self), name) is not getattr(DistributedModel, name),
                    applies=applies)

    def _make_train_function(self):
        k = self._accumulation_steps
        step = self._step("train")
        if k == 1:
            return self._strategy_function(step)
        if step.custom:
            raise ValueError(
                "backward_passes_per_step > 1 needs DistributedModel's own "
                "train_step; accumulate in your custom train_step instead."
            )
        if self.steps_per_execution != 1:
            raise ValueError(
                "backward_passes_per_step > 1 needs steps_per_execution=1 "
                f"(got {self.steps_per_execution}); compile without it."
            )
        accumulate = self._strategy_function(self._step("train", applies=False))
        accumulate_and_apply = self._strategy_function(step)
        steps = itertools.count()

        def train_function(iterator):
            if next(steps) % k == k - 1:
                return accumulate_and_apply(iterator)
            return accumulate(iterator)

        return train_function

    def _strategy_function(self, step: Step):
        """The function Keras's loop calls for `step`: the strategy's, made
        with Keras's maker (`_compat.KERAS_HOOKS`), one compiled call per step
        where it can (`step_call`)."""
        keras_make_function = functools.partial(
            step_call.one_call_per_step, self, keras_make_function=super()._make_function)
        return self._strategy.make_step_function(self, step, keras_make_function)

    def make_predict_function(self, force=False):
        if self.predict_function is not None and not force:
            return self.predict_function

        def keras_make_predict_function():
            super(DistributedModel, self).make_predict_function(force=True)
            return self.predict_function

        self.predict_function = self._strategy.make_predict_function(
            self, self._step("predict"), keras_make_predict_function)
        return self.predict_function

    # -- entry points: input to the strategy, lazy builds ----------------------

    @_outside_scopes
    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto",
            callbacks=None, validation_split=0.0, validation_data=None,
            shuffle=True, class_weight=None, sample_weight=None, **kwargs):
        x = _compat.undistributed(x)
        validation_data = _compat.undistributed(validation_data)
        self._strategy.check_batch_size(batch_size)
        self._strategy.check_batch_size(kwargs.get("validation_batch_size"),
                                        "validation_batch_size")
        self._check_fit_input(x, y, sample_weight)
        steps_per_epoch = kwargs.pop("steps_per_epoch", None)
        fit_checks.check_same_call(
            self._strategy, "fit", x, batch_size=batch_size, epochs=epochs,
            initial_epoch=kwargs.get("initial_epoch", 0), steps=steps_per_epoch,
            steps_per_execution=self.steps_per_execution)
        self._strategy.check_callbacks(_callback_list(callbacks))
        backup = fit_state_lib.resumable_among(_callback_list(callbacks))
        start = backup.resume_point(self) if backup is not None else None
        fit = self._strategy.distribute_fit_input(FitInput(
            x=x, y=y, sample_weight=sample_weight, batch_size=batch_size, shuffle=shuffle,
            validation_split=validation_split, validation_data=validation_data,
            validation_batch_size=kwargs.pop("validation_batch_size", None),
            steps_per_epoch=steps_per_epoch,
            class_weight=class_weight,  # with arrays: made sample weights (sharding.fit_input)
            steps_per_execution=self.steps_per_execution,
            start=start, resumable=backup is not None))
        if fit.build_batch is not None:
            # The strategy feeds Keras no real batches (parameter servers).
            self._maybe_symbolic_build(data_batch=fit.build_batch)
        if backup is not None:
            backup.record_seed(fit.seed)
        if start is not None:
            kwargs["initial_epoch"] = start.epoch
        state = fit_state_lib.FitState(
            backup=backup, replay=(start.step if start else 0) // self.steps_per_execution)
        preemption.reset()
        with self._fit_state_set(state), preemption.watching(), \
                self._side_effects(callbacks) as callbacks, \
                self._internal_callbacks(callbacks) as callbacks, \
                self._clearer_failure():
            history = super().fit(
                fit.x, fit.y, fit.batch_size, epochs, self._verbose(verbose),
                callbacks, fit.validation_split, fit.validation_data,
                fit.shuffle, fit.class_weight, fit.sample_weight,
                validation_batch_size=fit.validation_batch_size,
                steps_per_epoch=fit.steps_per_epoch, **kwargs,
            )
        if state.preempted_at is not None:
            where = (f"; backup in {backup.backup_dir}" if backup is not None else
                     "; nothing was saved (add keras_distrib.callbacks.BackupAndRestore)")
            raise preemption.announce(state.preempted_at, where)
        return history

    @property
    def fit_state(self) -> Optional[fit_state_lib.FitState]:
        """The state of the `fit` call running now (`FitState`), or None."""
        return self.__dict__.get("_fit_state")

    @contextlib.contextmanager
    def _fit_state_set(self, state: fit_state_lib.FitState):
        # In __dict__: not an attribute Keras tracks or saves.
        self.__dict__["_fit_state"] = state
        try:
            yield state
        finally:
            self.__dict__["_fit_state"] = None

    def _check_fit_input(self, x, y, sample_weight) -> None:
        """Bad input that is cheap to see before training: one-line errors.

        Reads numpy arrays (one pass each) and what TensorFlow knows of a
        dataset without reading it; the same on every worker, which all get
        the same arguments.
        """
        data_lib.check_not_empty(x)
        sparse = fit_checks.sparse_categorical_classes(self)
        if sparse is not None:
            data_lib.check_sparse_labels(y, *sparse)
        if self.check_finite:
            for name, value in (("x", x), ("y", y), ("sample_weight", sample_weight)):
                data_lib.check_finite(name, value)

    @contextlib.contextmanager
    def _internal_callbacks(self, callbacks):
        """`callbacks` with ours around the user's.

        First: `PreemptionWatch` (the train function asks it after every
        step whether to stop) and, unless opted out, `FiniteLossCheck`. Last
        (after the user's `on_train_begin` set the weights: broadcasts,
        restores): `ReplicasAgree`, with several processes.
        """
        watch = preemption.PreemptionWatch(self.fit_state, self._preemption_vote())
        self.fit_state.watch = watch
        first = [watch]
        if self.check_finite:
            # Per-batch logs are global values only with one process; with
            # several, the exact epoch logs are checked, so all stop together.
            first.append(fit_checks.FiniteLossCheck(per_batch=self._strategy.world_size == 1))
        last = [fit_checks.ReplicasAgree()] if self._strategy.world_size > 1 else []
        if not isinstance(callbacks, keras.callbacks.CallbackList):
            yield [*first, *(keras.tree.flatten(callbacks) if callbacks else []), *last]
            return
        for callback in first + last:
            callback.set_model(self)
            callback.set_params(callbacks.params)
        callbacks.callbacks[:0] = first
        callbacks.callbacks.extend(last)
        try:
            yield callbacks
        finally:
            for callback in first + last:
                callbacks.callbacks.remove(callback)

    def _preemption_vote(self) -> Optional[preemption.Vote]:
        """The stop vote the step's all-reduce carries (None with one
        process: its own SIGTERM flag decides). One per model: the traced
        train function, which outlives a `fit` call, holds its variable."""
        if self._strategy.world_size == 1:
            return None
        vote = self.__dict__.get("_vote")
        if vote is None:
            with self._strategy.scope():
                vote = preemption.Vote(tf.Variable(
                    0.0, trainable=False, name="kd_preemption_vote",
                    aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA))
            # Not a Keras attribute: no weight, never saved.
            self.__dict__["_vote"] = vote
        return vote

    @_outside_scopes
    def evaluate(self, x=None, y=None, batch_size=None, verbose="auto",
                 sample_weight=None, steps=None, callbacks=None, **kwargs):
        x = _compat.undistributed(x)
        self._strategy.check_batch_size(batch_size)
        if kwargs.get("_use_cached_eval_dataset"):
            # Validation inside fit: the input was distributed by fit already.
            if preemption.stopped_at(self) is not None:
                return {}  # stopping on a SIGTERM: no time for validation
            return super().evaluate(x, y, batch_size, verbose, sample_weight,
                                    steps, callbacks, **kwargs)
        fit_checks.check_same_call(self._strategy, "evaluate", x, batch_size=batch_size,
                                   steps=steps, steps_per_execution=self.steps_per_execution)
        x, y, sample_weight, batch_size = self._strategy.distribute_input(
            x, y, sample_weight, batch_size)
        with self._side_effects(callbacks) as callbacks, self._clearer_failure():
            return super().evaluate(x, y, batch_size, self._verbose(verbose),
                                    sample_weight, steps, callbacks, **kwargs)

    @_outside_scopes
    def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
        x = _compat.undistributed(x)
        self._strategy.check_batch_size(batch_size)
        fit_checks.check_same_call(self._strategy, "predict", x, batch_size=batch_size,
                                   steps=steps, steps_per_execution=self.steps_per_execution)
        if not self.built:
            self._maybe_symbolic_build(iterator=_compat.epoch_iterator(x, batch_size))
        x, _, _, batch_size = self._strategy.distribute_input(x, batch_size=batch_size)
        with self._side_effects(callbacks) as callbacks, self._clearer_failure():
            return super().predict(x, batch_size, self._verbose(verbose), steps, callbacks)

    def _verbose(self, verbose):
        if self.chief_only_side_effects and not self._strategy.is_chief:
            return 0
        return verbose

    @contextlib.contextmanager
    def _clearer_failure(self):
        """The strategy's one-line error (a lost or stuck peer, named) in
        place of what TensorFlow raised, where the strategy has one."""
        try:
            yield
        except Exception as error:
            clearer = self._strategy.failure(error)
            if clearer is None:
                raise
            raise clearer from None

    def _side_effects(self, callbacks):
        return chief_only.redirected(
            callbacks, self._strategy.is_chief, self.chief_only_side_effects
        )

    @_outside_scopes
    def train_on_batch(self, *args, **kwargs):
        return super().train_on_batch(*args, **kwargs)

    @_outside_scopes
    def test_on_batch(self, *args, **kwargs):
        return super().test_on_batch(*args, **kwargs)

    @_outside_scopes
    def predict_on_batch(self, x):
        if not self.built:
            self._maybe_symbolic_build(data_batch=(x, None, None))
        return super().predict_on_batch(x)

    # -- weights: whole values, as a plain model's --------------------------------

    def get_weights(self):
        """`keras.Model.get_weights()`: a plain model's list, also where the
        strategy splits variables (`tensor_parallel`: each comes whole)."""
        return self.strategy.whole_weights(self)

    def set_weights(self, weights):
        """`keras.Model.set_weights()`, from a plain model's list."""
        self.strategy.set_whole_weights(self, weights)

    # -- saving: atomic files -------------------------------------------------

    def save(self, filepath, overwrite=True, **kwargs):
        """`keras.Model.save`, written atomically (temp file + rename)."""
        if not _can_write_atomically(filepath, overwrite, kwargs):
            return super().save(filepath, overwrite=overwrite, **kwargs)
        with saving.atomic_path(filepath) as tmp:
            super().save(tmp, overwrite=True, **kwargs)

    def save_weights(self, filepath, overwrite=True, **kwargs):
        """`keras.Model.save_weights`, written atomically (temp file + rename)."""
        if not _can_write_atomically(filepath, overwrite, kwargs):
            return super().save_weights(filepath, overwrite=overwrite, **kwargs)
        with saving.atomic_path(filepath) as tmp:
            super().save_weights(tmp, overwrite=True, **kwargs)


@keras.saving.register_keras_serializable(package="keras_distrib")
class FunctionalDistributedModel(DistributedModel, Functional):
    """What `DistributedModel(inputs, outputs, ...)` returns.

    The model is made of the layers between `inputs` and `outputs`, as
    `keras.Model(inputs, outputs)` is (shared with any plain model of
    them); their variables are moved under the strategy, same values.
    Layers that another live `DistributedModel` trains are copied instead
    (a variable lives under one strategy).
    """

    def __init__(self, inputs, outputs, name=None, *, strategy: StrategyLike = "auto", **kwargs):
        resolved = strategies.get(strategy)
        registry.check_not_model_options(kwargs, resolved)
        if placement.owned_by_another(keras.Model(inputs, outputs).variables):
            # Layers another DistributedModel trains: this one gets its own
            # copies (a variable lives under one strategy).
            inputs, outputs = placement.copy_graph(inputs, outputs)
        Functional.__init__(self, inputs, outputs, name=name, **kwargs)
        self._init_distribution(resolved)
        self._take_variables()

    def get_config(self):
        """Keras's Functional config, and the strategy's name (`"strategy"`).

        The file names Keras's own public `keras.Model` as its class (see
        `_compat.save_as_keras_model`), so plain Keras loads it where
        keras_distrib is not installed (its Functional ignores the
        `"strategy"` key); where keras_distrib is imported, the key makes
        `keras.models.load_model` return a `DistributedModel` on that
        strategy (`_strategy_for_loading`).
        """
        config = super().get_config()
        if type(self) is FunctionalDistributedModel:
            config[_SAVED_STRATEGY_KEY] = self._strategy.name
        return config


_SAVED_STRATEGY_KEY = "strategy"


def _strategy_for_loading(name):
    """The strategy a loaded model trains on: the one it was saved with,
    unless a strategy's scope is entered (then that one, as Keras loads
    into a scope), or it cannot run here (a cluster strategy in a notebook:
    then `"auto"`, with a warning naming why)."""
    if tf.distribute.has_strategy() or not isinstance(name, str):
        return "auto"
    try:
        return strategies.get(name)
    except (ValueError, ImportError) as error:
        warnings.warn(f"The model was saved with strategy {name!r}, which cannot run here "
                      f"({error}); loading it with strategy='auto'.", stacklevel=3)
        return "auto"


def _load_saved(config, custom_objects=None):
    """`keras.Model.from_config` of a file written by a FunctionalDistributedModel."""
    config = dict(config)
    config[_SAVED_STRATEGY_KEY] = _strategy_for_loading(config.get(_SAVED_STRATEGY_KEY))
    return FunctionalDistributedModel.from_config(config, custom_objects=custom_objects)


_compat.save_as_keras_model(FunctionalDistributedModel, _SAVED_STRATEGY_KEY, _load_saved)


@functools.lru_cache(maxsize=None)
def _functional_variant(cls: type) -> type:
    """`cls` built from `(inputs, outputs)`: its methods, Functional's graph.

    The variant keeps `cls`'s name and module, so `isinstance` and saving
    see `cls` (loading calls `cls(inputs=..., outputs=...)`, which lands
    here again).
    """
    if cls is DistributedModel:
        return FunctionalDistributedModel
    return type(cls.__name__, (cls, FunctionalDistributedModel),
                {"__module__": cls.__module__, "__qualname__": cls.__qualname__})


def _with_resume_and_preemption(model, train_function):
    """`train_function`, then the preemption check (`PreemptionWatch`);
    except that its first calls after a resume (as many as the model's
    replay count says) only pull their batches: the steps the run did
    before its backup (see `keras_distrib.callbacks.BackupAndRestore`)."""

    @functools.wraps(train_function)  # keeps its attributes (step_call's `compiled`)
    def function(iterator):
        state = model.fit_state
        if state is None or not state.replay:
            logs = train_function(iterator)
            if state is not None and state.watch is not None:
                state.watch.after_step()
            return logs
        state.replay -= 1
        for _ in range(model.steps_per_execution):
            try:
                next(iterator)
            except (StopIteration, tf.errors.OutOfRangeError):
                break  # the epoch's last, shorter execution
        return {}

    return function


def _defines_call(model) -> bool:
    """Whether `model` has a forward pass (`keras.Model.call` is abstract)."""
    return type(model).call is not keras.Model.call


def _check_built_without_call(model) -> None:
    """A one-line error naming a sub-layer of a model with no `call` that
    is not built: with no forward pass there is no way to build it before
    the first step, where the strategy cannot make variables."""
    unbuilt = [layer.name for layer in _compat.all_layers(model) if not layer.built]
    if unbuilt:
        raise ValueError(
            f"Model {model.name!r} has no call(), so fit cannot build its layer "
            f"{unbuilt[0]!r}; build it before fit (give its model a keras.Input shape, "
            "or call it on a batch).")


def _callback_list(callbacks) -> list:
    """`fit`'s `callbacks` argument as a flat list."""
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    return list(keras.tree.flatten(callbacks or []))


def _check_steps_per_execution(steps) -> None:
    if not data_lib.is_positive_int(steps):
        raise ValueError(
            f"steps_per_execution={steps!r} must be an integer >= 1 (training steps "
            "per call of the compiled function; 1 is the default)."
        )


def _adopt_optimizer(optimizer, strategy: Strategy, model):
    """Returns `optimizer`, made this strategy's in place if it was made
    outside it.

    An optimizer creates its step counter and learning-rate variables when
    constructed (and its slots when built); made outside the scope they are
    not replicated, and every replica would bump the step counter. They are
    made again under the scope with their values (no config round trip, so
    a user optimizer without `get_config` adopts too), and the optimizer
    then makes its slots and updates through the strategy's engine.
    """
    steps = getattr(optimizer, "gradient_accumulation_steps", None)
    if steps and steps > 1 and not strategy.capabilities.keras_gradient_accumulation:
        raise ValueError(
            f"gradient_accumulation_steps={steps} of a Keras optimizer cannot run under "
            f"strategy {strategy.name!r}; use keras_distrib.optimizers.DistributedOptimizer("
            f"optimizer, backward_passes_per_step={steps}) instead."
        )
    if _ADOPTED.get(optimizer) is strategy:
        return optimizer
    inner = optimizers_in(optimizer)
    if optimizer.built:
        mine = {id(v) for v in model.trainable_variables}
        if not all(id(v) in mine for opt in inner
                   for v in _compat.optimizer_trainable_variables(opt)):
            raise ValueError(
                "The optimizer was already used outside this model's strategy; "
                "pass a new optimizer (or its name) to compile()."
            )
    moving = placement.unheld(strategy, [v for opt in inner for v in opt.variables], model)
    placement.remake(moving, strategy, model)
    with strategy.scope():
        engine = tf.distribute.get_strategy()
    for opt in inner:
        _compat.set_optimizer_strategy(opt, engine)
    for opt in inner:
        if opt.built:
            _compat.reindex_optimizer(opt)
        # Every optimizer that applies gradients: a LossScaleOptimizer's
        # inner one and a MultiOptimizer's each reduce them again otherwise.
        _install_reduction_switch(opt, strategy)
        _build_under(opt, strategy)
    strategy.adopt_optimizer(optimizer)
    _ADOPTED[optimizer] = strategy
    return optimizer


def _build_under(optimizer, strategy: Strategy) -> None:
    """Makes `optimizer` create its slots under the strategy, eagerly, also
    when its first `apply_gradients` builds it inside a replica's step.

    `fit` builds the compiled optimizer before the first step; an optimizer
    only a custom `train_step` uses (a GAN's two) builds at its first
    `apply_gradients`, inside the traced step and a replica context, where
    variables cannot be made ("Mixing different tf.distribute.Strategy
    objects": Keras runs every step inside its default strategy's `run`).
    Once for all replicas (`merge_call`), lifted out of the trace
    (`tf.init_scope`) and into the strategy's scope, the slots are made as
    `fit`'s build would make them.
    """
    keras_build = optimizer.build

    def build_eagerly(variables):
        with tf.init_scope(), _compat.without_default_strategy_creator(), strategy.scope():
            keras_build(variables)

    @functools.wraps(keras_build)
    def build(variables):
        context = tf.distribute.get_replica_context()
        if tf.distribute.has_strategy() and context is not None:
            # In a replica: once, from the cross-replica context.
            context.merge_call(lambda _: build_eagerly(variables))
        else:
            build_eagerly(variables)

    optimizer.build = build


def _optimizer_attributes(model) -> list:
    """The optimizers `model` holds: the compiled one and any set as an
    attribute (a GAN's `d_optimizer`, in a list or dict too)."""
    found = [model.optimizer] if getattr(model, "optimizer", None) is not None else []
    for value in list(vars(model).values()):
        for item in (value.values() if isinstance(value, dict) else
                     value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(item, keras.optimizers.Optimizer) and not any(
                    item is seen for seen in found):
                found.append(item)
    return found


def _adopt_metrics(metrics, strategy: Strategy, model):
    """`metrics` (as passed to `compile`), each metric object made outside
    the strategy made its own in place.

    A metric object creates its variables when constructed; made outside
    the scope they are plain per-process variables, and each worker would
    report its own value instead of the global one. They are made again
    under the scope (no config round trip: a metric without `get_config`
    or `**kwargs` adopts too).
    """
    if isinstance(metrics, dict):
        return {k: _adopt_metrics(v, strategy, model) for k, v in metrics.items()}
    if isinstance(metrics, (list, tuple)):
        return type(metrics)(_adopt_metrics(m, strategy, model) for m in metrics)
    if isinstance(metrics, keras.metrics.Metric):
        placement.remake(placement.unheld(strategy, metrics.variables, model), strategy, model)
    return metrics


def _install_reduction_switch(optimizer, strategy: Strategy) -> None:
    """Lets our step make Keras's optimizer skip its own gradient all-reduce,
    and gives a custom `train_step`'s `apply_gradients` the strategy's.

    Keras's TF optimizer sums gradients across replicas inside
    `apply_gradients` when called in a replica context. `train_step` has
    already reduced them (reducing twice multiplies them by the replica
    count), so while `apply_reduced_gradients` runs the sum is skipped, in
    whichever thread the optimizer applies them (a `LossScaleOptimizer`
    applies through `merge_call` and `call_for_each_replica`). Gradients a
    custom `train_step` applies itself are averaged over the replicas
    instead (`Strategy.reduce_applied_gradients`: Keras's losses are not
    divided by the replica count under our engines, so its sum would be
    too large). The switch acts at trace time.
    """
    def unless_reduced(_keras_sum):
        def all_reduce_unless_reduced(grads_and_vars):
            if _reduced_applies[0] > 0 or tf.distribute.in_cross_replica_context():
                # Reduced by our step, or applied once for all replicas
                # (central_storage reduced them in the replicas first).
                return list(grads_and_vars)
            return strategy.reduce_applied_gradients(list(grads_and_vars))

        return all_reduce_unless_reduced

    _compat.wrap_optimizer_all_reduce(optimizer, unless_reduced)


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


def _can_write_atomically(filepath, overwrite, kwargs) -> bool:
    if not saving.is_local(filepath) or kwargs.get("max_shard_size"):
        return False
    return overwrite or not os.path.exists(os.fspath(filepath))


def _compile_like(source: keras.Model, target: DistributedModel) -> None:
    """Compiles `target` as `source` was: from `source`'s compile config, or,
    where that does not deserialize (a metric or loss class Keras cannot
    locate, as a user's written without `get_config` or registration),
    with copies of the objects `source` was compiled with (metrics copied
    object by object, their state reset; the optimizer made from its
    config, its state carried over afterwards by `_copy_optimizer_state`)."""
    try:
        target.compile_from_config(source.get_compile_config())
        return
    except (TypeError, ValueError):
        pass
    arguments = dict(_compat.compile_arguments(source))
    optimizer = arguments.get("optimizer")
    if isinstance(optimizer, keras.optimizers.Optimizer):
        arguments["optimizer"] = type(optimizer).from_config(optimizer.get_config())
    for key in ("loss", "metrics", "weighted_metrics"):
        arguments[key] = placement.copy_objects(arguments.get(key))
    target.compile(**arguments)
    if target.built:
        with target.strategy.scope():
            target.optimizer.build(target.trainable_variables)


def _copy_optimizer_state(source: keras.Model, target: DistributedModel) -> None:
    """Gives `target`'s optimizer the state of `source`'s (step count, slots).

    The state travels as a saved file would carry it (the optimizer's
    `save_own_variables` / `load_own_variables`), in the plain model's
    layout: a strategy that splits weights (tensor_parallel) splits the
    slots on the way in, as it does when loading a file.
    """
    src = source.optimizer
    if src is None or not src.built:
        return
    with target.strategy.scope():
        target.optimizer.build(target.trainable_variables)
    # The strategy's hooks for a built optimizer (tensor_parallel: the file layout).
    target.strategy.sync_initial_state(target)
    saved, layout = {}, {}
    src.save_own_variables(saved)
    target.optimizer.save_own_variables(layout)
    shapes = [np.shape(saved[str(i)]) for i in range(len(saved))]
    expected = [np.shape(layout[str(i)]) for i in range(len(layout))]
    if shapes != expected:
        raise ValueError(
            "Cannot carry the optimizer state over: the wrapped model's optimizer holds "
            f"{len(shapes)} variables of shapes {shapes}, the copy's "
            f"{len(expected)} of shapes {expected}; compile the copy afresh instead."
        )
    target.optimizer.load_own_variables(saved)
    target.strategy.broadcast_variables(target.optimizer.variables)
