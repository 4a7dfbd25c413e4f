"""Training steps scheduled on parameter-server workers, for Keras's `fit` loop.

Keras's loop calls the train function once per `steps_per_execution`
steps. Here each call schedules one *closure* with the
`ClusterCoordinator`: a compiled function that a free worker runs, taking
its batches from its own stream (or from the call's arguments, for input
the chief feeds) and applying each step's update to the variables on the
parameter servers. The call returns at once; the workers run in parallel.

Three things plain Keras code gets wrong when several workers update the
same variables at once, and how each step here avoids them:

* **Metrics.** Keras metrics update their variables by read-then-write
  (`total.assign(total + x)`): concurrent workers would lose updates and
  mix steps. Each closure instead runs the user's `train_step` in a
  `keras.StatelessScope` that maps every metric variable to the closure's
  own running state (starting from the reset value), and returns that
  state. The chief adds the states' increments (Keras metric states are
  sums: totals, counts, confusion matrices) and writes the sum into the
  model's metric variables when Keras reads the epoch's results: the epoch
  logs are exact aggregates of the steps applied.
* **The step counter.** `optimizer.iterations.assign_add(1)` is a
  read-then-write in Keras 3 (`KerasVariable.assign_add` is
  `assign(self + 1)`), which loses concurrent steps (docs/design.md,
  section 1.1, row 5). In the scope
  the counter reads as the true global count at the start of the step (so
  learning-rate schedules see the real step), and the step's increment is
  then applied with TensorFlow's atomic `assign_add` on the ps.
* **Other state** a step assigns (BatchNormalization's moving statistics,
  seed generators, a loss-scale factor) is written back after the step,
  as tf-keras's asynchronous training did: last writer wins.

Weights and optimizer slots are updated by the optimizer's own
`assign_add`/`assign_sub` on the parameter servers (real TensorFlow ops,
outside the scope's bookkeeping), as in TensorFlow's own asynchronous
training: each step reads the current weights and adds its update, so no
update is lost, though a step's gradient may be computed from weights other
workers changed meanwhile (staleness).

Per-batch logs are the aggregate of the closures finished so far: the
chief waits for the closure scheduled `lag` calls earlier before returning
(that also bounds the queue), so the logs run a few steps behind the
progress bar's step count.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Optional

import keras
import numpy as np
import tensorflow as tf

from keras_distrib.strategies.parameter_server.per_worker_input import Plan

# What the coordinator raises once it gives up on a task (a ps, usually:
# closures of a failed worker run again elsewhere).
_REMOTE_ERRORS = (
    tf.errors.UnavailableError,
    tf.errors.AbortedError,
    tf.errors.CancelledError,
    tf.errors.NotFoundError,
    tf.errors.InternalError,
    tf.errors.FailedPreconditionError,
)


class ScheduledTraining:
    """The train function of one `fit` under `parameter_server`.

    Args:
        model: the `DistributedModel` (built, compiled, optimizer built).
        engine: the `tf.distribute.ParameterServerStrategy`.
        coordinator: its `ClusterCoordinator`.
        plan: the input plan of this `fit`
            (`keras_distrib.strategies.parameter_server.per_worker_input`).
        step_fn: the per-step function (`model.train_step`).
        lag: closures in flight before a call waits for the oldest.
        lost: turns an error the coordinator gave up on (a lost ps) into
            the error `fit` raises.
    """

    def __init__(
        self,
        model,
        engine,
        coordinator,
        plan: Plan,
        step_fn: Callable,
        lag: int,
        lost: Callable[[Exception], Exception],
    ):
        self.model = model
        self.engine = engine
        self.coordinator = coordinator
        self.plan = plan
        self.step_fn = step_fn
        self.lag = max(1, lag)
        self.lost = lost
        self.metric_variables = list(model.metrics_variables)
        self.initial = [np.asarray(v) for v in self.metric_variables]
        self.totals = [np.zeros_like(v) for v in self.initial]
        self.steps_applied = 0  # steps whose results reached the chief (re-runs too)
        self.lost_results = 0  # closures that finished on a worker that then died
        self.pending: collections.deque = collections.deque()
        self._logs: Optional[dict] = None  # running_logs, until a fold or reset changes it
        self.dirty = False
        self._iterator = None
        # [Keras's ticket iterator, index into the PyDataset]
        self._py_state: Optional[list[Any]] = None
        self._closure = tf.function(self._run_steps, reduce_retracing=True)

    # -- on the worker -----------------------------------------------------------

    def _run_steps(self, source, num_steps):
        """`num_steps` training steps; returns the metric states' increments and
        the number of optimizer steps applied."""
        states = [tf.constant(v) for v in self.initial]
        applied = tf.constant(0, tf.int64)
        if self.plan.py_dataset is not None:
            for batch in source:  # fed: a tuple of batches (Python loop, traced per count)
                states, done = self._one_step(batch, states)
                applied += done
        else:
            for _ in tf.range(num_steps):
                states, done = self._one_step(next(source), states)
                applied += done
        return [s - i for s, i in zip(states, self.initial)], applied

    def _one_step(self, batch, states):
        # Inside `run`: TensorFlow runs the replica function in a thread of
        # its own, and Keras's StatelessScope is thread-local.
        return self.engine.run(self._replica_step, args=(batch, states))

    def _replica_step(self, batch, states):
        counter = self.model.optimizer.iterations
        before = tf.identity(counter.value)  # the true global step, read now
        mapping = list(zip(self.metric_variables, states)) + [(counter, before)]
        with keras.StatelessScope(state_mapping=mapping) as scope:
            self.step_fn(batch)
        new_states = [scope.get_current_value(v) for v in self.metric_variables]
        done = tf.cast(scope.get_current_value(counter) - before, tf.int64)
        handled = {id(v) for v in self.metric_variables} | {id(counter)}
        for variable in self._state_variables():
            if id(variable) not in handled:
                value = scope.get_current_value(variable)
                if value is not None:
                    variable.assign(value)
        counter.value.assign_add(tf.cast(done, counter.dtype))
        return new_states, done

    def _state_variables(self):
        model = self.model
        seen, out = set(), []
        for v in [*model.variables, *model.optimizer.variables]:
            if id(v) not in seen:
                seen.add(id(v))
                out.append(v)
        return out

    # -- on the chief: the function Keras's loop calls ------------------------------

    def __call__(self, iterator):
        """Schedules the next `steps_per_execution` steps (Keras's `iterator`
        yields one ticket per step of the epoch)."""
        count = 0
        for _ in range(self.model.steps_per_execution):
            try:
                next(iterator)
            except (StopIteration, tf.errors.OutOfRangeError):
                break
            count += 1
        if count == 0:
            raise StopIteration
        try:
            if self.plan.py_dataset is not None:
                args = (self._fed_batches(iterator, count), tf.constant(count, tf.int64))
            else:
                args = (self._worker_iterator(), tf.constant(count, tf.int64))
            self.pending.append(self.coordinator.schedule(self._closure, args=args))
            self.dirty = True
            while len(self.pending) > self.lag:
                self._fold(self.pending.popleft())
        except _REMOTE_ERRORS as error:
            raise self.lost(error) from None
        return self.running_logs()

    def _worker_iterator(self):
        if self._iterator is None:
            per_worker = self.coordinator.create_per_worker_dataset(self.plan.dataset_fn)
            self._iterator = iter(per_worker)
        return self._iterator

    def _fed_batches(self, ticket_iterator, count: int) -> tuple:
        """The next `count` batches of the PyDataset, in order; a new epoch
        (Keras made a new ticket iterator) starts again at batch 0."""
        data = self.plan.py_dataset
        assert data is not None  # the chief feeds a PyDataset
        if self._py_state is None or self._py_state[0] is not ticket_iterator:
            if self._py_state is not None:
                data.on_epoch_end()
            self._py_state = [ticket_iterator, 0]
        batches = []
        for _ in range(count):
            index = self._py_state[1] % len(data)
            self._py_state[1] += 1
            batch = tuple(b for b in _as_tuple(data[index]) if b is not None)
            batches.append(tuple(tf.convert_to_tensor(b) for b in batch))
        return tuple(batches)

    def _fold(self, remote) -> None:
        try:
            increments, applied = remote.fetch()
        except _REMOTE_ERRORS as error:
            if "/job:ps" in str(error) or "/job:worker" not in str(error):
                raise
            # The closure finished (its steps are applied on the ps) but its
            # worker died before the chief fetched the result, which stays
            # on the worker: only its share of the metric logs is lost.
            self.lost_results += 1
            return
        for total, inc in zip(self.totals, increments):
            total += np.asarray(inc)
        self._logs = None
        self.steps_applied += int(applied)

    def running_logs(self) -> dict:
        """Metric results of the closures finished so far (no remote reads;
        computed again only after new results arrived)."""
        if self._logs is None:
            values = [i + t for i, t in zip(self.initial, self.totals)]
            with keras.StatelessScope(state_mapping=list(zip(self.metric_variables, values))):
                logs = keras.Model.get_metrics_result(self.model)
            self._logs = {
                k: float(np.asarray(v)) if np.ndim(v) == 0 else np.asarray(v)
                for k, v in logs.items()
            }
        return dict(self._logs)  # callbacks may add keys to the dict they get

    # -- epoch boundaries ---------------------------------------------------------------

    def settle(self) -> None:
        """Waits for every scheduled closure and writes the aggregate into the
        model's metric variables (then Keras reads the epoch's results)."""
        if not self.dirty:
            return
        try:
            self.coordinator.join()
            while self.pending:
                self._fold(self.pending.popleft())
            for variable, initial, total in zip(self.metric_variables, self.initial, self.totals):
                variable.assign(initial + total)  # on a ps
        except _REMOTE_ERRORS as error:
            raise self.lost(error) from None
        self.dirty = False

    def metrics_reset(self) -> None:
        """Keras reset the metrics (a new epoch, or evaluate): start from zero."""
        for total in self.totals:
            total[...] = 0
        self._logs = None


def _as_tuple(batch) -> tuple:
    return tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
