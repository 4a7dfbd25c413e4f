"""A strategy named by a string works wherever the model is built.

Real processes: `keras-distrib launch -n 2`, and
`keras-distrib launch --backend horovod -n 2`, run a script that imports
Keras first, creates TensorFlow objects before any model, and builds each
usage form with `strategy="multi_worker"` / `"auto"` / `"horovod"` as a
string. Every worker must end with the weights one process gets with
`"single"` and the same global batch.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import as_reference
from helpers import ROOT, WORKERS, build, kill_process_group, launch, make_data

WORKER = os.path.join(WORKERS, "by_name.py")
FORMS = ("functional", "subclass", "from_model")
BATCH, EPOCHS = 30, 2  # 203 samples: 7 steps per epoch, 14 SGD steps


@pytest.fixture(scope="module")
def single():
    """ "single" with the same global batch, traced: the bounds of float32's
    rounding of its math in other orders (tests/float_bounds.py); x, y."""
    x, y = make_data()
    return as_reference.fit(build("functional", "single"), x, y, BATCH, EPOCHS), x, y


def _weights(out, name, form, rank):
    arrays = np.load(out / f"{name}-{form}-rank{rank}.npz")
    return [arrays[f"arr_{i}"] for i in range(len(arrays.files))]


def _launch(out, n, names, *launch_flags, script_args=(), timeout=300):
    launch(
        out,
        n,
        WORKER,
        "--out",
        str(out),
        "--names",
        ",".join(names),
        "--batch",
        str(BATCH),
        "--epochs",
        str(EPOCHS),
        *script_args,
        launch_flags=launch_flags,
        timeout=timeout,
    )
    return [json.load(open(out / f"summary-rank{r}.json")) for r in range(n)]


def _check(out, summaries, names, expected_strategy, n, single, forms=FORMS):
    reference, x, y = single
    for name in names:
        for form in forms:
            for r in range(n):
                got = summaries[r][f"{name}-{form}"]
                assert got["strategy"] == expected_strategy and got["rank"] == r
                assert got["world_size"] == n and got["iterations"] == 14
                as_reference.assert_evaluate(reference, got["evaluate"], x, y, BATCH)
                as_reference.assert_weights(
                    reference, _weights(out, name, form, r), err_msg=f"{name} {form} rank {r}"
                )
    assert all(s["before"] == [6.0, 12] for s in summaries)


# 2 workers: the name resolves as with any number (3 workers equal one
# process in tests/distributed/test_multi_worker.py).
@pytest.mark.slow
def test_launch_multi_worker_and_auto_by_name_with_steps_per_execution(tmp_path, single):
    names = ["multi_worker", "auto"]
    # With 7 batches per epoch and 4 steps per execution, the last execution
    # of each epoch runs 3 steps, as plain Keras does: 14 steps, not 16.
    summaries = _launch(tmp_path, 2, names, script_args=("--steps_per_execution", "4"))
    _check(tmp_path, summaries, names, "multi_worker", 2, single)


@pytest.mark.slow
def test_launch_horovod_and_auto_by_name(tmp_path, single):
    pytest.importorskip("horovod.tensorflow")
    names = ["horovod", "auto"]
    summaries = _launch(tmp_path, 2, names, "--backend", "horovod")
    # evaluate's metrics are the global ones also where the last batch
    # splits 12/11 (averaging each rank's value would be off by more).
    _check(tmp_path, summaries, names, "horovod", 2, single)


@pytest.mark.slow
def test_hand_set_tf_config_with_chief_role(tmp_path, single):
    """Kubeflow-style TF_CONFIG (a chief and a worker), set by hand."""
    from keras_distrib import cluster

    ports = cluster.free_ports(2)
    spec = {"chief": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"]}
    procs = []
    try:
        for task in ({"type": "chief", "index": 0}, {"type": "worker", "index": 0}):
            env = dict(
                os.environ,
                TF_CPP_MIN_LOG_LEVEL="2",
                TF_CONFIG=json.dumps({"cluster": spec, "task": task}),
            )
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        WORKER,
                        "--out",
                        str(tmp_path),
                        "--names",
                        "auto",
                        "--forms",
                        "functional",
                        "--batch",
                        str(BATCH),
                        "--epochs",
                        str(EPOCHS),
                    ],
                    cwd=ROOT,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                )
            )
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            kill_process_group(p)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    summaries = [json.load(open(tmp_path / f"summary-rank{r}.json")) for r in range(2)]
    reference, _, _ = single
    for r in range(2):
        assert summaries[r]["auto-functional"]["strategy"] == "multi_worker"
        as_reference.assert_weights(
            reference, _weights(tmp_path, "auto", "functional", r), err_msg=f"rank {r}"
        )
