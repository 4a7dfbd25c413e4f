"""keras_distrib: distributed training for Keras 3 by one constructor argument.

Example:

```python
import keras, keras_distrib as kd

inputs = keras.Input((8,))
outputs = keras.layers.Dense(1)(inputs)
model = kd.DistributedModel(inputs, outputs, strategy="mirrored")
model.compile(optimizer="sgd", loss="mse")
model.fit(x, y, batch_size=64)
```

Importing the package is cheap: TensorFlow is imported when a public name
that needs it is first used, or when the process imports Keras (so that
`keras.models.load_model` finds our model classes), and the launcher never
imports it. The one exception is a process that is part of a configured cluster (`TF_CONFIG`,
Slurm): there the import starts TensorFlow's collective runtime at once,
before anything else can start TensorFlow, so that `strategy="multi_worker"`
(or `"auto"`) works as a plain string wherever the model is built (see
`keras_distrib.collectives.runtime`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from importlib.machinery import ModuleSpec
from typing import TYPE_CHECKING, Any, Optional, Sequence

if TYPE_CHECKING:  # the public names as type checkers see them (at run time: `__getattr__`)
    from keras_distrib import callbacks as callbacks
    from keras_distrib import optimizers as optimizers
    from keras_distrib import strategies as strategies
    from keras_distrib.model import DistributedModel as DistributedModel
    from keras_distrib.model import FunctionalDistributedModel as FunctionalDistributedModel

__version__ = "0.1.0"

# Public name -> module that defines it (imported on first use).
_LAZY = {
    "DistributedModel": "keras_distrib.model",
    "FunctionalDistributedModel": "keras_distrib.model",
    "callbacks": "keras_distrib.callbacks",
    "optimizers": "keras_distrib.optimizers",
    "strategies": "keras_distrib.strategies",
}

__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'keras_distrib' has no attribute {name!r}")
    module = importlib.import_module(module_name)
    value = module if module_name.endswith("." + name) else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _RegisterAfterKeras(importlib.abc.MetaPathFinder):
    """Imports `keras_distrib.model` right after Keras is imported.

    The model classes register themselves with Keras's serialization (for
    `keras.models.load_model`) when their module is imported; doing that at
    `import keras_distrib` would import TensorFlow in every process, the
    launcher's included. Processes that import Keras get them registered,
    whatever the order of the two imports.
    """

    def find_spec(
        self,
        fullname: str,
        path: Optional[Sequence[str]] = None,
        target: Optional[types.ModuleType] = None,
    ) -> Optional[ModuleSpec]:
        if fullname != "keras":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module: types.ModuleType) -> None:
            exec_module(module)
            sys.modules[fullname] = module
            importlib.import_module("keras_distrib.model")

        setattr(spec.loader, "exec_module", exec_then_register)  # this spec's loader only
        return spec


def _start() -> None:
    from keras_distrib.cluster import gpu_share
    from keras_distrib.collectives import flight_recorder, runtime

    if not runtime.is_launcher():
        gpu_share.assign()  # this process's own GPUs, before TensorFlow touches them
    flight_recorder.install()  # a launched rank answers the launcher from now on
    runtime.bootstrap()  # first: it may import Keras, which must not recurse here
    if "keras" in sys.modules:
        importlib.import_module("keras_distrib.model")
    else:
        sys.meta_path.insert(0, _RegisterAfterKeras())


_start()
