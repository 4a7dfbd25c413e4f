"""`fit`, `evaluate` and `predict` of a `DistributedModel`: the user's input
handed to the strategy, what runs around Keras's loop.

`EntryPoints` is a mixin of `DistributedModel`. Each call checks what is
cheap to check first (`fit_checks`, `input.data`), hands the input to the
strategy (`fit` as a `FitInput`), and runs Keras's own loop with:

* side effects on the chief only (`chief_only`) and the strategy's
  one-line errors in place of TensorFlow's (`_clearer_failure`);
* for `fit`, Keras's `BackupAndRestore` replaced by ours
  (`keras_distrib.callbacks.keras_backup`), one `FitState`
  (`model.fit_state`), the resume point of a `Resumable` callback, and
  internal callbacks around the user's: the preemption watch, the
  finite-loss check, and the check that all replicas agree
  (`_internal_callbacks`).

`with_resume_and_preemption` wraps the train function the model makes: the
steps to replay after a resume, the preemption check after each step.
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any, Callable, Optional

import keras
import tensorflow as tf

from keras_distrib import _compat
from keras_distrib import preemption
from keras_distrib.callbacks import keras_backup
from keras_distrib.input import data as data_lib
from keras_distrib.input.fit_input import FitInput
from keras_distrib.training import chief_only
from keras_distrib.training import fit_checks
from keras_distrib.training import fit_state as fit_state_lib
from keras_distrib.training.outside_scopes import outside_scopes
from keras_distrib.training.step_state import TrainerPart


class EntryPoints(TrainerPart):
    """`fit`, `evaluate`, `predict` and the `*_on_batch` calls of
    `DistributedModel` (see module doc)."""

    # The model's: Keras's, `StrategyAdoption`'s build, and whether `fit`
    # checks its input is finite and only the chief prints and writes files.
    # Its `super()` calls reach Keras's model, after these mixins in the
    # model's classes, where mypy cannot follow.
    built: bool
    steps_per_execution: int
    _maybe_symbolic_build: Callable[..., None]
    check_finite: bool
    chief_only_side_effects: bool

    @outside_scopes
    def fit(
        self,
        x=None,
        y=None,
        batch_size=None,
        epochs=1,
        verbose="auto",
        callbacks=None,
        validation_split=0.0,
        validation_data=None,
        shuffle=True,
        class_weight=None,
        sample_weight=None,
        **kwargs,
    ):
        x = _compat.undistributed(x)
        validation_data = _compat.undistributed(validation_data)
        steps_per_epoch = kwargs.pop("steps_per_epoch", None)
        self._check_fit_call(
            x, y, batch_size, epochs, sample_weight, callbacks, steps_per_epoch, kwargs
        )
        # Keras's BackupAndRestore resumes at an epoch's start, reshuffled, and
        # is not crash-safe: ours takes its place, with its arguments.
        callbacks = keras_backup.adopt_keras_backup(callbacks)
        self._strategy.check_callbacks(callback_list(callbacks))
        backup = fit_state_lib.resumable_among(callback_list(callbacks))
        start = backup.resume_point(self) if backup is not None else None
        fit = self._distribute_fit_input(
            FitInput(
                x=x,
                y=y,
                sample_weight=sample_weight,
                batch_size=batch_size,
                shuffle=shuffle,
                validation_split=validation_split,
                validation_data=validation_data,
                validation_batch_size=kwargs.pop("validation_batch_size", None),
                steps_per_epoch=steps_per_epoch,
                class_weight=class_weight,  # with arrays: made sample weights (sharding.fit_input)
                steps_per_execution=self.steps_per_execution,
                start=start,
                resumable=backup is not None,
            ),
            backup,
        )
        if start is not None:
            kwargs["initial_epoch"] = start.epoch
        state = fit_state_lib.FitState(
            backup=backup, replay=(start.step if start else 0) // self.steps_per_execution
        )
        history = self._keras_fit(fit, state, epochs, verbose, callbacks, kwargs)
        _raise_if_preempted(state, backup)
        return history

    def _check_fit_call(
        self, x, y, batch_size, epochs, sample_weight, callbacks, steps_per_epoch, kwargs
    ) -> None:
        """`fit`'s checks before its input is handed to the strategy, in
        this order on every process: the batch sizes, the input
        (`_check_fit_input`), then that every process was called alike
        (`check_same_call`, a collective). `kwargs`: `fit`'s own, read only."""
        self._strategy.check_batch_size(batch_size)
        self._strategy.check_batch_size(
            kwargs.get("validation_batch_size"), "validation_batch_size"
        )
        self._check_fit_input(x, y, sample_weight, callbacks)
        fit_checks.check_same_call(
            self._strategy,
            "fit",
            x,
            batch_size=batch_size,
            epochs=epochs,
            initial_epoch=kwargs.get("initial_epoch", 0),
            steps=steps_per_epoch,
            steps_per_execution=self.steps_per_execution,
        )

    def _distribute_fit_input(
        self, fit_input: FitInput, backup: Optional[fit_state_lib.Resumable]
    ) -> FitInput:
        """The strategy's input for `fit_input`; the model built from its
        batch where the strategy feeds Keras none, and its shuffle seed
        recorded in `backup`, if any."""
        fit = self._strategy.distribute_fit_input(fit_input)
        if fit.build_batch is not None:
            # The strategy feeds Keras no real batches (parameter servers).
            self._maybe_symbolic_build(data_batch=fit.build_batch)
        if backup is not None:
            backup.record_seed(fit.seed)
        return fit

    def _keras_fit(
        self, fit: FitInput, state: fit_state_lib.FitState, epochs, verbose, callbacks, kwargs
    ):
        """Keras's own `fit` on the strategy's input `fit`, with `state` as
        the model's `fit_state`, SIGTERM watched, side effects on the chief
        only and the internal callbacks around the user's."""
        preemption.reset()
        with (
            self._fit_state_set(state),
            preemption.watching(),
            self._side_effects(callbacks) as callbacks,
            self._internal_callbacks(callbacks, state) as callbacks,
            self._clearer_failure(),
        ):
            # Keras's Model.fit, after these mixins in the model's classes.
            return super().fit(  # type: ignore[misc]  # Keras's
                fit.x,
                fit.y,
                fit.batch_size,
                epochs,
                self._verbose(verbose),
                callbacks,
                fit.validation_split,
                fit.validation_data,
                fit.shuffle,
                fit.class_weight,
                fit.sample_weight,
                validation_batch_size=fit.validation_batch_size,
                steps_per_epoch=fit.steps_per_epoch,
                **kwargs,
            )

    @property
    def fit_state(self) -> Optional[fit_state_lib.FitState]:
        """The state of the `fit` call running now (`FitState`), or None."""
        return self._kd_state.fit_state

    @contextlib.contextmanager
    def _fit_state_set(self, state: fit_state_lib.FitState):
        self._kd_state.fit_state = state
        try:
            yield state
        finally:
            self._kd_state.fit_state = None

    def _check_fit_input(self, x, y, sample_weight, callbacks) -> None:
        """Bad input that is cheap to see before training: one-line errors.

        Reads numpy arrays (one pass each) and what TensorFlow knows of a
        dataset without reading it; the same on every worker, which all get
        the same arguments. NaN/Inf input is let through to a `fit` given
        `TerminateOnNaN`: the user said what a non-finite loss should do.
        """
        data_lib.check_not_empty(x)
        sparse = fit_checks.sparse_categorical_classes(self)
        if sparse is not None:
            data_lib.check_sparse_labels(y, *sparse)
        if self.check_finite and not _stops_quietly_on_nan(callbacks):
            for name, value in (("x", x), ("y", y), ("sample_weight", sample_weight)):
                data_lib.check_finite(name, value)

    @contextlib.contextmanager
    def _internal_callbacks(self, callbacks, state: fit_state_lib.FitState):
        """`callbacks` with ours around the user's, for the `fit` call of `state`.

        First: `PreemptionWatch` (the train function asks it after every
        step whether to stop) and, unless opted out, `FiniteLossCheck`; where
        the user passed `TerminateOnNaN`, not that but, with several
        processes, `NonFiniteLossVote` (all workers stop together). Last
        (after the user's `on_train_begin` set the weights: broadcasts,
        restores): `ReplicasAgree`, with several processes.
        """
        watch = preemption.PreemptionWatch(state, self._preemption_vote())
        state.watch = watch
        first = [watch]
        several = self._strategy.world_size > 1
        if _stops_quietly_on_nan(callbacks):
            if several:  # each worker's TerminateOnNaN sees its own loss
                first.append(fit_checks.NonFiniteLossVote())
        elif self.check_finite:
            # Per-batch logs are global values only with one process; with
            # several, the exact epoch logs are checked, so all stop together.
            first.append(fit_checks.FiniteLossCheck(per_batch=not several))
        last = [fit_checks.ReplicasAgree()] if several else []
        if not isinstance(callbacks, keras.callbacks.CallbackList):
            yield [*first, *(keras.tree.flatten(callbacks) if callbacks else []), *last]
            return
        for callback in first + last:
            callback.set_model(self)
            callback.set_params(callbacks.params)
        callbacks.callbacks[:0] = first
        callbacks.callbacks.extend(last)
        try:
            yield callbacks
        finally:
            for callback in first + last:
                callbacks.callbacks.remove(callback)

    def _preemption_vote(self) -> Optional[preemption.Vote]:
        """The stop vote the step's all-reduce carries (None with one
        process: its own SIGTERM flag decides). One per model: the traced
        train function, which outlives a `fit` call, holds its variable."""
        if self._strategy.world_size == 1:
            return None
        vote = self._kd_state.vote
        if vote is None:
            with self._strategy.scope():
                vote = preemption.Vote(
                    tf.Variable(
                        0.0,
                        trainable=False,
                        name="kd_preemption_vote",
                        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
                    )
                )
            # Held by the model's state, not as a Keras attribute: no weight,
            # never saved.
            self._kd_state.vote = vote
        return vote

    @outside_scopes
    def evaluate(
        self,
        x=None,
        y=None,
        batch_size=None,
        verbose="auto",
        sample_weight=None,
        steps=None,
        callbacks=None,
        **kwargs,
    ):
        x = _compat.undistributed(x)
        self._strategy.check_batch_size(batch_size)
        if _compat.validation_in_fit(kwargs):
            # Validation inside fit: the input was distributed by fit already.
            if preemption.stopped_at(self) is not None:
                return {}  # stopping on a SIGTERM: no time for validation
            return super().evaluate(  # type: ignore[misc]  # Keras's
                x, y, batch_size, verbose, sample_weight, steps, callbacks, **kwargs
            )
        fit_checks.check_same_call(
            self._strategy,
            "evaluate",
            x,
            batch_size=batch_size,
            steps=steps,
            steps_per_execution=self.steps_per_execution,
        )
        x, y, sample_weight, batch_size = self._strategy.distribute_input(
            x, y, sample_weight, batch_size
        )
        with self._side_effects(callbacks) as callbacks, self._clearer_failure():
            return super().evaluate(  # type: ignore[misc]  # Keras's
                x, y, batch_size, self._verbose(verbose), sample_weight, steps, callbacks, **kwargs
            )

    @outside_scopes
    def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
        x = _compat.undistributed(x)
        self._strategy.check_batch_size(batch_size)
        fit_checks.check_same_call(
            self._strategy,
            "predict",
            x,
            batch_size=batch_size,
            steps=steps,
            steps_per_execution=self.steps_per_execution,
        )
        if not self.built:
            x = self._build_from_predict_input(x, batch_size)
        x, _, _, batch_size = self._strategy.distribute_input(x, batch_size=batch_size)
        with self._side_effects(callbacks) as callbacks, self._clearer_failure():
            return super().predict(  # type: ignore[misc]  # Keras's
                x, batch_size, self._verbose(verbose), steps, callbacks
            )

    def _build_from_predict_input(self, x, batch_size):
        """Builds the model's layers from `x`'s first batch; returns `x`,
        or for a Python generator (read once) one that yields that batch
        again, then the rest: nothing it gave is lost."""
        if isinstance(x, types.GeneratorType):
            first, x = data_lib.peek(x)
            self._maybe_symbolic_build(data_batch=first, forward_only=True)
            return x
        self._maybe_symbolic_build(
            iterator=_compat.epoch_iterator(x, batch_size), forward_only=True
        )
        return x

    def _verbose(self, verbose):
        if self.chief_only_side_effects and not self._strategy.is_chief:
            return 0
        return verbose

    @contextlib.contextmanager
    def _clearer_failure(self):
        """The strategy's one-line error (a lost or stuck peer, named) in
        place of what TensorFlow raised, where the strategy has one."""
        try:
            yield
        except Exception as error:
            clearer = self._strategy.failure(error)
            if clearer is None:
                raise
            raise clearer from None

    def _side_effects(self, callbacks):
        return chief_only.redirected(
            callbacks,
            self._strategy.is_chief,
            self.chief_only_side_effects,
            rank=self._strategy.rank,
        )

    @outside_scopes
    def train_on_batch(self, *args, **kwargs):
        return super().train_on_batch(*args, **kwargs)  # type: ignore[misc]  # Keras's

    @outside_scopes
    def test_on_batch(self, *args, **kwargs):
        return super().test_on_batch(*args, **kwargs)  # type: ignore[misc]  # Keras's

    @outside_scopes
    def predict_on_batch(self, x):
        if not self.built:
            self._maybe_symbolic_build(data_batch=(x, None, None), forward_only=True)
        return super().predict_on_batch(x)  # type: ignore[misc]  # Keras's


def _raise_if_preempted(
    state: fit_state_lib.FitState, backup: Optional[fit_state_lib.Resumable]
) -> None:
    """After Keras's `fit` returned: the preemption's one-line error, naming
    the backup (or that there is none), when a SIGTERM stopped the call of
    `state`."""
    if state.preempted_at is not None:
        where = (
            f"; backup in {backup.backup_dir}"
            if backup is not None
            else "; nothing was saved (add keras_distrib.callbacks.BackupAndRestore)"
        )
        raise preemption.announce(state.preempted_at, where)


def _stops_quietly_on_nan(callbacks) -> bool:
    """Whether the user passed `keras.callbacks.TerminateOnNaN`, whose
    contract is to stop training quietly at a NaN/Inf loss: then that, not
    our error (`fit_checks.FiniteLossCheck`), is what happens."""
    return any(isinstance(c, keras.callbacks.TerminateOnNaN) for c in callback_list(callbacks))


def callback_list(callbacks) -> list:
    """`fit`'s `callbacks` argument as a flat list."""
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    return list(keras.tree.flatten(callbacks or []))


def with_resume_and_preemption(
    model: Any, train_function: Callable[..., Any]
) -> Callable[..., Any]:
    """`train_function`, then the preemption check (`PreemptionWatch`);
    except that its first calls after a resume (as many as the model's
    replay count says) only pull their batches: the steps the run did
    before its backup (see `keras_distrib.callbacks.BackupAndRestore`)."""

    @functools.wraps(train_function)  # keeps its attributes (step_call's `compiled`)
    def function(iterator):
        state = model.fit_state
        if state is None or not state.replay:
            logs = train_function(iterator)
            if state is not None and state.watch is not None:
                state.watch.after_step()
            return logs
        state.replay -= 1
        for _ in range(model.steps_per_execution):
            try:
                next(iterator)
            except (StopIteration, tf.errors.OutOfRangeError):
                break  # the epoch's last, shorter execution
        return {}

    return function
