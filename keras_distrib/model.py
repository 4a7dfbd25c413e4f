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

The class is made of mixins from `keras_distrib.training`, one concern each:
`adoption.StrategyAdoption` (what the model trains with, made the
strategy's), `replica_step.ReplicaStep` (the per-replica math),
`gradient_reduction.GradientReduction` (the step's one reduction) and
`entry_points.EntryPoints` (`fit`, `evaluate`, `predict`). This module
keeps resolving `strategy=`, the function-making layer, `from_model` and
loading.
"""

from __future__ import annotations

import functools
import itertools
import os
import warnings
from typing import Any, Callable, Optional, Sequence, Union

import keras
import numpy as np
import tensorflow as tf

from keras_distrib import _compat
from keras_distrib import placement
from keras_distrib import strategies
from keras_distrib.strategies import registry
from keras_distrib.strategies.base import Step, Strategy
from keras_distrib.training import from_model as from_model_lib
from keras_distrib.training import saving
from keras_distrib.training import step_call
from keras_distrib.training.adoption import StrategyAdoption
from keras_distrib.training.entry_points import EntryPoints, with_resume_and_preemption
from keras_distrib.training.gradient_reduction import GradientReduction
from keras_distrib.training.replica_step import ReplicaStep
from keras_distrib.training.step_state import StepState

_compat.warn_if_untested()
_compat.check_hooks()
Functional: Any = _compat.functional_class()  # Keras's (not exported), a class

StrategyLike = Union[str, Strategy]


class DistributedTrainer(StrategyAdoption, ReplicaStep, GradientReduction, EntryPoints):
    """The distribution `DistributedModel` adds to Keras's trainer.

    A mixin in Keras's own shape (Keras's trainer_test: "a model is just a
    layer mixed in with a Trainer"): `DistributedModel` is this in front of
    `keras.Model`; a layer mixed with this and Keras's backend trainer
    trains distributed as well, once `_init_distribution(strategy)` has run
    after the trainer's `__init__`. It holds the strategy and hands it the
    function-making layer; the mixins hold the per-replica math.
    """

    # Only the chief prints and writes files (see keras_distrib.training.chief_only).
    chief_only_side_effects = True
    # `fit` refuses float numpy input holding NaN/Inf and stops, naming the
    # step, when the training loss is NaN/Inf (see `fit_checks.FiniteLossCheck`).
    # Set `model.check_finite = False` to train on such input anyway.
    check_finite = True

    # Keras's trainer's functions and steps per call, which the
    # function-making layer below sets and reads (the strategy and the
    # state the mixins share: `training.step_state.TrainerPart`).
    # Its `super()` calls reach Keras's trainer, after these mixins in the
    # model's classes, where mypy cannot follow (`# type: ignore[...]  # Keras's`).
    train_function: Optional[Callable[..., Any]]
    test_function: Optional[Callable[..., Any]]
    predict_function: Optional[Callable[..., Any]]
    steps_per_execution: int

    def _init_distribution(self, strategy: Strategy) -> None:
        self._strategy = strategy
        # What the mixins keep for the model's steps and fit calls.
        self._kd_state = StepState()
        # Keras must only ever see the default strategy (see module doc).
        _compat.hide_distribute_strategy(self)

    # -- public surface -------------------------------------------------------

    @property
    def strategy(self) -> Strategy:
        """The strategy this model trains on."""
        return self._strategy

    def _resolve_auto_jit_compile(self) -> bool:
        """Keras's `jit_compile="auto"` (True on GPU machines, in `compile` and
        for `predict` before it), but False where the strategy's step cannot
        be compiled by XLA (`Strategy.without_xla`)."""
        strategy = getattr(self, "_strategy", None)
        if strategy is not None and strategy.without_xla():
            return False
        resolved: bool = super()._resolve_auto_jit_compile()  # type: ignore[misc]  # Keras's
        return resolved

    def _set_jit_compile(self, value: Union[bool, str]) -> None:
        # Keras's setter, also reached from `compile`: an explicit True where
        # XLA cannot compile the step warns with the reason and stays off.
        reason = value is True and self._strategy.without_xla()
        if reason:
            warnings.warn(
                f"jit_compile=True is not possible with strategy="
                f"{self._strategy.name!r}: {reason}; proceeding with "
                "jit_compile=False.",
                stacklevel=2,
            )
            value = False
        keras.Model.jit_compile.fset(self, value)

    jit_compile = property(
        keras.Model.jit_compile.fget, _set_jit_compile, doc=keras.Model.jit_compile.__doc__
    )

    # -- metrics: read through the strategy -----------------------------------

    def get_metrics_result(self) -> dict[str, Any]:
        keras_read = super().get_metrics_result  # type: ignore[misc]  # Keras's
        return self._strategy.read_metrics(self, keras_read)

    def reset_metrics(self) -> None:
        keras_reset = super().reset_metrics  # type: ignore[misc]  # Keras's
        self._strategy.reset_metrics(self, keras_reset)

    # -- the function-making layer: the strategy's ---------------------------

    def make_train_function(self, force: bool = False) -> Callable[..., Any]:
        if self.train_function is not None and not force:
            return self.train_function
        self.train_function = with_resume_and_preemption(self, self._make_train_function())
        return self.train_function

    def make_test_function(self, force: bool = False) -> Callable[..., Any]:
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
        custom = getattr(type(self), name) is not getattr(DistributedModel, name)
        return Step(fn, kind, custom=custom, applies=applies)

    def _make_train_function(self) -> Callable[..., Any]:
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

        def train_function(iterator: Any) -> Any:
            if next(steps) % k == k - 1:
                return accumulate_and_apply(iterator)
            return accumulate(iterator)

        return train_function

    def _strategy_function(self, step: Step) -> Callable[..., Any]:
        """The function Keras's loop calls for `step`: the strategy's, made
        with Keras's maker (`_compat.KERAS_HOOKS`), one compiled call per step
        where it can (`step_call`)."""
        keras_maker = super()._make_function  # type: ignore[misc]  # Keras's
        keras_make_function = functools.partial(
            step_call.one_call_per_step, self, keras_make_function=keras_maker
        )
        return self._strategy.make_step_function(self, step, keras_make_function)

    def make_predict_function(self, force: bool = False) -> Callable[..., Any]:
        if self.predict_function is not None and not force:
            return self.predict_function

        def keras_make_predict_function() -> Optional[Callable[..., Any]]:
            keras_model = super(DistributedTrainer, self)
            keras_model.make_predict_function(force=True)  # type: ignore[attr-defined]  # Keras's
            return self.predict_function

        self.predict_function = self._strategy.make_predict_function(
            self, self._step("predict"), keras_make_predict_function
        )
        return self.predict_function

    # -- weights: whole values, as a plain model's --------------------------------

    def get_weights(self) -> list[np.ndarray]:
        """`keras.Model.get_weights()`: a plain model's list, also where the
        strategy splits variables (`tensor_parallel`: each comes whole)."""
        return self.strategy.whole_weights(self)

    def set_weights(self, weights: Sequence[Any]) -> None:
        """`keras.Model.set_weights()`, from a plain model's list."""
        self.strategy.set_whole_weights(self, weights)


@keras.saving.register_keras_serializable(package="keras_distrib")
class DistributedModel(DistributedTrainer, keras.Model):  # type: ignore[misc]  # Keras has no types
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

    def __new__(cls, *args: Any, **kwargs: Any) -> DistributedModel:
        made_as: type = cls
        if _compat.is_functional_call(args, kwargs) and not issubclass(cls, Functional):
            # `Net(inputs, outputs)` for a subclass `Net` (the Keras guide's
            # custom train_step on a functional model): an instance of a
            # functional variant of `Net`. Keras would instead rewrite the
            # bases of every class up to keras.Model, turning all
            # DistributedModel subclasses functional.
            made_as = functional_variant(made_as)
        made: DistributedModel = super().__new__(made_as)
        return made

    def __init__(self, *args: Any, strategy: StrategyLike = "auto", **kwargs: Any):
        if _compat.functional_arguments(args, kwargs) and not isinstance(self, Functional):
            # A subclass's `super().__init__(inputs, outputs)` (Keras's
            # "functional init in a subclass"): this instance becomes the
            # functional variant of its class. Keras's `Model.__init__` would
            # instead rewrite `__bases__` up to keras.Model, ours included,
            # for the rest of the process (`inject_functional_model_class`).
            own_class: type = type(self)
            self.__class__ = functional_variant(own_class)
            FunctionalDistributedModel.__init__(self, *args, strategy=strategy, **kwargs)
            return
        resolved = strategies.get(strategy)
        registry.check_not_model_options(kwargs, resolved)
        super().__init__(*args, **kwargs)
        self._init_distribution(resolved)

    @classmethod
    def from_model(cls, model: keras.Model, strategy: StrategyLike = "auto") -> "DistributedModel":
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
        from_model_lib.check_wrappable(model, Functional)
        copied = placement.copy_functional(model)
        wrapped = FunctionalDistributedModel(
            copied.input, copied.output, name=model.name, strategy=strategy
        )
        if model.compiled:
            from_model_lib.compile_like(model, wrapped)
            from_model_lib.copy_optimizer_state(model, wrapped)
        return wrapped

    # -- saving: atomic files -------------------------------------------------

    def save(self, filepath: saving.PathLike, overwrite: bool = True, **kwargs: Any) -> None:
        """`keras.Model.save`, written atomically (temp file + rename)."""
        if not _can_write_atomically(filepath, overwrite, kwargs):
            super().save(filepath, overwrite=overwrite, **kwargs)
            return
        with saving.atomic_path(filepath) as tmp:
            super().save(tmp, overwrite=True, **kwargs)

    def save_weights(
        self, filepath: saving.PathLike, overwrite: bool = True, **kwargs: Any
    ) -> None:
        """`keras.Model.save_weights`, written atomically (temp file + rename)."""
        if not _can_write_atomically(filepath, overwrite, kwargs):
            super().save_weights(filepath, overwrite=overwrite, **kwargs)
            return
        with saving.atomic_path(filepath) as tmp:
            super().save_weights(tmp, overwrite=True, **kwargs)


@keras.saving.register_keras_serializable(package="keras_distrib")
class FunctionalDistributedModel(DistributedModel, Functional):  # type: ignore[misc]  # Keras has no types
    """What `DistributedModel(inputs, outputs, ...)` returns.

    The model is made of the layers between `inputs` and `outputs`, as
    `keras.Model(inputs, outputs)` is (shared with any plain model of
    them); their variables are moved under the strategy, same values.
    Layers that another live `DistributedModel` trains are copied instead
    (a variable lives under one strategy).
    """

    def __init__(
        self,
        inputs: Any,
        outputs: Any,
        name: Optional[str] = None,
        *,
        strategy: StrategyLike = "auto",
        **kwargs: Any,
    ):
        resolved = strategies.get(strategy)
        registry.check_not_model_options(kwargs, resolved)
        graph = keras.Model(inputs, outputs)
        if placement.owned_by_another(graph.variables, graph):
            # Layers another DistributedModel trains: this one gets its own
            # copies (a variable lives under one strategy). A
            # DistributedModel nested in this graph as a layer is not
            # another: this model trains it, as a Keras model its sub-models.
            inputs, outputs = placement.copy_graph(inputs, outputs)
        Functional.__init__(self, inputs, outputs, name=name, **kwargs)
        self._init_distribution(resolved)
        self._take_variables()

    def get_config(self) -> dict[str, Any]:
        """Keras's Functional config, and the strategy's name (`"strategy"`).

        The file names Keras's own public `keras.Model` as its class (see
        `_compat.save_as_keras_model`), so plain Keras loads it where
        keras_distrib is not installed (its Functional ignores the
        `"strategy"` key); where keras_distrib is imported, the key makes
        `keras.models.load_model` return a `DistributedModel` on that
        strategy (`_strategy_for_loading`).
        """
        config: dict[str, Any] = super().get_config()
        if type(self) is FunctionalDistributedModel:
            config[_SAVED_STRATEGY_KEY] = self._strategy.name
        return config


_SAVED_STRATEGY_KEY = "strategy"


def _strategy_for_loading(name: Any) -> StrategyLike:
    """The strategy a loaded model trains on: the one it was saved with,
    unless a strategy's scope is entered (then that one, as Keras loads
    into a scope), or it cannot run here (a cluster strategy in a notebook:
    then `"auto"`, with a warning naming why)."""
    if tf.distribute.has_strategy() or not isinstance(name, str):
        return "auto"
    try:
        return strategies.get(name)
    except (ValueError, ImportError) as error:
        warnings.warn(
            f"The model was saved with strategy {name!r}, which cannot run here "
            f"({error}); loading it with strategy='auto'.",
            stacklevel=3,
        )
        return "auto"


def _load_saved(
    config: dict[str, Any], custom_objects: Optional[dict[str, Any]] = None
) -> FunctionalDistributedModel:
    """`keras.Model.from_config` of a file written by a FunctionalDistributedModel."""
    config = dict(config)
    config[_SAVED_STRATEGY_KEY] = _strategy_for_loading(config.get(_SAVED_STRATEGY_KEY))
    loaded: FunctionalDistributedModel = FunctionalDistributedModel.from_config(
        config, custom_objects=custom_objects
    )
    return loaded


_compat.save_as_keras_model(FunctionalDistributedModel, _SAVED_STRATEGY_KEY, _load_saved)
_compat.name_damaged_keras_files()
_compat.remat_in_graphs()
# Keras saves a variable as `np.asarray(variable)`, which TensorFlow's
# ShardedVariable (a variable split over parameter servers) lacks.
_compat.convert_sharded_variables_to_numpy()


@functools.lru_cache(maxsize=None)
def functional_variant(cls: type) -> type:
    """`cls` built from `(inputs, outputs)`: its methods, Functional's graph.

    The variant keeps `cls`'s name and module, so `isinstance` and saving
    see `cls` (loading calls `cls(inputs=..., outputs=...)`, which lands
    here again). It derives from the variant of `cls`'s own
    `DistributedModel` base, so a functional `Net(Base)` is also an
    instance of functional `Base`, as with Keras's classes.
    """
    if cls is DistributedModel or issubclass(cls, Functional):
        return FunctionalDistributedModel if cls is DistributedModel else cls
    parent: type = next(base for base in cls.__bases__ if issubclass(base, DistributedModel))
    return type(
        cls.__name__,
        (cls, functional_variant(parent)),
        {"__module__": cls.__module__, "__qualname__": cls.__qualname__},
    )


def _can_write_atomically(
    filepath: saving.PathLike, overwrite: bool, kwargs: dict[str, Any]
) -> bool:
    if not saving.is_local(filepath) or kwargs.get("max_shard_size"):
        return False
    return overwrite or not os.path.exists(os.fspath(filepath))


# Keras's legacy HDF5 loader (`model.save("m.h5")`, `keras.models.load_model`)
# finds a class by the bare name saved in the file's config, where the
# `.keras` format reads the registered "keras_distrib>..." name: both are
# known, so either file loads back into the class that saved it.
for _cls in (DistributedModel, FunctionalDistributedModel):
    keras.saving.get_custom_objects().setdefault(_cls.__name__, _cls)
del _cls
