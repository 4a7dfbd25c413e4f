"""`ThroughputMonitor`: samples per second and scaling efficiency per epoch."""

from __future__ import annotations

import time
from typing import Optional

import keras
import numpy as np
import tensorflow as tf

from keras_distrib.callbacks import _common


class ThroughputMonitor(keras.callbacks.Callback):  # type: ignore[misc]  # Keras has no types
    """Times the training steps and adds throughput to the epoch logs.

    Each training batch is timed from `on_train_batch_begin` to
    `on_train_batch_end` (the step itself, input included, callbacks
    excluded). The first batch of each `fit` call is not counted: it traces
    the step function. At the end of each epoch the logs get:

    * `samples_per_sec`: global samples per second (all processes together),
      counting `global_batch_size` per step (a last partial batch counts
      as full);
    * `samples_per_sec_per_worker`: that divided by the number of processes;
    * `step_time`: the median step time in seconds;
    * `scaling_efficiency`: `samples_per_sec / (world_size *
      single_worker_throughput)`, when `single_worker_throughput` is given;
    * with several processes, `slowest_rank` and
      `slowest_rank_samples_per_sec`: the rank whose own steps ran at the
      lowest rate, and that rate (the straggler to look at).

    Under an asynchronous strategy (`"parameter_server"`) a batch is the
    chief scheduling a step; it waits for the oldest step in flight once
    `lag` are, so in steady state the batches pace at the rate the workers
    apply steps, and the figures are those of the applied steps.

    The numbers are averaged over processes (one collective per epoch), so
    every rank logs the same values; the chief also writes them with
    `tf.summary` to `log_dir` (give it the `TensorBoard` callback's
    `log_dir` to see them beside its runs), with each rank's own rate as
    `throughput/samples_per_sec_rank_R`. Epochs without a timed step add nothing.

    Args:
        global_batch_size: Samples per step over all replicas.
        single_worker_throughput: Samples/second of one process alone, to
            compute `scaling_efficiency` against.
        log_dir: Directory for TensorBoard summaries (chief only).

    Example:

    ```python
    monitor = keras_distrib.callbacks.ThroughputMonitor(
        global_batch_size=256, single_worker_throughput=5200.0, log_dir="logs/throughput")
    history = model.fit(x, y, batch_size=256, epochs=3, callbacks=[monitor])
    print(history.history["scaling_efficiency"])
    ```
    """

    KEYS = ("samples_per_sec", "samples_per_sec_per_worker", "step_time")

    def __init__(
        self,
        global_batch_size: int,
        single_worker_throughput: Optional[float] = None,
        log_dir: Optional[str] = None,
    ):
        super().__init__()
        if not global_batch_size or global_batch_size <= 0:
            raise ValueError(f"global_batch_size={global_batch_size!r} must be > 0.")
        if single_worker_throughput is not None and single_worker_throughput <= 0:
            raise ValueError(f"single_worker_throughput={single_worker_throughput!r} must be > 0.")
        self.global_batch_size = global_batch_size
        self.single_worker_throughput = single_worker_throughput
        self.log_dir = log_dir
        self._writer: Optional[tf.summary.SummaryWriter] = None

    def on_train_begin(self, logs: _common.Logs = None) -> None:
        self._strategy = _common.strategy_of(self)
        self._skip_next = True
        if self.log_dir and self._strategy.is_chief and self._writer is None:
            self._writer = tf.summary.create_file_writer(self.log_dir)

    def on_epoch_begin(self, epoch: int, logs: _common.Logs = None) -> None:
        self._step_times: list[float] = []
        self._busy = 0.0
        self._steps = 0

    def on_train_batch_begin(self, batch: int, logs: _common.Logs = None) -> None:
        self._begin_batch = batch
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch: int, logs: _common.Logs = None) -> None:
        elapsed = time.perf_counter() - self._start
        if self._skip_next:
            self._skip_next = False
            return
        steps = max(batch - self._begin_batch + 1, 1)  # steps_per_execution
        self._busy += elapsed
        self._steps += steps
        self._step_times.extend([elapsed / steps] * steps)

    def on_epoch_end(self, epoch: int, logs: _common.Logs = None) -> None:
        timed = self._steps > 0
        world_size, rank = self._strategy.world_size, self._strategy.rank
        own = self._steps * self.global_batch_size / self._busy if timed else 0.0
        # The means, and each rank's own rate in its slot: one sum for all.
        mine = np.zeros(3 + world_size)
        mine[:3] = [own, float(np.median(self._step_times)) if timed else 0.0, float(timed)]
        mine[3 + rank] = own
        if world_size > 1:
            (mine,) = self._strategy.sync_sum([mine])
        if mine[2] == 0:
            return
        samples_per_sec, step_time = mine[0] / mine[2], mine[1] / mine[2]
        per_rank = mine[3:]
        results = {
            "samples_per_sec": samples_per_sec,
            "samples_per_sec_per_worker": samples_per_sec / world_size,
            "step_time": step_time,
        }
        if world_size > 1 and mine[2] == world_size:  # every rank timed some steps
            slowest = int(np.argmin(per_rank))
            results["slowest_rank"] = slowest
            results["slowest_rank_samples_per_sec"] = per_rank[slowest]
        if self.single_worker_throughput:
            results["scaling_efficiency"] = samples_per_sec / (
                world_size * self.single_worker_throughput
            )
        results = {k: float(v) for k, v in results.items()}
        if logs is not None:
            logs.update(results)
        if self._writer is not None:
            with self._writer.as_default():
                for key, value in sorted(results.items()):
                    tf.summary.scalar(f"throughput/{key}", value, step=epoch)
                if world_size > 1:
                    for r, value in enumerate(per_rank):
                        tf.summary.scalar(f"throughput/samples_per_sec_rank_{r}", value, step=epoch)
            self._writer.flush()

    def on_train_end(self, logs: _common.Logs = None) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
