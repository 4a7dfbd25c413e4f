"""A `tf.distribute.Strategy` where keras_distrib takes a strategy: ours that runs the same.

Code written for tf.distribute passes a strategy object (`strategy=
tf.distribute.MirroredStrategy([...])`), or builds and loads models inside
its scope. Both mean "train on that strategy", so `keras_distrib.strategies.get`
adopts the object (and `strategy="auto"` inside a scope adopts the scope's):

| tf.distribute | keras_distrib |
|---|---|
| `OneDeviceStrategy(d)` | `"single"` on `d` |
| `MirroredStrategy(devices, cross_device_ops)` | `"mirrored"` on that very object |
| `experimental.CentralStorageStrategy(...)` | `"central_storage"` on that very object |
| `MultiWorkerMirroredStrategy(communication_options=o)` | `"multi_worker"` as `o` says |
| `ParameterServerStrategy(resolver, variable_partitioner)` | `"parameter_server"`, that split |
| `TPUStrategy(resolver)` | `"tpu"` |

In-process engines are wrapped as they are, so variables the user made in
their scope are already where the strategy keeps them. The cluster
engines are one per process in keras_distrib (TensorFlow runs one
collective runtime per process, which `import keras_distrib` starts from
the cluster's description), so their options carry over to ours.
"""

from __future__ import annotations

import weakref

import tensorflow as tf

from keras_distrib import _compat
from keras_distrib import devices as devices_lib
from keras_distrib.strategies import tf_distribute
from keras_distrib.strategies.base import Strategy

# Engines mapped to a strategy that does not wrap them (OneDevice, cluster
# engines) -> that strategy.
_MAPPED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def adopt(engine: tf.distribute.Strategy) -> Strategy:
    """The keras_distrib strategy that trains as `engine` would.

    Raises:
        TypeError: a tf.distribute strategy keras_distrib has no counterpart
            for.
    """
    from keras_distrib.strategies import registry

    owner = tf_distribute.owner_of(engine)
    if owner is not None:
        return owner
    if engine in _MAPPED:
        return _MAPPED[engine]
    if isinstance(engine, tf.distribute.experimental.CentralStorageStrategy):
        from keras_distrib.strategies.central_storage import CentralStorage

        return CentralStorage.around(engine)
    if isinstance(engine, tf.distribute.MirroredStrategy):
        from keras_distrib.strategies.mirrored import Mirrored

        return Mirrored.around(engine)
    with _compat.outside_strategy_scopes():  # ours are made outside the user's scope
        strategy = _counterpart(engine, registry)
    _MAPPED[engine] = strategy
    return strategy


def _counterpart(engine, registry):
    """Our strategy for an engine we do not wrap, with its options."""
    if isinstance(engine, tf.distribute.OneDeviceStrategy):
        device = devices_lib.short(engine.extended.worker_devices[0])
        return registry.create("single", device=device)
    if isinstance(engine, tf.distribute.MultiWorkerMirroredStrategy):
        return registry.create("multi_worker", **_multi_worker_options(engine, registry))
    if isinstance(
        engine,
        (tf.distribute.ParameterServerStrategy, tf.distribute.experimental.ParameterServerStrategy),
    ):
        partitioner = _compat.variable_partitioner(engine)
        return registry.create(
            "parameter_server", **({"variable_partitioner": partitioner} if partitioner else {})
        )
    if isinstance(engine, (tf.distribute.TPUStrategy, tf.distribute.experimental.TPUStrategy)):
        return registry.create("tpu")
    raise TypeError(
        f"keras_distrib has no strategy for {type(engine).__name__}; pass one of "
        f"{sorted(registry.available())} by name (or a keras_distrib Strategy object)."
    )


def _multi_worker_options(engine, registry) -> dict:
    """The engine's communication options as `multi_worker` takes them, or
    none when `multi_worker` already runs in this process (one per process)."""
    if registry.started("multi_worker"):
        return {}
    options = _compat.communication_options(engine)
    implementation = {"RING": "ring", "NCCL": "nccl"}.get(
        getattr(options.implementation, "name", ""), "auto"
    )
    found = {"implementation": implementation}
    if options.timeout_seconds:
        found["collective_timeout"] = options.timeout_seconds
    return found
