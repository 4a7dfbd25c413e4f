"""Keras's callback internals: where `BackupAndRestore` writes and the
progress it shows, whether `TensorBoard` profiles and where. Verified on Keras
3.15.1."""

from __future__ import annotations

import os

_BACKUP = "keras.src.callbacks.backup_and_restore:BackupAndRestore"

# Private names the shims below use (checked at import, see `versions`).
PRIVATE = (
    # redirect_backup_writes
    f"{_BACKUP}._weights_path",
    f"{_BACKUP}._training_metadata_path",
    f"{_BACKUP}._prev_weights_path",
    f"{_BACKUP}._prev_training_metadata_path",
    # backup_paths (the four above), show_backup_progress
    f"{_BACKUP}._current_epoch",
    f"{_BACKUP}._last_batch_seen",
    # tensorboard_profiles
    "keras.src.callbacks.tensorboard:TensorBoard._start_batch",
    # ProfileElsewhere
    "keras.src.callbacks.tensorboard:TensorBoard._start_profiler",
)


def redirect_backup_writes(callback, directory: str) -> None:
    """Points a `BackupAndRestore`'s file paths (set in its `__init__`) at
    `directory`, so a non-chief worker writes to scratch."""
    callback.backup_dir = directory
    callback._weights_path = os.path.join(directory, "latest.weights.h5")
    callback._training_metadata_path = os.path.join(directory, "training_metadata.json")
    callback._prev_weights_path = f"{callback._weights_path}.bkp"
    callback._prev_training_metadata_path = f"{callback._training_metadata_path}.bkp"


def backup_paths(callback) -> tuple:
    """A `BackupAndRestore`'s file paths, set in its `__init__` from
    `backup_dir` (Keras has no public names for them): `(weights, training
    metadata, previous weights, previous training metadata)`, the last two
    written with `double_checkpoint`."""
    return (
        callback._weights_path,
        callback._training_metadata_path,
        callback._prev_weights_path,
        callback._prev_training_metadata_path,
    )


def show_backup_progress(callback, epochs_done: int, last_batch: int) -> None:
    """Sets the progress a `BackupAndRestore` keeps as its own hooks do:
    `_current_epoch`, the epochs done (set at each epoch's end), and
    `_last_batch_seen`, the index of the epoch's last batch seen (0 after
    an epoch's end)."""
    callback._current_epoch = epochs_done
    callback._last_batch_seen = last_batch


def tensorboard_profiles(callback) -> bool:
    """Whether a `keras.callbacks.TensorBoard` will profile some batches
    (`profile_batch` > 0: Keras keeps only the parsed `_start_batch`;
    keras/src/callbacks/tensorboard.py `_init_profile_batch`, Keras 3.15)."""
    return getattr(callback, "_start_batch", 0) > 0


class ProfileElsewhere:
    """Put in front of a `keras.callbacks.TensorBoard` class: its profiler
    writes to `self.profile_dir`, not to its train directory (Keras starts
    it in `_start_profiler(logdir)`; the warm-up start with logdir="" saves
    nothing and stays)."""

    profile_dir: str

    def _start_profiler(self, logdir):
        super()._start_profiler(self.profile_dir if logdir else logdir)
