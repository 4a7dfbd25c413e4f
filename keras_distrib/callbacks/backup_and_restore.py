"""`BackupAndRestore`: crash-safe backups that resume `fit` exactly.

Keras 3's `keras.callbacks.BackupAndRestore` writes the weights and then a
`training_metadata.json` in place: a kill between the two writes resumes at
the wrong epoch (an extra epoch trained silently), a kill during the JSON
write leaves a 0-byte file that breaks every relaunch, it restores at epoch
granularity only, and every worker writes. This one keeps each backup as
one unit that appears atomically:

    backup_dir/backup-000000000120/    (named by the global step)
        weights.weights.h5             model and optimizer variables
        state.json                     epoch, step in it, global step, shuffle seed

The chief writes it under a temporary name, syncs it to disk, then renames
it into place and removes the older one (keeps the one before it too with
`double_checkpoint`), so an interrupted save always leaves the previous
backup usable (leftover temporary directories are removed at the next
start). `state.json` holds the SHA-256 of the weights file as synced to
disk, so a backup whose file changed since (truncated, overwritten, a bad
sector) does not read; a backup that does not read is skipped for the one
before it, when there is one, else resuming fails in one line. A backup
that cannot be written (a full disk) fails `fit` in one line
(`BackupWriteError`), keeping the previous one. Only the chief reads it too: it shares the
resume point with one collective and its restored weights and optimizer
state with a broadcast, so workers need not share a file system.

Resuming is exact (`DistributedModel.fit` only): the epoch, the steps
already done in it and the shuffle seed come back; array and `PyDataset`
input shuffle epoch `e` from `(seed, e)` alone, so the resumed run sees the
same batches as an uninterrupted one, and the steps already done are
replayed as no-op steps that only pull their batches (the progress bar
counts them). Epoch logs of a run resumed mid-epoch cover the steps after
the resume. `tf.data` input resumes at the right step, but a pipeline that
reshuffles every epoch draws a new order.

It also writes the backup when `fit` stops on a SIGTERM
(`keras_distrib.preemption`), at the step where every worker stopped.

Under `keras-distrib launch` the chief reports each backup it wrote in one
line (`launch_contract.BACKUP_LINE`), which the launcher keeps off its
output and uses to say from which step a restarted job goes on.

Keras's own `keras.callbacks.BackupAndRestore` given to
`DistributedModel.fit` is replaced by this one, with its arguments
(`keras_distrib.callbacks.keras_backup`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import uuid
from typing import Any, Literal, Optional, Union

import h5py
import keras
import numpy as np

from keras_distrib import preemption
from keras_distrib.cluster import launch_contract
from keras_distrib.input import fit_input
from keras_distrib.callbacks import _common
from keras_distrib.arithmetic import optimizer_shards

WEIGHTS = "weights.weights.h5"
STATE = "state.json"
_FORMAT = 1
_BACKUP = re.compile(r"^backup-(\d{12})$")
# A backup that reads, `(path, state)`, and one that does not, `(path, why)`.
_Found = tuple[str, dict[str, Any]]
_Damage = tuple[str, str]


class BackupAndRestore(keras.callbacks.Callback):  # type: ignore[misc]  # Keras has no types
    """Backs up training every epoch or every N steps; resumes after a failure.

    Use it with a `keras_distrib.DistributedModel` on any strategy (every
    worker passes it; only the chief writes). When `fit` starts and a
    backup exists, the model, the optimizer and the position in the data
    are restored and training goes on from the step after the backup.

    Args:
        backup_dir: Local directory for the backups (created if missing).
            Use one directory per training job.
        save_freq: `"epoch"` (after every epoch) or an int: after every
            that many training steps (and also where `fit` stops on a
            SIGTERM).
        double_checkpoint: Keep the backup before the newest one too, to
            resume from when the newest does not read (as Keras does).
        delete_checkpoint: Remove the backups when `fit` ends normally
            (as Keras does), so that the next run trains afresh.

    The arguments are those of `keras.callbacks.BackupAndRestore`, which
    `DistributedModel.fit` replaces by this one (`keras_backup`).

    Example:

    ```python
    model.fit(x, y, epochs=10, shuffle=True, callbacks=[
        keras_distrib.callbacks.BackupAndRestore("/ckpt/job-1", save_freq=100)])
    ```
    """

    def __init__(
        self,
        backup_dir: Union[str, os.PathLike[str]],
        save_freq: Union[Literal["epoch"], int] = "epoch",
        double_checkpoint: bool = False,
        delete_checkpoint: bool = True,
    ):
        super().__init__()
        if not isinstance(backup_dir, (str, os.PathLike)) or not os.fspath(backup_dir):
            raise ValueError(f"backup_dir={backup_dir!r} must be a directory path.")
        if "://" in os.fspath(backup_dir):
            raise ValueError(
                f"backup_dir={os.fspath(backup_dir)!r} must be a local path (atomic "
                "renames); mount the remote storage or back up to local disk."
            )
        if save_freq != "epoch" and not (
            isinstance(save_freq, int) and not isinstance(save_freq, bool) and save_freq > 0
        ):
            raise ValueError(f"save_freq={save_freq!r} must be 'epoch' or a number of steps >= 1.")
        self.backup_dir = os.path.abspath(os.fspath(backup_dir))
        self.save_freq = save_freq
        self.double_checkpoint = bool(double_checkpoint)
        self.delete_checkpoint = bool(delete_checkpoint)
        self._found: Optional[_Found] = None  # the chief's backup to restore
        self._damaged: list[_Damage] = []  # the chief's newer backups that did not read
        self._start = fit_input.Start()
        self._global_step = 0
        self._seed: Optional[int] = None

    # -- before fit builds its input (called by DistributedModel.fit) ----------------

    def resume_point(self, model: Any) -> Optional[fit_input.Start]:
        """Where the newest backup stands, the same on every worker (collective).

        The chief reads the backup directory; the others learn the result
        from it. Returns None when there is nothing to resume.
        """
        strategy = model.strategy
        found, self._damaged = _latest(self.backup_dir) if strategy.is_chief else (None, [])
        for path, reason in self._damaged:
            print(
                f"keras_distrib: the backup {path} is damaged ({reason}); it is removed "
                "and training resumes from the backup before it.",
                flush=True,
            )
        mine = np.zeros(6, np.int64)
        if found is not None:
            _, state = found
            seed = state.get("seed")
            mine[:] = [
                1,
                state["epoch"],
                state["step"],
                state["global_step"],
                seed is not None,
                seed or 0,
            ]
        (shared,) = strategy.sync_sum([mine])
        self._found = found
        self._prepared, self._resuming = True, bool(shared[0])
        if not shared[0]:
            self._start, self._global_step = fit_input.Start(), 0
            return None
        _, epoch, step, global_step, has_seed, seed = (int(v) for v in shared)
        self._start = fit_input.Start(epoch, step, seed if has_seed else None)
        self._global_step = global_step
        return self._start

    def record_seed(self, seed: Optional[int]) -> None:
        """The shuffle seed `fit`'s input uses (written into every backup)."""
        self._seed = seed

    # -- Keras callback hooks ------------------------------------------------------

    def on_train_begin(self, logs: _common.Logs = None) -> None:
        if not getattr(self, "_prepared", False):
            raise ValueError(
                "keras_distrib.callbacks.BackupAndRestore needs the fit of a "
                "keras_distrib.DistributedModel (DistributedModel.from_model(model) wraps "
                "a Keras model); for plain Keras use keras.callbacks.BackupAndRestore."
            )
        self._prepared = False
        self._strategy = _common.strategy_of(self)
        if self._strategy.is_chief:
            os.makedirs(self.backup_dir, exist_ok=True)
            _remove_unfinished(self.backup_dir)
            for path, _ in self._damaged:
                shutil.rmtree(path, ignore_errors=True)
        if self._resuming:
            self._restore()
        self._epoch, self._step = self._start.epoch, self._start.step
        self._saved_at = self._global_step

    def on_epoch_begin(self, epoch: int, logs: _common.Logs = None) -> None:
        if epoch != self._start.epoch:
            self._step = 0
        self._epoch = epoch

    def on_train_batch_end(self, batch: int, logs: _common.Logs = None) -> None:
        done = batch + 1
        if done <= self._step:
            return  # a step replayed after a resume (a no-op)
        self._global_step += done - self._step
        self._step = done
        if (
            isinstance(self.save_freq, int)  # not "epoch"
            and self._global_step // self.save_freq > self._saved_at // self.save_freq
        ):
            self._save()

    def on_epoch_end(self, epoch: int, logs: _common.Logs = None) -> None:
        if self.save_freq == "epoch" and preemption.stopped_at(self.model) is None:
            self._epoch, self._step = epoch + 1, 0
            self._save()

    def on_train_end(self, logs: _common.Logs = None) -> None:
        if preemption.stopped_at(self.model) is not None:
            self._save()
        elif self.delete_checkpoint and self._strategy.is_chief:
            self._delete_backups()

    def _delete_backups(self) -> None:
        for path in self._backup_paths():
            shutil.rmtree(path, ignore_errors=True)

    # -- saving and restoring ------------------------------------------------------

    def _save(self) -> None:
        """Writes the backup of this point (chief only; the others go on,
        once they gave their part of a sharded optimizer's slots)."""
        if self._saved_at == self._global_step:
            return  # this point is already backed up (or nothing was trained yet)
        self._saved_at = self._global_step
        shards = optimizer_shards.of(getattr(self.model, "optimizer", None))
        with shards.gathered() if shards is not None else contextlib.nullcontext():
            if self._strategy.is_chief:
                self._write()

    def _write(self) -> None:
        # Steps still running elsewhere (parameter servers) land first, so
        # the backup holds every step counted in its state.
        self._strategy.settle(self.model)
        state: dict[str, Any] = {
            "format": _FORMAT,
            "epoch": self._epoch,
            "step": self._step,
            "global_step": self._global_step,
            "seed": self._seed,
            "num_replicas": self._strategy.num_replicas,
        }
        tmp = os.path.join(self.backup_dir, f".tmp-{uuid.uuid4().hex[:12]}")
        try:
            os.makedirs(tmp)
            keras.Model.save_weights(self.model, os.path.join(tmp, WEIGHTS))
            # The weights' digest, read back from the disk once synced: a
            # backup whose file changed since (truncated, overwritten, a bad
            # sector) is seen as damaged at restore instead of read silently.
            state["weights_sha256"] = _synced_digest(os.path.join(tmp, WEIGHTS))
            with open(os.path.join(tmp, STATE), "w") as f:
                json.dump(state, f)
                f.flush()
                os.fsync(f.fileno())
            _fsync(tmp)
            final = os.path.join(self.backup_dir, f"backup-{self._global_step:012d}")
            if os.path.exists(final):
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync(self.backup_dir)
        except OSError as e:  # a full disk, a file system gone read-only
            raise BackupWriteError(
                f"BackupAndRestore: cannot write the backup of {_point(state)} to "
                f"{self.backup_dir}: {_os_reason(e)}; the last backup is kept. Free space "
                "there or pass another backup_dir."
            ) from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        # The new one is the newest: backups are named by the global step.
        paths = self._backup_paths()
        self._published(paths[-self._keep :])
        for path in paths[: -self._keep]:
            shutil.rmtree(path, ignore_errors=True)
        if launch_contract.RESTART_ENV in os.environ:
            print(f"{launch_contract.BACKUP_LINE}{_point(state)}.", flush=True)

    def _backup_paths(self) -> list[str]:
        """The complete backups' directories, oldest first."""
        return [os.path.join(self.backup_dir, name) for name in _backups(self.backup_dir)]

    @property
    def _keep(self) -> int:
        """How many backups stay: the newest, and with `double_checkpoint` the one before."""
        return 2 if self.double_checkpoint else 1

    def _published(self, kept: list[str]) -> None:
        """Called on the chief after each backup with the paths of those
        that stay (oldest first), before the others are removed."""

    def _restore(self) -> None:
        """The chief loads the backup; every worker gets its values."""
        model, strategy = self.model, self._strategy
        optimizer = getattr(model, "optimizer", None)
        shards = optimizer_shards.of(optimizer)
        if strategy.is_chief:
            assert self._found is not None  # resume_point found the backup
            path, state = self._found
            print(_resuming_line(path, state, strategy.num_replicas), flush=True)
            # A sharded optimizer keeps the whole slots read for share_loaded.
            with shards.keeping_loaded() if shards is not None else contextlib.nullcontext():
                keras.Model.load_weights(model, os.path.join(path, WEIGHTS))
        variables = list(model.weights) + [
            v
            for v in getattr(optimizer, "variables", [])
            if shards is None or not shards.sharded(v)
        ]
        strategy.broadcast_variables(variables)
        if shards is not None:
            # Each worker holds its part of the slots: cut from the chief's whole ones.
            shards.share_loaded()
        strategy.broadcast_derived_state(model)


def _resuming_line(path: str, state: dict[str, Any], num_replicas: int) -> str:
    """What a resumed run says first: the step it goes on from, and, when
    the backup was made with other replicas (an elastic restart), that the
    global batches and so the steps stay the same."""
    line = f"{launch_contract.RESUMING_LINE}{_point(state)} of the backup in {path}."
    made_with = state.get("num_replicas")
    if made_with is not None and made_with != num_replicas:
        line += (
            f" It was made with {made_with} replica{'s' * (made_with != 1)}, this run "
            f"has {num_replicas}: "
            "each replica's share of the global batch changes, the steps do not."
        )
    return line


def _point(state: dict[str, Any]) -> str:
    """`step 12 (epoch 2, step 4)`: the global step, and the epoch (from 1)
    and the steps done in it."""
    return f"step {state['global_step']} (epoch {state['epoch'] + 1}, step {state['step']})"


def _backups(directory: str) -> list[str]:
    """Names of the complete backups in `directory`, oldest first."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if _BACKUP.match(n))


def _latest(directory: str) -> tuple[Optional[_Found], list[_Damage]]:
    """`(path, state)` of the newest backup that reads, or None; and the
    `(path, reason)` of the newer ones that do not.

    Raises:
        ValueError: no backup reads but some exist (a one-line error).
    """
    damaged: list[_Damage] = []
    for name in reversed(_backups(directory)):
        path = os.path.join(directory, name)
        try:
            return (path, _read_state(path)), damaged
        except _Damaged as e:
            damaged.append((path, str(e)))
    if damaged:
        path, reason = damaged[0]
        raise ValueError(
            f"The backup {path} is damaged ({reason}) and no older one reads; "
            f"delete {directory} to start afresh."
        )
    return None, []


class BackupWriteError(OSError):
    """A backup could not be written (one line: where, why, the fix); the
    previous backup is kept."""


class _Damaged(Exception):
    """A backup that does not read; the message says why."""


def _read_state(path: str) -> dict[str, Any]:
    try:
        with open(os.path.join(path, STATE)) as f:
            state: dict[str, Any] = json.load(f)
        if state.get("format") != _FORMAT:
            raise ValueError("unknown format")
        for key in ("epoch", "step", "global_step"):
            int(state[key])
        # The weights are read only once the model is built; a file that is
        # not HDF5 at all (overwritten, zeroed) or that changed since it was
        # written is seen here already.
        weights = os.path.join(path, WEIGHTS)
        if not h5py.is_hdf5(weights):
            raise ValueError(f"{WEIGHTS} is missing or not an HDF5 file")
        if "weights_sha256" in state and _digest(weights) != state["weights_sha256"]:
            raise ValueError(f"{WEIGHTS} changed since it was written (its SHA-256 differs)")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _Damaged(e) from None
    return state


def _remove_unfinished(directory: str) -> None:
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if name.startswith(".tmp-") and os.path.islink(path):
            os.remove(path)  # a link to a backup's file (KerasBackupAndRestore)
        elif name.startswith(".tmp-"):
            shutil.rmtree(path, ignore_errors=True)


def _os_reason(error: OSError) -> str:
    """`No space left on device`: the reason of an OS error, also from
    h5py's, which carries the errno in a message of several lines."""
    code = error.errno
    if code is None:
        found = re.search(r"errno = (\d+)", str(error))
        code = int(found[1]) if found else None
    return os.strerror(code) if code else " ".join(str(error).split())


def _digest(path: str) -> str:
    """The SHA-256 of the file at `path`, in hex."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _synced_digest(path: str) -> str:
    """Syncs the file at `path` to disk, then returns its digest."""
    _fsync(path)
    return _digest(path)


def _fsync(path: str) -> None:
    """Syncs the file or directory at `path` to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
