"""A small training job that hurts itself once, for the fault-injection suite.

Run by `keras-distrib launch -n N [--max-restarts K]`
(tests/distributed/test_faults.py). It trains an MLP with Adam (or
`--optimizer sgd`) and a step-dependent learning rate on shuffled arrays,
under `--strategy` (`auto`), backing up every
`--save_freq` steps with `keras_distrib.callbacks.BackupAndRestore`. On
the launcher's first attempt (`KERAS_DISTRIB_RESTART` unset or 0; the
first `--fault_attempts` attempts), rank `--fault_rank` sends itself
`--fault` (`kill`: SIGKILL, `stop`: SIGSTOP, `term`: SIGTERM) right after
global step `--fault_step` of that attempt. With
`--hold_after_step N` every rank waits after global step N until it is
sent SIGTERM (the preemption test's signal then lands mid-training,
however loaded the machine; `--hold_on_attempt` on one attempt only, saying
so in `--out/held-rank<r>`); with `--pause_after_step N` every rank says
so in `--out/paused-rank<r>` after global step N and waits for `--out/go`
(writing `--out/sigterm-rank<r>` if it is sent SIGTERM meanwhile)
(a network-fault test cuts a link meanwhile, tests/distributed/
test_network_faults.py). Every rank that finishes writes its final
weights and step count to `--out/rank<r>.npz`; every attempt appends a
line to `--out/attempts-rank<r>.txt` (attempt number, pid, start time, the
attempt's shared-memory directory `KERAS_DISTRIB_SHM_DIR`, `-` on another
host than the launcher's) and the faulting rank writes `--out/fault.txt`
(pid, time), so the test can count restarts, time them and check that no
process or file is left.

Seeded (`keras.utils.set_random_seed`) only so that an uninterrupted run
of this script can serve as the reference the restarted run must equal,
and so that the test can run the same math in its own process
(`fault_job.traced`, which builds the model as `main` does).
"""

import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if os.environ.get("FAULTS_LOGICAL_CPUS"):
    # Before `import keras_distrib`, which starts the collective runtime (and
    # with it TensorFlow's devices) under the launcher: the model-parallel
    # strategies split each worker's model over these devices.
    import tensorflow as tf

    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration()] * int(os.environ["FAULTS_LOGICAL_CPUS"]),
    )

import keras  # noqa: E402
import keras_distrib as kd  # noqa: E402
from keras_distrib import preemption  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

import fault_job  # noqa: E402  (the job's data and optimizers, shared with the tests)

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Directory for results.")
flags.DEFINE_string("backup", None, "BackupAndRestore directory.")
flags.DEFINE_enum("fault", "none", ["none", "kill", "stop", "term"], "What to inject.")
flags.DEFINE_integer("fault_rank", 1, "The rank that hurts itself.")
flags.DEFINE_integer("fault_step", 5, "After this global step (1-based).")
flags.DEFINE_integer(
    "fault_attempts",
    1,
    "The fault strikes on the launcher's first this "
    "many attempts (KERAS_DISTRIB_RESTART below it).",
)
flags.DEFINE_integer("epochs", 3, "Epochs.")
flags.DEFINE_enum("optimizer", "adam", ["adam", "sgd"], "Adam or SGD, on a decaying learning rate.")
flags.DEFINE_string(
    "strategy",
    "auto",
    "The strategy (with FAULTS_LOGICAL_CPUS=2 in the "
    "environment, a model-parallel one splits each worker's model).",
)
flags.DEFINE_string(
    "implementation",
    None,
    "multi_worker's implementation, with --strategy auto, or its workers' "
    "under pipeline and tensor_parallel (default: its own, which across "
    "hosts measures the engines).",
)
flags.DEFINE_integer("save_freq", 4, "Backup every this many steps.")
flags.DEFINE_integer(
    "pause_after_step",
    0,
    "After this global step (1-based; 0: never) every rank writes "
    "--out/paused-rank<r> and waits until --out/go exists (at most 120 s), "
    "on the first attempt only: a network-fault test cuts a link there.",
)
flags.DEFINE_integer(
    "hold_after_step",
    0,
    "After this global step (1-based; 0: never) every rank waits until it "
    "is asked to stop (SIGTERM, as keras_distrib.preemption records it), "
    "at most 120 s: a preemption test's signal then lands mid-training.",
)
flags.DEFINE_bool(
    "step_log",
    False,
    "Append `attempt begin|step count time` to "
    "--out/steps-rank<r>.txt at the start and after every step that "
    "trained (for benchmarks/elastic.py).",
)
flags.DEFINE_integer(
    "hold_on_attempt",
    -1,
    "Hold (--hold_after_step) on this attempt "
    "only, after its --hold_after_step-th step, and say so in "
    "--out/held-rank<r>; -1: on every attempt.",
)


def _workers(across):
    """`workers=across` for a model-parallel strategy, if given."""
    return {"workers": across} if across else {}


SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM}


class _Fault(keras.callbacks.Callback):
    """Sends this process the fault's signal after global step `at`."""

    def __init__(self, signum, at):
        super().__init__()
        self.signum, self.at, self.steps = signum, at, 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if self.steps == self.at:
            with open(os.path.join(FLAGS.out, "fault.txt"), "w") as f:
                f.write(f"{os.getpid()} {time.time()}\n")
            os.kill(os.getpid(), self.signum)


class _PauseUntilGo(keras.callbacks.Callback):
    """After global step `after`, says so and waits for `--out/go`."""

    def __init__(self, after, rank):
        super().__init__()
        self.after, self.rank, self.steps = after, rank, 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if self.steps != self.after:
            return
        open(os.path.join(FLAGS.out, f"paused-rank{self.rank}"), "w").close()
        deadline = time.monotonic() + 120
        told = False
        while not os.path.exists(os.path.join(FLAGS.out, "go")):
            if time.monotonic() > deadline:
                sys.exit(f"rank paused after step {self.after} was never told to go on")
            if preemption.requested() and not told:  # a test waits for this
                open(os.path.join(FLAGS.out, f"sigterm-rank{self.rank}"), "w").close()
                told = True
            time.sleep(0.05)


class _HoldUntilPreempted(keras.callbacks.Callback):
    """After global step `after`, waits for this process's SIGTERM."""

    def __init__(self, after, rank):
        super().__init__()
        self.after, self.rank, self.steps = after, rank, 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if self.steps < self.after:
            return
        open(os.path.join(FLAGS.out, f"held-rank{self.rank}"), "w").close()
        deadline = time.monotonic() + 120
        while not preemption.requested():
            if time.monotonic() > deadline:
                sys.exit(f"rank held after step {self.after} was never sent SIGTERM")
            time.sleep(0.05)


class _StepLog(keras.callbacks.Callback):
    """At the start (`begin`: the step a resume starts from) and after every
    step that trained (`step`: the optimizer's step count then, so the no-op
    steps a resume replays are left out): the attempt, what, the count, the
    time."""

    def __init__(self, attempt, rank):
        super().__init__()
        self.path, self.attempt = os.path.join(FLAGS.out, f"steps-rank{rank}.txt"), attempt
        self.last = None

    def _write(self, what):
        count = int(self.model.optimizer.iterations.numpy())
        if what == "step" and count == self.last:
            return
        self.last = count
        with open(self.path, "a") as f:
            f.write(f"{self.attempt} {what} {count} {time.time()}\n")

    def on_train_begin(self, logs=None):
        self._write("begin")

    def on_train_batch_end(self, batch, logs=None):
        self._write("step")


def main(argv):
    del argv
    # The launcher's attempt, or the run of a requeued Slurm job.
    attempt = int(
        os.environ.get("KERAS_DISTRIB_RESTART") or os.environ.get("SLURM_RESTART_COUNT") or 0
    )
    keras.utils.set_random_seed(fault_job.SEED)
    x, y = fault_job.data()

    strategy = FLAGS.strategy
    # The collectives between workers: multi_worker's, also under a
    # model-parallel strategy (its `workers`).
    across = {"implementation": FLAGS.implementation} if FLAGS.implementation else {}
    if strategy == "pipeline":  # micro-batches that split 30 rows per worker, or 15
        strategy = kd.strategies.get("pipeline", num_micro_batches=3, **_workers(across))
    elif strategy == "tensor_parallel" and across:
        strategy = kd.strategies.get("tensor_parallel", workers=across)
    elif strategy == "auto" and across:
        strategy = kd.strategies.get("multi_worker", **across)
    model = fault_job.build(strategy)
    rank = model.strategy.rank
    with open(os.path.join(FLAGS.out, f"attempts-rank{rank}.txt"), "a") as f:
        # A rank on another host than the launcher gets no shared memory: "-".
        shm_dir = os.environ.get("KERAS_DISTRIB_SHM_DIR", "-")
        f.write(f"{attempt} {os.getpid()} {time.time()} {shm_dir}\n")
    fault_job.compile_job(model, FLAGS.optimizer)
    callbacks = [kd.callbacks.BackupAndRestore(FLAGS.backup, save_freq=FLAGS.save_freq)]
    if FLAGS.pause_after_step and attempt == 0:
        callbacks.append(_PauseUntilGo(FLAGS.pause_after_step, rank))
    if FLAGS.step_log:
        callbacks.append(_StepLog(attempt, rank))
    if FLAGS.hold_after_step and FLAGS.hold_on_attempt in (-1, attempt):
        callbacks.append(_HoldUntilPreempted(FLAGS.hold_after_step, rank))
    if FLAGS.fault != "none" and attempt < FLAGS.fault_attempts and rank == FLAGS.fault_rank:
        callbacks.append(_Fault(SIGNALS[FLAGS.fault], FLAGS.fault_step))
    model.fit(
        x,
        y,
        batch_size=fault_job.BATCH,
        epochs=FLAGS.epochs,
        shuffle=True,
        verbose=0,
        callbacks=callbacks,
    )
    np.savez(
        os.path.join(FLAGS.out, f"rank{rank}.npz"),
        *model.get_weights(),
        iterations=int(model.optimizer.iterations.numpy()),
    )


if __name__ == "__main__":
    flags.mark_flags_as_required(["out", "backup"])
    app.run(main)
