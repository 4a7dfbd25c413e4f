"""Every private TensorFlow / Keras name keras_distrib relies on, in one place.

Each item says why no public API does the job and on which versions it was
verified. `setup.cfg` bounds TensorFlow and Keras to the minor versions the
test suite ran on (`TESTED`); importing keras_distrib's TensorFlow parts on
any other version warns once, naming it. `check_hooks()` fails at import,
in one line, when a Keras method that `DistributedModel` overrides or calls
is gone (an override of a method Keras no longer calls would otherwise be
silently skipped).

Verified on: TensorFlow 2.21.0 (tensorflow-cpu), Keras 3.15.1, Python 3.11.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import uuid
import warnings
from typing import Any, Iterator

import keras
import numpy as np
import tensorflow as tf

from keras_distrib.input import data as data_lib

# Minor versions the whole suite ran on (setup.cfg pins the same ranges).
TESTED = {"tensorflow": "2.21", "keras": "3.15"}


# -- versions -------------------------------------------------------------------


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


@functools.lru_cache(maxsize=None)
def warn_if_untested() -> None:
    """Warns once when TensorFlow or Keras is a minor version we never tested."""
    found = {"tensorflow": tf.__version__, "keras": keras.__version__}
    for name, version in found.items():
        if _minor(version) != TESTED[name]:
            warnings.warn(
                f"keras_distrib was tested with {name} {TESTED[name]}.x but found "
                f"{name} {version}; private {name} internals it relies on may have "
                "changed (see keras_distrib/_compat.py).",
                RuntimeWarning,
                stacklevel=2,
            )


# -- Keras Trainer / Model ------------------------------------------------------
# DistributedModel overrides or calls these private Trainer methods. Keras 3
# exposes no public hook between "a step function" and "the function fit
# calls", nor for the build that fit/evaluate/predict run before the first
# step (keras/src/backend/tensorflow/trainer.py, keras/src/trainers/trainer.py).
KERAS_HOOKS = (
    "_make_function",  # step function -> train/test function (TF trainer)
    "_maybe_symbolic_build",  # builds model, metrics and optimizer before fit
    "_symbolic_build",
    "_compute_loss",  # compute_loss, adapted to overrides without `training`
    "_resolve_auto_jit_compile",  # jit_compile="auto", off where XLA cannot compile
)


def check_hooks() -> None:
    """One-line error when a Keras method DistributedModel hooks into is gone."""
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    missing = [name for name in KERAS_HOOKS if not hasattr(TensorFlowTrainer, name)]
    if missing:
        raise ImportError(
            f"keras {keras.__version__} has no TensorFlowTrainer.{missing[0]}, which "
            f"keras_distrib hooks into; install keras=={TESTED['keras']}.* "
            "(see keras_distrib/_compat.py)."
        )


def functional_class() -> type:
    """Keras's `Functional` model class (not exported; needed to subclass it).

    `FunctionalDistributedModel` is a `DistributedModel` and a `Functional`,
    so `DistributedModel(inputs, outputs)` behaves as `keras.Model(inputs,
    outputs)` does.
    """
    from keras.src.models.functional import Functional

    return Functional


def clone_functional(template, **kwargs):
    """`keras.models.clone_model(template, **kwargs)` for a Functional
    `template`, whose inputs keep their kind.

    Keras 3.15 makes each input of a Functional clone as
    `Input(batch_shape=..., dtype=..., name=...)`
    (`keras/src/models/cloning.py`, `_clone_functional_model`): a sparse or
    ragged input comes back dense, and the clone then densifies sparse
    batches (more memory, dense math) and fails on layers that read the
    ragged structure (`row_lengths`). Here each input is made from its
    `InputLayer`'s config (shape, dtype, sparse, ragged, name, optional).
    """
    inputs = tf.nest.map_structure(
        lambda x: keras.Input(**x._keras_history.operation.get_config()), template.input)
    return keras.models.clone_model(template, input_tensors=inputs, **kwargs)


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
      (`data.absent_as_none`); Keras's build would read the Optional's shape.

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

    return ((0, 0, [data_lib.absent_as_none(first_batch())]) for _ in range(1))


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


def is_functional_call(args, kwargs) -> bool:
    """Whether `Model(*args, **kwargs)` is the functional form (inputs, outputs).

    Keras's own test (`functional_init_arguments`, used by `Model.__new__`)
    counts arguments only; a subclass taking two models (the keras-io VAE:
    `VAE(encoder, decoder)`) passes it too. Keras itself decides in
    `Model.__init__`, from what the subclass passes up; here the inputs
    must also be Keras tensors.
    """
    from keras.src.models.model import functional_init_arguments

    if not functional_init_arguments(args, kwargs):
        return False
    inputs = args[0] if args else kwargs.get("inputs")
    return all(isinstance(t, keras.KerasTensor) for t in keras.tree.flatten(inputs))


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
    logs, came out divided (a GAN's `d_loss` logged half of one device's
    over 2 replicas). Ours reduce gradients themselves (the mean over
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

        unless_ours._kd_wrapped = True
        functools.update_wrapper(unless_ours, keras_function)
        setattr(loss_module, name, unless_ours)


def save_as_keras_model(cls: type, marker: str, load: Any) -> None:
    """Files of `cls` name Keras's public `keras.Model` as their class, and
    `keras.Model.from_config` of a config holding `marker` is `load(config,
    custom_objects)`.

    Keras writes a model's class into its `.keras` file: its public name
    when it has one (`serialize_with_public_class`, from the symbol table
    `api_export.REGISTERED_OBJS_TO_NAMES`), else its module and registered
    name, which a process without that module cannot load ("Could not
    locate class 'FunctionalDistributedModel'"). Registered as the public
    `keras.Model`, a file loads anywhere as Keras's own Functional model
    (`Model.from_config` of a Functional config). Loading it where
    keras_distrib is imported, the marker key routes it back to `load`
    (Horovod keeps a wrapped optimizer's class name for the same reason).
    Idempotent.
    """
    from keras.src import api_export

    api_export.REGISTERED_OBJS_TO_NAMES[cls] = "keras.Model"
    keras_from_config = keras.Model.__dict__["from_config"].__func__
    if getattr(keras_from_config, "_kd_wrapped", False):
        return

    def from_config(model_cls, config, custom_objects=None):
        if model_cls is keras.Model and isinstance(config, dict) and marker in config:
            return load(config, custom_objects)
        return keras_from_config(model_cls, config, custom_objects=custom_objects)

    from_config._kd_wrapped = True
    functools.update_wrapper(from_config, keras_from_config)
    keras.Model.from_config = classmethod(from_config)


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


def take_added_losses(model) -> list:
    """The losses `model`'s layers added in their latest call (`add_loss`,
    activity regularizers: `Layer._get_own_losses`), which are then cleared
    (`Layer._clear_losses`), so that `model.losses` of an enclosing model
    no longer lists them (weight regularization losses are not among them:
    Keras computes those from the weights when asked)."""
    losses = [loss for layer in [model, *all_layers(model)] for loss in layer._get_own_losses()]
    model._clear_losses()
    return losses


def added_losses_per_thread(model) -> None:
    """Gives `model` and each of its layers one list of added losses per
    thread (`Layer._losses`: what `add_loss` and activity regularizers add,
    cleared by the outermost call, read by `Layer.losses`).

    tf.distribute runs each in-process replica in a thread of its own, one
    at a time, switching at every `merge_call`; under CentralStorage every
    assignment to a variable in a replica (a metric's update inside Keras's
    `compute_loss`, a BatchNormalization or seed update in the forward pass)
    is one. The next replica's forward pass then cleared and refilled the
    shared lists, and the first replica's `compute_loss` read the other's
    losses: weights 1e-3 off one device with an activity regularizer and
    two outputs. With a list per thread each replica reads its own.
    """
    for layer in [model, *all_layers(model)]:
        if not isinstance(layer._losses, _PerThreadList):
            object.__setattr__(layer, "_losses", _PerThreadList(layer._losses))


class _PerThreadList:
    """The list operations Keras's `Layer` uses on `_losses`, on a list of
    the calling thread's own (the creating thread starts with `items`)."""

    def __init__(self, items):
        self._local = threading.local()
        self._local.items = list(items)

    def _items(self) -> list:
        if not hasattr(self._local, "items"):
            self._local.items = []
        return self._local.items

    def append(self, item):
        self._items().append(item)

    def extend(self, items):
        self._items().extend(items)

    def clear(self):
        self._items().clear()

    def __getitem__(self, index):
        return self._items()[index]

    def __iter__(self):
        return iter(self._items())

    def __len__(self):
        return len(self._items())


def graph_of(layer):
    """The Functional graph of a nested Functional or Sequential model
    (`Sequential._functional`), or None for another layer."""
    functional = functional_class()
    if isinstance(layer, functional):
        return layer
    inner = getattr(layer, "_functional", None) if isinstance(layer, keras.Sequential) else None
    return inner if isinstance(inner, functional) else None


def inlined_functional(model):
    """A Functional model computing what Functional `model` computes, with
    each nested Functional or Sequential model replaced by the calls of
    its own layers (recursively), on `model`'s inputs. The layers are the
    same objects (each gets one more call in its node list); Keras's
    `Function._run_through_graph` replays a graph with a `call_fn` per
    operation, which here replays a nested model's graph instead of calling
    it."""
    def call(operation, *args, **kwargs):
        inner = graph_of(operation)
        if inner is None:
            return operation(*args, **kwargs)
        return inner._run_through_graph(args[0] if len(args) == 1 else args, call_fn=call)

    outputs = model._run_through_graph(model.input, call_fn=call)
    return keras.Model(model.input, outputs, name=f"{model.name}_inlined")


def layer_tensors(model) -> dict:
    """`id(layer) -> (input tensors, output tensors)` of each layer's calls
    in `model`'s own graph (all its calls, for a shared layer), read from
    the graph's nodes (`Function._nodes_by_depth`; `node.input_tensors`,
    `node.outputs`). A nested model's `input` / `output` properties give the
    tensors of its own graph instead, which are not in `model`'s."""
    found: dict = {}
    for depth in sorted(model._nodes_by_depth, reverse=True):
        for node in model._nodes_by_depth[depth]:
            if not node.operation or node.is_input:
                continue
            inputs, outputs = found.setdefault(id(node.operation), ([], []))
            inputs.extend(node.input_tensors)
            outputs.extend(node.outputs)
    return found


def all_layers(model) -> list:
    """Every layer nested in `model` (`Layer._flatten_layers`), found through
    custom layers too, which `model.layers` does not descend into."""
    return list(model._flatten_layers(include_self=False, recursive=True))


def call_has_training_arg(model) -> bool:
    """Whether `model.call` takes `training` (`Layer._call_has_training_arg`)."""
    return model._call_has_training_arg


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
        x=x, batch_size=batch_size, shuffle=False,
        distribute_strategy=tf.distribute.get_strategy(),
    )


def train_validation_split(arrays, validation_split: float):
    """Keras's own `validation_split` slicing (last fraction of the arrays).

    Multi-process input is sharded after the split, so we split first, the
    way `fit` would.
    """
    from keras.src.trainers.data_adapters import array_slicing

    return array_slicing.train_validation_split(arrays, validation_split=validation_split)


# -- Keras optimizers -------------------------------------------------------------


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


@contextlib.contextmanager
def updates_in_cross_replica_context(engine):
    """Lets Keras's optimizer update variables from `engine`'s cross-replica context.

    Keras 3's TF optimizer reaches the cross-replica context through
    `tf.__internal__.distribute.interim.maybe_merge_call`, which, for a
    strategy that uses merge calls, asks the *replica* context for one: in
    the cross-replica context there is none ("'NoneType' object has no
    attribute 'merge_call'"). With `extended._use_merge_call()` False it
    calls the update directly, which is what the cross-replica context
    needs (TensorFlow's own strategy tests set it so:
    tensorflow/python/distribute/strategy_combinations.py). Trace time only.
    """
    extended = engine.extended
    had_own = "_use_merge_call" in vars(extended)
    previous = vars(extended).get("_use_merge_call")
    extended._use_merge_call = lambda: False
    try:
        yield
    finally:
        if had_own:
            extended._use_merge_call = previous
        else:
            del extended._use_merge_call


@contextlib.contextmanager
def without_default_strategy_creator() -> Iterator[None]:
    """Variables made inside skip the default tf.distribute strategy's
    variable creator.

    Keras runs each step inside the default strategy's `run`
    (`TensorFlowTrainer._make_function`, and `keras_distrib.training.step_call` as
    Keras does), whose scope installs a creator that refuses any other
    strategy (`_DefaultDistributionContext`, tensorflow/python/distribute/
    distribute_lib.py: "Mixing different tf.distribute.Strategy objects");
    `tf.init_scope` carries it out of the step. No public API removes a
    creator: the graph's creator stack (`Graph._variable_creator_stack`)
    is set without it while the variables are made, then restored.
    """
    graph = tf.compat.v1.get_default_graph()
    stack = graph._variable_creator_stack
    graph._variable_creator_stack = [
        entry for entry in stack
        if not getattr(entry[-1], "__qualname__", "").startswith("_DefaultDistributionContext.")]
    try:
        yield
    finally:
        graph._variable_creator_stack = stack


@contextlib.contextmanager
def outside_strategy_scopes() -> Iterator[None]:
    """Runs the body as if no tf.distribute strategy scope were entered.

    Code written for tf.distribute calls `fit`, `evaluate`, `predict` and
    `compile` inside `with strategy.scope():`. Keras then reads that
    strategy (`Trainer.distribute_strategy` falls back to
    `tf.distribute.get_strategy()`) and runs its own distribution code,
    which fails ("'PerReplica' object has no attribute 'shape'",
    keras-team/keras#20585); our model does the distribution itself and
    enters its strategy's scope where it makes variables. A scope is the
    graph's strategy stack (`Graph._distribution_strategy_stack`) and the
    variable creators it pushed (`Graph._variable_creator_stack`); both
    are set aside for the body and put back after it (TensorFlow has no
    public way to leave a scope from inside it).
    """
    graph = tf.compat.v1.get_default_graph()
    modes, creators = graph._distribution_strategy_stack, graph._variable_creator_stack
    graph._distribution_strategy_stack, graph._variable_creator_stack = [], []
    try:
        yield
    finally:
        graph._distribution_strategy_stack, graph._variable_creator_stack = modes, creators


def add_through_tensorflow(variable) -> None:
    """Makes `variable.assign_add(v)` TensorFlow's own `assign_add`.

    Keras 3 implements `Variable.assign_add(v)` as `assign(self + v)`
    (keras/src/backend/common/variables.py). Under a strategy that keeps one
    aggregating copy of a variable for several replicas (CentralStorage), each
    replica's `assign` is summed: the result is `R * self + sum(v)` instead of
    `self + sum(v)`. TensorFlow's `assign_add` aggregates the increments.
    """
    tf_variable = variable.value

    def assign_add(value):
        return tf_variable.assign_add(tf.cast(value, tf_variable.dtype))

    variable.assign_add = assign_add


def sharded_variable_class() -> type:
    """TensorFlow's `ShardedVariable` (what `ParameterServerStrategy` with a
    `variable_partitioner` creates for a variable split over several ps).

    Exported only as `tf.__internal__.distribute.ShardedVariable`; needed to
    recognise one and to build a sharded optimizer slot from its parts.
    """
    return tf.__internal__.distribute.ShardedVariable


def optimizer_trainable_variables(optimizer) -> list:
    """The weights a built optimizer updates (`optimizer._trainable_variables`;
    Keras has no public accessor)."""
    return list(optimizer._trainable_variables)


def optimizer_strategy(optimizer):
    """The tf.distribute strategy a Keras TF optimizer was made under
    (`optimizer._distribution_strategy`), in whose scope its slots live."""
    return optimizer._distribution_strategy


def variable_value(variable):
    """The whole value of Keras variable `variable` (numpy), or None when
    it is not initialized yet (`_value` None: it is made where it is first
    used, so it needs no moving)."""
    if variable._value is None:
        return None
    return np.asarray(variable.numpy())


def set_variable_value(variable, value) -> None:
    """Makes the TensorFlow variable under Keras variable `variable` again,
    holding `value`, where the current scope and device say: Keras's TF
    `Variable._initialize` (keras/src/backend/tensorflow/core.py), which is
    how Keras made it first, with its name, trainability, aggregation and
    synchronization.

    Keras has no public way to move a variable under a tf.distribute
    strategy or onto a device other than a config round trip of the whole
    layer (`clone_model`); this keeps the Keras variable object, so every
    layer, optimizer list and saving path that refers to it stays right.
    """
    variable._initialize(value)


def reindex_optimizer(optimizer) -> None:
    """Makes a built optimizer find its trainable variables again after
    the TensorFlow variables under them were made anew (`set_variable_value`).

    Keras's TF optimizer finds a variable's slots through
    `_trainable_variables_indices`, keyed by the TensorFlow variable's
    `_unique_id` (`TFOptimizer._var_key`), not by the Keras variable.
    """
    optimizer._trainable_variables_indices = {
        optimizer._var_key(variable): i
        for i, variable in enumerate(optimizer._trainable_variables)}


def set_optimizer_strategy(optimizer, tf_strategy) -> None:
    """Makes a Keras TF optimizer made outside `tf_strategy` act under it.

    The optimizer records the strategy current at its construction
    (`TFOptimizer._distribution_strategy`) and makes its slots and updates
    through it; one adopted by a model on another strategy must use that
    model's.
    """
    if hasattr(optimizer, "_distribution_strategy"):
        optimizer._distribution_strategy = tf_strategy


def replace_variable_value(variable, value) -> None:
    """Points a Keras variable at another TF variable (`variable._value`).

    Keras's only public ways to set a variable's backing TF variable are at
    construction; an optimizer's slots, once built, are referenced from its
    own lists and tracking, so replacing the backing variable in place keeps
    them all consistent.
    """
    variable._value = value


def convert_sharded_variables_to_numpy() -> None:
    """Gives TensorFlow's `ShardedVariable` the `__array__` its parts have.

    Keras saves a variable as `np.asarray(variable)` (`.weights.h5` and
    `.keras`), which calls `variable.value.__array__`; ShardedVariable has
    `numpy()` (its parts, concatenated) but no `__array__` (TensorFlow
    2.21.0): saving fails with "'ShardedVariable' object has no attribute
    '__array__'". The method added is ResourceVariable's, on the whole value.
    Does nothing when TensorFlow defines it. Verified on TensorFlow 2.21.0
    with Keras 3.15.1 (save_weights, model.save, get_weights).
    """
    cls = sharded_variable_class()
    if hasattr(cls, "__array__"):
        return

    def __array__(self, dtype=None):
        return np.asarray(self.numpy(), dtype=dtype)

    cls.__array__ = __array__


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
    update = optimizer._distributed_tf_update_step
    if getattr(update, "_kd_sharded", False):
        return

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

    distributed_update_step._kd_sharded = True
    optimizer._distributed_tf_update_step = distributed_update_step

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


def learning_rate_or_schedule(optimizer):
    """The optimizer's rate as given: a variable, or the schedule object.

    The public `learning_rate` property evaluates a schedule; the warmup
    callbacks need the schedule itself (`optimizer._learning_rate`).
    """
    return optimizer._learning_rate


# -- Keras callbacks ------------------------------------------------------------------


def redirect_backup_writes(callback, directory: str) -> None:
    """Points a `BackupAndRestore`'s file paths (set in its `__init__`) at
    `directory`, so a non-chief worker writes to scratch."""
    import os

    callback.backup_dir = directory
    callback._weights_path = os.path.join(directory, "latest.weights.h5")
    callback._training_metadata_path = os.path.join(directory, "training_metadata.json")
    callback._prev_weights_path = f"{callback._weights_path}.bkp"
    callback._prev_training_metadata_path = f"{callback._training_metadata_path}.bkp"


def tensorboard_profiles(callback) -> bool:
    """Whether a `keras.callbacks.TensorBoard` will profile some batches
    (`profile_batch` > 0: Keras keeps only the parsed `_start_batch`;
    keras/src/callbacks/tensorboard.py `_init_profile_batch`, Keras 3.15)."""
    return getattr(callback, "_start_batch", 0) > 0


# -- TensorFlow runtime -------------------------------------------------------------


def tensorflow_started() -> bool:
    """Whether TensorFlow's eager context exists (devices are fixed from then).

    A collective runtime (multi-worker server) can only be configured before
    this; `tf.config` has no public query for it.
    """
    from tensorflow.python.eager import context

    return context.context()._context_handle is not None


def set_collective_key_base(tf_strategy: Any, base: int) -> None:
    """Gives a tf.distribute strategy its own collective key range.

    Every Mirrored/MultiWorkerMirrored strategy starts its group keys at 1, so
    two in one process share collective instances and TF aborts with "Shape
    mismatch in the collective instance". Must be set before its `__init__`.
    """
    tf_strategy._collective_key_base = base


def rekey_collectives(tf_strategy: Any, base: int) -> None:
    """Gives a `MirroredStrategy` made by the user (with the default key
    range, see `set_collective_key_base`) its own collective key range, by
    making its collective ops again as its constructor did
    (`MirroredExtended._make_collective_ops_with_fallbacks`, which reads
    `_collective_key_base`); its cross-device ops become them unless the
    user chose others. Two such strategies in one process otherwise shared
    instance keys: "Shape mismatch in the collective instance 100"."""
    extended = tf_strategy.extended
    if getattr(extended, "_collective_key_base", None) != 0:
        return  # already its own range
    chosen = extended._cross_device_ops is not extended._collective_ops
    extended._collective_key_base = base
    extended._collective_ops = extended._make_collective_ops_with_fallbacks()
    if not chosen:
        extended._cross_device_ops = extended._collective_ops


def abort_collective_ops(message: str) -> None:
    """Fails every collective of this process, running or to come, with
    DEADLINE_EXCEEDED and `message` (what TensorFlow's own health check
    does on a lost peer; the eager context has no public call for it)."""
    from tensorflow.python.eager import context

    context.context().abort_collective_ops(tf.errors.DEADLINE_EXCEEDED, message)


def gather(tf_strategy: Any, value: Any, axis: int, options: Any) -> Any:
    """`tf_strategy.gather(value, axis)` with collective `options` (the
    public call takes none; this is its body, with them)."""
    from tensorflow.python.distribute import device_util

    extended = tf_strategy.extended
    destination = device_util.current() or extended._default_device or "/device:CPU:0"
    return extended._local_results(extended._gather_to(value, destination, axis, options))[0]


@contextlib.contextmanager
def reuse_collective_server() -> Iterator[None]:
    """MultiWorkerMirroredStrategy objects built inside reuse the running server.

    `keras_distrib.collectives.runtime` starts this process's collective server once;
    a strategy built later must not start a second one (TensorFlow checks
    `_std_server_started` on the strategy's extended object), and, as when
    TensorFlow starts the server itself with its coordination service, must
    not start its Python health-check thread (`_enable_check_health`).
    """
    from tensorflow.python.distribute import collective_all_reduce_strategy as car

    extended = car.CollectiveAllReduceExtended
    saved = extended._enable_check_health
    extended._std_server_started = True
    extended._enable_check_health = False
    try:
        yield
    finally:
        del extended._std_server_started
        extended._enable_check_health = saved


# -- Slurm -------------------------------------------------------------------------
# TensorFlow's SlurmClusterResolver expands Slurm's compressed host lists and
# task counts ("n[1-3]", "2(x3)") as Slurm documents them; the expansion
# helpers are module functions with no public export.


def slurm_hosts_and_tasks(nodelist: str, tasks_per_node: str) -> tuple[list, list]:
    """(`SLURM_STEP_NODELIST` expanded, `SLURM_STEP_TASKS_PER_NODE` expanded)."""
    from tensorflow.python.distribute.cluster_resolver import slurm_cluster_resolver as slurm

    return slurm.expand_hostlist(nodelist), slurm.expand_tasks_per_node(tasks_per_node)


def slurm_worker_addresses(rank: int, num_tasks: int, task_config: dict, port_base: int) -> list:
    """Worker addresses as TensorFlow's SlurmClusterResolver assigns them.

    The stock resolver reads `SLURM_PROCID` from `os.environ`
    (`_resolve_own_rank`); ours reads the environment it was given.
    """
    from tensorflow.python.distribute.cluster_resolver import slurm_cluster_resolver as slurm

    class _Resolver(slurm.SlurmClusterResolver):
        def _resolve_own_rank(self):
            return rank

    resolver = _Resolver(
        jobs={"worker": num_tasks},
        port_base=port_base,
        tasks_per_node=task_config,
        # One fake "GPU" per task keeps the resolver from calling nvidia-smi
        # and from assigning devices; which devices a worker uses is the
        # strategy's business, and auto_set_gpu=False leaves the env alone.
        gpus_per_node=max(task_config.values()),
        gpus_per_task=1,
        auto_set_gpu=False,
    )
    return resolver.cluster_spec().job_tasks("worker")


# -- tf.distribute parameter servers -------------------------------------------------


def set_variable_partitioner(strategy: Any, partitioner: Any) -> None:
    """Sets the partitioner of a `tf.distribute.ParameterServerStrategy` made
    earlier (its extended's `_variable_partitioner`, which the constructor
    sets and variable creation reads; verified TF 2.21).

    The chief must connect to its cluster before TensorFlow makes any
    tensor (see `keras_distrib.collectives.runtime.start_coordinator`), which is before
    the user's script names its partitioner; TensorFlow offers no setter.
    """
    strategy.extended._variable_partitioner = partitioner


def cross_device_ops(strategy: Any) -> Any:
    """A `MirroredStrategy`'s cross-device ops object (its extended's
    `_cross_device_ops`; None: TensorFlow's choice, made at first use)."""
    return getattr(strategy.extended, "_cross_device_ops", None)


def variable_partitioner(strategy: Any) -> Any:
    """A `ParameterServerStrategy`'s partitioner (see `set_variable_partitioner`)."""
    return getattr(strategy.extended, "_variable_partitioner", None)


def communication_options(strategy: Any) -> Any:
    """A `MultiWorkerMirroredStrategy`'s `CommunicationOptions` (its
    extended's `_communication_options`, set by the constructor; no public
    getter, verified TF 2.21)."""
    return strategy.extended._communication_options


# -- tf.data ------------------------------------------------------------------------


def undistributed(data: Any) -> Any:
    """The `tf.data.Dataset` of global batches behind a tf.distribute
    distributed dataset, or `data` itself.

    `strategy.experimental_distribute_dataset(ds)` keeps `ds` (its
    `_original_dataset`, before TensorFlow splits each batch over the
    replicas); `strategy.distribute_datasets_from_function(fn)` keeps `fn`
    (`_dataset_fn`), which called with a one-pipeline, one-replica
    `tf.distribute.InputContext` gives global batches
    (`ctx.get_per_replica_batch_size(global_batch)` is then the global
    batch). Our strategies split batches themselves; TensorFlow's
    `DistributedDataset` has no public accessor for either (verified TF
    2.21, tensorflow/python/distribute/input_lib.py).
    """
    from tensorflow.python.distribute import input_lib

    if isinstance(data, input_lib.DistributedDataset) and hasattr(data, "_original_dataset"):
        return data._original_dataset
    if isinstance(data, input_lib.DistributedDatasetsFromFunction) and hasattr(data, "_dataset_fn"):
        return data._dataset_fn(tf.distribute.InputContext(
            num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=1))
    return data


def _dataset_graph(dataset: tf.data.Dataset):
    """The pipeline's GraphDef (`Dataset._as_serialized_graph`, what
    tf.distribute's own auto-sharding reads; there is no public way to
    inspect a pipeline)."""
    graph = tf.compat.v1.GraphDef()
    graph.ParseFromString(dataset._as_serialized_graph().numpy())
    return graph


def dataset_ops(dataset: tf.data.Dataset) -> set[str]:
    """Names of the ops in a dataset's graph (to find file readers)."""
    graph = _dataset_graph(dataset)
    ops = {node.op for node in graph.node}
    for function in graph.library.function:
        ops.update(node.op for node in function.node_def)
    return ops


class UnseededShuffleError(ValueError):
    """An unseeded shuffle the workers cannot be made to agree on."""


def _unseeded(nodes: dict, shuffle) -> bool:
    # ShuffleDatasetV3(input, buffer_size, seed, seed2, seed_generator):
    # seed == seed2 == 0 is TensorFlow's "draw a random seed".
    seeds = [nodes.get(name.split(":")[0].lstrip("^")) for name in shuffle.input[2:4]]
    return all(
        node is not None and node.op == "Const"
        and tf.make_ndarray(node.attr["value"].tensor) == 0
        for node in seeds
    )


def agree_on_shuffles(dataset: tf.data.Dataset, draw_seed) -> tf.data.Dataset:
    """`dataset` with every unseeded `shuffle` given a seed from `draw_seed()`.

    Workers that each cut their rows from the same global batches must see
    the same batches; `.shuffle(n)` without a seed (TensorFlow's tutorials
    use it) draws a different order in every process. The pipeline's graph
    is serialized, each unseeded `ShuffleDatasetV3` gets the agreed seed
    (and a fresh seed-generator handle: deserialization reuses a live
    generator found under the old name), and the graph is deserialized
    (`DatasetFromGraph`, public raw op). Each epoch still reshuffles, in
    the same order on every worker. Returns `dataset` itself when it has no
    unseeded shuffle (`draw_seed` is then not called).

    Raises:
        UnseededShuffleError: an unseeded shuffle that cannot be rewritten
            (inside a nested dataset function, an older shuffle op, or a
            pipeline that cannot be serialized).
    """
    graph = _dataset_graph(dataset)
    nodes = {node.name: node for node in graph.node}
    top = [n for n in graph.node if n.op == "ShuffleDatasetV3" and _unseeded(nodes, n)]
    nested = [
        n.op for function in graph.library.function for n in function.node_def
        if "Shuffle" in n.op and _unseeded({m.name: m for m in function.node_def}, n)
    ] + [n.op for n in graph.node if "Shuffle" in n.op and n.op != "ShuffleDatasetV3"
         and len(n.input) >= 4 and _unseeded(nodes, n)]
    if nested:
        raise UnseededShuffleError("inside a nested dataset function or an older shuffle op")
    if not top:
        return dataset
    seed = int(draw_seed())
    for number, shuffle in enumerate(top):
        seed_node, seed2_node = (nodes[n.split(":")[0]] for n in shuffle.input[2:4])
        seed_node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(np.int64(seed)))
        seed2_node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(np.int64(number + 1)))
        generator = nodes[shuffle.input[4].split(":")[0]]
        for handle in generator.attr["value"].tensor.resource_handle_val:
            handle.name = f"kd_agreed_shuffle_{uuid.uuid4().hex}"
    try:
        variant = tf.raw_ops.DatasetFromGraph(graph_def=graph.SerializeToString())
    except (tf.errors.OpError, ValueError) as error:
        raise UnseededShuffleError(f"the pipeline cannot be rebuilt ({error})") from error
    return tf.data.experimental.from_variant(variant, dataset.element_spec)


def static_batch_size(dataset: tf.data.Dataset) -> int:
    """The batch size of a batched pipeline, or -1 (tf.distribute's helper)."""
    from tensorflow.python.data.experimental.ops import distribute

    return int(distribute.compute_batch_size(dataset))


def shard_by_file(dataset: tf.data.Dataset, num_shards: int, index: int,
                  num_replicas: int) -> tf.data.Dataset:
    """TensorFlow's file-based auto-sharding (`_AutoShardDataset`), as
    `experimental_distribute_dataset` applies it, for our own input path."""
    from tensorflow.python.data.experimental.ops import distribute

    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.FILE
    return distribute._AutoShardDataset(
        dataset.with_options(options), num_shards, index, num_replicas
    )


# -- tensor parallel -----------------------------------------------------------------
# `strategy="tensor_parallel"` replaces the whole variables of a built Dense /
# Embedding by per-device shards. Keras has no public way to take a variable
# away from a built layer or to add one after its build. Verified on Keras
# 3.15.1 / TensorFlow 2.21.0.

# The attributes behind `Dense.kernel` / `Dense.bias` / `Embedding.embeddings`
# (keras/src/layers/core/dense.py, embedding.py), in the order of the keys
# ("0", "1") their `save_own_variables` writes.
_WHOLE_VARIABLE_ATTRIBUTES = {"Dense": ("_kernel", "bias"), "Embedding": ("_embeddings",)}


@contextlib.contextmanager
def variables_made_at_once() -> Iterator[None]:
    """Variables created inside exist at once, where `tf.device` says, even
    within Keras's `StatelessScope` (fit's symbolic build, keras
    backend/tensorflow/core.py `compute_output_spec`): there Keras defers
    creating them to the scope's exit, outside any device scope, so a
    shard made for device 1 would land on device 0."""
    from keras.src.backend.common import global_state

    scope = global_state.get_global_attribute("stateless_scope")
    global_state.set_global_attribute("stateless_scope", None)
    try:
        yield
    finally:
        global_state.set_global_attribute("stateless_scope", scope)


def whole_layer_variables(layer) -> list:
    """The variables a plain built Dense (kernel, then bias if any) or
    Embedding (embeddings) saves, in its file order."""
    names = _WHOLE_VARIABLE_ATTRIBUTES[type(layer).__name__]
    return [v for v in (getattr(layer, n, None) for n in names) if v is not None]


def drop_whole_layer_variables(layer) -> None:
    """Makes a built Dense / Embedding forget its whole variables.

    What `Layer.__delattr__` does for a variable attribute: Keras's tracker
    forgets it (`_untrack_variable`) and TensorFlow's AutoTrackable drops
    its dependency, so nothing keeps the whole variable alive; but not the
    `gc.collect()` Keras then runs, which costs ~0.2 s per variable in a
    process holding many objects (and a split layer drops two). `bias` is
    then None, as with `use_bias=False`.
    """
    for name in _WHOLE_VARIABLE_ATTRIBUTES[type(layer).__name__]:
        variable = getattr(layer, name, None)
        if variable is not None:
            layer._untrack_variable(variable)
            super(keras.layers.Layer, layer).__delattr__(name)
    if type(layer).__name__ == "Dense":
        layer.bias = None


@contextlib.contextmanager
def layer_state_unlocked(layer) -> Iterator[None]:
    """Lets `layer.add_weight` run on a built layer.

    Keras locks a layer's variable tracker (`layer._tracker`) after `build`;
    the shard variables are added to the built layer, then it is locked
    again.
    """
    tracker = layer._tracker
    was_locked = tracker.locked
    tracker.unlock()
    try:
        yield
    finally:
        if was_locked:
            tracker.lock()


def optimizer_slot_prefix(variable) -> str:
    """How the name of an optimizer slot made for `variable` starts.

    Keras names a slot `f"{variable.path.replace('/', '_')}_{slot}"`
    (`BaseOptimizer.add_variable_from_reference`, Keras 3.15.1; no public
    map from a variable to its slots, each optimizer keeps its own lists).
    The tensor-parallel optimizer files gather a split weight's slots by it.
    """
    return variable.path.replace("/", "_") + "_"


def wrap_backend_draw_seed(wrapper) -> None:
    """Routes the TensorFlow backend's seed draws through
    `wrapper(keras_draw_seed, seed)` (see `keras_distrib.replica_seeds`).

    Every random op of the backend (`keras/src/backend/tensorflow/random.py`
    and `image.py`) turns its `seed` argument into a seed tensor with
    `draw_seed`, imported by name into those modules; no public hook sees
    the seed between the generator and the op.
    """
    from keras.src.backend.tensorflow import image as tf_image
    from keras.src.backend.tensorflow import random as tf_random

    def wrapped(keras_draw_seed):
        @functools.wraps(keras_draw_seed)
        def draw_seed(seed):
            return wrapper(keras_draw_seed, seed)
        return draw_seed

    for module in (tf_random, tf_image):
        module.draw_seed = wrapped(module.draw_seed)
