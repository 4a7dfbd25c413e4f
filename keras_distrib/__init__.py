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
that needs it is first used (the launcher never imports it). The one
exception is a process that is part of a configured cluster (`TF_CONFIG`,
Slurm): there the import starts TensorFlow's collective runtime at once,
before anything else can start TensorFlow, so that `strategy="multi_worker"`
(or `"auto"`) works as a plain string wherever the model is built (see
`keras_distrib.runtime`).
"""

from __future__ import annotations

import importlib
from typing import Any

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
