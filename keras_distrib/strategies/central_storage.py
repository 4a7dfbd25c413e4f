"""`"central_storage"`: variables on one device, compute on all local devices."""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import keras
import tensorflow as tf

from keras_distrib import _compat
from keras_distrib import devices as devices_lib
from keras_distrib.strategies.tf_distribute import TFDistributeStrategy


class CentralStorage(TFDistributeStrategy):
    """Keeps one copy of every variable on one device; replicas compute in sync.

    Built on `tf.distribute.experimental.CentralStorageStrategy`: each step
    runs on every compute device (all local GPUs, or all visible CPUs
    including logical ones), gradients are summed onto the parameter device
    and the update is applied there once. Useful when the devices are few
    and memory is short (one copy of the weights) or when there is no fast
    link between the devices; with a fast link `"mirrored"` is faster.

    Args:
        compute_devices: Devices the replicas run on (default: all local
            devices).
        parameter_device: Where the variables live (default: the CPU,
            `"/cpu:0"`).

    Example:

    ```python
    model = keras_distrib.DistributedModel(inputs, outputs, strategy="central_storage")
    strategy = keras_distrib.strategies.get(
        "central_storage", compute_devices=["/gpu:0", "/gpu:1"], parameter_device="/gpu:0")
    ```
    """

    name = "central_storage"
    aliases = ("central",)
    description = "Variables on one device (CPU by default), compute on all local devices."

    def __init__(
        self,
        compute_devices: Optional[Sequence[str]] = None,
        parameter_device: Optional[str] = None,
    ):
        compute = (
            devices_lib.local_devices()
            if compute_devices is None
            else devices_lib.check_devices(compute_devices, "compute_devices")
        )
        parameters = devices_lib.check_device(parameter_device or "/cpu:0", "parameter_device")
        super().__init__(
            tf.distribute.experimental.CentralStorageStrategy(
                compute_devices=compute, parameter_device=parameters
            )
        )
        self.parameter_device = parameters
        self._compute_devices = compute  # short names, as parameter_device (devices_lib)

    @classmethod
    def around(cls, engine) -> "CentralStorage":
        """The strategy on a `tf.distribute.experimental.CentralStorageStrategy`
        the user made (its devices, see `strategies.from_tf`)."""
        strategy = cls.__new__(cls)
        TFDistributeStrategy.__init__(strategy, engine)
        (parameters,) = engine.extended.parameter_devices
        strategy.parameter_device = devices_lib.short(parameters)
        strategy._compute_devices = [devices_lib.short(d) for d in engine.extended.worker_devices]
        return strategy

    @contextlib.contextmanager
    def scope(self):
        """TensorFlow's scope, where Keras's state variables can be assigned
        by the replicas.

        Here every variable is one `AggregatingVariable`, which a replica may
        assign only through an aggregation; Keras makes its state variables
        with none (BatchNormalization's moving statistics, the seed state of
        Dropout, GaussianNoise and every random layer), and their first
        training step failed ("You must specify an aggregation method to
        update a AggregatingVariable in Replica Context"). Made here, they
        get one: float state the replicas' mean (BatchNormalization's
        moving statistics: the mean of the replicas' updates, what
        `mirrored` keeps), other state the first replica's (a seed state
        advances once per step, as on one device).
        """
        with self.tf_strategy.scope(), tf.variable_creator_scope(_aggregated_state):
            yield

    def holds(self, variable) -> bool:
        """Made under the engine, and by `scope()` if it is state (made in
        the engine's own scope, as a user's `tf.distribute` code does, a
        state variable has no aggregation and is made again here)."""
        if not super().holds(variable):
            return False
        value = getattr(variable, "value", variable)
        return value.trainable or value.aggregation != tf.VariableAggregation.NONE

    def without_xla(self) -> Optional[str]:
        """XLA cannot read a variable kept on another device than the one it
        computes on (TensorFlow's XLA known issue "tf.Variable on a different
        device": "Trying to access resource ... located in device CPU:0 from
        device CPU:1"), which is what every replica here does unless its one
        compute device holds the variables. Keras's "auto" turned XLA on for
        us on GPU machines, where this failed the first step."""
        if self._compute_devices == [self.parameter_device]:
            return None
        return (
            f"XLA cannot read the variables kept on {self.parameter_device} from the "
            "replicas' devices (TensorFlow's XLA known issue 'tf.Variable on a different "
            "device'); use strategy='mirrored' for XLA"
        )

    def adopt_optimizer(self, optimizer) -> None:
        """Makes the optimizer apply its update once, in the cross-replica context.

        Here every variable is one `AggregatingVariable` on the parameter
        device, which a replica may assign only through an aggregation, and
        Keras's optimizers assign some of theirs in the replica context with
        none: Nadam's `u_product`, Muon's, the EMA copies (`use_ema=True`),
        a LossScaleOptimizer's scale and counter (the last inside a
        `tf.cond`, where a replica cannot hand over to the cross-replica
        context at all). All failed with TensorFlow's "You must specify an
        aggregation method to update a AggregatingVariable in Replica
        Context". So `apply`, called in a replica context, sums the
        gradients across replicas as Keras does (not again when our step
        has), then runs the whole update once from the cross-replica
        context (`merge_call`), as Keras 2's optimizers did under
        tf.distribute: every assignment there goes straight to the one copy.
        """
        keras_apply = optimizer.apply

        def apply(grads, trainable_variables=None):
            context = tf.distribute.get_replica_context()
            if (
                context is None
                or trainable_variables is None
                or context.strategy is not self.tf_strategy
            ):
                return keras_apply(grads, trainable_variables)
            variables = list(trainable_variables)
            summed = [
                g
                for g, _ in _compat.sum_gradients_across_replicas(
                    optimizer, list(zip(grads, variables))
                )
            ]

            def update_once(engine, per_replica):
                # Every replica holds the same sum: take the first one's.
                first = [
                    None if g is None else engine.experimental_local_results(g)[0]
                    for g in per_replica
                ]
                with _compat.updates_in_cross_replica_context(engine):
                    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
                        _compat.apply_loss_scaled(optimizer, first, variables)
                    else:
                        keras_apply(first, variables)

            context.merge_call(update_once, args=(summed,))

        optimizer.apply = apply

    def sync_initial_state(self, model) -> None:
        # Metric variables are single aggregating copies here: their
        # per-replica increments must be added, not their assigned values
        # (see _compat.add_through_tensorflow).
        for variable in model.metrics_variables:
            _compat.add_through_tensorflow(variable)
        # Replicas switch at every such update, mid-step: each keeps its own
        # added losses (activity regularizers, add_loss).
        _compat.added_losses_per_thread(model)


def _aggregated_state(next_creator, **kwargs):
    """A variable creator giving state variables without an aggregation one
    (see `CentralStorage.scope`); trainable variables, updated once by the
    optimizer from the cross-replica context, keep theirs."""
    if not kwargs.get("trainable", True) and kwargs.get("aggregation") in (
        None,
        tf.VariableAggregation.NONE,
    ):
        dtype = kwargs.get("dtype")
        floating = dtype is not None and tf.as_dtype(dtype).is_floating
        kwargs["aggregation"] = (
            tf.VariableAggregation.MEAN if floating else tf.VariableAggregation.ONLY_FIRST_REPLICA
        )
    return next_creator(**kwargs)
