"""The shared base of strategies whose engine is a `tf.distribute.Strategy`.

Variables are created under the engine's scope (mirrored, or kept on a
central device), each step runs on every local replica through
`strategy.run`, and the collectives are TensorFlow's, through the engine
(the transport `keras_distrib.collectives.tf_collectives`).
Keras itself never sees the engine: `DistributedModel` hides it, because
Keras 3's own tf.distribute paths fail for multi-worker engines
(keras-team/keras#20585).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any, Callable, Optional

import numpy as np
import tensorflow as tf

from keras_distrib import _compat
from keras_distrib import replica_seeds
from keras_distrib.collectives import registry as transports
from keras_distrib.input import data as data_lib
from keras_distrib.strategies import synced_metrics
from keras_distrib.strategies.base import Capabilities, Strategy
from keras_distrib.strategies.lockstep import Lockstep
from keras_distrib.topology import Topology

# Engine -> a weak reference to the keras_distrib strategy built on it (see
# `entered`). Both sides weak: the strategy holds its engine, so a strong
# value would keep every engine, and its strategy, alive for good.
_OWNERS: "weakref.WeakKeyDictionary[tf.distribute.Strategy, weakref.ref]" = (
    weakref.WeakKeyDictionary()
)


def owner_of(engine: tf.distribute.Strategy) -> Optional["TFDistributeStrategy"]:
    """The keras_distrib strategy built on `engine`, if any."""
    owner = _OWNERS.get(engine)
    return owner() if owner is not None else None


def entered() -> Optional["TFDistributeStrategy"]:
    """The keras_distrib strategy whose `scope()` the caller is in, if any."""
    if not tf.distribute.has_strategy():
        return None
    return owner_of(tf.distribute.get_strategy())


# Keras's losses stay per-replica means inside our engines' steps (they
# reduce gradients themselves); under a user's own tf.distribute strategy,
# Keras's division stays. Installed here, where the engines are defined: a
# step runs in one only after this module is imported.
_compat.unscaled_losses_where(lambda: entered() is not None)


class TFDistributeStrategy(Lockstep, Strategy):
    """A strategy running on a `tf.distribute.Strategy` (`tf_strategy`).

    Subclasses build the engine and call `super().__init__(engine, ...)`
    with this process's place among the processes.

    Args:
        tf_strategy: the engine.
        num_processes: processes in the job (each reads its own data shard).
        process_index: this process's index (its rank).
        local_rank: its index among the processes on its host.
        **collective_options: options of its transport
            (`keras_distrib.collectives.tf_collectives.TFCollectives`).
    """

    # Keras accumulates inside a `tf.cond`, where a tf.distribute replica
    # cannot `merge_call` ("`merge_call` called while defining a new graph
    # or a tf.function"; keras-team/keras#20582): `compile` refuses it.
    # Per-batch logs within one process are exact for free (metric variables
    # sum over local replicas when read); across processes each would cost a
    # collective per metric and step, so multi-process engines declare
    # `exact_batch_logs=False` and report the process's own values.
    capabilities = Capabilities(keras_gradient_accumulation=False)

    def __init__(
        self,
        tf_strategy: tf.distribute.Strategy,
        num_processes: int = 1,
        process_index: int = 0,
        local_rank: int = 0,
        **collective_options: Any,
    ):
        self._tf_strategy = tf_strategy
        _OWNERS[tf_strategy] = weakref.ref(self)
        self._topology = Topology.data_parallel(
            tf_strategy.extended.worker_devices,
            num_processes=num_processes,
            process_index=process_index,
            local_rank=local_rank,
        )
        if self._topology.num_replicas != tf_strategy.num_replicas_in_sync:
            raise ValueError(
                f"{type(self).__name__}: {tf_strategy.num_replicas_in_sync} replicas in sync "
                f"but {num_processes} process(es) x {len(self.devices)} local device(s); every "
                "process must have the same number of devices."
            )
        self.transport = transports.create(
            "tensorflow",
            engine=tf_strategy,
            first_local_replica=self._topology.first_local_replica,
            **collective_options,
        )

    @property
    def topology(self) -> Topology:
        return self._topology

    @property
    def tf_strategy(self) -> tf.distribute.Strategy:
        """The `tf.distribute.Strategy` that places variables and runs steps."""
        return self._tf_strategy

    # -- placement ----------------------------------------------------------------

    @contextlib.contextmanager
    def scope(self):
        """The engine's scope, whose variables plain Keras code can use as
        it uses a plain variable: `int(layer.counter)`, and a plain
        `keras.Model` sharing layers with ours trains them
        (`_compat.make_plain_usable`)."""
        with self._tf_strategy.scope(), tf.variable_creator_scope(_compat.plain_usable_creator):
            yield

    def holds(self, variable: Any) -> bool:
        value = getattr(variable, "value", variable)
        return _compat.variable_strategy(value) is self._tf_strategy

    def place(self, model) -> list:
        moved = super().place(model)
        # Those built in the engine's own scope (tf.distribute code builds
        # inside `with strategy.scope():`) were made without `scope()`'s
        # creator.
        for variable in model.variables:
            _compat.make_plain_usable(variable)
        return moved

    # -- the step -------------------------------------------------------------------

    def run(self, replica_fn: Callable, batch: Any):
        # A generator's None (an optional input) reaches here as an empty
        # Optional, which Keras's step function turns back into None; the
        # split must see it as None too.
        shards = data_lib.split_batch(_compat.absent_as_none(batch), self.num_local_replicas)
        first = self.first_local_replica

        def value_fn(ctx):
            return shards[ctx.replica_id_in_sync_group - first]

        def seeded_fn(shard):
            index = tf.distribute.get_replica_context().replica_id_in_sync_group
            with (
                replica_seeds.as_replica(index),
                _warnings_shown(tf.get_static_value(index) in (None, first)),
            ):
                return replica_fn(shard)

        per_replica = self._tf_strategy.experimental_distribute_values_from_function(value_fn)
        return self._tf_strategy.run(seeded_fn, args=(per_replica,))

    def replica_index(self):
        return tf.distribute.get_replica_context().replica_id_in_sync_group

    def step_logs(self, model, outputs: Any) -> Any:
        if not any(
            isinstance(v, tf.distribute.DistributedValues) for v in tf.nest.flatten(outputs)
        ):
            return outputs
        # Inside the scope: reading metric variables and reducing other
        # values (a custom train_step's own keys) both need it.
        with self.scope():
            if not self.capabilities.exact_batch_logs:
                return self._local_mean(outputs)
            if isinstance(outputs, dict):
                # Metric variables sum across replicas when read here, so
                # these are exact global values, not a mean of replica values.
                metrics = model.get_metrics_result()
                return {
                    k: metrics[k] if k in metrics else self._reduce_mean(v)
                    for k, v in outputs.items()
                }
            return self._reduce_mean(outputs)

    def read_metrics(self, model, read):
        """Outside the step, every metric variable's value across replicas
        from one batched reduction (`synced_metrics`); inside it, as
        TensorFlow reads them."""
        if not _between_steps():
            return super().read_metrics(model, read)
        self.settle(model)
        return self.metric_results(synced_metrics.read(self._tf_strategy, model, read))

    def reset_metrics(self, model, reset):
        """Keras's reset without reading each variable back
        (`synced_metrics.reset`)."""
        if not _between_steps():
            return super().reset_metrics(model, reset)
        synced_metrics.reset(model, reset)

    def _reduce_mean(self, per_replica: Any) -> Any:
        return tf.nest.map_structure(
            lambda v: self._tf_strategy.reduce("MEAN", v, axis=None), per_replica
        )

    def _local_mean(self, per_replica: Any) -> Any:
        def mean(value):
            parts = self._tf_strategy.experimental_local_results(value)
            return tf.add_n(list(parts)) / len(parts) if len(parts) > 1 else parts[0]

        return tf.nest.map_structure(mean, per_replica)

    # -- between steps -------------------------------------------------------------------

    def local_replica_values(self, variable: Any) -> list[np.ndarray]:
        return [np.asarray(v) for v in self.local_replica_variables(variable)]

    def local_replica_variables(self, variable: Any) -> list:
        value = getattr(variable, "value", variable)
        return list(self._tf_strategy.experimental_local_results(value))


def _between_steps() -> bool:
    """Eager and outside any replica's step (Keras's reads and resets at an
    epoch's ends and around evaluate)."""
    return tf.executing_eagerly() and (
        tf.distribute.in_cross_replica_context() or not tf.distribute.has_strategy()
    )


@contextlib.contextmanager
def _warnings_shown(shown: bool):
    """Python warnings of the step (Keras's input-structure warning, a
    user's layer's) shown once, by the first local replica: every replica
    runs the step's Python, which plain Keras runs once. TensorFlow runs
    the replicas' threads one at a time (`mirrored_run`), so the filter set
    for a replica is not in force while another runs alongside."""
    if shown:
        yield
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
