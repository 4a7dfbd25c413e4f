"""strategy='parameter_server': real clusters of processes started by the launcher.

`keras-distrib launch --workers N --ps M` runs tests/workers/ps_train.py on
the chief (the coordinator) and TensorFlow servers on the worker and ps
tasks. The tests that only read what the chief reports share one launch
(`shared`); those that kill a task or need another cluster launch their
own. The launcher's process group is killed whatever happens.
Configuration errors, in one process, are in
tests/integration/test_parameter_server_config.py.
"""

import contextlib
import json
import math
import os
import re
import signal
import socket
import sys
import time

import pytest

import helpers
import netns_hosts

SCRIPT = os.path.join(helpers.WORKERS, "ps_train.py")


def _launch_modes(
    tmp_path, modes, workers=2, ps=1, timeout=400, env=None, during=None, launch_flags=()
):
    """Runs the chief script's `modes` in turn under the launcher; returns
    (code, output, {mode: its report, or None}). `during(proc, report
    path)` acts on the first mode."""
    out = str(tmp_path / f"{modes[0]}.json")
    code, output = helpers.launch(
        tmp_path,
        workers,
        SCRIPT,
        ",".join(modes),
        str(tmp_path),
        launch_flags=("--ps", str(ps), *launch_flags),
        timeout=timeout,
        expect=None,
        env=env,
        during=during and (lambda proc: during(proc, out)),
    )
    paths = {m: tmp_path / f"{m}.json" for m in modes}
    return code, output, {m: json.load(open(p)) if p.exists() else None for m, p in paths.items()}


def _launch(tmp_path, mode, **kwargs):
    """Runs the chief script in `mode`; returns (code, output, report)."""
    code, output, reports = _launch_modes(tmp_path, [mode], **kwargs)
    return code, output, reports[mode]


# One cluster (a chief, 2 workers, 1 ps) runs the modes whose tests only
# read what the chief reports, one after another.
SHARED_MODES = ("inputs", "warmup", "callbacks", "digits", "remat", "errors")


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """{mode: (code, output, report)} of the one launch of SHARED_MODES."""
    code, output, reports = _launch_modes(tmp_path_factory.mktemp("ps"), SHARED_MODES, timeout=540)
    return {mode: (code, output, reports[mode]) for mode in SHARED_MODES}


# What a task server prints when it serves (keras_distrib.strategies.
# parameter_server.task_server), relayed by the launcher.
SERVING = (
    r"\[(?P<label>(?:worker|ps) \d+)\] keras_distrib: (?P=label) serving on "
    r"(?P<address>\S+) \(pid (?P<pid>\d+)\)"
)


def _tasks(launcher_pid, task_type, index=None):
    """{pid: address} of the launcher's task_server children of `task_type`
    (the address the cluster gives each, from its TF_CONFIG)."""
    tasks = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read().split(b"\0")
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if b"keras_distrib.strategies.parameter_server.task_server" not in cmdline:
            continue
        config = [e for e in environ if e.startswith(b"TF_CONFIG=")]
        if not config:
            continue
        config = json.loads(config[0][len(b"TF_CONFIG=") :])
        task = config["task"]
        if task["type"] == task_type and (index is None or task["index"] == index):
            if os.getsid(int(entry)) == launcher_pid or _descends(int(entry), launcher_pid):
                tasks[int(entry)] = config["cluster"][task_type][task["index"]]
    return tasks


def _task_pids(launcher_pid, task_type, index=None):
    """Pids of the launcher's task_server children of `task_type`."""
    return list(_tasks(launcher_pid, task_type, index))


def _wait_until_restarted(proc, task_type, index, old_pid, timeout=90):
    """Waits until the launcher's new `task_type` `index` (a pid other than
    `old_pid`) accepts connections at its address."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, "the job ended before the task was restarted"
        assert time.monotonic() < deadline, f"{task_type} {index} was not restarted"
        new = [
            address for pid, address in _tasks(proc.pid, task_type, index).items() if pid != old_pid
        ]
        if new:
            host, port = new[0].rsplit(":", 1)
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
                return
            except OSError:
                pass
        time.sleep(0.1)


def _descends(pid, ancestor):
    while pid > 1:
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            return False
        if pid == ancestor:
            return True
    return False


def _wait_for(path, proc, timeout=200):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert proc.poll() is None, "the job ended before it was ready"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.2)


def _digits_layers():
    import keras

    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(64, activation="relu")(inputs)
    return inputs, keras.layers.Dense(10)(hidden)


def _digits_validation():
    import numpy as np

    sys.path.insert(0, os.path.join(helpers.ROOT, "examples"))
    from _digits import digits_arrays

    x, _ = digits_arrays()
    order = np.random.RandomState(0).permutation(len(x))
    return (x[order] / 16.0).astype("float32")[1500:]


# -- real clusters -------------------------------------------------------------------


@pytest.mark.slow
def test_digits_trains_asynchronously_as_well_as_plain_keras(shared):
    code, output, report = shared["digits"]
    assert code == 0, output[-3000:]
    assert report["placement"] == ["/job:ps/replica:0/task:0"]  # variables on the ps
    epochs = len(report["history"]["loss"])
    # Every scheduled step applied once, counted exactly under concurrency.
    assert report["iterations"] == report["applied"] == epochs * 47
    # Asynchronous SGD's accuracy moves from epoch to epoch (0.94 to 0.97
    # on this set, 8 of 297 samples), and plain Keras's is one unseeded run:
    # each is an accuracy measured on the same 297 samples, with a standard
    # error of sqrt(p (1 - p) / 297) (0.008 at p = 0.98). The best of the
    # last five epochs reaches plain Keras's within three standard errors
    # of the difference of two such accuracies.
    plain = report["plain_acc"]
    bound = 3 * math.sqrt(2 * plain * (1 - plain) / 297)
    assert max(report["history"]["val_acc"][-5:]) >= plain - bound, (plain, bound)
    # Exact: the share of the same 297 rows predicted right at the same
    # weights (a count over a count).
    assert report["evaluate"]["acc"] == report["history"]["val_acc"][-1]
    assert "[chief]" in output and "Epoch 10/10" in output


@pytest.mark.slow
def test_every_input_form_and_a_custom_train_step(shared):
    code, output, report = shared["inputs"]
    assert code == 0, output[-3000:]
    # 1500 samples, batch 50: 30 steps an epoch; the dataset function's
    # epoch is steps_per_epoch=12; the PyDataset has 10 batches.
    expected = {
        "arrays": 60,
        "dataset": 60,
        "dataset_fn": 24,
        "pydataset": 20,
        "steps_per_execution": 60,
        "custom": 60,
    }
    for name, steps in expected.items():
        assert report[name]["iterations"] == steps, name
        losses = report[name]["history"]["loss"]
        assert losses[1] < losses[0], name  # it learns
    # A metric object of the custom train_step, summed exactly over the
    # steps of each epoch though workers ran them concurrently.
    assert report["custom"]["history"]["seen"] == [1500.0, 1500.0]
    assert report["predict_rows"] == 297


@pytest.mark.slow
def test_learning_rate_warmup_follows_the_global_step(shared):
    code, output, report = shared["warmup"]
    assert code == 0, output[-3000:]
    import numpy as np

    # Exact: past the warmup the factor is 3 (1 + 2 x 1, exact), times the
    # rate as float32 holds it, rounded once, as numpy's float32 product is.
    final_lr = float(np.float32(0.05) * np.float32(3))
    for kind in ("float", "schedule"):
        assert report[kind]["iterations"] == 60
        assert report[kind]["schedule"] == "ScaledSchedule"
        assert report[kind]["final_lr"] == final_lr  # 3 x 0.05


@pytest.mark.slow
def test_remat_scope_trains_on_the_workers(shared):
    # The workers run the step the chief traced: with RematScope its
    # backward pass recomputes the layer's forward pass.
    code, output, report = shared["remat"]
    assert code == 0, output[-3000:]
    plain, remat = report["plain"], report["remat"]
    assert plain["iterations"] == remat["iterations"] == 60
    assert remat["forward_passes"] > plain["forward_passes"], report
    assert remat["loss"][-1] < remat["loss"][0]


@pytest.mark.slow
def test_variables_split_over_two_ps_train_and_save_whole(tmp_path, request):
    # Over two hosts (network namespaces, tests/netns_hosts.py) where this
    # machine can make them: the chief and worker 0 on one, worker 1 and
    # both ps on the other; else on this host.
    with contextlib.ExitStack() as stack:
        flags = ()
        if netns_hosts.unavailable() is None:
            bed = stack.enter_context(netns_hosts.TestBed(2))
            a, b = bed.addresses
            flags = ("--hosts", f"{a}:2,{b}:3", "--ssh", "--ssh_command", bed.ssh_command)
        code, output, report = _launch(tmp_path, "sharded", ps=2, launch_flags=flags)
    assert code == 0, output[-3000:]
    if flags:
        for task, host in (("worker 0", a), ("worker 1", b), ("ps 0", b), ("ps 1", b)):
            assert f"[{task}] keras_distrib: {task} serving on {host}:" in output
    parts = report["parts"]
    assert parts["embedding/embeddings"] == 2 and parts["dense/kernel"] == 2
    assert report["iterations"] == 3 * 40
    assert report["loss"][-1] < report["loss"][0]
    # Saved whole: a plain Keras model loads the files; loading back re-splits.
    assert report["weights_h5_max_diff"] == 0.0
    assert report["keras_max_diff"] == 0.0
    assert report["reloaded_max_diff"] == 0.0


@pytest.mark.slow
def test_epoch_level_callbacks_see_every_step_applied(shared):
    import csv

    import keras
    import numpy as np

    from bounds_distributed import outputs_apart_by_rows
    from float_bounds import assert_within

    code, output, report = shared["callbacks"]
    assert code == 0, output[-3000:]
    files, history = report["files"], report["history"]
    steps = report["steps_per_epoch"]
    epochs = len(history["loss"])
    assert epochs == 3  # EarlyStopping: no epoch improved on the first by 10
    assert report["iterations"] == epochs * steps
    # ModelCheckpoint: one file per epoch. EarlyStopping put the first
    # epoch's weights back into the variables on the ps.
    x_val = _digits_validation()
    plains, predictions = [], []
    for epoch in range(1, epochs + 1):
        plains.append(keras.Model(*_digits_layers()))
        plains[-1].load_weights(f"{files}/epoch-{epoch}.weights.h5")
        predictions.append(plains[-1].predict(x_val, verbose=0))
    # The chief's model and a plain one at the same weights: within what
    # other kernels' orders of sums change (float_bounds.outputs_apart).
    bound = outputs_apart_by_rows(plains[0], x_val)
    assert_within(report["predict"], predictions[0], bound, "predict")
    assert np.abs(predictions[-1] - predictions[0]).max() > 1e-3
    assert keras.saving.load_model(f"{files}/best.keras", compile=False) is not None
    # BackupAndRestore: the last backup counts every step of the 3 epochs.
    (backup,) = os.listdir(f"{files}/backup")
    state = json.load(open(f"{files}/backup/{backup}/state.json"))
    assert (state["epoch"], state["global_step"]) == (epochs, epochs * steps)
    # CSVLogger: the exact epoch logs.
    rows = list(csv.DictReader(open(f"{files}/log.csv")))
    # Exact: each float32 log is written as a text that reads back to it.
    assert [np.float32(r["loss"]) for r in rows] == [np.float32(v) for v in history["loss"]]
    # TensorBoard: the epoch scalars were written.
    logs = [f for _, _, fs in os.walk(f"{files}/tensorboard") for f in fs]
    assert any(f.startswith("events.out.tfevents") for f in logs)
    # ThroughputMonitor: the chief's batches are paced by the workers' steps
    # (it waits once `lag` closures are in flight), so the rate it reports
    # is that of training, not that of scheduling alone, which the workers'
    # steps would not pace at all (queueing a closure takes well under a
    # millisecond: over 32,000 samples/s, more than a hundred times the
    # whole fit's rate on a loaded machine). The whole fit's rate is a loose
    # yardstick: it also counts each epoch's validation and saved files,
    # which a loaded machine slows the most (CI saw the monitor's rate at 3.5
    # and at 12.6 times the whole fit's).
    overall = epochs * steps * 32 / report["seconds"]
    for rate in history["samples_per_sec"]:
        assert overall / 10 < rate < overall * 40, (rate, overall)
    # A batch-level callback that cannot work: a one-line error naming it.
    assert re.match(
        r"TensorBoard\(profile_batch=\.\.\.\) profiles the chief", report["profile_error"]
    )
    assert "\n" not in report["profile_error"]


@pytest.mark.slow
def test_a_lost_ps_is_one_line_and_a_rerun_resumes_from_the_last_backup(tmp_path):
    backup_dir = str(tmp_path / "backup")
    env = {"PS_BACKUP_DIR": backup_dir, "PS_EPOCHS": "60"}

    def kill_the_ps(proc, out):
        _wait_for(out + ".ready", proc)
        os.kill(_task_pids(proc.pid, "ps")[0], signal.SIGKILL)

    first = tmp_path / "first"
    first.mkdir()
    code, output, report = _launch(first, "resume", env=env, during=kill_the_ps)
    # The lost ps is one line; the chief fails on its own (the launcher did
    # not have to stop it, as it does when the chief runs on a while).
    assert code != 0 and report is None, output[-3000:]
    assert re.search(
        r"ParameterServerLostError: parameter server ps 0 \(127\.0\.0\.1:\d+\) "
        r"failed; its variables are lost",
        output,
    ), output[-3000:]
    assert (
        "[launcher] ps 0 exited (signal 9); not restarting it (its variables are lost); "
        "the chief should fail, else it is stopped in 60s."
    ) in output, output[-3000:]
    assert "keras-distrib: chief failed with exit code 1; last output:" in output
    assert "the chief still runs" not in output
    (backup,) = os.listdir(backup_dir)
    state = json.load(open(f"{backup_dir}/{backup}/state.json"))
    assert state["global_step"] >= 80  # backups every 20 steps; 47 an epoch

    # Three epochs on from the backup's: after two, asynchronous SGD's
    # accuracy can still be just under the bar on a loaded machine.
    env["PS_EPOCHS"] = str(state["epoch"] + 3)
    code, output, report = _launch(tmp_path, "resume", env=env)
    assert code == 0, output[-3000:]
    steps = report["steps_per_epoch"]
    assert state["global_step"] == state["epoch"] * steps + state["step"]
    # The new ps starts from the backup: weights, optimizer and step count,
    # which holds every step counted (the steps in flight landed first).
    assert report["iterations_at_start"] == state["global_step"]
    assert report["epochs_run"] == 3  # the rest of the backup's epoch, and two more
    assert report["iterations"] == (state["epoch"] + 3) * steps
    assert report["val_acc"] > 0.85
    assert not os.listdir(backup_dir)  # a finished fit removes its backups


@pytest.mark.slow
def test_bad_input_gives_one_line_errors(shared):
    code, output, report = shared["errors"]
    assert code == 0, output[-3000:]
    assert re.search(
        r"rebuilds the training dataset on every worker, but this one runs "
        r"Python \(.*GeneratorDataset.*\).*PyDataset",
        report["generator"],
    )
    assert "pass steps_per_epoch= to fit" in report["endless"]
    assert "the dataset repeats forever" in report["endless"]
    assert "class_weight is not supported" in report["class_weight"]
    assert "Muon(weight_decay=None, adam_weight_decay=None)" in report["muon"]
    assert report.pop("muon_without_decay") is None  # it trains
    # jit_compile=True: evaluate failed inside XLA ("Trying to access resource
    # ... located in device /job:ps/...") and was reported as a lost ps.
    assert report.pop("jit_compile") is None
    # Several inputs (a list) and outputs (a dict) of arrays: np.asarray made
    # the dict one 0-d object array ("too many indices for array").
    assert report.pop("list_and_dict") is None
    (warned,) = report.pop("jit_compile_warnings")
    assert "XLA cannot read the variables kept on the ps tasks" in warned
    for message in report.values():
        assert "\n" not in message


@pytest.mark.slow
def test_a_killed_worker_does_not_stop_training(tmp_path):
    killed = []

    def kill_a_worker(proc, out):
        _wait_for(out + ".ready", proc)
        pids = _task_pids(proc.pid, "worker", 1)
        assert len(pids) == 1
        os.kill(pids[0], signal.SIGKILL)
        killed.append(pids[0])
        # The chief holds after epoch 1 until the launcher's new worker 1
        # listens at the address the cluster knows (PS_HOLD).
        _wait_until_restarted(proc, "worker", 1, pids[0])
        open(out + ".go", "w").close()

    code, output, report = _launch(tmp_path, "long", during=kill_a_worker, env={"PS_HOLD": "1"})
    assert killed and code == 0, output[-3000:]
    # The launcher started it again, serving at the address the cluster knows.
    assert "[launcher] worker 1 exited (signal 9); restarting it (restart 1)" in output, output[
        -3000:
    ]
    serving = [
        m.group("address", "pid") for m in re.finditer(SERVING, output) if m["label"] == "worker 1"
    ]
    assert len(serving) == 2 and serving[0][0] == serving[1][0], serving
    assert serving[0][1] == str(killed[0]) != serving[1][1]
    # At least once: every scheduled step was applied, a re-run closure's
    # steps possibly twice; the counter on the ps counts every application.
    assert report["iterations"] >= report["scheduled"]
    assert report["iterations"] >= report["applied"]
    # Results lost with the worker are at most what it had in flight.
    assert report["lost_results"] <= 4 * 2
    print(
        "steps applied twice:",
        report["iterations"] - report["scheduled"],
        "of",
        report["scheduled"],
        "| results lost with the worker:",
        report["lost_results"],
    )
    assert report["loss"][-1] < report["loss"][0]
