"""Keras's callback internals: where `BackupAndRestore` writes and whether
`TensorBoard` profiles. Verified on Keras 3.15.1."""

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
    # tensorboard_profiles
    "keras.src.callbacks.tensorboard:TensorBoard._start_batch",
)


def redirect_backup_writes(callback, directory: str) -> None:
    """Points a `BackupAndRestore`'s file paths (set in its `__init__`) at
    `directory`, so a non-chief worker writes to scratch."""
    callback.backup_dir = directory
    callback._weights_path = os.path.join(directory, "latest.weights.h5")
    callback._training_metadata_path = os.path.join(directory, "training_metadata.json")
    callback._prev_weights_path = f"{callback._weights_path}.bkp"
    callback._prev_training_metadata_path = f"{callback._training_metadata_path}.bkp"


def tensorboard_profiles(callback) -> bool:
    """Whether a `keras.callbacks.TensorBoard` will profile some batches
    (`profile_batch` > 0: Keras keeps only the parsed `_start_batch`;
    keras/src/callbacks/tensorboard.py `_init_profile_batch`, Keras 3.15)."""
    return getattr(callback, "_start_batch", 0) > 0
