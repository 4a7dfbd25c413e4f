"""Hybrid data x model parallelism: 2 workers x 2 logical CPUs, through the launcher.

Each worker holds the test MLP split over its two devices (tensor parallel,
or a 2-stage pipeline under both schedules) and the workers are
data-parallel. The core assertion: after 14 SGD steps the weights, logs,
`evaluate` and `predict` equal those of `"single"` with the same global
batch, with the workers on one host (shared memory between them) and on
two hosts (TF's ring over the link between them).
The hybrid options in one process: tests/integration/test_hybrid_options.py.
"""

import contextlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import as_reference
from helpers import CLASSES, ROOT, WORKERS, build, make_data
from netns_hosts import TestBed

WORKER = os.path.join(WORKERS, "hybrid_train.py")
RUNS = ["tensor_parallel", "gpipe", "1f1b", "tensor_parallel_spe3", "1f1b_ours"]
BATCH, EPOCHS = 32, 2
UNEVEN_BATCH = 36  # tests/workers/hybrid_train.py's


@pytest.fixture(scope="module")
def single():
    """ "single" with the same global batch, traced: the bounds of float32's
    rounding of its math in other orders (tests/float_bounds.py)."""
    x, y = make_data()
    return as_reference.fit(build("functional", "single"), x, y, BATCH, EPOCHS), x, y


@pytest.fixture(scope="module")
def single_uneven():
    """The same for one epoch of `UNEVEN_BATCH`."""
    x, y = make_data()
    return as_reference.fit(build("functional", "single"), x, y, UNEVEN_BATCH)


# The two workers on one host (shared memory between them) or on two hosts
# (network namespaces, tests/netns_hosts.py: TensorFlow's ring or our TCP
# ring between them, as "auto" measures).
@pytest.fixture(scope="module", params=["one host", "two hosts"], ids=["shm", "2hosts-ring"])
def launched(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("hybrid")
    env = dict(os.environ, TMPDIR=str(out), TF_CPP_MIN_LOG_LEVEL="2")
    argv = [sys.executable, "-m", "keras_distrib.launch", "launch", "-n", "2", "--timeout", "200"]
    with contextlib.ExitStack() as stack:
        if request.param == "two hosts":
            request.getfixturevalue("netns_usable")
            bed = stack.enter_context(TestBed(2))
            argv += ["--hosts", bed.hosts_flag(), "--ssh", "--ssh_command", bed.ssh_command]
        proc = subprocess.run(
            [*argv, WORKER, "--out", str(out)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = {}
    for run in RUNS:
        for rank in range(2):
            with open(out / f"{run}-rank{rank}.json") as f:
                result = json.load(f)
            arrays = np.load(out / f"{run}-rank{rank}.npz")
            result["predict"] = arrays["predict"]
            result["weights"] = [arrays[f"arr_{i}"] for i in range(len(arrays.files) - 1)]
            results[run, rank] = result
    return request.param, out, results


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS)
def test_hybrid_equals_single_device(launched, single, run):
    where, _, results = launched
    reference, x, y = single
    for rank in range(2):
        r = results[run, rank]
        assert (r["rank"], r["world_size"], r["num_replicas"]) == (rank, 2, 2)
        # Across hosts "auto" is TensorFlow's collectives or our TCP ring,
        # whichever it measured faster; never shared memory.
        assert r["implementation"] in (("shm",) if where == "one host" else ("auto", "tcp"))
        assert r["devices"] == [0, 1]  # the model really spans both local devices
        assert r["iterations"] == EPOCHS * -(-203 // BATCH)
        for got, mine in zip(r["weights"], results[run, 0]["weights"]):
            np.testing.assert_array_equal(got, mine)  # replicas identical
        as_reference.assert_weights(reference, r["weights"])
        # Epoch logs: the global values.
        as_reference.assert_history(reference, r["history"], ("loss", "accuracy"))
        as_reference.assert_evaluate(reference, r["evaluate"], x, y, BATCH)
        assert r["predict"].shape == (len(x), CLASSES)  # every row, in order
        as_reference.assert_predict(reference, r["predict"], x, BATCH)


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS)
def test_chief_checkpoint_loads_into_plain_keras(launched, single, run):
    _, out, _ = launched
    plain = build("functional", "single", compile_model=False)
    plain.load_weights(out / f"{run}.weights.h5")
    as_reference.assert_weights(single[0], plain)


@pytest.mark.slow
def test_our_callbacks_and_optimizer_run_under_hybrid(launched):
    """`1f1b_ours` (equal to single above) trained with DistributedOptimizer,
    BackupAndRestore(save_freq=5), ReplicaConsistencyCheck, ThroughputMonitor."""
    _, out, _ = launched
    backups = os.listdir(out / "1f1b_ours-backup")
    assert backups, "the chief wrote no backup"


@pytest.mark.slow
@pytest.mark.parametrize("run", ["gpipe", "1f1b"])
def test_a_batch_micro_batches_and_workers_cannot_share_evenly_trains_as_one_device(
    launched, single_uneven, run
):
    _, out, _ = launched
    for rank in (0, 1):
        got = np.load(out / f"{run}-rank{rank}-uneven.npz")
        as_reference.assert_weights(
            single_uneven, [got[f"arr_{i}"] for i in range(len(got.files))], err_msg=f"rank {rank}"
        )
