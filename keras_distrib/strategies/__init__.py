"""Distribution strategies, by name or as objects.

Every module of this package is imported here, so each strategy class
registers itself (see `registry`): adding a strategy is adding one file.

Example:

```python
from keras_distrib import strategies
print(strategies.available())
strategy = strategies.get("mirrored", cross_device_ops="reduction_to_one_device")
```
"""

import importlib
import pkgutil

from keras_distrib.strategies.base import Strategy
from keras_distrib.strategies.registry import available, get, register

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

from keras_distrib.strategies.mirrored import Mirrored  # noqa: E402
from keras_distrib.strategies.multi_worker import MultiWorker  # noqa: E402
from keras_distrib.strategies.single import SingleDevice  # noqa: E402

__all__ = ["Strategy", "Mirrored", "MultiWorker", "SingleDevice", "available", "get", "register"]
