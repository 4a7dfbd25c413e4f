"""Graceful preemption: SIGTERM stops every worker of `fit` at the same step.

Clusters ask a job to leave with SIGTERM (Kubernetes eviction, Slurm
preemption, `keras-distrib launch` shutting down) and kill it a grace
period later. TensorFlow's coordination service installs a SIGTERM handler
of its own that only records the signal, so without ours a worker sent
SIGTERM trains on to the end. Stopping one worker alone would leave the others
waiting in the next collective, so the workers *agree* on when to stop:

1. During `DistributedModel.fit` our handler only records the request
   (`requested()`); outside `fit` SIGTERM terminates the process as usual.
2. Each training step every replica adds its vote (1.0 if its process
   was asked to stop) to the step's gradient all-reduce: no extra
   collective. The reduced vote lands in a variable every worker reads
   after the step (`PreemptionWatch`), so all see it after the same step.
   A custom `train_step` does not carry the vote; then the workers sum
   their flags in one small collective every `CUSTOM_STEP_INTERVAL` steps.
3. All stop after that step (`model.stop_training`; validation is
   skipped), `keras_distrib.callbacks.BackupAndRestore` writes its backup
   there, and `fit` raises `Preempted`, a `SystemExit` with code 75
   (`launch_contract.PREEMPTED`): the process exits with it unless the
   script catches it. Running the script again resumes from the backup;
   `keras-distrib launch --max-restarts N` does that itself.

The handler is installed from the main thread the first time `fit` runs
there and stays (TensorFlow's, which swallows SIGTERM, is not restored).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Optional

import keras
import numpy as np

from keras_distrib.cluster import launch_contract
from keras_distrib.collectives import flight_recorder

EXIT_CODE = launch_contract.PREEMPTED
# Steps between the flag collectives of a custom train_step (see above).
CUSTOM_STEP_INTERVAL = 10

_requested = False
_watching = 0
# The SIGTERM handler ours replaced (called outside fit), or None.
_previous = None
_delegating = False


class Preempted(SystemExit):
    """Raised by `fit` when the workers stopped on a SIGTERM (exit code 75)."""

    def __init__(self, message: str):
        super().__init__(EXIT_CODE)
        self.message = message

    def __str__(self) -> str:
        return self.message


def requested() -> bool:
    """Whether this process was sent SIGTERM during `fit`."""
    return _requested


def local_vote() -> np.float32:
    """This process's vote for the step's all-reduce (runs inside the step)."""
    return np.float32(1.0 if _requested else 0.0)


def reset() -> None:
    """Forgets a recorded request (a new run of `fit` after `Preempted` was caught)."""
    global _requested
    _requested = False


@contextlib.contextmanager
def watching():
    """Inside, SIGTERM is recorded instead of terminating (main thread only)."""
    global _watching
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be installed from the main thread
        return
    _install()
    _watching += 1
    try:
        yield
    finally:
        _watching -= 1


def _install() -> None:
    """Makes `_on_sigterm` the SIGTERM handler, at every `fit`: a library
    that set its own since (Ray's driver does) would otherwise take SIGTERM
    during training. The handler it replaces runs outside `fit`."""
    global _previous
    current = signal.getsignal(signal.SIGTERM)
    if current is not _on_sigterm:
        _previous = current
        signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum, frame) -> None:
    global _requested
    if _watching:
        _requested = True
        return
    # Outside fit: what the replaced handler does (once: one that calls
    # the handler it replaced, ours, must not bounce back), or the default.
    global _delegating
    if callable(_previous) and not _delegating:
        _delegating = True
        try:
            _previous(signum, frame)
        finally:
            _delegating = False
        return
    if _previous == signal.SIG_IGN:
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


class PreemptionWatch(keras.callbacks.Callback):
    """Stops `fit` on every worker after the step where any was asked to stop.

    `DistributedModel`'s train function calls `after_step()` after each of
    its calls (not a batch callback: one would make Keras convert every
    step's logs on the loop's thread, at every step); this callback only
    tracks the epoch. Checkpointing callbacks see `model.stop_training` and
    the stopping point (`stopped_at(model)`) in that step's batch end.

    Args:
        state: the `fit` call's state (`keras_distrib.training.fit_state`):
            where the workers stopped is written to its `preempted_at`.
        vote: the `Vote` the step's all-reduce writes the summed votes to,
            or None when the process is alone (its own flag is the verdict).
            When the traced step did not put the vote in its all-reduce (a
            custom train_step does not), the flags are summed here every
            CUSTOM_STEP_INTERVAL steps.
    """

    def __init__(self, state, vote: Optional["Vote"]):
        super().__init__()
        self._state = state
        self._vote = vote
        self._epoch = self._calls = self._steps = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch, self._calls = epoch, 0

    def after_step(self) -> None:
        self._calls += 1
        self._steps += 1
        per_call = self.model.steps_per_execution
        flight_recorder.record_step(self._epoch, self._calls * per_call, self._steps * per_call)
        if self._agreed_to_stop():
            model = self.model
            model.stop_training = True
            done = self._calls * model.steps_per_execution
            steps = (self.params or {}).get("steps")
            self._state.preempted_at = (self._epoch, min(done, steps or done))

    def _agreed_to_stop(self) -> bool:
        if self._vote is None:
            return _requested
        if self._vote.carried:
            # Every local copy holds the reduced vote: read one (reading a
            # mirrored variable as a whole costs a cross-replica read).
            variable = self._vote.variable
            copies = getattr(variable, "values", None)
            return float((copies[0] if copies else variable).numpy()) > 0
        if self._steps % CUSTOM_STEP_INTERVAL:
            return False
        (total,) = self.model.strategy.sync_sum([np.float64(_requested)])
        return float(total) > 0


class Vote:
    """The variable a step's all-reduce writes the summed stop votes to, and
    whether the traced step carries it (`carried`, set at trace time)."""

    def __init__(self, variable):
        self.variable = variable
        self.carried = False


def stopped_at(model) -> Optional[tuple]:
    """`(epoch, steps done in it)` where the model's running `fit` stopped on
    a SIGTERM, or None (also outside `fit`)."""
    state = getattr(model, "fit_state", None)
    return state.preempted_at if state is not None else None


def announce(stopped: tuple, where: str) -> Preempted:
    """The `Preempted` to raise after a stop at `stopped` (`(epoch, step)`),
    its line printed on stderr."""
    epoch, step = stopped
    message = (
        f"{launch_contract.PREEMPTED_LINE}every worker stopped at epoch {epoch + 1}, "
        f"step {step}{where}; exiting with code {EXIT_CODE}. Run the same command again "
        "to resume."
    )
    print(message, file=sys.stderr, flush=True)
    return Preempted(message)
