"""How gradients travel in the step's all-reduce: `Compression` casts them
to a smaller float type for the wire and back after.

`COMPRESSIONS` holds the three a `DistributedOptimizer` takes by name
(`keras_distrib.optimizers`); the strategies' `reduce_gradients` applies
the optimizer's.
"""

from __future__ import annotations

from typing import Optional

import tensorflow as tf


class Compression:
    """Casts gradients to a smaller float type for the all-reduce."""

    def __init__(self, name: str, dtype: Optional[tf.DType]):
        self.name, self.dtype = name, dtype

    def compress(self, tensor: tf.Tensor) -> tf.Tensor:
        if self.dtype is None or not tensor.dtype.is_floating:
            return tensor
        return tf.cast(tensor, self.dtype)

    def decompress(self, tensor: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
        return tensor if tensor.dtype == dtype else tf.cast(tensor, dtype)

    def __repr__(self) -> str:
        return f"Compression({self.name!r})"


COMPRESSIONS = {
    "none": Compression("none", None),
    "fp16": Compression("fp16", tf.float16),
    "bf16": Compression("bf16", tf.bfloat16),
}
