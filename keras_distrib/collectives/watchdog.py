"""`collective_timeout` for TensorFlow's collectives, with one thread per process.

TensorFlow enforces a collective's `timeout_seconds` with a new thread per
collective that sleeps for the whole timeout, even when the collective is
done in a millisecond (`BaseCollectiveExecutor` schedules the expiry with
`SchedNonBlockingClosureAfter`; tensorflow/tensorflow#62466, "20,000
sleeping threads", closed unfixed; `CommunicationOptions` says so too: "an
overhead of timeout_seconds * num_collectives_per_second more threads").
Measured on TensorFlow 2.21: `multi_worker` on the gRPC ring with a 300 s
timeout gained 2 threads per training step, and a benchmark issuing
collectives faster died at ~16,000 threads with `std::system_error:
Resource temporarily unavailable`. A long training run would too.

So the collectives of the training and predict steps get no TensorFlow
timeout (0: no thread) and this watchdog enforces `collective_timeout` on
them instead: the step arms it just before its collectives start and
disarms it when they are done (`around`, `around_call`: two
`tf.numpy_function`s in the step's graph, so the clock starts when this
worker reaches the collective, as TensorFlow's does). One thread per
process sleeps until the earliest deadline; a collective still running
then makes it abort this process's collectives
(`_compat.abort_collective_ops`), which fails the waiting step with the
watchdog's message instead of hanging.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Callable, Optional, Sequence

import numpy as np
import tensorflow as tf

from keras_distrib import _compat
from keras_distrib.collectives import flight_recorder


class CollectiveWatchdog:
    """Fails collectives still running `timeout` seconds after they were armed.

    Args:
        timeout: seconds (> 0).

    Example:

    ```python
    watchdog = CollectiveWatchdog(300.0)
    reduced = watchdog.around(gradients, all_reduce, "the gradient all-reduce")
    ```
    """

    def __init__(self, timeout: float):
        self.timeout = float(timeout)
        self.fired: Optional[str] = None  # the message, once it aborted the collectives
        # token -> (deadline, what, bytes or None)
        self._armed: dict[int, tuple[float, str, Optional[int]]] = {}
        self._tokens = itertools.count(1)
        self._changed = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        flight_recorder.watch(self)

    def arm(self, what: str, nbytes: Optional[int] = None) -> int:
        """Starts the clock for a collective (`what` names it, `nbytes` its
        size for the flight recorder); returns its token."""
        with self._changed:
            token = next(self._tokens)
            self._armed[token] = (time.monotonic() + self.timeout, what, nbytes)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._watch, daemon=True, name="keras_distrib-collective-watchdog"
                )
                self._thread.start()
            self._changed.notify()
        return token

    def disarm(self, token: int) -> None:
        """The collective of `token` is done."""
        with self._changed:
            self._armed.pop(int(token), None)

    def in_flight(self) -> list[tuple[str, float]]:
        """`(what, seconds since armed)` of each collective armed now."""
        now = time.monotonic()
        with self._changed:
            return [
                (flight_recorder.described(what, nbytes), now - (deadline - self.timeout))
                for deadline, what, nbytes in self._armed.values()
            ]

    def around(
        self, values: Sequence[tf.Tensor], collective: Callable[[list], list], what: str
    ) -> list:
        """`collective(values)`, armed while it runs (eager or in a graph):
        its inputs wait for the arming, its results for the disarming.
        `what` is told with the bytes the values hold (when their shapes
        are known)."""
        token = self._arm_op(what, _bytes_of(values))
        with tf.control_dependencies([token]):
            values = [tf.identity(v) for v in values]
        return self._disarmed_after(token, collective(values))

    def around_call(self, collective: Callable[[], object], what: str):
        """`collective()` (in cross-replica context, e.g. a gather of a
        step's per-replica outputs), armed while it runs: the ops it makes
        wait for the arming (control dependencies), its results for the
        disarming."""
        token = self._arm_op(what)
        with tf.control_dependencies([token]):
            results = collective()
        flat = self._disarmed_after(token, tf.nest.flatten(results))
        return tf.nest.pack_sequence_as(results, flat)

    def _arm_op(self, what: str, nbytes: Optional[int] = None) -> tf.Tensor:
        return tf.numpy_function(
            lambda: np.int64(self.arm(what, nbytes)),
            [],
            tf.int64,
            stateful=True,
            name="kd_watchdog_arm",
        )

    def _disarmed_after(self, token: tf.Tensor, results: list) -> list:
        def disarm(t: np.ndarray) -> np.int64:
            self.disarm(int(t))
            return np.int64(0)

        with tf.control_dependencies(results):
            done = tf.numpy_function(
                disarm, [token], tf.int64, stateful=True, name="kd_watchdog_disarm"
            )
        with tf.control_dependencies([done]):
            return [tf.identity(r) for r in results]

    def _watch(self) -> None:
        with self._changed:
            while True:
                if not self._armed:
                    self._changed.wait()
                    continue
                deadline, what, _ = min(self._armed.values())
                left = deadline - time.monotonic()
                if left > 0:
                    self._changed.wait(left)
                    continue
                self.fired = (
                    f"{what} did not complete within collective_timeout={self.timeout:g}s: a "
                    "worker is stuck, stopped, or runs different code (the workers' output "
                    "says which)"
                )
                break
        flight_recorder.report(f"its collective watchdog fired: {self.fired}")
        with self._changed:
            self._armed.clear()
        _compat.abort_collective_ops(self.fired)


def _bytes_of(values: Sequence[tf.Tensor]) -> Optional[int]:
    """The values' bytes, or None when a shape is unknown."""
    total = 0
    for value in values:
        count = value.shape.num_elements()
        if count is None:
            return None
        total += count * value.dtype.size
    return total
