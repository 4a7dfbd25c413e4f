"""Callbacks for distributed training; each works under every strategy.

The model's strategy comes from `model.strategy` (`DistributedModel`); a
plain single-replica `keras.Model` gets a one-process strategy, under which
the cross-process parts do nothing.

Callbacks marked *collective* talk to the other processes: every process
must use them, in the same order.

* `BackupAndRestore` (collective): crash-safe backups every epoch or N
  steps; `fit` resumes exactly where the last one stands (also written when
  the workers stop on a SIGTERM). `DistributedModel.fit` runs it in place of
  Keras's own `keras.callbacks.BackupAndRestore` (`keras_backup`).
* `BroadcastInitialWeights` (collective): start from one rank's state.
* `MetricAverage` (collective): logs averaged over processes; put it first.
* `LearningRateWarmup`: gradual warmup to `lr * num_replicas` (Goyal et al.).
* `LearningRateScaling`: the linear scaling rule, without warmup.
* `ThroughputMonitor` (collective): samples/sec, step time, scaling efficiency.
* `ReplicaConsistencyCheck` (collective): non-finite loss or weights, drift
  between replicas; raises `ReplicaDivergenceError` on every rank.
* `ScaledSchedule`: the schedule wrapper the learning-rate callbacks install.

Example:

```python
import keras_distrib as kd

model.fit(x, y, batch_size=256, epochs=10, callbacks=[
    kd.callbacks.MetricAverage(),
    kd.callbacks.BroadcastInitialWeights(),
    kd.callbacks.LearningRateWarmup(warmup_epochs=2),
    kd.callbacks.ReplicaConsistencyCheck(every_n_steps=100),
])
```
"""

# Keras first: importing it imports keras_distrib.model (see
# keras_distrib._RegisterAfterKeras), which uses these callbacks' modules;
# imported from one of them instead, it would find that one half made.
import keras  # noqa: F401

from keras_distrib.callbacks.backup_and_restore import BackupAndRestore
from keras_distrib.callbacks.broadcast_initial_weights import BroadcastInitialWeights
from keras_distrib.callbacks.learning_rate_scaling import LearningRateScaling
from keras_distrib.callbacks.learning_rate_warmup import LearningRateWarmup
from keras_distrib.callbacks.metric_average import MetricAverage
from keras_distrib.callbacks.replica_consistency_check import (
    ReplicaConsistencyCheck,
    ReplicaDivergenceError,
)
from keras_distrib.callbacks.scaled_schedule import ScaledSchedule
from keras_distrib.callbacks.throughput_monitor import ThroughputMonitor

__all__ = [
    "BackupAndRestore",
    "BroadcastInitialWeights",
    "LearningRateScaling",
    "LearningRateWarmup",
    "MetricAverage",
    "ReplicaConsistencyCheck",
    "ReplicaDivergenceError",
    "ScaledSchedule",
    "ThroughputMonitor",
]
