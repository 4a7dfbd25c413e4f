"""Distribution strategies, by name or as objects.

Example:

```python
from keras_distrib import strategies
print(strategies.available())
strategy = strategies.get("mirrored", cross_device_ops="reduction_to_one_device")
```
"""

from keras_distrib.strategies.base import Strategy
from keras_distrib.strategies.mirrored import Mirrored
from keras_distrib.strategies.multi_worker import MultiWorker
from keras_distrib.strategies.registry import available, get, register
from keras_distrib.strategies.single import SingleDevice

__all__ = ["Strategy", "Mirrored", "MultiWorker", "SingleDevice", "available", "get", "register"]
