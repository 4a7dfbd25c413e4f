"""Keras's own `BackupAndRestore`, adopted: ours runs in its place.

`keras.callbacks.BackupAndRestore` restores at an epoch's start only (a run
resumed mid-epoch trains that epoch's first steps again), and a resumed run
reshuffles from a fresh random state; it writes its weights and then its
JSON in place (a kill in between or during the write breaks the backup),
and every worker writes. `DistributedModel.fit` therefore puts
`KerasBackupAndRestore`, keras_distrib's `BackupAndRestore` with the Keras
callback's arguments (`backup_dir`, `save_freq`, `double_checkpoint`,
`delete_checkpoint`), in its place (`adopt_keras_backup`), as it makes the
user's optimizer and metrics its strategy's.

The Keras object stays as its own hooks would leave it, so code that reads
it still works: its paths (`latest.weights.h5`, `training_metadata.json`,
and their `.bkp` with `double_checkpoint`) are symbolic links to the files
of the newest backups (whose `state.json` holds Keras's `"epoch"` too), its
epoch and batch counters follow training, and with `delete_checkpoint` its
directory goes at the end, as Keras's does (unless something else is in it).

Adopted: the class itself and subclasses that override none of its
methods (a constructor with other defaults is fine), with a local
`backup_dir`. A subclass with its own hooks keeps running as it is: its
code may rely on Keras's files. So does a remote `backup_dir`
(`gs://...`), which cannot be renamed into place atomically.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
import uuid
from typing import Any, Optional

import keras

from keras_distrib import _compat
from keras_distrib.callbacks import backup_and_restore as ours


def adopt_keras_backup(callbacks: Any) -> Any:
    """`fit`'s `callbacks` with each adoptable Keras `BackupAndRestore`
    replaced by a `KerasBackupAndRestore`.

    Args:
        callbacks: `fit`'s `callbacks` argument: None, a (nested) list or a
            `keras.callbacks.CallbackList`.

    Returns:
        `callbacks` itself when there is nothing to adopt; otherwise a flat
        list, or a copy of the `CallbackList` (the user's is left as it is).
    """
    if isinstance(callbacks, keras.callbacks.CallbackList):
        listed = callbacks.callbacks
    else:
        listed = list(keras.tree.flatten(callbacks or []))
    adopted = [
        KerasBackupAndRestore(c)
        if isinstance(c, keras.callbacks.BackupAndRestore) and _not_adoptable(c) is None
        else c
        for c in listed
    ]
    if all(a is c for a, c in zip(adopted, listed)):
        return callbacks
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = copy.copy(callbacks)
        callbacks.callbacks = adopted
        return callbacks
    return adopted


class KerasBackupAndRestore(ours.BackupAndRestore):
    """keras_distrib's `BackupAndRestore` in place of a Keras one (module doc).

    Only the chief writes the backups and the links to them; the Keras
    object's counters follow training on every worker.

    Args:
        keras_callback: the `keras.callbacks.BackupAndRestore` to stand for.

    Raises:
        ValueError: its class overrides one of Keras's methods (that code
            would not run), or its `backup_dir` is remote.
    """

    def __init__(self, keras_callback: keras.callbacks.BackupAndRestore):
        why_not = _not_adoptable(keras_callback)
        if why_not is not None:
            raise ValueError(why_not)
        super().__init__(
            keras_callback.backup_dir,
            keras_callback.save_freq,
            keras_callback.double_checkpoint,
            keras_callback.delete_checkpoint,
        )
        self.keras_callback = keras_callback
        weights, metadata, previous_weights, previous_metadata = _compat.backup_paths(
            keras_callback
        )
        # Newest backup first: (link, the backup's file it leads to).
        self._links = (
            ((weights, ours.WEIGHTS), (metadata, ours.STATE)),
            ((previous_weights, ours.WEIGHTS), (previous_metadata, ours.STATE)),
        )

    def set_model(self, model):
        super().set_model(model)
        self.keras_callback.set_model(model)

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        if self._strategy.is_chief:
            # Damaged backups are gone by now: lead to the ones left.
            self._published(self._backup_paths()[-self._keep :])

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, logs)
        _compat.show_backup_progress(self.keras_callback, self._epoch, batch)

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        _compat.show_backup_progress(self.keras_callback, epoch + 1, 0)

    def _published(self, kept: list) -> None:
        newest_first = kept[::-1]
        for i, links in enumerate(self._links):
            for link, name in links:
                if i < len(newest_first):
                    _link(link, os.path.join(newest_first[i], name))
                elif os.path.islink(link):
                    os.remove(link)

    def _delete_backups(self) -> None:
        super()._delete_backups()
        for links in self._links:
            for link, _ in links:
                if os.path.islink(link):
                    os.remove(link)
        with contextlib.suppress(OSError):
            os.rmdir(self.backup_dir)  # only when nothing else is in it


def _not_adoptable(callback) -> Optional[str]:
    """Why ours cannot stand for the Keras `callback` (one line), or None."""
    keras_class = keras.callbacks.BackupAndRestore
    overridden = sorted(
        name
        for name, method in inspect.getmembers(keras_class, inspect.isfunction)
        if name != "__init__" and getattr(type(callback), name) is not method
    )
    if overridden:
        return (
            f"{type(callback).__name__} overrides {', '.join(overridden)} of "
            "keras.callbacks.BackupAndRestore, which keras_distrib's would not run; "
            "pass keras_distrib.callbacks.BackupAndRestore or Keras's own class."
        )
    backup_dir = callback.backup_dir
    if isinstance(backup_dir, (str, os.PathLike)) and "://" in os.fspath(backup_dir):
        return (
            f"backup_dir={os.fspath(backup_dir)!r} is remote; keras_distrib's "
            "BackupAndRestore needs a local path (atomic renames)."
        )
    return None


def _link(link: str, target: str) -> None:
    """Makes `link` a symbolic link to `target` (relative), atomically."""
    directory = os.path.dirname(os.path.abspath(link))
    tmp = os.path.join(directory, f".tmp-{uuid.uuid4().hex[:12]}")
    os.symlink(os.path.relpath(target, directory), tmp)
    os.replace(tmp, link)
