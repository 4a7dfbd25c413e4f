"""Distribution strategies, by name or as objects.

Example:

```python
from keras_distrib import strategies
print(strategies.available())
strategy = strategies.get("mirrored", cross_device_ops="reduction_to_one_device")
```

The names below are imported when first used, and a built-in strategy's
module when the strategy is first asked for (`registry.BUILTIN`): importing
this package imports neither TensorFlow nor any strategy, so
`python -m keras_distrib.strategies.parameter_server.task_server` and the
launcher pay for none of them.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names below as type checkers see them (at run time: `__getattr__`)
    from keras_distrib.strategies.replica_memory import ReplicaMemory as ReplicaMemory
    from keras_distrib.strategies.base import Strategy as Strategy
    from keras_distrib.strategies.mirrored import Mirrored as Mirrored
    from keras_distrib.strategies.multi_worker import MultiWorker as MultiWorker
    from keras_distrib.strategies.registry import available as available
    from keras_distrib.strategies.registry import register as register
    from keras_distrib.strategies.resolve import get as get
    from keras_distrib.strategies.single import SingleDevice as SingleDevice

# Public name -> module that defines it.
_LAZY = {
    "Strategy": "keras_distrib.strategies.base",
    "ReplicaMemory": "keras_distrib.strategies.replica_memory",
    "available": "keras_distrib.strategies.registry",
    "register": "keras_distrib.strategies.registry",
    "get": "keras_distrib.strategies.resolve",
    "Mirrored": "keras_distrib.strategies.mirrored",
    "MultiWorker": "keras_distrib.strategies.multi_worker",
    "SingleDevice": "keras_distrib.strategies.single",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
