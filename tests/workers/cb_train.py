"""A worker of the callback tests (run through `keras-distrib launch -n 2`).

Three trainings in one job, on the multi_worker strategy:

A. rank 1 changes its weights before `fit`; `BroadcastInitialWeights` must
   undo that; a callback writes a rank-dependent value into the epoch logs
   ahead of `MetricAverage`; warmup, throughput and the consistency check
   run along, and Keras's TensorBoard profiling batch 2, whose logs the
   throughput monitor shares (--out/tb).
B. rank 1 sets a weight to NaN after step 2: the check at step 2 must stop
   both ranks.
N. Keras's TerminateOnNaN; rank 1 sets its output bias to NaN after step 2, so
   only rank 1's loss of step 3 is NaN (rank 0's forward pass still had
   finite weights): both ranks must stop quietly after step 3.
C. rank 1 nudges a weight after step 3: the check at step 4 must stop both
   ranks, naming replica 1. This one is re-raised, so the job fails.

Each rank writes rank{R}.json to --out before re-raising.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

import keras_distrib as kd  # noqa: E402
from keras_distrib import callbacks as kdc  # noqa: E402
from helpers import build, make_data  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Directory for results.")
flags.DEFINE_string("strategy", "multi_worker", "multi_worker or horovod.")

BATCH, EPOCHS = 32, 2


class RankValue(keras.callbacks.Callback):
    """Writes a value that differs per rank into the epoch logs."""

    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def on_epoch_end(self, epoch, logs=None):
        logs["rank_value"] = 10.0 * self.rank + epoch
        logs["note"] = f"from rank {self.rank}"  # not a number: left alone


class Record(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.start_weights = None
        self.epoch_logs = []
        self.batch_lr = []

    def on_train_begin(self, logs=None):
        self.start_weights = [w.tolist() for w in self.model.get_weights()]

    def on_train_batch_end(self, batch, logs=None):
        self.batch_lr.append(logs["lr"])

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_logs.append(dict(logs))


class CountBatches(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


class OnRank(keras.callbacks.Callback):
    """Runs `action(model)` on one rank after one batch."""

    def __init__(self, rank, at_batch, action):
        super().__init__()
        self.rank, self.at_batch, self.action = rank, at_batch, action

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.at_batch and self.model.strategy.rank == self.rank:
            self.action(self.model)


def nan_weight(model):
    v = model.trainable_variables[0]
    value = v.numpy()
    value[0, 0] = np.nan
    v.assign(value)


def nan_output_bias(model):
    v = model.trainable_variables[-1]
    v.assign(np.full(v.shape, np.nan, "float32"))


def nudge_weight(model):
    v = model.trainable_variables[0]
    v.assign(v.numpy() + 1e-3)


def main(argv):
    del argv
    strategy = kd.strategies.get(FLAGS.strategy)
    rank = strategy.rank
    x, y = make_data(n=128)
    result = {"rank": rank, "world_size": strategy.world_size}

    # A: broadcast, averaging, warmup, throughput; a clean consistency check.
    model = build("functional", strategy)
    result["rank0_initial"] = [w.tolist() for w in model.get_weights()]
    if rank == 1:
        for v in model.trainable_variables:
            v.assign(v.numpy() + 1.0)
    record = Record()
    warmup = kdc.LearningRateWarmup(warmup_epochs=1, verbose=1)
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=[
            # First: it sees the epoch logs before RankValue's text, which no
            # summary takes.
            keras.callbacks.TensorBoard(os.path.join(FLAGS.out, "tb"), profile_batch=2),
            RankValue(rank),
            kdc.MetricAverage(),
            kdc.BroadcastInitialWeights(),
            warmup,
            kdc.ThroughputMonitor(
                BATCH, single_worker_throughput=1000.0, log_dir=os.path.join(FLAGS.out, "tb")
            ),
            kdc.ReplicaConsistencyCheck(every_n_steps=2),
            record,
        ],
    )
    result.update(
        history=history.history,
        epoch_logs=record.epoch_logs,
        start_weights=record.start_weights,
        final_weights=[w.tolist() for w in model.get_weights()],
        lr_history=warmup.lr_history,
        batch_lr=record.batch_lr,
        final_lr=float(np.asarray(model.optimizer.learning_rate)),
    )

    # B: NaN weights on rank 1 only.
    try:
        build("functional", strategy).fit(
            x,
            y,
            batch_size=BATCH,
            epochs=EPOCHS,
            shuffle=False,
            verbose=0,
            callbacks=[OnRank(1, 1, nan_weight), kdc.ReplicaConsistencyCheck(every_n_steps=2)],
        )
    except kdc.ReplicaDivergenceError as e:
        result["nan_error"] = str(e)

    # N: TerminateOnNaN, a NaN loss on rank 1 only.
    batches = CountBatches()
    history = build("functional", strategy).fit(
        x,
        y,
        batch_size=BATCH,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=[OnRank(1, 1, nan_output_bias), keras.callbacks.TerminateOnNaN(), batches],
    )
    result["terminate_on_nan"] = {
        "batches": len(batches.losses),
        "finite": [bool(np.isfinite(v)) for v in batches.losses],
        "epochs": len(history.epoch),
    }

    # C: drift on rank 1 only; the error ends the job.
    try:
        build("functional", strategy).fit(
            x,
            y,
            batch_size=BATCH,
            epochs=EPOCHS,
            shuffle=False,
            verbose=0,
            callbacks=[OnRank(1, 2, nudge_weight), kdc.ReplicaConsistencyCheck(every_n_steps=2)],
        )
    except kdc.ReplicaDivergenceError as e:
        result["drift_error"] = str(e)
        with open(os.path.join(FLAGS.out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        strategy.sync_sum([np.float64(1)])  # both files exist before anyone exits
        raise
    with open(os.path.join(FLAGS.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    flags.mark_flag_as_required("out")
    app.run(main)
