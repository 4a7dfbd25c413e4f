"""`keras_distrib.callbacks.BackupAndRestore` in one process.

A run that crashes (or is preempted) and is run again must end exactly where
an uninterrupted run ends: same weights, optimizer state and step count, with
shuffled input, for a crash at any step. Multi-worker jobs killed for real
are in tests/distributed/test_faults.py.
"""

import json
import os
import random
import signal
import subprocess

import keras
import numpy as np
import pytest

import as_reference
import keras_distrib as kd
from float_bounds import Reference, Trace
from helpers import Batches, Crash, CrashAfter, build, make_data, plain_model
from keras_distrib import preemption
from keras_distrib.callbacks import backup_and_restore, keras_backup
from keras_distrib.cluster import launch_contract
from keras_distrib.training import chief_only

EPOCHS, BATCH = 3, 32  # 203 samples: 7 steps per epoch, 21 in all


def _model(strategy="single"):
    return build("functional", strategy, optimizer=keras.optimizers.Adam(0.01))


def _fit(model, data, backup_dir, *extra, save_freq=4, epochs=EPOCHS, **options):
    x, y = data
    callbacks = [kd.callbacks.BackupAndRestore(backup_dir, save_freq=save_freq, **options), *extra]
    if isinstance(x, keras.utils.PyDataset):
        return model.fit(x, epochs=epochs, shuffle=True, verbose=0, callbacks=callbacks)
    return model.fit(
        x, y, batch_size=BATCH, epochs=epochs, shuffle=True, verbose=0, callbacks=callbacks
    )


def _assert_same_state(a, b):
    """The same model and strategy from the same state, the same steps on
    the same batches: the same kernels, the same weights and optimizer
    state (a resumed run that lost or repeated a step is off by a step)."""
    assert int(a.optimizer.iterations.numpy()) == int(b.optimizer.iterations.numpy())
    for wa, wb in zip(
        a.get_weights() + [v.numpy() for v in a.optimizer.variables],
        b.get_weights() + [v.numpy() for v in b.optimizer.variables],
        strict=True,
    ):
        np.testing.assert_array_equal(wa, wb)


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory):
    """The reference: the same runs, never interrupted (per save_freq). The
    one saving every 4 steps is traced too (`traced`)."""
    models = {}
    for save_freq in (4, "epoch"):
        model = _model()
        extra = []
        if save_freq == 4:  # shuffled: each step's rows unknown to the trace
            extra = [Trace(*data, BATCH, model.loss, shuffled=True)]
        _fit(model, data, tmp_path_factory.mktemp("ref"), *extra, save_freq=save_freq)
        models[save_freq] = model
        if extra:
            models["traced"] = Reference(model, extra[0], steps_per_epoch=7)
    return models


@pytest.mark.parametrize("save_freq", [4, "epoch"])
def test_a_run_resumed_after_a_crash_equals_an_uninterrupted_one(
    data, uninterrupted, tmp_path, save_freq, capsys
):
    at = random.randint(1, 7 * EPOCHS - 1)
    first = _model()
    with pytest.raises(Crash):
        _fit(first, data, tmp_path, CrashAfter(at), save_freq=save_freq)
    capsys.readouterr()
    second = _model()
    history = _fit(second, data, tmp_path, save_freq=save_freq)
    _assert_same_state(second, uninterrupted[save_freq])
    saved = at // 4 * 4 if save_freq == 4 else at // 7 * 7
    assert history.epoch == list(range(saved // 7, EPOCHS)), (at, history.epoch)
    said = capsys.readouterr().out
    if saved:  # the one line a resumed run prints
        assert said.startswith(
            f"keras_distrib: resuming from step {saved} (epoch "
            f"{saved // 7 + 1}, step {saved % 7}) of the backup in "
            f"{tmp_path}"
        ), (at, said)
    else:
        assert "resuming" not in said
    assert os.listdir(tmp_path) == []  # removed after the normal end


def test_under_the_launcher_the_chief_reports_each_backup_it_writes(
    data, tmp_path, capsys, monkeypatch
):
    """The line `keras-distrib launch` reads to say from which step a
    restarted job goes on; the resumed run's own line names the same."""
    _fit(_model(), data, tmp_path / "alone", epochs=1)
    assert capsys.readouterr().out == ""  # not under the launcher: nothing
    monkeypatch.setenv(launch_contract.RESTART_ENV, "0")
    with pytest.raises(Crash):
        _fit(_model(), data, tmp_path / "b", CrashAfter(10))
    reports = capsys.readouterr().out.splitlines()
    assert reports == [
        "keras_distrib: backup saved at step 4 (epoch 1, step 4).",
        "keras_distrib: backup saved at step 8 (epoch 2, step 1).",
    ]
    _fit(_model(), data, tmp_path / "b")
    resumed = capsys.readouterr().out.splitlines()
    assert launch_contract.backup_point(resumed[0]) == "step 8 (epoch 2, step 1)", resumed
    assert [launch_contract.backup_point(line) for line in resumed[1:]] == [
        f"step {s} (epoch {s // 7 + 1}, step {s % 7})" for s in (12, 16, 20)
    ], resumed


def test_a_pydataset_run_resumes_exactly(tmp_path):
    x, y = make_data()
    reference = _model()
    _fit(reference, (Batches(x, y, BATCH), None), tmp_path / "ref")
    first = _model()
    with pytest.raises(Crash):
        _fit(first, (Batches(x, y, BATCH), None), tmp_path / "run", CrashAfter(10))
    second = _model()
    _fit(second, (Batches(x, y, BATCH), None), tmp_path / "run")
    _assert_same_state(second, reference)


def test_mirrored_resumes_exactly(data, tmp_path):
    reference = _model("mirrored")
    _fit(reference, data, tmp_path / "ref")
    first = _model("mirrored")
    with pytest.raises(Crash):
        _fit(first, data, tmp_path / "run", CrashAfter(13))
    second = _model("mirrored")
    _fit(second, data, tmp_path / "run")
    _assert_same_state(second, reference)


def test_a_backup_goes_on_with_the_same_steps_on_more_replicas(
    data, uninterrupted, tmp_path, capsys
):
    """An elastic restart in one process: a backup made with one replica
    goes on with two, which split the same global batches, and ends as the
    uninterrupted one-replica run."""
    with pytest.raises(Crash):
        _fit(_model(), data, tmp_path, CrashAfter(6))
    assert os.listdir(tmp_path) == ["backup-000000000004"]
    capsys.readouterr()
    second = _model("mirrored")
    _fit(second, data, tmp_path)
    # Two replicas' sums in other orders than one's, from step 5 on.
    as_reference.assert_weights(uninterrupted["traced"], second)
    assert int(second.optimizer.iterations.numpy()) == 7 * EPOCHS
    assert (
        "of the backup in {}. It was made with 1 replica, this run has 2: each replica's "
        "share of the global batch changes, the steps do not.".format(
            tmp_path / "backup-000000000004"
        )
    ) in capsys.readouterr().out


def test_an_interrupted_save_leaves_the_previous_backup_usable(
    data, uninterrupted, tmp_path, monkeypatch
):
    saves = []
    real_dump = json.dump

    def dump_then_die_on_the_third_save(state, f):
        saves.append(state["global_step"])
        if len(saves) == 3:
            real_dump({"format": 1}, f)  # half a file...
            raise Crash("killed while writing the backup")
        real_dump(state, f)

    monkeypatch.setattr(backup_and_restore.json, "dump", dump_then_die_on_the_third_save)
    with pytest.raises(Crash):
        _fit(_model(), data, tmp_path)
    monkeypatch.undo()
    assert saves == [4, 8, 12]
    assert os.listdir(tmp_path) == ["backup-000000000008"]  # no half-written one
    second = _model()
    _fit(second, data, tmp_path)
    _assert_same_state(second, uninterrupted[4])


def test_leftovers_of_a_killed_save_are_ignored_and_removed(data, uninterrupted, tmp_path):
    first = _model()
    with pytest.raises(Crash):
        _fit(first, data, tmp_path, CrashAfter(6))
    leftover = tmp_path / ".tmp-0123456789ab"
    leftover.mkdir()
    (leftover / "state.json").write_text("{")  # a save killed mid-write
    second = _model()
    _fit(second, data, tmp_path)
    _assert_same_state(second, uninterrupted[4])
    assert os.listdir(tmp_path) == []


def test_sigterm_stops_fit_writes_a_backup_and_the_next_run_resumes(data, uninterrupted, tmp_path):
    class TermAfter(CrashAfter):
        def on_train_batch_end(self, batch, logs=None):
            self.steps += 1
            if self.steps == self.at:
                os.kill(os.getpid(), signal.SIGTERM)

    first = _model()
    with pytest.raises(preemption.Preempted) as stop:
        _fit(first, data, tmp_path, TermAfter(9))
    assert stop.value.code == 75
    # The signal lands after step 9's check: fit stops after the next step.
    assert "stopped at epoch 2, step 3" in str(stop.value)
    assert os.listdir(tmp_path) == ["backup-000000000010"]
    assert int(first.optimizer.iterations.numpy()) == 10
    second = _model()
    _fit(second, data, tmp_path)
    _assert_same_state(second, uninterrupted[4])


def test_delete_checkpoint_false_keeps_the_last_backup_and_resumes_at_the_end(data, tmp_path):
    model = _model()
    model.fit(
        *data,
        batch_size=BATCH,
        epochs=2,
        verbose=0,
        callbacks=[kd.callbacks.BackupAndRestore(tmp_path, delete_checkpoint=False)],
    )
    assert os.listdir(tmp_path) == ["backup-000000000014"]
    again = _model()
    history = again.fit(
        *data,
        batch_size=BATCH,
        epochs=2,
        verbose=0,
        callbacks=[kd.callbacks.BackupAndRestore(tmp_path, delete_checkpoint=False)],
    )
    assert history.epoch == []  # nothing left to train
    _assert_same_state(again, model)


def test_double_checkpoint_resumes_from_the_backup_before_a_damaged_one(
    data, uninterrupted, tmp_path, capsys
):
    with pytest.raises(Crash):
        _fit(_model(), data, tmp_path, CrashAfter(10), double_checkpoint=True)
    assert sorted(os.listdir(tmp_path)) == ["backup-000000000004", "backup-000000000008"]
    (tmp_path / "backup-000000000008" / backup_and_restore.WEIGHTS).write_text("0")
    capsys.readouterr()
    second = _model()
    _fit(second, data, tmp_path, double_checkpoint=True)
    said = capsys.readouterr().out.splitlines()
    assert said[:2] == [
        f"keras_distrib: the backup {tmp_path / 'backup-000000000008'} is damaged "
        f"(weights.weights.h5 is missing or not an HDF5 file); it is removed and training "
        "resumes from the backup before it.",
        f"keras_distrib: resuming from step 4 (epoch 1, step 4) of the backup in "
        f"{tmp_path / 'backup-000000000004'}.",
    ], said
    _assert_same_state(second, uninterrupted[4])


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_backup_whose_weights_changed_since_is_damaged(
    data, uninterrupted, tmp_path, capsys, damage
):
    """A byte flipped in the middle of the weights (the file still HDF5,
    the values wrong) or the file cut short: the backup before it is used."""
    with pytest.raises(Crash):
        _fit(_model(), data, tmp_path, CrashAfter(10), double_checkpoint=True)
    weights = tmp_path / "backup-000000000008" / backup_and_restore.WEIGHTS
    content = bytearray(weights.read_bytes())
    if damage == "flip":
        content[-len(content) // 3] ^= 0xFF
    else:
        del content[len(content) * 3 // 4 :]
    weights.write_bytes(bytes(content))
    capsys.readouterr()
    second = _model()
    _fit(second, data, tmp_path, double_checkpoint=True)
    said = capsys.readouterr().out.splitlines()
    assert said[0].startswith(
        f"keras_distrib: the backup {tmp_path / 'backup-000000000008'} is damaged ("
    ), said
    assert said[1].startswith("keras_distrib: resuming from step 4 (epoch 1, step 4)"), said
    _assert_same_state(second, uninterrupted[4])


class _FillDisk(keras.callbacks.Callback):
    """After step `after`, fills the file system of `directory` up."""

    def __init__(self, directory, after):
        super().__init__()
        self.directory, self.after, self.steps = directory, after, 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if self.steps != self.after:
            return
        with open(os.path.join(self.directory, "filler"), "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass


def test_a_backup_that_cannot_be_written_is_one_line_and_keeps_the_last(data, tmp_path):
    """The disk fills up between the first and second backups (a small
    tmpfs): one line, the first backup kept, no temporary left."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small file system needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], check=True)
    try:
        backups = disk / "backups"
        with pytest.raises(backup_and_restore.BackupWriteError) as error:
            _fit(_model(), data, backups, _FillDisk(disk, after=5))
        assert str(error.value) == (
            f"BackupAndRestore: cannot write the backup of step 8 (epoch 2, step 1) to "
            f"{backups}: No space left on device; the last backup is kept. Free space there or "
            "pass another backup_dir."
        )
        assert os.listdir(backups) == ["backup-000000000004"]
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_damaged_backup_is_a_one_line_error(data, tmp_path):
    damaged = tmp_path / "backup-000000000004"
    damaged.mkdir()
    (damaged / "state.json").write_text("{not json")
    with pytest.raises(
        ValueError,
        match=r"^The backup .*backup-000000000004 is damaged "
        r"\(.*\) and no older one reads; delete .* to "
        r"start afresh\.$",
    ) as error:
        _fit(_model(), data, tmp_path)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(save_freq=0), r"save_freq=0 must be 'epoch' or a number of steps >= 1\."),
        (dict(save_freq="batch"), r"save_freq='batch' must be 'epoch' or a number"),
        (dict(save_freq=True), r"save_freq=True must be"),
        (dict(backup_dir="gs://bucket/b"), r"must be a local path"),
        (dict(backup_dir=""), r"backup_dir='' must be a directory path\."),
    ],
)
def test_bad_arguments_are_one_line_errors(tmp_path, kwargs, message):
    kwargs.setdefault("backup_dir", str(tmp_path))
    with pytest.raises(ValueError, match=message):
        kd.callbacks.BackupAndRestore(**kwargs)


def test_a_plain_keras_model_is_told_what_to_use(data, tmp_path):
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match=r"needs the fit of a keras_distrib.DistributedModel"):
        model.fit(*data, verbose=0, callbacks=[kd.callbacks.BackupAndRestore(tmp_path)])


def test_sigterm_stops_fit_after_a_library_replaced_the_handler(data, tmp_path):
    """A library that sets its own SIGTERM handler between two fits (Ray's
    driver does) does not switch preemption off; outside fit its handler
    runs again."""

    class TermAfter(CrashAfter):
        def on_train_batch_end(self, batch, logs=None):
            self.steps += 1
            if self.steps == self.at:
                os.kill(os.getpid(), signal.SIGTERM)

    _model().fit(*data, batch_size=BATCH, epochs=1, verbose=0)  # ours installed
    library_got = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: library_got.append(signum))
    try:
        with pytest.raises(preemption.Preempted):
            _fit(_model(), data, tmp_path, TermAfter(3))
        assert library_got == []
        preemption.reset()
        os.kill(os.getpid(), signal.SIGTERM)  # outside fit: the library's handler
        assert library_got == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


# -- Keras's own BackupAndRestore, passed to a DistributedModel --------------------------

KERAS_EPOCHS, KERAS_SAVE_FREQ = 4, 3  # 28 steps; backups at steps 3, 6, 9, ...


def _fit_with_keras_backup(model, data, backup_dir, *extra, process):
    """`fit` with `keras.callbacks.BackupAndRestore`, shuffled input and no
    seed: the random state of each run is that of a new process (`process`)."""
    keras.utils.set_random_seed(process)
    x, y = data
    return model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=KERAS_EPOCHS,
        verbose=0,
        callbacks=[keras.callbacks.BackupAndRestore(backup_dir, save_freq=KERAS_SAVE_FREQ), *extra],
    )


def _resumed_and_uninterrupted(make_model, data, tmp_path):
    """A run crashed after step 11 (epoch 2, step 4: its last backup is
    mid-epoch, at step 9) and run again in a "new process", and the same
    run uninterrupted; all from the same initial weights. Also what the
    backup directory held after the crash."""
    reference = make_model()
    _fit_with_keras_backup(reference, data, tmp_path / "reference", process=1)
    with pytest.raises(Crash):
        _fit_with_keras_backup(make_model(), data, tmp_path / "run", CrashAfter(11), process=1)
    after_the_crash = sorted(os.listdir(tmp_path / "run"))
    resumed = make_model()
    _fit_with_keras_backup(resumed, data, tmp_path / "run", process=2)
    return resumed, reference, after_the_crash


def _largest_difference(a, b) -> float:
    return max(float(np.abs(wa - wb).max()) for wa, wb in zip(a.get_weights(), b.get_weights()))


@pytest.mark.parametrize("strategy", ["single", "mirrored"])
def test_keras_backup_and_restore_resumes_a_distributed_model_exactly(data, tmp_path, strategy):
    """Keras's callback is adopted as ours: the resumed run goes on at the
    step after the backup, with the shuffle seed of the crashed run."""
    resumed, reference, after_the_crash = _resumed_and_uninterrupted(
        lambda: build("functional", strategy), data, tmp_path
    )
    assert int(resumed.optimizer.iterations.numpy()) == 7 * KERAS_EPOCHS
    # The same model and strategy, the same float32 operations on the same
    # batches: the same kernels, the same weights.
    assert _largest_difference(resumed, reference) == 0.0
    # Keras's file names lead to the backup; all is gone after the end.
    assert after_the_crash == ["backup-000000000009", "latest.weights.h5", "training_metadata.json"]
    assert not os.path.exists(tmp_path / "run")


def test_keras_backup_and_restore_on_a_plain_keras_model_is_not_exact(data, tmp_path):
    """The control: Keras restores the weights of step 9 but trains epoch 2
    again from its start, in a new order, so it ends far from the run that
    was not interrupted."""

    def plain():
        model = plain_model()
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        return model

    resumed, reference, _ = _resumed_and_uninterrupted(plain, data, tmp_path)
    assert _largest_difference(resumed, reference) > 1e-3


class _OtherDefaults(keras.callbacks.BackupAndRestore):
    def __init__(self, backup_dir):
        super().__init__(backup_dir, save_freq=5, double_checkpoint=True)


class _OwnHook(keras.callbacks.BackupAndRestore):
    def on_epoch_end(self, epoch, logs=None):
        self.ended = epoch
        super().on_epoch_end(epoch, logs)


def test_keras_backup_and_restore_is_adopted_unless_its_code_would_be_lost(tmp_path):
    adopted = keras_backup.adopt_keras_backup(
        [
            [keras.callbacks.BackupAndRestore(tmp_path / "a", save_freq=3)],
            _OtherDefaults(str(tmp_path / "b")),
        ]
    )
    assert [type(c) for c in adopted] == [keras_backup.KerasBackupAndRestore] * 2
    assert [(c.save_freq, c.double_checkpoint, c.delete_checkpoint) for c in adopted] == [
        (3, False, True),
        (5, True, True),
    ]
    kept = [_OwnHook(str(tmp_path / "c")), keras.callbacks.BackupAndRestore("gs://bucket/d")]
    assert keras_backup.adopt_keras_backup(kept) is kept
    listed = keras.callbacks.CallbackList([keras.callbacks.BackupAndRestore(str(tmp_path))])
    copied = keras_backup.adopt_keras_backup(listed)
    assert type(listed.callbacks[0]) is keras.callbacks.BackupAndRestore  # the user's, as it was
    assert type(copied.callbacks[0]) is keras_backup.KerasBackupAndRestore
    with pytest.raises(
        ValueError,
        match=r"^_OwnHook overrides on_epoch_end of "
        r"keras.callbacks.BackupAndRestore, .*; pass "
        r"keras_distrib.callbacks.BackupAndRestore",
    ):
        keras_backup.KerasBackupAndRestore(kept[0])


def test_a_keras_backup_subclass_keeps_its_own_hooks_on_the_other_workers(tmp_path):
    """Not adopted, it runs as Keras's callback, its writes redirected to
    scratch on workers other than the chief: its own code runs there too."""
    with chief_only.redirected([_OwnHook(str(tmp_path))], is_chief=False, enabled=True) as (
        redirected,
    ):
        assert isinstance(redirected, _OwnHook)
        assert type(redirected).on_epoch_end is _OwnHook.on_epoch_end


def test_a_killed_workers_scratch_is_deleted_by_the_next_worker(tmp_path, monkeypatch):
    """A worker SIGKILLed in `fit` leaves its scratch directory; the next
    worker of the machine to make one deletes it (its pid no longer runs),
    and leaves a running process's alone."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen(["sleep", "60"])
    gone.kill()
    gone.wait()
    left = tmp_path / f"{chief_only.SCRATCH_PREFIX}{gone.pid}-abc"
    (left / "0").mkdir(parents=True)
    (left / "0" / "model.keras").write_bytes(b"half a checkpoint")
    running = tmp_path / f"{chief_only.SCRATCH_PREFIX}{os.getpid()}-def"
    running.mkdir()
    with chief_only.redirected(
        [keras.callbacks.CSVLogger(str(tmp_path / "log.csv"))], is_chief=False, enabled=True
    ) as (logger,):
        assert logger.filename.startswith(f"{tmp_path}/{chief_only.SCRATCH_PREFIX}{os.getpid()}-")
        assert not left.exists() and running.exists()
    assert sorted(os.listdir(tmp_path)) == [running.name]
