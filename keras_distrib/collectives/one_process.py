"""The transport of one replica in one process: every collective is the identity.

`single`, the chief of `parameter_server` (one replica, the steps run on
the workers) and `pipeline` / `tensor_parallel` without a cluster run on
it.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from keras_distrib.collectives.transport import Transport


class OneProcess(Transport):
    """One replica, one process: nothing to reduce, gather or send."""

    name = "one_process"

    def all_reduce(self, values: Sequence[Any], op: str = "sum") -> list[Any]:
        return list(values)

    def all_gather(self, value: Any) -> Any:
        return tf.convert_to_tensor(value)[None]

    def reduce_scatter(self, tables: Sequence[Any]) -> list[Any]:
        return [tf.convert_to_tensor(t)[0] for t in tables]

    def gather_rows(self, per_replica: Any) -> Any:
        return per_replica

    def sum_over_processes(self, flat: np.ndarray) -> np.ndarray:
        return flat
