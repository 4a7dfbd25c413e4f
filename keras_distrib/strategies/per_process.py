"""The shared base of one-replica-per-process strategies (single, Horovod).

Each process holds one plain (unreplicated) copy of every variable on one
device and trains on its rows of each global batch; processes combine
gradients with their transport's collectives inside the step. With one
process the step is exactly Keras's own (no collective, whole-step XLA
when `jit_compile=True`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import numpy as np
import tensorflow as tf

from keras_distrib import devices as devices_lib
from keras_distrib import replica_seeds
from keras_distrib.collectives import registry as transports
from keras_distrib.collectives.transport import Transport
from keras_distrib.strategies.base import Strategy
from keras_distrib.strategies.lockstep import Lockstep
from keras_distrib.topology import Topology


class PerProcessStrategy(Lockstep, Strategy):
    """One replica per process, on `device` (None: TensorFlow's choice).

    Subclasses with several processes pass the transport their processes
    reduce with.

    Args:
        device: where variables and computation go (None: TensorFlow chooses).
        rank: this process's index; `size`: number of processes;
        local_rank: index among the processes on this host.
        transport: the collectives between the processes (default: those of
            one process, the identity).
    """

    def __init__(
        self,
        device: Optional[str] = None,
        rank: int = 0,
        size: int = 1,
        local_rank: int = 0,
        transport: Optional[Transport] = None,
    ):
        self._device = device
        self.transport = transport if transport is not None else transports.create("one_process")
        self._topology = Topology.data_parallel(
            (device or devices_lib.local_devices()[0],),
            num_processes=size,
            process_index=rank,
            local_rank=local_rank,
        )

    @property
    def topology(self) -> Topology:
        return self._topology

    # -- placement ----------------------------------------------------------------

    @contextlib.contextmanager
    def scope(self):
        if self._device is None:
            yield
        else:
            with tf.device(self._device):
                yield

    def holds(self, variable: Any) -> bool:
        return devices_lib.holds_plain(variable, self._device)

    # -- execution ----------------------------------------------------------------

    def make_step_function(self, model, step, keras_make_function: Callable):
        if self.world_size > 1:
            return super().make_step_function(model, step, keras_make_function)
        model.compile_replicas_separately(False)
        return keras_make_function(lambda data: self.run(step.fn, data))

    def make_predict_function(self, model, step, keras_make_predict_function: Callable):
        if self.world_size > 1:
            return super().make_predict_function(model, step, keras_make_predict_function)
        return keras_make_predict_function()

    def run(self, replica_fn: Callable, batch: Any):
        # One replica per process: this process's rows are the replica's.
        with self.scope(), replica_seeds.as_replica(self.rank):
            return replica_fn(batch)

    def step_logs(self, model, outputs: Any) -> Any:
        return outputs  # one replica: already plain values

    # -- between steps ---------------------------------------------------------------

    def local_replica_values(self, variable: Any) -> list[np.ndarray]:
        return [np.asarray(variable)]
