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
from typing import Union

import keras
import numpy as np
import tensorflow as tf

from keras_distrib import _compat
from keras_distrib import chief_only
from keras_distrib import data as data_lib
from keras_distrib import fit_checks
from keras_distrib import preemption
from keras_distrib import sharded_variables
from keras_distrib import saving
from keras_distrib import step_call
from keras_distrib import strategies
from keras_distrib.strategies import registry
from keras_distrib.strategies.base import Strategy, optimizers_in

_compat.warn_if_untested()
_compat.check_hooks()
Functional = _compat.functional_class()

StrategyLike = Union[str, Strategy]

# Trace-time state: how many replica threads are applying gradients that
# `train_step` already reduced. Not thread-local: a loss-scale optimizer
# under MirroredStrategy applies them from `merge_call`, in other threads
# than the replicas' (see `_install_reduction_switch`).
_reduced_applies = [0]
_reduced_applies_lock = threading.Lock()

_COMPILE_SIGNATURE = inspect.signature(keras.Model.compile)


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

    # Only the chief prints and writes files (see keras_distrib.chief_only).
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
        """Wraps a Functional or Sequential Keras model, keeping its state.

        The graph is rebuilt under the strategy with the same weights; if the
        model was compiled, the copy is compiled the same way and the
        optimizer's state (step count, slots) is carried over too.

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
        wrapped = FunctionalDistributedModel(
            graph.input, graph.output, name=model.name, strategy=strategy
        )
        if model.compiled:
            wrapped.compile_from_config(model.get_compile_config())
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
                self._strategy.place_built(self)
            return outputs
        return super().__call__(*args, **kwargs)

    def compile(self, optimizer="rmsprop", *args, **kwargs):
        arguments = _COMPILE_SIGNATURE.bind(self, optimizer, *args, **kwargs).arguments
        arguments.pop("self")
        arguments.update(arguments.pop("kwargs", {}))
        _check_steps_per_execution(arguments.get("steps_per_execution", 1))
        with self._strategy.scope():
            arguments["optimizer"] = _adopt_optimizer(
                self._loss_scaled_if_mixed(keras.optimizers.get(arguments["optimizer"]),
                                           arguments.get("auto_scale_loss", True)),
                self._strategy)
            for key in ("metrics", "weighted_metrics"):
                arguments[key] = _adopt_metrics(arguments.get(key), self._strategy)
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
        loss, y_pred, gradients = loss_and_gradients(x, y, sample_weight)
        num_samples = _batch_size(x)
        _compat.loss_tracker(self).update_state(
            _unscale_replica_loss(loss), sample_weight=num_samples
        )
        if gradients:
            if self._accumulation_steps > 1:
                self.optimizer.accumulate(gradients, num_samples)
                if apply_gradients:
                    gradients, num_samples = self.optimizer.take_accumulated(gradients)
            if apply_gradients:
                gradients = self.reduce_with_statistics(gradients, num_samples)
                self.apply_reduced_gradients(gradients)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def reduce_with_statistics(self, gradients: list, num_samples) -> list:
        """`reduce_gradients`, with moving statistics and the stop vote riding along.

        Keras updates non-trainable float variables (BatchNormalization's
        moving mean and variance) on each replica from that replica's shard;
        left alone, the copies drift apart and `predict` of a row would
        depend on its replica. Their sample-weighted mean over the replicas
        travels in the gradients' all-reduce (no extra collective) and is
        assigned to every copy, so all replicas and workers keep one value.
        With several processes each replica's preemption vote travels in
        it too (see `keras_distrib.preemption`).
        """
        statistics = self._replica_statistics() if self._sums_sample_losses else []
        vote = self.__dict__.get("_kd_vote")
        if not statistics and vote is None:
            return self.reduce_gradients(gradients, num_samples)
        count = tf.cast(num_samples, tf.float32)
        extras = [tf.cast(v, tf.float32) * count for v in statistics]
        if vote is not None:
            mine = tf.numpy_function(preemption.local_vote, [], tf.float32, stateful=True,
                                     name="kd_preemption_vote")
            extras.append(tf.reshape(mine, []))
            self.__dict__["_kd_vote_carried"] = True
        reduced = self.reduce_gradients([*gradients, *extras], num_samples)
        for variable, value in zip(statistics, reduced[len(gradients):]):
            variable.assign(tf.cast(value, variable.dtype))
        if vote is not None:
            vote.assign(reduced[-1])
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
        with tf.GradientTape() as tape:
            y_pred = self._forward(x, training=True)
            loss = _compat.compute_loss(
                self, x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
            )
            scaled = _unscale_replica_loss(loss) if self._sums_sample_losses else loss
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
                gradients = [_times(g, _batch_size(x)) for g in gradients]
        return loss, y_pred, gradients

    def reduce_gradients(self, gradients: list, num_samples) -> list:
        """The one cross-replica reduction of the step.

        Each replica's gradients are of the *sum* of its per-sample losses
        (see `_loss_and_gradients`); the strategy sums them over replicas
        together with the sample counts and divides by the global count
        (`Strategy.reduce_gradients`): exactly the gradient of the mean loss
        over the global batch, whatever the split. `None` entries (variables
        the loss does not reach) stay `None`.
        """
        present = [g for g in gradients if g is not None]
        if not present:
            raise ValueError(
                "No gradients reach any trainable variable; check that the "
                "loss depends on the model's outputs."
            )
        if self._sums_sample_losses:
            compression = getattr(self.optimizer, "compression", None)
            present = self._strategy.reduce_gradients(present, num_samples, compression)
        reduced = iter(present)
        return [None if g is None else next(reduced) for g in gradients]

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
        loss = _compat.compute_loss(
            self, x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False
        )
        _compat.loss_tracker(self).update_state(
            _unscale_replica_loss(loss), sample_weight=_batch_size(x)
        )
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
        self.train_function = _with_resume_and_preemption(self, self._make_train_function(force))
        return self.train_function

    def _make_train_function(self, force):
        k = self._accumulation_steps
        if k == 1:
            super().make_train_function(force=True)
            return self.train_function
        if type(self).train_step is not DistributedModel.train_step:
            raise ValueError(
                "backward_passes_per_step > 1 needs DistributedModel's own "
                "train_step; accumulate in your custom train_step instead."
            )
        if self.steps_per_execution != 1:
            raise ValueError(
                "backward_passes_per_step > 1 needs steps_per_execution=1 "
                f"(got {self.steps_per_execution}); compile without it."
            )
        accumulate = self._make_function(
            functools.partial(self._train_step, apply_gradients=False)
        )
        accumulate_and_apply = self._make_function(self.train_step)
        steps = itertools.count()

        def train_function(iterator):
            if next(steps) % k == k - 1:
                return accumulate_and_apply(iterator)
            return accumulate(iterator)

        return train_function

    def _make_function(self, step_function):
        # Keras's hook (see _compat.KERAS_HOOKS): the strategy decides how
        # the per-replica step becomes the function Keras's loop calls.
        # Keras's maker, one compiled call per step where it can (step_call).
        keras_make_function = functools.partial(
            step_call.one_call_per_step, self, keras_make_function=super()._make_function)
        return self._strategy.make_step_function(self, step_function, keras_make_function)

    def make_predict_function(self, force=False):
        if self.predict_function is not None and not force:
            return self.predict_function

        def keras_make_predict_function():
            super(DistributedModel, self).make_predict_function(force=True)
            return self.predict_function

        self.predict_function = self._strategy.make_predict_function(
            self, keras_make_predict_function
        )
        return self.predict_function

    # -- entry points: input to the strategy, lazy builds ----------------------

    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto",
            callbacks=None, validation_split=0.0, validation_data=None,
            shuffle=True, class_weight=None, sample_weight=None, **kwargs):
        self._strategy.check_batch_size(batch_size)
        self._strategy.check_batch_size(kwargs.get("validation_batch_size"),
                                        "validation_batch_size")
        self._check_fit_input(x, y, sample_weight)
        given = dict(
            x=x, y=y, sample_weight=sample_weight, batch_size=batch_size, shuffle=shuffle,
            validation_split=validation_split, validation_data=validation_data,
            validation_batch_size=kwargs.pop("validation_batch_size", None),
            steps_per_epoch=kwargs.pop("steps_per_epoch", None),
            steps_per_execution=self.steps_per_execution,  # read only
            class_weight=class_weight,  # with arrays: made sample weights (sharding.fit_input)
        )
        fit_checks.check_same_call(
            self._strategy, "fit", x, batch_size=batch_size, epochs=epochs,
            initial_epoch=kwargs.get("initial_epoch", 0), steps=given["steps_per_epoch"],
            steps_per_execution=self.steps_per_execution)
        self._strategy.check_callbacks(_callback_list(callbacks))
        backup = _backup_callback(callbacks)
        start = backup.resume_point(self) if backup is not None else None
        given.update(start=start, resumable=backup is not None)
        fit = self._strategy.distribute_fit_input(given)
        if fit.get("build_batch") is not None:
            # The strategy feeds Keras no real batches (parameter servers).
            self._maybe_symbolic_build(data_batch=fit["build_batch"])
        if backup is not None:
            backup.record_seed(fit.get("seed"))
        if start is not None:
            kwargs["initial_epoch"] = start.epoch
        self.__dict__["_kd_replay"] = (start.step if start else 0) // self.steps_per_execution
        preemption.reset()
        preemption.clear(self)
        with preemption.watching(), \
                self._side_effects(callbacks) as callbacks, \
                self._internal_callbacks(callbacks) as callbacks, \
                self._clearer_failure():
            history = super().fit(
                fit["x"], fit["y"], fit["batch_size"], epochs, self._verbose(verbose),
                callbacks, fit["validation_split"], fit["validation_data"],
                fit["shuffle"], fit.get("class_weight"), fit["sample_weight"],
                validation_batch_size=fit["validation_batch_size"],
                steps_per_epoch=fit["steps_per_epoch"], **kwargs,
            )
        if preemption.stopped_at(self) is not None:
            where = (f"; backup in {backup.backup_dir}" if backup is not None else
                     "; nothing was saved (add keras_distrib.callbacks.BackupAndRestore)")
            raise preemption.announce(self, where)
        return history

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
        watch = preemption.PreemptionWatch(
            self._preemption_vote(), lambda: self.__dict__.get("_kd_vote_carried", False))
        self.__dict__["_kd_watch"] = watch
        first = [watch]
        if self.check_finite:
            # Per-batch logs are global values only with one process; with
            # several, the exact epoch logs are checked, so all stop together.
            first.append(fit_checks.FiniteLossCheck(per_batch=self._strategy.world_size == 1))
        last = [fit_checks.ReplicasAgree()] if self._strategy.world_size > 1 else []
        try:
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
        finally:
            self.__dict__.pop("_kd_watch", None)

    def _preemption_vote(self):
        """The variable the step's all-reduce writes the summed stop votes to
        (None with one process: its own SIGTERM flag decides)."""
        if self._strategy.world_size == 1:
            return None
        vote = self.__dict__.get("_kd_vote")
        if vote is None:
            with self._strategy.scope():
                vote = tf.Variable(
                    0.0, trainable=False, name="kd_preemption_vote",
                    aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
            # Not a Keras attribute: no weight, never saved.
            self.__dict__["_kd_vote"] = vote
        return vote

    def evaluate(self, x=None, y=None, batch_size=None, verbose="auto",
                 sample_weight=None, steps=None, callbacks=None, **kwargs):
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

    def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
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

    The layer graph between `inputs` and `outputs` is rebuilt under the
    strategy (same weights) unless its variables already live there.
    """

    def __init__(self, inputs, outputs, name=None, *, strategy: StrategyLike = "auto", **kwargs):
        resolved = strategies.get(strategy)
        registry.check_not_model_options(kwargs, resolved)
        inputs, outputs = _rebuild_under(resolved, inputs, outputs)
        Functional.__init__(self, inputs, outputs, name=name, **kwargs)
        self._init_distribution(resolved)


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
        if not model.__dict__.get("_kd_replay"):
            logs = train_function(iterator)
            watch = model.__dict__.get("_kd_watch")
            if watch is not None:
                watch.after_step()
            return logs
        model.__dict__["_kd_replay"] -= 1
        for _ in range(model.steps_per_execution):
            try:
                next(iterator)
            except (StopIteration, tf.errors.OutOfRangeError):
                break  # the epoch's last, shorter execution
        return {}

    return function


def _callback_list(callbacks) -> list:
    """`fit`'s `callbacks` argument as a flat list."""
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    return list(keras.tree.flatten(callbacks or []))


def _backup_callback(callbacks):
    """The `keras_distrib.callbacks.BackupAndRestore` among `callbacks`, if any."""
    from keras_distrib.callbacks.backup_and_restore import BackupAndRestore

    found = [c for c in _callback_list(callbacks) if isinstance(c, BackupAndRestore)]
    if len(found) > 1:
        raise ValueError("Pass one keras_distrib.callbacks.BackupAndRestore per fit, not "
                         f"{len(found)}.")
    return found[0] if found else None


def _check_steps_per_execution(steps) -> None:
    if not data_lib.is_positive_int(steps):
        raise ValueError(
            f"steps_per_execution={steps!r} must be an integer >= 1 (training steps "
            "per call of the compiled function; 1 is the default)."
        )


def _unscale_replica_loss(loss):
    """The replica's mean loss from Keras's, which divided it by the number of
    replicas of the enclosing tf.distribute strategy (`scale_loss_for_distribution`)."""
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    return loss * tf.cast(replicas, loss.dtype) if replicas > 1 else loss


def _rebuild_under(strategy: Strategy, inputs, outputs):
    template = keras.Model(inputs, outputs)
    if all(strategy.holds(v) for v in template.variables):
        return inputs, outputs
    fit_checks.check_same_model(strategy, template.weights)
    clone = strategy.rebuild(template)
    # Each process set its own values (initializers are unseeded by default,
    # so they differ): worker 0's win, as they would at variable creation.
    strategy.broadcast_variables(clone.weights)
    strategy.broadcast_derived_state(clone)
    return clone.input, clone.output


def _adopt_optimizer(optimizer, strategy: Strategy):
    """Returns `optimizer`, re-created under the strategy if made outside it.

    An optimizer creates its step counter and learning-rate variables when
    constructed; made outside the scope they are not replicated, and every
    replica would bump the step counter.
    """
    steps = getattr(optimizer, "gradient_accumulation_steps", None)
    if steps and steps > 1 and not strategy.keras_gradient_accumulation:
        raise ValueError(
            f"gradient_accumulation_steps={steps} of a Keras optimizer cannot run under "
            f"strategy {strategy.name!r}; use keras_distrib.optimizers.DistributedOptimizer("
            f"optimizer, backward_passes_per_step={steps}) instead."
        )
    if not all(strategy.holds(v) for v in optimizer.variables):
        if optimizer.built:
            raise ValueError(
                "The optimizer was already used outside this model's strategy; "
                "pass a new optimizer (or its name) to compile()."
            )
        with strategy.scope():
            optimizer = type(optimizer).from_config(optimizer.get_config())
    # Every optimizer that applies gradients: a LossScaleOptimizer's inner
    # one and a MultiOptimizer's each reduce them again otherwise.
    for opt in optimizers_in(optimizer):
        _install_reduction_switch(opt)
    strategy.adopt_optimizer(optimizer)
    return optimizer


def _adopt_metrics(metrics, strategy: Strategy):
    """`metrics` (as passed to `compile`) with metric objects made outside the
    strategy re-created under it from their config.

    A metric object creates its variables when constructed; made outside
    the scope they are plain per-process variables, and each worker would
    report its own value instead of the global one.
    """
    if isinstance(metrics, dict):
        return {k: _adopt_metrics(v, strategy) for k, v in metrics.items()}
    if isinstance(metrics, (list, tuple)):
        return type(metrics)(_adopt_metrics(m, strategy) for m in metrics)
    if not isinstance(metrics, keras.metrics.Metric) or all(
        strategy.holds(v) for v in metrics.variables
    ):
        return metrics
    try:
        with strategy.scope():
            return type(metrics).from_config(metrics.get_config())
    except Exception as error:
        raise ValueError(
            f"Metric {metrics.name!r} ({type(metrics).__name__}) was created outside the "
            f"strategy's scope and cannot be re-created from its config ({error}); create "
            "it inside `with model.strategy.scope():` or give it a get_config()."
        ) from error


def _install_reduction_switch(optimizer) -> None:
    """Lets our step make Keras's optimizer skip its own gradient all-reduce.

    Keras's TF optimizer sums gradients across replicas inside
    `apply_gradients` when called in a replica context. `train_step` has
    already reduced them (reducing twice multiplies them by the replica
    count), so while `apply_reduced_gradients` runs the sum is skipped, in
    whichever thread the optimizer applies them (a `LossScaleOptimizer`
    applies through `merge_call` and `call_for_each_replica`). Custom
    `train_step`s that call `apply_gradients` themselves keep Keras's
    reduction. The switch acts at trace time.
    """
    def unless_reduced(keras_all_reduce):
        def all_reduce_unless_reduced(grads_and_vars):
            if _reduced_applies[0] > 0:
                return list(grads_and_vars)
            return keras_all_reduce(grads_and_vars)

        return all_reduce_unless_reduced

    _compat.wrap_optimizer_all_reduce(optimizer, unless_reduced)


def _has_float16_layers(model) -> bool:
    return any(layer.compute_dtype == "float16" for layer in _compat.all_layers(model))


def _times(gradient, count):
    """`gradient * count`, for dense and sparse (`IndexedSlices`) gradients."""
    if gradient is None:
        return None
    if isinstance(gradient, tf.IndexedSlices):
        values = gradient.values * tf.cast(count, gradient.values.dtype)
        return tf.IndexedSlices(values, gradient.indices, gradient.dense_shape)
    return gradient * tf.cast(count, gradient.dtype)


def _batch_size(x):
    return tf.shape(next(t for t in tf.nest.flatten(x) if t is not None))[0]


def _can_write_atomically(filepath, overwrite, kwargs) -> bool:
    if not saving.is_local(filepath) or kwargs.get("max_shard_size"):
        return False
    return overwrite or not os.path.exists(os.fspath(filepath))


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
