"""tf.distribute variables: ShardedVariable, the strategy a variable was
made under, and distributed variables that plain Keras code can use.
Verified on TensorFlow 2.21.0."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import tensorflow as tf

_DISTRIBUTE = "tensorflow.python.distribute"

# Private names the shims below use (checked at import, see `versions`).
PRIVATE = (
    # sharded_variable_class, convert_sharded_variables_to_numpy
    "tensorflow:__internal__.distribute.ShardedVariable",
    # plain_usable_creator, make_plain_usable
    f"{_DISTRIBUTE}.values:DistributedVariable._update",
    f"{_DISTRIBUTE}.values:DistributedVariable._get_replica",
    f"{_DISTRIBUTE}.values:DistributedVariable._get_on_device_or_primary",
    f"{_DISTRIBUTE}.distribute_lib:get_update_replica_id",
    f"{_DISTRIBUTE}.distribute_lib:UpdateContext",
    "keras.src.backend.common.variables:Variable._value",
    # variable_strategy
    f"{_DISTRIBUTE}.values:DistributedVariable._distribute_strategy",
    f"{_DISTRIBUTE}.ps_values:AggregatingVariable._distribute_strategy",
    "tensorflow.python.ops.resource_variable_ops:BaseResourceVariable._distribute_strategy",
)


def sharded_variable_class() -> type[Any]:
    """TensorFlow's `ShardedVariable` (what `ParameterServerStrategy` with a
    `variable_partitioner` creates for a variable split over several ps).

    Exported only as `tf.__internal__.distribute.ShardedVariable`; needed to
    recognise one and to build a sharded optimizer slot from its parts.
    """
    return tf.__internal__.distribute.ShardedVariable


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


def variable_strategy(variable: Any) -> Any:
    """The tf.distribute strategy TensorFlow variable `variable` was made
    under (`_distribute_strategy`), or None. Distributed, aggregating and
    resource variables all keep it; only the first two have the public
    `distribute_strategy`."""
    return getattr(variable, "_distribute_strategy", None)


def plain_usable_creator(next_creator, **kwargs):
    """A variable creator (`tf.variable_creator_scope`) whose distributed
    variables plain Keras code can use (`make_plain_usable`)."""
    variable = next_creator(**kwargs)
    make_plain_usable(variable)
    return variable


def make_plain_usable(variable: Any) -> None:
    """Lets code outside the strategy use tf.distribute variable `variable`
    (or the one under Keras variable `variable`) as a plain `tf.Variable`:
    read as a Python number, and updated by a plain Keras model's optimizer.

    - `int()`, `float()`, `complex()`. Keras's `int(variable)` is
      `int(variable.value)`, and users (and Keras's own BackupAndRestore
      tests) read a counter a layer keeps as `int(layer.counter.value)`.
      Under a strategy `value` is a `MirroredVariable` (or
      `SyncOnReadVariable`), which TensorFlow 2.21 gives none of them (its
      `ResourceVariable` and `AggregatingVariable` have them): "int()
      argument must be ... not 'MirroredVariable'". They read the value as
      `numpy()` does: outside a replica, a mirrored variable's (every copy
      holds it) or a sync-on-read variable's aggregate.
    - Updates inside another strategy's `extended.update`. A plain
      `keras.Model` sharing layers with a `DistributedModel` trains them
      outside any strategy, and Keras's optimizer makes each update inside
      the default strategy's `extended.update`
      (`TFOptimizer._distributed_tf_update_step`), which marks the update
      with the variable itself instead of a replica index (TensorFlow's own
      TODO in `_DefaultDistributionExtended._update_non_slot`); a mirrored
      variable took it for one: "tuple indices must be integers or slices,
      not MirroredVariable". Marked so, the update is made as one from
      outside any strategy is: through the variable's own strategy, the
      same value to every copy.

    The variable's class becomes a subclass of its own that adds these.
    Only the variables our strategies make (or take over) change:
    TensorFlow's classes, and variables a user makes with them elsewhere,
    stay as they are. Does nothing for any other variable.
    """
    import keras
    from tensorflow.python.distribute import values

    if isinstance(variable, keras.Variable):
        variable = variable._value  # not `.value`: no initializer run, no autocast
    cls: type = type(variable)
    if isinstance(variable, values.DistributedVariable) and not getattr(
        cls, "_kd_plain_usable", False
    ):
        variable.__class__ = _plain_usable(cls)


@functools.lru_cache(maxsize=None)
def _plain_usable(cls: type) -> type:
    """`cls` with `make_plain_usable`'s additions; same name, module and
    layout (no new slot), so reprs, checks by name and the instance's
    memory stay the class's own."""
    from tensorflow.python.distribute import distribute_lib

    # As ResourceVariable's (tensorflow/python/ops/resource_variable_ops.py).
    def __int__(self):
        return int(self.numpy())

    def __float__(self):
        return float(self.numpy())

    def __complex__(self):
        return complex(self.numpy())

    # The replica an update is for is an index into the copies; another
    # strategy's `extended.update` marks its updates with something else.
    def _update(self, update_fn, value, **kwargs):
        if _is_replica(distribute_lib.get_update_replica_id()):
            return cls._update(self, update_fn, value, **kwargs)
        with distribute_lib.UpdateContext(None):  # every copy, as from outside
            return cls._update(self, update_fn, value, **kwargs)

    def _get_replica(self, replica_id):
        if _is_replica(replica_id):
            return cls._get_replica(self, replica_id)
        with distribute_lib.UpdateContext(None):  # a read: any copy holds the value
            return self._get_on_device_or_primary()

    return type(
        cls.__name__,
        (cls,),
        {
            "__slots__": (),
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "_kd_plain_usable": True,
            "__int__": __int__,
            "__float__": __float__,
            "__complex__": __complex__,
            "_update": _update,
            "_get_replica": _get_replica,
        },
    )


def _is_replica(replica_id) -> bool:
    """Whether an update context's mark names a replica (or there is none)."""
    return replica_id is None or isinstance(replica_id, (int, np.integer))
