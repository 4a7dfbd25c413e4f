"""Keras 3 variables sharded over parameter servers
(keras_distrib.strategies.parameter_server.sharded_variables).

A real cluster: 2 ps and 2 worker TF servers, processes shared by the tests
of this file; each test's coordinator ("chief") is a fresh process
(`python tests/workers/sharded_ps.py chief ...`), with
`ParameterServerStrategy(variable_partitioner=MinSizePartitioner(256, 2))`
and `ClusterCoordinator`. The chief writes what it measured to a directory;
the test compares with a plain Keras model (no strategy) in this process.

Sharded variables without a cluster (a variable creator splits variables
into `ShardedVariable`s in this process, as the strategy does) are tested in
tests/integration/test_sharded_variables_in_process.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import as_reference
from float_bounds import assert_within
from helpers import CHILD_PYTHONPATH, ROOT, WORKERS, kill_process_group

sys.path.insert(0, WORKERS)
from sharded_ps import (  # noqa: E402
    EXPECTED_PARTS,
    OPTIMIZERS,
    STEPS,
    build_model,
    data,
    initial_weights,
    loss_fn,
    plain_replay,
)

WORKER = os.path.join(WORKERS, "sharded_ps.py")


def _spawn(*args, log):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=CHILD_PYTHONPATH)
    return subprocess.Popen(
        [sys.executable, WORKER, *args],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """2 ps and 2 worker servers; yields the cluster spec (chief included)."""
    from keras_distrib.cluster import free_ports

    logs = tmp_path_factory.mktemp("servers")
    ports = free_ports(5)
    spec = {
        "chief": [f"127.0.0.1:{ports[0]}"],
        "worker": [f"127.0.0.1:{p}" for p in ports[1:3]],
        "ps": [f"127.0.0.1:{p}" for p in ports[3:5]],
    }
    procs = []
    try:
        for job in ("ps", "worker"):
            for index in range(len(spec[job])):
                with open(logs / f"{job}{index}.log", "w") as log:
                    procs.append(_spawn("server", json.dumps(spec), job, str(index), log=log))
        _wait_listening(ports[1:], procs, logs)
        yield spec
    finally:
        for proc in procs:
            kill_process_group(proc)


def _wait_listening(ports, procs, logs, timeout=120):
    """Until every server accepts connections; fails if one exits."""
    deadline = time.monotonic() + timeout
    waiting = list(ports)
    while waiting:
        dead = [p.args[4:] for p in procs if p.poll() is not None]
        assert not dead and time.monotonic() < deadline, (
            f"servers not up (exited: {dead}):\n"
            + "\n".join(f.read_text()[-2000:] for f in sorted(logs.iterdir()))
        )
        try:
            socket.create_connection(("127.0.0.1", waiting[0]), timeout=1).close()
            waiting.pop(0)
        except OSError:
            time.sleep(0.2)


def run_chief(cluster, mode, out, timeout=240):
    """Runs a fresh coordinator process; fails with its output's tail."""
    with open(out / "chief.log", "w") as log:
        proc = _spawn("chief", json.dumps(cluster), mode, str(out), log=log)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = "timeout"
        finally:
            kill_process_group(proc)
    output = (out / "chief.log").read_text()
    assert code == 0, f"chief exited {code}:\n{output[-5000:]}"
    with open(out / "report.json") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def trained(cluster, tmp_path_factory):
    out = tmp_path_factory.mktemp("train")
    return out, run_chief(cluster, "train", out)


def assert_sharded_as_expected(weights, slots):
    """Weights split as EXPECTED_PARTS, parts on distinct ps; each slot of a
    weight split the same way, part i on weight part i's ps."""
    assert {p: [rows for rows, _ in layout] for p, layout in weights.items()} == EXPECTED_PARTS
    for path, layout in weights.items():
        devices = [device for _, device in layout]
        assert len(set(devices)) == len(devices), (path, devices)
        assert all("/job:ps/" in d for d in devices), (path, devices)
        mine = [
            layout_
            for p, layout_ in slots.items()
            if p.split("/", 1)[1].startswith(path.replace("/", "_") + "_")
        ]
        assert mine, path
        for slot in mine:
            assert slot == layout, (path, slot, layout)


@pytest.mark.slow
def test_variables_and_slots_are_sharded_on_the_weights_ps(trained):
    _, report = trained
    for name in OPTIMIZERS:
        run = report[name]
        assert_sharded_as_expected(run["weights"], run["slots"])
        assert run["grad_types"]["embedding/embeddings"] == "IndexedSlices", run["grad_types"]
        assert run["grad_types"]["hidden/kernel"] != "IndexedSlices", run["grad_types"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_sharded_training_equals_plain_training(trained, name):
    """One step at a time: the same as a plain model on the same batches,
    within the bounds of float32's rounding of its math in other orders
    (the plain run traced, tests/float_bounds.py): each step's loss, the
    weights and the optimizer's variables."""
    out, report = trained
    run = np.load(out / f"{name}.npz")
    losses = report[name]["losses"]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.2, losses
    model, optimizer, _, reference = plain_replay(name, run["x"], run["y"])
    as_reference.assert_history(reference, {"loss": losses}, ("loss",), steps_per_epoch=1)
    as_reference.assert_weights(reference, [run[f"w{i}"] for i in range(len(model.weights))])
    assert len(optimizer.variables) == len([k for k in run.files if k.startswith("o")])
    assert len(reference.slots) == len(optimizer.variables)
    for i, (v, bound) in enumerate(zip(optimizer.variables, reference.slots)):
        assert_within(run[f"o{i}"], v.numpy(), bound, v.path)


@pytest.mark.slow
def test_asynchronous_workers_train_sharded_variables(trained):
    out, report = trained
    run = report["async"]
    # Keras counts steps with `iterations.assign(iterations + 1)`, which
    # concurrent steps can overlap (measured: 26 of 30); weights are written
    # by TF assign_sub/assign_add only.
    assert 0 < run["iterations"] <= STEPS
    # Learned: the loss over the whole training set (not the racing steps'
    # own 16-row batch losses, whose first/last means are too noisy to
    # compare) falls from the initial weights to the trained ones.
    x, y = data(2)
    model = build_model()
    trained_weights = np.load(out / "async.npz")
    whole_set_loss = {}
    for when, weights in (
        ("initial", initial_weights()),
        ("trained", [trained_weights[f"arr_{i}"] for i in range(len(trained_weights.files))]),
    ):
        model.set_weights(weights)
        whole_set_loss[when] = float(loss_fn()(y, model(x)))
    assert whole_set_loss["trained"] < whole_set_loss["initial"] - 0.1, whole_set_loss


@pytest.mark.slow
def test_saved_files_load_into_plain_and_sharded_models(cluster, tmp_path):
    import keras

    report = run_chief(cluster, "save", tmp_path)
    saved = np.load(tmp_path / "saved.npz")
    weights = [saved[f"w{i}"] for i in range(len(EXPECTED_PARTS))]
    reference = build_model()
    reference.set_weights(weights)
    x, _ = data(seed=5, n=64)
    expected = reference.predict(x, verbose=0)

    plain = build_model()
    plain.load_weights(tmp_path / "sharded.weights.h5")
    np.testing.assert_array_equal(plain.predict(x, verbose=0), expected)

    loaded = keras.models.load_model(tmp_path / "sharded.keras")
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), expected)
    slots = loaded.optimizer.variables
    assert len(slots) == len([k for k in saved.files if k.startswith("o")])
    for i, v in enumerate(slots):
        np.testing.assert_array_equal(v.numpy(), saved[f"o{i}"], err_msg=v.path)

    # load_weights into fresh sharded models: whole values and their parts.
    assert {p: [r for r, _ in layout] for p, layout in report["loaded"].items()} == EXPECTED_PARTS
    plain_file = np.load(tmp_path / "plain.npz")
    for name, source in (("sharded", saved), ("plain", plain_file)):
        loaded = np.load(tmp_path / f"loaded_{name}.npz")
        for i, rows in enumerate(EXPECTED_PARTS.values()):
            np.testing.assert_array_equal(loaded[f"w{i}"], source[f"w{i}"])
            starts = np.cumsum([0] + rows)
            for j in range(len(rows)):
                np.testing.assert_array_equal(
                    loaded[f"p{i}_{j}"], source[f"w{i}"][starts[j] : starts[j + 1]]
                )

    # The .keras file loaded in the strategy's scope, then install().
    reloaded = report["reloaded"]
    assert reloaded["same_weights"] and reloaded["same_slots"]
    assert any("/job:chief/" in layout[0][1] for layout in reloaded["slots_as_loaded"].values())
    assert_sharded_as_expected(reloaded["weights"], reloaded["slots"])
