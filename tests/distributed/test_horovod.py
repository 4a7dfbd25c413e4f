"""Strategy "horovod": real ranks under `horovodrun --gloo` on localhost.

Every test skips where `horovod.tensorflow` cannot be imported (the
Makefile builds it for CI with scripts/install_horovod.sh). One process
without horovodrun, and the missing-Horovod error (tested everywhere), are
in tests/integration/test_horovod_in_process.py.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import as_reference
import netns_hosts
from helpers import (
    CLASSES,
    ROOT,
    WORKERS,
    kill_process_group,
    train_single,
)

WORKER = os.path.join(WORKERS, "hvd_train.py")
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")
BATCH, EPOCHS = 32, 2


# -- running ranks --------------------------------------------------------------


def _run(argv, out, timeout, env=None):
    """Runs `argv` in its own process group (`env` added to the environment);
    kills what is left, always."""
    env = dict(
        os.environ,
        TF_CPP_MIN_LOG_LEVEL="2",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
        **(env or {}),
    )
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # horovodrun stops its ranks on SIGTERM (and its per-rank middlemen
        # kill their rank when it dies, whatever way it dies).
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        pytest.fail(f"{argv[:3]} did not finish in {timeout}s:\n{output[-4000:]}")
    finally:
        kill_process_group(proc)
    assert proc.returncode == 0, output[-6000:]
    return _read(out), output


def _read(out, n=2):
    ranks = []
    for r in range(n):
        with open(out / f"rank{r}.json") as f:
            result = json.load(f)
        arrays = np.load(out / f"rank{r}.npz")
        count = len([k for k in arrays.files if k.startswith("final_")])
        result["initial"] = [arrays[f"initial_{i}"] for i in range(count)]
        result["final"] = [arrays[f"final_{i}"] for i in range(count)]
        if "predict" in arrays.files:
            result["predict"] = arrays["predict"]
        for part in ("initial", "final"):
            result[f"control_{part}"] = [
                arrays[f"control_{part}_{i}"]
                for i in range(count)
                if f"control_{part}_{i}" in arrays.files
            ]
        ranks.append(result)
    return ranks


def _horovodrun(out, *args, timeout=240):
    argv = [
        HOROVODRUN,
        "-np",
        "2",
        "-H",
        "localhost:2",
        "--gloo",
        sys.executable,
        WORKER,
        "--out",
        str(out),
        *args,
    ]
    return _run(argv, out, timeout)


@pytest.fixture(scope="module")
def trained(hvd, tmp_path_factory):
    """2 ranks from different initial weights; 256 samples (even split).
    Then the control: the same ranks and shards, each training plain
    "single" alone from the same weights."""
    out = tmp_path_factory.mktemp("hvd")
    return _horovodrun(
        out, "--samples", "256", "--seed_per_rank", "--validation", "64", "--control"
    )


@pytest.fixture(scope="module")
def launched(hvd, tmp_path_factory):
    """Through `keras-distrib launch --backend horovod`; 203 samples (uneven).

    `--n` also proves the script's flags reach it untouched: horovodrun
    itself would reject `--n` as an ambiguous abbreviation of its options.
    Rank 0 makes a model of its own first (`--rank0_extra_model`), so its
    layers and model are named `dense_1`, `functional_1`, ... where rank 1's
    are `dense`, `functional`: Horovod named its collectives after them, and
    the ranks waited for each other for good.

    On two hosts where this machine can make them (network namespaces,
    tests/netns_hosts.py): the launcher runs on host 0 and horovodrun
    reaches host 1 with `ssh` (the test bed's), so Gloo works across the
    link; else both ranks run here. Returns (ranks, output, the hosts).
    """
    out = tmp_path_factory.mktemp("hvd_launch")
    launcher = [
        sys.executable,
        "-m",
        "keras_distrib.launch",
        "launch",
        "--backend",
        "horovod",
        "-n",
        "2",
        "--timeout",
        "220",
    ]
    script = [WORKER, "--out", str(out), "--n", "203", "--seed_per_rank", "--rank0_extra_model"]
    with contextlib.ExitStack() as stack:
        if netns_hosts.unavailable() is not None:
            return (*_run(launcher + script, out, timeout=240), None)
        bed = stack.enter_context(netns_hosts.TestBed(2))
        path = bed.ssh_program(str(out)) + os.pathsep + os.environ["PATH"]
        argv = bed.on(0, launcher + ["--hosts", bed.hosts_flag()] + script)
        return (*_run(argv, out, timeout=240, env={"PATH": path}), bed.addresses)


@pytest.fixture(scope="module")
def single(trained):
    """(`train_single` from rank 0's initial weights, traced, x, y): the
    one-process run `trained`'s ranks must equal, within the bounds of
    float32's rounding of its math in other orders (tests/float_bounds.py)."""
    ranks, _ = trained
    return train_single(ranks[0]["initial"], 256, BATCH, EPOCHS, validation=64)


# -- (a) different starts and data, identical ends equal to one process --------


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ranks_start_different_end_identical_and_equal_single_process(trained, single):
    ranks, _ = trained
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["world_size"] == 2 and r["num_replicas"] == 2 for r in ranks)
    # Different random starts: only the broadcast can make them agree.
    assert any(not np.allclose(a, b) for a, b in zip(ranks[0]["initial"], ranks[1]["initial"]))
    for got, want in zip(ranks[1]["final"], ranks[0]["final"]):
        np.testing.assert_array_equal(got, want)
    reference, x, y = single
    steps = EPOCHS * 256 // BATCH
    assert steps >= 10
    for r in ranks:
        assert r["iterations"] == steps
        as_reference.assert_weights(reference, r["final"])
        as_reference.assert_history(reference, r["history"], ("loss", "accuracy"))
        # val_loss, val_accuracy
        as_reference.assert_validation(reference, r["history"], x[:64], y[:64], BATCH)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ranks_see_disjoint_shards_covering_the_data(trained):
    ranks, _ = trained
    seen = [set(r["seen"]) for r in ranks]
    assert all(len(r["seen"]) == 128 for r in ranks)
    assert not seen[0] & seen[1]
    assert seen[0] | seen[1] == set(range(256))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_initial_state_broadcast_once_per_variable_set(trained):
    ranks, _ = trained
    for r in ranks:
        # model + optimizer variables, once, for fit (with validation),
        # evaluate and predict together.
        assert r["broadcasts"] == [sum(r["num_variables"])]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_only_rank_0_prints_progress(trained):
    _, output = trained
    assert "[0]<stdout>:Epoch 1/2" in output
    assert "[1]<stdout>:Epoch" not in output


# -- (b) the control: without the strategy, ranks diverge ----------------------


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_control_without_strategy_ends_different(trained):
    ranks, _ = trained
    for got, want in zip(ranks[1]["control_initial"], ranks[0]["control_initial"]):
        np.testing.assert_array_equal(got, want)  # same start
    assert ranks[0]["control_initial"]
    assert all(r["control_iterations"] == EPOCHS * 128 // (BATCH // 2) for r in ranks)
    assert any(
        np.abs(a - b).max() > 1e-3
        for a, b in zip(ranks[0]["control_final"], ranks[1]["control_final"])
    )


# -- (c) evaluate / predict ----------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_evaluate_and_predict_match_single_process_on_every_rank(trained, single):
    ranks, _ = trained
    reference, x, y = single
    for r in ranks:
        as_reference.assert_evaluate(reference, r["evaluate"], x, y, BATCH)
        assert r["predict"].shape == (len(x), CLASSES)
        as_reference.assert_predict(reference, r["predict"], x, BATCH)


# -- the strategy's collectives, on known per-rank values -------------------------


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_collectives(trained):
    ranks, _ = trained
    dtypes = ["float32", "float16", "bfloat16", "int32", "float64", "int64"]
    for r in ranks:
        c = r["collectives"]
        for key in ("eager_sum", "graph_sum"):  # mixed dtypes: order and dtypes kept
            assert c[key] == [[d, [3.0, 3.0, 3.0]] for d in dtypes], key
        assert c["graph_mean"] == [1.0, 4.0]
        assert c["concat_rows"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]  # rank order
        assert c["concat_scalars"] == [0.0, 1.0]
        assert c["sync_sum"] == [3.0, [0, 1, 2]]
        assert c["sync_gather"] == [[0, 0], [1, 10]]
        assert c["seed"] == 1234
        assert c["broadcast"] == [[10.0, 10.0], 7, True]


# -- (d) through the launcher ---------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_launch_backend_horovod_trains_like_one_process(launched):
    ranks, output, hosts = launched
    assert [r["rank"] for r in ranks] == [0, 1]
    if hosts is not None:  # one rank on each host
        assert [r["hostname"] for r in ranks] == hosts
    names = [r["names"] for r in ranks]
    assert len(names[0]) == len(names[1]) and names[0] != names[1], names
    assert any(not np.allclose(a, b) for a, b in zip(ranks[0]["initial"], ranks[1]["initial"]))
    for got, want in zip(ranks[1]["final"], ranks[0]["final"]):
        np.testing.assert_array_equal(got, want)
    # 203 samples: the last batch of 11 splits 6/5, which the summed
    # gradients weight exactly.
    reference, x, y = train_single(ranks[0]["initial"], 203, BATCH, EPOCHS)
    for r in ranks:
        assert r["iterations"] == EPOCHS * 7
        as_reference.assert_weights(reference, r["final"])
        as_reference.assert_predict(reference, r["predict"], x, BATCH)
        # Metrics are the global ones, also for the unequal shares here (102
        # and 101 samples; averaging each rank's value, as Horovod does, was
        # 5e-3 off): within float32's rounding.
        as_reference.assert_evaluate(reference, r["evaluate"], x, y, BATCH)
        assert sorted(r["history"]) == sorted(reference.logs)
        as_reference.assert_history(reference, r["history"], list(reference.logs))
    assert "[rank 0] Epoch 1/2" in output and "<stdout>:" not in output
