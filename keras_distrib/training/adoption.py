"""What a `DistributedModel` trains with, made its strategy's.

`StrategyAdoption` is a mixin of `DistributedModel`. Before `fit`,
`evaluate` or `predict` builds, everything the model trains with becomes
the strategy's, in place (no layer, optimizer or metric is re-created from
its config): the variables of its layers (`_take_variables`), the metrics
passed to `compile` or made in `__init__` (`adopt_metrics`), and every
optimizer it holds (`adopt_optimizer`: the compiled one and any set as an
attribute, as a GAN's two). A subclassed model builds its variables under
the strategy at its first call (`__call__`), and `_maybe_symbolic_build`
builds under the strategy where Keras builds before the first step.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import Any, Callable

import keras
import tensorflow as tf

from keras_distrib import _compat
from keras_distrib import placement
from keras_distrib.arithmetic import optimizer_shards
from keras_distrib.arithmetic.optimizer_tree import optimizers_in
from keras_distrib.arithmetic.reduction_switch import ReductionSwitch, install_reduction_switch
from keras_distrib.input import data as data_lib
from keras_distrib.strategies.base import Strategy
from keras_distrib.training import fit_checks
from keras_distrib.training.outside_scopes import outside_scopes
from keras_distrib.training.step_state import TrainerPart

_COMPILE_SIGNATURE = inspect.signature(keras.Model.compile)

# Optimizer -> the strategy that adopted it (see `adopt_optimizer`).
_ADOPTED: "weakref.WeakKeyDictionary[keras.optimizers.Optimizer, object]" = (
    weakref.WeakKeyDictionary()
)


class StrategyAdoption(TrainerPart):
    """Adoption of a `DistributedModel`'s layers, metrics and optimizers
    under its strategy (see module doc)."""

    # The model's: Keras's. Its `super()` calls reach Keras's model, after
    # these mixins in the model's classes, where mypy cannot follow.
    built: bool
    variables: Any
    trainable_variables: Any
    metrics: Any
    dtype_policy: Any
    _symbolic_build: Callable[..., None]

    def __call__(self, *args, **kwargs):
        # Lazily built (subclassed) models create their variables on the first
        # call; make sure that happens under the strategy.
        if not self.built and not tf.distribute.has_strategy():
            with self._strategy.scope(), fit_checks.same_model_or_error(self._strategy):
                outputs = super().__call__(*args, **kwargs)  # type: ignore[misc]  # Keras's
            if self.built:
                self._take_variables()
            return outputs
        return super().__call__(*args, **kwargs)  # type: ignore[misc]  # Keras's

    @outside_scopes
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
        placed = {id(v) for v in self._strategy.place(self)}
        placement.claim(self.variables, self._strategy, self)
        moved = [v for v in self.variables if id(v) in placed]
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
        placement.remake(
            placement.unheld(self._strategy, metric_variables, self), self._strategy, self
        )
        for optimizer in optimizer_attributes(self):
            adopt_optimizer(
                optimizer,
                optimizers_in(optimizer),
                self._strategy,
                self,
                self._kd_state.reduction_switch,
            )

    @outside_scopes
    def compile(self, optimizer="rmsprop", *args, **kwargs):
        arguments = _COMPILE_SIGNATURE.bind(self, optimizer, *args, **kwargs).arguments
        arguments.pop("self")
        arguments.update(arguments.pop("kwargs", {}))
        check_steps_per_execution(arguments.get("steps_per_execution", 1))
        fit_checks.check_same_compile(self._strategy, arguments)
        with self._strategy.scope():
            optimizer = self._loss_scaled_if_mixed(
                keras.optimizers.get(arguments["optimizer"]), arguments.get("auto_scale_loss", True)
            )
            arguments["optimizer"] = adopt_optimizer(
                optimizer,
                optimizers_in(optimizer),
                self._strategy,
                self,
                self._kd_state.reduction_switch,
            )
            for key in ("metrics", "weighted_metrics"):
                arguments[key] = adopt_metrics(arguments.get(key), self._strategy, self)
            super().compile(**arguments)  # type: ignore[misc]  # Keras's

    def _loss_scaled_if_mixed(self, optimizer, auto_scale_loss: bool):
        """`optimizer` in a LossScaleOptimizer where Keras's `compile` would
        wrap it (policy "mixed_float16"), so that the strategy adopts the
        optimizer that applies the updates: wrapped after `adopt_optimizer`,
        its loss-scale update ran unadopted (under central_storage it failed:
        "`merge_call` called while defining a new graph")."""
        if (
            auto_scale_loss
            and optimizer
            and self.dtype_policy.name == "mixed_float16"
            and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        ):
            return keras.optimizers.LossScaleOptimizer(optimizer, name="loss_scale_optimizer")
        return optimizer

    def compile_from_config(self, config):
        # Keras skips compiling on load when `compile` is overridden.
        self.compile(**keras.saving.deserialize_keras_object(config))
        if self.built:
            # The loaded layers' variables become the strategy's first: the
            # optimizer's slots (an EMA's too) are made beside them.
            self._take_variables()
            with self._strategy.scope():
                self.optimizer.build(self.trainable_variables)

    def _maybe_symbolic_build(self, iterator=None, data_batch=None, forward_only=False):
        """Keras's build before the first step, under the strategy.

        `forward_only` (`predict`): the layers only, as Keras's own predict
        builds nothing but the model (its first call). Keras's full build
        also builds the compiled metrics and loss from the batch's `y`,
        which `predict` input does not have, and reads an optimizer an
        uncompiled model does not hold.
        """
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
                if forward_only:
                    _compat.build_forward(self, iterator=iterator, data_batch=data_batch)
                else:
                    self._symbolic_build(iterator=iterator, data_batch=data_batch)
            except _compat.EmptyInput:
                # Keras reads one batch to build; an empty input has none.
                raise ValueError(
                    "The input data is empty: it gave no batch; check its source and "
                    "any filter/take/skip/shard that could remove every element."
                ) from None
        self._strategy.sync_initial_state(self)


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
            "or call it on a batch)."
        )


def check_steps_per_execution(steps) -> None:
    if not data_lib.is_positive_int(steps):
        raise ValueError(
            f"steps_per_execution={steps!r} must be an integer >= 1 (training steps "
            "per call of the compiled function; 1 is the default)."
        )


def adopt_optimizer(optimizer, applying: list, strategy: Strategy, model, switch: ReductionSwitch):
    """Returns `optimizer`, made `strategy`'s in place if it was made
    outside it; `applying`: it and the optimizers it applies through, each
    of which gets `model`'s reduction `switch` (`install_reduction_switch`).

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
    if optimizer.built:
        mine = {id(v) for v in model.trainable_variables}
        if not all(
            id(v) in mine for opt in applying for v in _compat.optimizer_trainable_variables(opt)
        ):
            raise ValueError(
                "The optimizer was already used outside this model's strategy; "
                "pass a new optimizer (or its name) to compile()."
            )
    moving = placement.unheld(strategy, [v for opt in applying for v in opt.variables], model)
    placement.remake(moving, strategy, model)
    with strategy.scope():
        engine = tf.distribute.get_strategy()
    for opt in applying:
        _compat.set_optimizer_strategy(opt, engine)
    if strategy.optimizer_sharding:
        # Before build_under: its eager build under the scope builds the parts.
        optimizer_shards.install(optimizer, strategy, switch)
    for opt in applying:
        if opt.built:
            _compat.reindex_optimizer(opt)
        # Every optimizer that applies gradients: a LossScaleOptimizer's
        # inner one and a MultiOptimizer's each reduce them again otherwise.
        install_reduction_switch(opt, strategy, switch)
        build_under(opt, strategy)
    strategy.adopt_optimizer(optimizer)
    _ADOPTED[optimizer] = strategy
    return optimizer


def build_under(optimizer, strategy: Strategy) -> None:
    """Makes `optimizer` create its slots under `strategy`, eagerly, also
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


def optimizer_attributes(model) -> list:
    """The optimizers `model` holds: the compiled one and any set as an
    attribute (a GAN's `d_optimizer`, in a list or dict too)."""
    found = [model.optimizer] if getattr(model, "optimizer", None) is not None else []
    for value in list(vars(model).values()):
        for item in (
            value.values()
            if isinstance(value, dict)
            else value
            if isinstance(value, (list, tuple))
            else [value]
        ):
            if isinstance(item, keras.optimizers.Optimizer) and not any(
                item is seen for seen in found
            ):
                found.append(item)
    return found


def adopt_metrics(metrics, strategy: Strategy, model):
    """`metrics` (as passed to `compile`), each metric object made outside
    `strategy` made its own in place.

    A metric object creates its variables when constructed; made outside
    the scope they are plain per-process variables, and each worker would
    report its own value instead of the global one. They are made again
    under the scope (no config round trip: a metric without `get_config`
    or `**kwargs` adopts too).
    """
    if isinstance(metrics, dict):
        return {k: adopt_metrics(v, strategy, model) for k, v in metrics.items()}
    if isinstance(metrics, (list, tuple)):
        return type(metrics)(adopt_metrics(m, strategy, model) for m in metrics)
    if isinstance(metrics, keras.metrics.Metric):
        placement.remake(placement.unheld(strategy, metrics.variables, model), strategy, model)
    return metrics
