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
"""

from keras_distrib import callbacks, optimizers, strategies
from keras_distrib.model import DistributedModel, FunctionalDistributedModel

__version__ = "0.1.0"

__all__ = [
    "DistributedModel",
    "FunctionalDistributedModel",
    "callbacks",
    "optimizers",
    "strategies",
    "__version__",
]
