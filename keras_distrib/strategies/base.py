"""The interface every strategy implements, whatever its kind of parallelism.

`DistributedModel` holds the per-replica math (forward pass, loss,
gradients) and asks its strategy for everything else:

* topology: `topology` (replicas, devices, processes, data shards, role);
* placement: `scope()`, `holds(variable)`, and `whole_weights` /
  `set_whole_weights` behind `model.get_weights()` / `set_weights()`;
* input: `distribute_fit_input` / `distribute_input` turn what the user
  passed to `fit` / `evaluate` / `predict` into what each step consumes;
* execution: `make_step_function` / `make_predict_function` turn the
  per-replica step into the function Keras's loop calls (run in lockstep on
  every replica, or scheduled elsewhere), and `run` runs a per-replica
  function on this process's replicas;
* gradients: `gradients` (from the replica's tape) and their reduction,
  `all_reduce`, `reduce_gradients`, `reduce_scatter`, `all_gather` and
  `gather_sparse_gradients` (replica context), on the strategy's
  `transport` (`keras_distrib.collectives.transport`);
* results: `read_metrics` / `metric_results` (what metric values every
  process reports) and `reset_metrics`; `read_summed_metrics` for exact
  values across processes;
* cross-process helpers for callbacks, eager and between steps:
  `sync_sum`, `sync_gather`, `broadcast_variables`, `agree_on_seed`,
  `local_replica_values`, `broadcast_derived_state` (with
  `read_summed_metrics`, inherited from `cross_process.CrossProcessHelpers`),
  and `sync_initial_state(model)`.

Every collective, in the step and between steps, runs on the strategy's
`transport`, which its constructor picks by name from
`keras_distrib.collectives.registry`. Two shared bases implement most of
the rest: `tf_distribute.TFDistributeStrategy` for engines built on a
`tf.distribute.Strategy`, and `per_process.PerProcessStrategy` for one
replica per process (single, Horovod). A concrete strategy is one file: a
subclass that sets `name` (which registers it, see `registry`),
`description`, optional `aliases`, and builds its engine and transport in
`__init__`.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
from typing import Any, Callable, ClassVar, Optional, Sequence, Union

import numpy as np
import tensorflow as tf

from keras_distrib.arithmetic import gradients as gradients_lib
from keras_distrib.arithmetic.compression import Compression
from keras_distrib.collectives.transport import Transport
from keras_distrib.input import data as data_lib
from keras_distrib.input import sharding
from keras_distrib.input.fit_input import FitInput
from keras_distrib.strategies import names
from keras_distrib.strategies.cross_process import CrossProcessHelpers
from keras_distrib.strategies.replica_memory import ReplicaMemory, variable_bytes
from keras_distrib.topology import Topology


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a strategy's engine can and cannot do, declared in one place
    (`Strategy.capabilities`), for the registry, the model and callbacks.

    Attributes:
        one_per_process: TensorFlow allows one such engine per process (one
            collective runtime): the registry hands every later request the
            first instance.
        asynchronous: workers apply steps on their own schedule (parameter
            servers): per-batch callbacks then run ahead of the steps
            actually applied.
        keras_gradient_accumulation: a Keras optimizer's own
            `gradient_accumulation_steps` works in this strategy's step.
        exact_batch_logs: per-batch logs are global values (epoch logs and
            evaluate results always are).
    """

    one_per_process: bool = False
    asynchronous: bool = False
    keras_gradient_accumulation: bool = True
    exact_batch_logs: bool = True


@dataclasses.dataclass(frozen=True)
class Step:
    """A step the model hands its strategy to turn into what Keras's loop calls.

    `fn(batch) -> logs` (for `"predict"`: the outputs) is the per-replica
    math. `kind` is `"train"`, `"test"` or `"predict"`. `custom`: the user's
    own `train_step` / `test_step` / `predict_step` (a strategy that runs the
    model's math in its own schedule, like the pipeline's stages, cannot run
    it). `applies`: False for the steps of gradient accumulation
    (`backward_passes_per_step`) that only add to the accumulated
    gradients.
    """

    fn: Callable[..., Any]
    kind: str
    custom: bool = False
    applies: bool = True


class Strategy(CrossProcessHelpers):
    """Base class of all keras_distrib strategies.

    Subclasses that set `name` register themselves under it (and under
    `aliases`), so `keras_distrib.strategies.get(name)` builds them.

    Example:

    ```python
    strategy = keras_distrib.strategies.get("mirrored")
    t = strategy.topology
    print(strategy.name, t.num_replicas, t.num_processes, strategy.is_chief)
    ```
    """

    name: ClassVar[str] = ""
    aliases: ClassVar[tuple[str, ...]] = ()
    description: ClassVar[str] = ""
    capabilities: ClassVar[Capabilities] = Capabilities()
    # "optimizer": each replica keeps the optimizer's slots for its part of
    # every variable (keras_distrib.arithmetic.optimizer_sharding; set by the
    # data-parallel strategies that take the option).
    optimizer_sharding: Optional[str] = None
    # The collectives between its replicas and processes, which every
    # collective of the strategy runs on: set by its constructor
    # (`keras_distrib.collectives.registry.create`).
    transport: Transport

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("name"):
            names.register(cls)

    # -- topology -------------------------------------------------------------

    @property
    @abc.abstractmethod
    def topology(self) -> Topology:
        """Replicas, devices, processes and data shards, seen from here."""

    @property
    def num_replicas(self) -> int:
        """Replicas that train in sync, across all processes."""
        return self.topology.num_replicas

    @property
    def num_local_replicas(self) -> int:
        """Replicas that run in this process."""
        return self.topology.num_local_replicas

    @property
    def first_local_replica(self) -> int:
        """Global index of this process's first replica."""
        return self.topology.first_local_replica

    @property
    def devices(self) -> Sequence[str]:
        """The devices this process computes on."""
        return self.topology.devices

    @property
    def rank(self) -> int:
        """Index of this process among `world_size` processes."""
        return self.topology.process_index

    @property
    def world_size(self) -> int:
        """Number of processes taking part in training."""
        return self.topology.num_processes

    @property
    def local_rank(self) -> int:
        """Index of this process among the processes on its host."""
        return self.topology.local_rank

    @property
    def is_chief(self) -> bool:
        """Whether this process writes checkpoints and logs."""
        return self.topology.is_chief

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} name={self.name!r} "
            f"num_replicas={self.num_replicas} rank={self.rank} "
            f"world_size={self.world_size}>"
        )

    # -- placement --------------------------------------------------------------

    @abc.abstractmethod
    def scope(self) -> contextlib.AbstractContextManager[Any]:
        """Context under which variables are created for this strategy."""

    @abc.abstractmethod
    def holds(self, variable: Any) -> bool:
        """Whether `variable` was created under this strategy's scope."""

    def place(self, model: Any) -> list[Any]:
        """Makes `model`'s variables this strategy's, in place, and returns
        the variables it moved.

        `DistributedModel` calls it when it is made from a graph built
        outside the strategy, when a subclassed one has built its layers
        (its first call), and before `fit`, `evaluate` and `predict` build
        (sub-models or layers made outside, as a GAN's). Each variable not
        held yet is made again, with its value, under `scope()`
        (`keras_distrib.placement`): no layer is re-created from its
        config. Strategies that place layers one by one, or split them,
        override it.
        """
        from keras_distrib import placement  # not at import: it loads Keras

        moving = placement.unheld(self, model.variables, model)
        placement.remake(moving, self, model)
        return moving

    def whole_weights(self, model: Any) -> list[np.ndarray]:
        """`model.get_weights()`: its weights as a plain Keras model of the
        same architecture lists them (Keras's own list by default; strategies
        that split variables gather each one's parts)."""
        import keras  # not at import, as in place()

        weights: list[np.ndarray] = keras.layers.Layer.get_weights(model)
        return weights

    def set_whole_weights(self, model: Any, weights: Sequence[Any]) -> None:
        """`model.set_weights(weights)`, from such a list."""
        import keras

        keras.layers.Layer.set_weights(model, weights)

    def describe(self, model: Any) -> ReplicaMemory:
        """Bytes each replica holds for `model` (every replica a whole copy
        of the weights and gradients, or with `optimizer_sharding="gradients"`
        the reduced gradients of its parts; strategies that split the model
        override it)."""
        optimizer = getattr(model, "optimizer", None)
        parts = self.num_replicas if self.optimizer_sharding == "gradients" else 1
        return ReplicaMemory(
            weights=variable_bytes(model.weights),
            gradients=variable_bytes(model.trainable_weights, parts),
            optimizer=variable_bytes(optimizer.variables if optimizer is not None else []),
        )

    # -- input ------------------------------------------------------------------

    def check_batch_size(self, batch_size: Optional[int], name: str = "batch_size") -> None:
        """Rejects a global batch that is not a positive integer (`name`:
        the argument, for the message). Any other global batch trains:
        replicas share it as evenly as it divides (`data.replica_sizes`)."""
        data_lib.check_batch_size(batch_size, name)

    def distribute_fit_input(self, fit: FitInput) -> FitInput:
        """What `fit` hands Keras instead of the user's input.

        By default each process that reads input gets its data shard
        (`keras_distrib.input.sharding`: every sample of an epoch seen once,
        `batch_size` global). A resumable fit (`fit.resumable`: a
        `BackupAndRestore` is in the callbacks) takes that pipeline even with
        one process, so that epoch `e` has the same order after a restart
        (`fit.start`). Numpy arrays and tensors take it too: Keras's own
        array input builds and tears down a tf.data iterator every epoch,
        and the teardown of one that a compiled step has read waits on
        tf.data's autotuning thread, while this pipeline keeps one iterator
        for the whole run.
        """
        if (
            self.topology.num_data_shards == 1
            and not fit.resumable
            and not sharding.is_array_like(fit.x)
        ):
            return fit
        return sharding.fit_input(self, fit)

    def distribute_input(
        self, x: Any, y: Any = None, sample_weight: Any = None, batch_size: Optional[int] = None
    ) -> tuple[Any, Any, Any, Optional[int]]:
        """`(x, y, sample_weight, batch_size)` for `evaluate` / `predict`."""
        if self.topology.num_data_shards == 1:
            return x, y, sample_weight, batch_size
        x, batch_size = sharding.shard(self, x, y, sample_weight, batch_size)
        return x, None, None, batch_size

    def check_callbacks(self, callbacks: Sequence[Any]) -> None:
        """Raises a one-line error for a callback `fit` cannot serve under this
        strategy (default: every callback works)."""

    # -- execution ----------------------------------------------------------------

    @abc.abstractmethod
    def make_step_function(
        self, model: Any, step: Step, keras_make_function: Callable[..., Any]
    ) -> Callable[..., Any]:
        """The train/test function Keras's loop calls, from a per-replica step.

        Args:
            model: the `DistributedModel`.
            step: the per-replica step (`Step`: its function, kind, and
                whether it is the user's own).
            keras_make_function: Keras's own maker (`Trainer._make_function`):
                turns a function of one batch into a function of an iterator,
                with `steps_per_execution` and `jit_compile` handled.
        """

    @abc.abstractmethod
    def make_predict_function(
        self, model: Any, step: Step, keras_make_predict_function: Callable[..., Any]
    ) -> Callable[..., Any]:
        """The predict function Keras's loop calls (all rows, in order), from
        the per-replica `step` (kind `"predict"`); `keras_make_predict_function()`
        is Keras's own, which runs `model.predict_step` as one replica."""

    @abc.abstractmethod
    def run(self, replica_fn: Callable[..., Any], batch: Any) -> Any:
        """Runs `replica_fn(shard)` on this process's replicas.

        `batch` is this process's part of the global batch; it is split over
        the local replicas by the rule of `keras_distrib.input.data.split_batch`.
        """

    # -- gradients and their reduction (replica context) -----------------------------

    def gradients(self, tape: tf.GradientTape, target: Any, variables: Sequence[Any]) -> list[Any]:
        """The gradients of `target` for `variables` (the model's trainable
        weights) from the replica's `tape`: one per variable, shaped like
        it, `None` where `target` does not reach it. By default
        `tape.gradient`; a strategy whose variables the tape sees in parts
        puts each one's together (parameter servers)."""
        gradients: list[Any] = tape.gradient(target, list(variables))
        return gradients

    def all_reduce(self, values: Sequence[tf.Tensor], op: str = "sum") -> list[tf.Tensor]:
        """Sums (or averages) a list of tensors over all replicas."""
        return self.transport.all_reduce(values, op)

    def all_gather(self, value: tf.Tensor) -> tf.Tensor:
        """Every replica's `value` (one shape on all), stacked in replica
        order: `[num_replicas, *value.shape]` (replica context)."""
        return self.transport.all_gather(value)

    def reduce_scatter(self, tables: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """Row `replica_index()` of the sum over replicas of each of `tables`
        (`[num_replicas, k]` each, shapes the same on all), replica context."""
        return self.transport.reduce_scatter(tables)

    def reduce_gradients(
        self,
        gradients: list[tf.Tensor],
        num_samples: Any,
        compression: Optional[Compression] = None,
    ) -> list[tf.Tensor]:
        """Global mean gradient from each replica's gradient of its loss *sum*.

        The replica's sample count travels in the same all-reduce as the
        gradients, and the sums are divided by the global count
        (`Transport.mean_by_count`): exactly the gradient of the mean loss
        over the global batch, whatever the split, with no process needing
        to know the global batch size. `compression` (see
        `keras_distrib.optimizers`) casts gradients for the wire.
        """
        return self.transport.mean_by_count(gradients, num_samples, compression)

    def gather_sparse_gradients(
        self, gradients: Sequence[tf.IndexedSlices], num_samples: Any
    ) -> list[tf.IndexedSlices]:
        """Sparse gradients of every replica, as one device holds them for
        the global batch (`keras_distrib.arithmetic.gradients.gather_sparse`:
        only the batch's rows travel, in two all-reduces)."""
        return gradients_lib.gather_sparse(
            self.all_reduce, self.num_replicas, self.replica_index(), gradients, num_samples
        )

    def replica_index(self) -> Union[int, tf.Tensor]:
        """This replica's global index, in a replica's step (one replica per
        process by default: the rank)."""
        return self.rank

    def reduce_applied_gradients(
        self, grads_and_vars: list[tuple[Any, Any]]
    ) -> list[tuple[Any, Any]]:
        """The gradients an optimizer applies when a custom `train_step` (or
        a GAN's, with several optimizers) calls `apply_gradients` itself,
        from the replica's own `(gradient, variable)` pairs: each gradient
        averaged over all replicas, in one all-reduce (`None` stays).

        The replica's gradient is of its loss on its rows (Keras's losses
        are not divided by the replica count under our engines, see
        `_compat.unscaled_losses_where`); for equal shards the mean over
        replicas is one device's gradient of the global batch, and every
        replica applies the same update.
        """
        present = [i for i, (g, _) in enumerate(grads_and_vars) if g is not None]
        if not present:
            return list(grads_and_vars)
        reduced = self.all_reduce(
            [tf.convert_to_tensor(grads_and_vars[i][0]) for i in present], "mean"
        )
        pairs = list(grads_and_vars)
        for i, g in zip(present, reduced):
            pairs[i] = (g, pairs[i][1])
        return pairs

    # -- results ---------------------------------------------------------------------

    def read_metrics(self, model: Any, read: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """`model`'s metric results as this process reports them; `read()`
        reads them from the metric variables (Keras's `get_metrics_result`).
        By default: `settle`, then `metric_results` of what `read()` gives."""
        self.settle(model)
        return self.metric_results(read())

    def metric_results(self, results: dict[str, Any]) -> dict[str, Any]:
        """Metric values as this process should report them (default: as read)."""
        return results

    # `read_summed_metrics` (exact values across processes) is a
    # cross-process helper: `CrossProcessHelpers`.

    def settle(self, model: Any) -> None:
        """Finishes work still running elsewhere and brings its results into
        `model`'s metric variables, before Keras reads them (engines that
        schedule steps asynchronously; others have nothing to do)."""

    def reset_metrics(self, model: Any, reset: Callable[[], None]) -> None:
        """Resets `model`'s metrics (a new epoch, or evaluate); `reset()` is
        Keras's `reset_metrics`. By default: `reset()`."""
        reset()

    def failure(self, error: Exception) -> Optional[Exception]:
        """A clearer error to raise from `fit`, `evaluate` or `predict`
        instead of `error` (a lost task, named), or None to raise `error` as
        it is."""
        return None

    # -- set-up (the cross-process helpers: `CrossProcessHelpers`) -------------------------

    def adopt_optimizer(self, optimizer: Any) -> None:
        """Called by `compile` with the optimizer (made under `scope()`) before
        Keras sees it; strategies that must change how it applies updates
        do it here."""

    def without_xla(self) -> Optional[str]:
        """Why XLA cannot compile this strategy's step, or None when it can.

        The model then runs the step without XLA: silently for
        `jit_compile="auto"` (as Keras does under tf.distribute), with a
        warning naming this reason for `jit_compile=True` (in `compile` or
        set on the model).
        """
        return None

    def sync_initial_state(self, model: Any) -> None:
        """Makes every replica start from the same weights (after builds).

        Engines that broadcast initial values when variables are created
        (tf.distribute) need nothing here; others override it.
        """
