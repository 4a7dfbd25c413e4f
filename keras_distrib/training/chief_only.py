"""Side effects on the chief only: one progress bar, one set of files.

Keras's callbacks know nothing of ranks, so with N workers every one would
print and write the same files (racing each other). Under a multi-worker
strategy `DistributedModel` therefore, on every worker but the chief:

* turns the progress bar off (`verbose=0`);
* points `ModelCheckpoint`, `TensorBoard`, `CSVLogger` and the writes of
  a `BackupAndRestore` subclass with hooks of its own at a private scratch
  directory that is deleted after the call (`scratch_directory`: one that
  a killed worker could not delete is deleted by the next worker of the
  machine to make one); a `TensorBoard` that profiles
  (`profile_batch`) writes this worker's profile to `log_dir/rank-N/train`,
  a run of its own beside the chief's `train`. These callbacks still *run*
  there: saving may read replicated variables with collectives, which
  every worker must join. Such a `BackupAndRestore` still *reads* the
  chief's backup, so every worker resumes from the same state. (Keras's
  class itself, and subclasses without hooks of their own, were replaced
  by keras_distrib's before: `keras_distrib.callbacks.keras_backup`.)

The user's callback objects are never modified (copies are redirected).
Opt out with `model.chief_only_side_effects = False`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import shutil
import tempfile
from typing import ClassVar, Iterator, Optional, Protocol

import keras

from keras_distrib import _compat
from keras_distrib.cluster.process_state import process_state


@contextlib.contextmanager
def redirected(callbacks, is_chief: bool, enabled: bool, rank: int = 0) -> Iterator[Optional[list]]:
    """Yields the callbacks this worker (of `rank`) should run."""
    if is_chief or not enabled or not callbacks:
        yield callbacks
        return
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    scratch = scratch_directory()
    try:
        yield [_redirect(cb, os.path.join(scratch, str(i)), rank) for i, cb in enumerate(callbacks)]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# A worker's scratch directory: `<temp dir>/keras_distrib-worker-<pid>-<random>`.
SCRATCH_PREFIX = "keras_distrib-worker-"


def scratch_directory() -> str:
    """A new scratch directory for this process, after deleting those of
    processes of this machine that no longer run: a worker killed (SIGKILL,
    a scheduler's kill after its grace time) in `fit` never ran its
    cleanup."""
    parent = tempfile.gettempdir()
    for name in os.listdir(parent):
        pid = name[len(SCRATCH_PREFIX) :].split("-", 1)[0]
        if (
            name.startswith(SCRATCH_PREFIX)
            and pid.isdigit()
            and process_state(int(pid)) == "exited"
        ):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-", dir=parent)


def _redirect(callback, scratch: str, rank: int):
    os.makedirs(scratch, exist_ok=True)
    if isinstance(callback, keras.callbacks.ModelCheckpoint):
        callback = copy.copy(callback)
        callback.filepath = os.path.join(scratch, os.path.basename(callback.filepath))
    elif isinstance(callback, keras.callbacks.TensorBoard):
        profile_dir = os.path.join(callback.log_dir, f"rank-{rank}", "train")
        callback = copy.copy(callback)
        callback.log_dir = scratch
        if _compat.tensorboard_profiles(callback):
            callback = _RankProfile.of(callback, profile_dir)
    elif isinstance(callback, keras.callbacks.CSVLogger):
        callback = copy.copy(callback)
        callback.filename = os.path.join(scratch, os.path.basename(callback.filename))
    elif isinstance(callback, keras.callbacks.BackupAndRestore):
        callback = _ReadOnlyBackup.of(callback, scratch)
    return callback


class _Front(Protocol):
    """A class `_in_front` puts in front of a callback's, by its name."""

    NAMED: ClassVar[str]


def _copy_as(front: type[_Front], callback, **attributes):
    """A copy of `callback` whose class has `front` in front of its own
    (`_in_front`), with `attributes` set."""
    copied = copy.copy(callback)
    callback_class: type = type(callback)
    copied.__class__ = _in_front(front, callback_class)
    vars(copied).update(attributes)
    return copied


@functools.lru_cache(maxsize=None)
def _in_front(front: type[_Front], callback_class: type) -> type:
    """`front` in front of `callback_class`: a subclass's own hooks still
    run, around Keras's. Named `<front.NAMED><class>`."""
    return type(f"{front.NAMED}{callback_class.__name__}", (front, callback_class), {})


class _ReadOnlyBackup(keras.callbacks.BackupAndRestore):
    """Restores from the chief's backup, then writes to scratch."""

    NAMED = "ReadOnly"
    _scratch: str  # the directory its writes go to (`of`)

    @classmethod
    def of(cls, callback, scratch):
        return _copy_as(cls, callback, _scratch=scratch)

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        _compat.redirect_backup_writes(self, self._scratch)


class _RankProfile(_compat.ProfileElsewhere, keras.callbacks.TensorBoard):
    """A worker's `TensorBoard(profile_batch=...)`: its summaries go to
    scratch (the chief writes the scalars, once), its profile to
    `log_dir/rank-N/train`, a run of its own beside the chief's `train`."""

    NAMED = "RankProfile"

    @classmethod
    def of(cls, callback, profile_dir):
        return _copy_as(cls, callback, profile_dir=profile_dir)
