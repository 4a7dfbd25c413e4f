"""`DistributedModel`: a `keras.Model` whose fit/evaluate/predict are distributed.

The split follows Keras: `train_step` / `test_step` are the per-replica math
(forward, loss, gradients, one reduction, apply), and the function-making
layer (`_make_function`, `make_predict_function`) is distribution: it hands
each global batch to the strategy, which splits it and runs the step once
per replica, and turns per-replica results back into plain numbers for the
callbacks.

Keras itself only ever sees the default (no-op) `tf.distribute` strategy, so
its input pipeline yields plain global batches and none of its broken
distribution paths (DESIGN.md section 2) run.
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
from typing import Union

import keras
import tensorflow as tf
from keras.src.losses import loss as loss_module
from keras.src.models.functional import Functional
from keras.src.models.model import functional_init_arguments
from keras.src.trainers.data_adapters import data_adapter_utils

from keras_distrib import chief_only
from keras_distrib import data as data_lib
from keras_distrib import saving
from keras_distrib import sharding
from keras_distrib import strategies
from keras_distrib.strategies.base import Strategy

StrategyLike = Union[str, Strategy]

# Trace-time state of the step being traced. Thread-local because
# MirroredStrategy traces each replica's step in its own thread.
_step_state = threading.local()


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

    def __new__(cls, *args, **kwargs):
        if cls is DistributedModel and functional_init_arguments(args, kwargs):
            return super().__new__(FunctionalDistributedModel)
        return super().__new__(cls)

    def __init__(self, *args, strategy: StrategyLike = "auto", **kwargs):
        if functional_init_arguments(args, kwargs):
            # Keras would rewrite this class's bases to include Functional,
            # which would turn every DistributedModel subclass functional.
            raise TypeError(
                f"{type(self).__name__} is a subclassed model and cannot take "
                "(inputs, outputs); build functional models with "
                "keras_distrib.DistributedModel(inputs, outputs, strategy=...)."
            )
        resolved = strategies.get(strategy)
        super().__init__(*args, **kwargs)
        self._init_distribution(resolved)

    def _init_distribution(self, strategy: Strategy) -> None:
        self._strategy = strategy
        # Keras must only ever see the default strategy (see module doc).
        self._distribute_strategy = None

    # -- public surface -------------------------------------------------------

    @property
    def strategy(self) -> Strategy:
        """The strategy this model trains on."""
        return self._strategy

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
            with self._strategy.scope():
                return super().__call__(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    def compile(self, optimizer="rmsprop", *args, **kwargs):
        with self._strategy.scope():
            optimizer = _adopt_optimizer(keras.optimizers.get(optimizer), self._strategy)
            super().compile(optimizer, *args, **kwargs)

    def compile_from_config(self, config):
        # Keras skips compiling on load when `compile` is overridden.
        self.compile(**keras.saving.deserialize_keras_object(config))
        if self.built:
            with self._strategy.scope():
                self.optimizer.build(self.trainable_variables)

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        with self._strategy.scope():
            self._symbolic_build(iterator=iterator, data_batch=data_batch)
        self._strategy.sync_initial_state(self)

    def get_metrics_result(self):
        results = super().get_metrics_result()
        if self._strategy.exact_batch_logs or tf.executing_eagerly():
            # Inside the step only when per-batch logs are to be global;
            # always for epoch logs and evaluate results (read eagerly).
            results = self._strategy.combine_metric_results(results)
        return results

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
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        loss_and_gradients = self._loss_and_gradients
        if self.jit_compile and self._strategy.replicates:
            loss_and_gradients = self._jit(loss_and_gradients)
        loss, y_pred, gradients = loss_and_gradients(x, y, sample_weight)
        num_samples = _batch_size(x)
        self._loss_tracker.update_state(
            loss_module.unscale_loss_for_distribution(loss), sample_weight=num_samples
        )
        if gradients:
            if self._accumulation_steps > 1:
                self.optimizer.accumulate(gradients, num_samples)
                if apply_gradients:
                    gradients, num_samples = self.optimizer.take_accumulated(gradients)
            if apply_gradients:
                gradients = self.reduce_gradients(gradients, num_samples)
                self.apply_reduced_gradients(gradients)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    @property
    def _accumulation_steps(self) -> int:
        return getattr(self.optimizer, "backward_passes_per_step", 1)

    @property
    def _sums_sample_losses(self) -> bool:
        # Gradients of summed (not averaged) per-sample losses are what can be
        # added across replicas and steps and divided by the sample count.
        return self._strategy.replicates or self._accumulation_steps > 1

    def _loss_and_gradients(self, x, y, sample_weight):
        with tf.GradientTape() as tape:
            y_pred = self._forward(x, training=True)
            loss = self._compute_loss(
                x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
            )
            scaled = self._weight_replica_loss(loss, x)
            if self.optimizer is not None:
                scaled = self.optimizer.scale_loss(scaled)
        gradients = None
        if self.trainable_weights:
            gradients = tape.gradient(scaled, self.trainable_weights)
        return loss, y_pred, gradients

    def reduce_gradients(self, gradients: list, num_samples) -> list:
        """The one cross-replica reduction of the step.

        Under a replicating strategy each replica's gradients are of the *sum*
        of its per-sample losses (see `_weight_replica_loss`); they travel
        with the replica's sample count in the same all-reduce, and the sums
        are divided by the global count. That is exactly the gradient of the
        mean loss over the global batch, whatever the split, and needs no
        knowledge of the global batch size on any worker. `None` entries
        (variables the loss does not reach) stay `None`.
        """
        present = [g for g in gradients if g is not None]
        if not present:
            raise ValueError(
                "No gradients reach any trainable variable; check that the "
                "loss depends on the model's outputs."
            )
        if self._sums_sample_losses:
            total = tf.cast(num_samples, tf.float32)
            if self._strategy.replicates:
                compression = getattr(self.optimizer, "compression", None)
                dtypes = [g.dtype for g in present]
                if compression is not None:
                    present = [compression.compress(g) for g in present]
                *present, total = self._strategy.all_reduce([*present, total], "sum")
                if compression is not None:
                    present = [compression.decompress(g, d) for g, d in zip(present, dtypes)]
            scale = 1.0 / tf.maximum(total, 1.0)
            present = [g * tf.cast(scale, g.dtype) for g in present]
        reduced = iter(present)
        return [None if g is None else next(reduced) for g in gradients]

    def apply_reduced_gradients(self, gradients: list) -> None:
        """Applies already-reduced gradients without Keras reducing again."""
        pairs = [(g, v) for g, v in zip(gradients, self.trainable_weights) if g is not None]
        _step_state.gradients_reduced = True
        try:
            self.optimizer.apply_gradients(pairs)
        finally:
            _step_state.gradients_reduced = False

    def test_step(self, data):
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        forward = self._forward
        if self.jit_compile and self._strategy.replicates:
            forward = self._jit(forward)
        y_pred = forward(x, training=False)
        loss = self._compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False
        )
        self._loss_tracker.update_state(
            loss_module.unscale_loss_for_distribution(loss),
            sample_weight=_batch_size(x),
        )
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _forward(self, x, training):
        if self._call_has_training_arg:
            return self(x, training=training)
        return self(x)

    def _weight_replica_loss(self, loss, x):
        # Keras divided this replica's mean loss by the replica count; turn it
        # into the sum over this replica's samples (see reduce_gradients).
        if not self._sums_sample_losses:
            return loss
        count = tf.cast(_batch_size(x), loss.dtype)
        keras_divisor = tf.distribute.get_strategy().num_replicas_in_sync
        return loss * count * tf.cast(keras_divisor, loss.dtype)

    def _jit(self, fn):
        """`fn` compiled with XLA, one compiled function per replica.

        Each replica's function captures that replica's copies of the
        variables, so the replicas cannot share one traced function.
        """
        ctx = tf.distribute.get_replica_context()
        replica = tf.get_static_value(getattr(ctx, "replica_id_in_sync_group", 0))
        cache = self.__dict__.setdefault("_kd_jit_cache", {})
        key = (fn.__name__, int(replica or 0))
        if key not in cache:
            cache[key] = tf.function(fn, jit_compile=True, reduce_retracing=True)
        return cache[key]

    # -- the function-making layer: distribution ---------------------------

    def make_train_function(self, force=False):
        k = self._accumulation_steps
        if k == 1 or (self.train_function is not None and not force):
            return super().make_train_function(force=force)
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

        self.train_function = train_function
        return train_function

    def _make_function(self, step_function):
        self.__dict__.pop("_kd_jit_cache", None)
        distributed = self._distributed(step_function)
        if not self._strategy.replicates:
            return super()._make_function(distributed)
        if self.steps_per_execution > 1:
            return self._make_stepwise_function(distributed)
        # Collectives cannot run inside one XLA cluster: XLA compiles the
        # per-replica math instead (see train_step/test_step).
        jit_compile, self._jit_compile = self._jit_compile, False
        try:
            return super()._make_function(distributed)
        finally:
            self._jit_compile = jit_compile

    def _make_stepwise_function(self, distributed):
        """`steps_per_execution` steps per call, one compiled step at a time.

        Keras fuses the steps with `tf.while_loop` + `tf.cond`, but
        `tf.distribute` replicas cannot be traced inside `tf.cond` (TF fails
        with "You must feed a value for placeholder"), so replicating
        strategies run the steps from Python; results are identical.
        """
        one_step = distributed
        if not self.run_eagerly:
            one_step = tf.function(distributed, reduce_retracing=True)

        def function(iterator):
            outputs = None
            for _ in range(self.steps_per_execution):
                try:
                    data = next(iterator)
                except (StopIteration, tf.errors.OutOfRangeError):
                    break
                outputs = one_step(data)
            if outputs is None:
                raise StopIteration
            return outputs

        return function

    def _distributed(self, step_function):
        strategy = self._strategy

        def distributed_step(data):
            return self._reduce_logs(strategy.run(step_function, data))

        return distributed_step

    def _reduce_logs(self, outputs):
        if not any(
            isinstance(v, tf.distribute.DistributedValues)
            for v in tf.nest.flatten(outputs)
        ):
            return outputs
        if not self._strategy.exact_batch_logs:
            return self._strategy.local_mean(outputs)
        if isinstance(outputs, dict):
            # Metric variables sum across replicas when read here, so these
            # are exact global values, not a mean of per-replica values.
            metrics = self.get_metrics_result()
            return {
                k: metrics[k] if k in metrics else self._strategy.reduce_mean(v)
                for k, v in outputs.items()
            }
        return self._strategy.reduce_mean(outputs)

    def make_predict_function(self, force=False):
        if not self._strategy.replicates:
            return super().make_predict_function(force=force)
        if self.predict_function is not None and not force:
            return self.predict_function
        self.__dict__.pop("_kd_jit_cache", None)
        strategy = self._strategy
        predict_step = self.predict_step
        if self.jit_compile:
            predict_step = lambda batch: self._jit(self.predict_step)(batch)  # noqa: E731

        def predict_function(steps):
            outputs = [
                strategy.concat(strategy.run(predict_step, step))
                for step in steps
            ]
            if len(outputs) == 1:
                return outputs[0]
            return tf.nest.map_structure(lambda *t: tf.concat(t, axis=0), *outputs)

        if not self.run_eagerly:
            predict_function = tf.function(predict_function, reduce_retracing=True)
        self.predict_function = predict_function
        return predict_function

    # -- entry points: batch checks and lazy builds ---------------------------

    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto",
            callbacks=None, validation_split=0.0, validation_data=None,
            shuffle=True, class_weight=None, sample_weight=None, **kwargs):
        self._check_batch_size(batch_size)
        self._check_batch_size(kwargs.get("validation_batch_size"))
        if self._sharded:
            if validation_split:
                (x, y, sample_weight), validation_data = sharding.split_validation(
                    x, y, sample_weight, validation_split
                )
                validation_split = 0.0
            seed = self._strategy.agree_on_seed() if shuffle else None
            # Arrays: one endless iterator for the whole fit (see sharding.shard).
            steps = None
            if kwargs.get("steps_per_epoch") is None:
                steps = sharding.array_steps(x, batch_size)
            x, batch_size = sharding.shard(
                self._strategy, x, y, sample_weight, batch_size, shuffle, seed,
                repeat=steps is not None,
            )
            if steps is not None:
                kwargs["steps_per_epoch"] = steps
            y = sample_weight = None
            shuffle = False
            if validation_data is not None:
                val_batch = kwargs.pop("validation_batch_size", None) or batch_size
                validation_data, _ = sharding.shard(
                    self._strategy, *sharding.unpack(validation_data), val_batch
                )
        with self._side_effects(callbacks) as callbacks:
            return super().fit(
                x, y, batch_size, epochs, self._verbose(verbose), callbacks,
                validation_split, validation_data, shuffle, class_weight,
                sample_weight, **kwargs,
            )

    def evaluate(self, x=None, y=None, batch_size=None, verbose="auto",
                 sample_weight=None, steps=None, callbacks=None, **kwargs):
        self._check_batch_size(batch_size)
        if kwargs.get("_use_cached_eval_dataset"):
            # Validation inside fit: inputs were sharded by fit already.
            return super().evaluate(x, y, batch_size, verbose, sample_weight,
                                    steps, callbacks, **kwargs)
        if self._sharded:
            x, batch_size = sharding.shard(self._strategy, x, y, sample_weight, batch_size)
            y = sample_weight = None
        with self._side_effects(callbacks) as callbacks:
            return super().evaluate(x, y, batch_size, self._verbose(verbose),
                                    sample_weight, steps, callbacks, **kwargs)

    def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
        self._check_batch_size(batch_size)
        if not self.built:
            from keras.src.backend.tensorflow.trainer import TFEpochIterator

            self._maybe_symbolic_build(
                iterator=TFEpochIterator(
                    x=x,
                    batch_size=batch_size,
                    shuffle=False,
                    distribute_strategy=tf.distribute.get_strategy(),
                )
            )
        if self._sharded:
            x, batch_size = sharding.shard(self._strategy, x, batch_size=batch_size)
        with self._side_effects(callbacks) as callbacks:
            return super().predict(x, batch_size, self._verbose(verbose), steps, callbacks)

    @property
    def _sharded(self) -> bool:
        return self._strategy.world_size > 1

    def _verbose(self, verbose):
        if self.chief_only_side_effects and not self._strategy.is_chief:
            return 0
        return verbose

    def _side_effects(self, callbacks):
        return chief_only.redirected(
            callbacks, self._strategy.is_chief, self.chief_only_side_effects
        )

    def predict_on_batch(self, x):
        if not self.built:
            self._maybe_symbolic_build(data_batch=(x, None, None))
        return super().predict_on_batch(x)

    def _check_batch_size(self, batch_size):
        data_lib.check_batch_size(
            batch_size, self._strategy.num_replicas, self._strategy.name
        )

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
        inputs, outputs = _rebuild_under(resolved, inputs, outputs)
        Functional.__init__(self, inputs, outputs, name=name, **kwargs)
        self._init_distribution(resolved)


def _rebuild_under(strategy: Strategy, inputs, outputs):
    template = keras.Model(inputs, outputs)
    if all(strategy.holds(v) for v in template.variables):
        return inputs, outputs
    with strategy.scope():
        clone = keras.models.clone_model(template)
    clone.set_weights(template.get_weights())
    return clone.input, clone.output


def _adopt_optimizer(optimizer, strategy: Strategy):
    """Returns `optimizer`, re-created under the strategy if made outside it.

    An optimizer creates its step counter and learning-rate variables when
    constructed; made outside the scope they are not replicated, and every
    replica would bump the step counter.
    """
    if not all(strategy.holds(v) for v in optimizer.variables):
        if optimizer.built:
            raise ValueError(
                "The optimizer was already used outside this model's strategy; "
                "pass a new optimizer (or its name) to compile()."
            )
        with strategy.scope():
            optimizer = type(optimizer).from_config(optimizer.get_config())
    for opt in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if opt is not None:
            _install_reduction_switch(opt)
    return optimizer


def _install_reduction_switch(optimizer) -> None:
    """Lets our step make Keras's optimizer skip its own gradient all-reduce.

    Keras's TF optimizer sums gradients across replicas inside
    `apply_gradients` when called in a replica context. `train_step` has
    already reduced them (reducing twice multiplies them by the replica
    count), so while `_step_state.gradients_reduced` is set the sum is
    skipped. Custom `train_step`s that call `apply_gradients` themselves keep
    Keras's reduction. The switch acts at trace time.
    """
    keras_all_reduce = optimizer._all_reduce_sum_gradients
    if getattr(keras_all_reduce, "_kd_switch", False):
        return

    def all_reduce_unless_reduced(grads_and_vars):
        if getattr(_step_state, "gradients_reduced", False):
            return list(grads_and_vars)
        return keras_all_reduce(grads_and_vars)

    all_reduce_unless_reduced._kd_switch = True
    optimizer._all_reduce_sum_gradients = all_reduce_unless_reduced


def _batch_size(x):
    return tf.shape(next(t for t in tf.nest.flatten(x) if t is not None))[0]


def _can_write_atomically(filepath, overwrite, kwargs) -> bool:
    if not saving.is_local(filepath) or kwargs.get("max_shard_size"):
        return False
    return overwrite or not os.path.exists(os.fspath(filepath))


def _copy_optimizer_state(source: keras.Model, target: DistributedModel) -> None:
    src = source.optimizer
    if src is None or not src.built:
        return
    with target.strategy.scope():
        target.optimizer.build(target.trainable_variables)
    if len(src.variables) != len(target.optimizer.variables):
        raise ValueError(
            "Cannot carry the optimizer state over: the wrapped model's optimizer "
            f"has {len(src.variables)} variables, the copy's has "
            f"{len(target.optimizer.variables)}."
        )
    for new, old in zip(target.optimizer.variables, src.variables):
        new.assign(old)
