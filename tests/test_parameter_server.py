"""strategy='parameter_server': real clusters of processes started by the launcher.

`keras-distrib launch --workers N --ps M` runs tests/workers/ps_train.py on
the chief (the coordinator) and TensorFlow servers on the worker and ps
tasks. Each test is one launch; the launcher's process group is killed
whatever happens.
"""

import json
import os
import re
import signal
import time

import pytest

import helpers

import keras_distrib as kd

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "ps_train.py")


def _launch(tmp_path, mode, workers=2, ps=1, timeout=400, env=None, during=None):
    """Runs the chief script in `mode` under the launcher; returns (code, output, report)."""
    out = str(tmp_path / f"{mode}.json")
    code, output = helpers.launch(
        tmp_path, workers, SCRIPT, mode, out, launch_flags=("--ps", str(ps)), timeout=timeout,
        expect=None, env=env, during=during and (lambda proc: during(proc, out)))
    report = json.load(open(out)) if os.path.exists(out) else None
    return code, output, report


def _task_pids(launcher_pid, task_type, index=None):
    """Pids of the launcher's task_server children of `task_type`."""
    pids = []
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
        if b"keras_distrib.task_server" not in cmdline:
            continue
        config = [e for e in environ if e.startswith(b"TF_CONFIG=")]
        if not config:
            continue
        task = json.loads(config[0][len(b"TF_CONFIG="):])["task"]
        if task["type"] == task_type and (index is None or task["index"] == index):
            if os.getsid(int(entry)) == launcher_pid or _descends(int(entry), launcher_pid):
                pids.append(int(entry))
    return pids


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


# -- in process: configuration errors ---------------------------------------------


def test_no_cluster_is_a_one_line_error(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError, match=r"needs a cluster with 'chief', 'worker' and 'ps' "
                                         r"tasks .* keras-distrib launch --workers 2 --ps 1") as e:
        kd.strategies.get("parameter_server")
    assert "\n" not in str(e.value)


def test_a_cluster_without_ps_is_a_one_line_error(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
        "task": {"type": "worker", "index": 0}}))
    with pytest.raises(ValueError, match="needs 'ps' tasks in the cluster, and it has none"):
        kd.strategies.get("ps")


def test_a_cluster_without_chief_is_a_one_line_error(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]},
        "task": {"type": "worker", "index": 0}}))
    with pytest.raises(ValueError, match="needs a 'chief' task"):
        kd.strategies.get("parameter_server")


def test_auto_picks_parameter_server_when_the_cluster_has_ps(monkeypatch):
    from keras_distrib.strategies import registry

    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]},
        "task": {"type": "chief", "index": 0}}))
    assert registry._auto_name() == "parameter_server"
    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
        "task": {"type": "worker", "index": 0}}))
    assert registry._auto_name() == "multi_worker"


# -- real clusters -------------------------------------------------------------------


@pytest.mark.slow
def test_digits_trains_asynchronously_as_well_as_plain_keras(tmp_path):
    code, output, report = _launch(tmp_path, "digits")
    assert code == 0, output[-3000:]
    assert report["placement"] == ["/job:ps/replica:0/task:0"]  # variables on the ps
    epochs = len(report["history"]["loss"])
    # Every scheduled step applied once, counted exactly under concurrency.
    assert report["iterations"] == report["applied"] == epochs * 47
    assert abs(report["history"]["val_acc"][-1] - report["plain_acc"]) <= 0.02
    assert report["evaluate"]["acc"] == pytest.approx(report["history"]["val_acc"][-1])
    assert "[chief]" in output and "Epoch 20/20" in output


@pytest.mark.slow
def test_every_input_form_and_a_custom_train_step(tmp_path):
    code, output, report = _launch(tmp_path, "inputs")
    assert code == 0, output[-3000:]
    # 1500 samples, batch 50: 30 steps an epoch; the dataset function's
    # epoch is steps_per_epoch=12; the PyDataset has 10 batches.
    expected = {"arrays": 60, "dataset": 60, "dataset_fn": 24, "pydataset": 20,
                "steps_per_execution": 60, "custom": 60}
    for name, steps in expected.items():
        assert report[name]["iterations"] == steps, name
        losses = report[name]["history"]["loss"]
        assert losses[1] < losses[0], name  # it learns
    # A metric object of the custom train_step, summed exactly over the
    # steps of each epoch though workers ran them concurrently.
    assert report["custom"]["history"]["seen"] == [1500.0, 1500.0]
    assert report["predict_rows"] == 297


@pytest.mark.slow
def test_learning_rate_warmup_follows_the_global_step(tmp_path):
    code, output, report = _launch(tmp_path, "warmup")
    assert code == 0, output[-3000:]
    for kind in ("float", "schedule"):
        assert report[kind]["iterations"] == 60
        assert report[kind]["schedule"] == "ScaledSchedule"
        assert report[kind]["final_lr"] == pytest.approx(0.15, rel=1e-5)  # 3 x 0.05


@pytest.mark.slow
def test_variables_split_over_two_ps_train_and_save_whole(tmp_path):
    code, output, report = _launch(tmp_path, "sharded", ps=2)
    assert code == 0, output[-3000:]
    parts = report["parts"]
    assert parts["embedding/embeddings"] == 2 and parts["dense/kernel"] == 2
    assert report["iterations"] == 3 * 40
    assert report["loss"][-1] < report["loss"][0]
    # Saved whole: a plain Keras model loads the files; loading back re-splits.
    assert report["weights_h5_max_diff"] == 0.0
    assert report["keras_max_diff"] == 0.0
    assert report["reloaded_max_diff"] == 0.0


@pytest.mark.slow
def test_bad_input_gives_one_line_errors(tmp_path):
    code, output, report = _launch(tmp_path, "errors", workers=1)
    assert code == 0, output[-3000:]
    assert re.search(r"rebuilds the training dataset on every worker, but this one runs "
                     r"Python \(.*GeneratorDataset.*\).*PyDataset", report["generator"])
    assert "pass steps_per_epoch= to fit" in report["endless"]
    assert "the dataset repeats forever" in report["endless"]
    assert "class_weight is not supported" in report["class_weight"]
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

    code, output, report = _launch(tmp_path, "long", during=kill_a_worker)
    assert killed and code == 0, output[-3000:]
    # At least once: every scheduled step was applied, a re-run closure's
    # steps possibly twice; the counter on the ps counts every application.
    assert report["iterations"] >= report["scheduled"]
    assert report["iterations"] >= report["applied"]
    # Results lost with the worker are at most what it had in flight.
    assert report["lost_results"] <= 4 * 2
    print("steps applied twice:", report["iterations"] - report["scheduled"],
          "of", report["scheduled"], "| results lost with the worker:", report["lost_results"])
    assert report["loss"][-1] < report["loss"][0]


@pytest.mark.slow
def test_a_killed_ps_is_a_one_line_error_and_nothing_is_left(tmp_path):
    started = []

    def kill_the_ps(proc, out):
        _wait_for(out + ".ready", proc)
        pids = _task_pids(proc.pid, "ps")
        assert len(pids) == 1
        started.append(time.monotonic())
        os.kill(pids[0], signal.SIGKILL)

    code, output, report = _launch(tmp_path, "long", env={"PS_EPOCHS": "200"},
                                   during=kill_the_ps)
    assert started and code != 0
    assert time.monotonic() - started[0] < 90
    assert re.search(r"ParameterServerLostError: parameter server ps 0 \(127\.0\.0\.1:\d+\) "
                     r"failed; its variables are lost", output), output[-3000:]
    assert report is None
