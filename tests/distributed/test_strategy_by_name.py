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

from helpers import ROOT, WORKERS, build, kill_process_group, launch, make_data

WORKER = os.path.join(WORKERS, "by_name.py")
FORMS = ("functional", "subclass", "from_model")
BATCH, EPOCHS = 30, 2  # 203 samples: 7 steps per epoch, 14 SGD steps


@pytest.fixture(scope="module")
def single_weights():
    x, y = make_data()
    model = build("functional", "single")
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return model.get_weights(), model.evaluate(x, y, batch_size=BATCH, verbose=0)


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


def _check(
    out, summaries, names, expected_strategy, n, single_weights, evaluate_atol=1e-5, forms=FORMS
):
    weights, evaluate = single_weights
    for name in names:
        for form in forms:
            for r in range(n):
                got = summaries[r][f"{name}-{form}"]
                assert got["strategy"] == expected_strategy and got["rank"] == r
                assert got["world_size"] == n and got["iterations"] == 14
                np.testing.assert_allclose(got["evaluate"], evaluate, atol=evaluate_atol)
                arrays = np.load(out / f"{name}-{form}-rank{r}.npz")
                for i, want in enumerate(weights):
                    np.testing.assert_allclose(
                        arrays[f"arr_{i}"],
                        want,
                        atol=1e-5,
                        rtol=0,
                        err_msg=f"{name} {form} rank {r}",
                    )
    assert all(s["before"] == [6.0, 12] for s in summaries)


# 2 workers: the name resolves as with any number (3 workers equal one
# process in tests/distributed/test_multi_worker.py).
@pytest.mark.slow
def test_launch_multi_worker_and_auto_by_name_with_steps_per_execution(tmp_path, single_weights):
    names = ["multi_worker", "auto"]
    # With 7 batches per epoch and 4 steps per execution, the last execution
    # of each epoch runs 3 steps, as plain Keras does: 14 steps, not 16.
    summaries = _launch(tmp_path, 2, names, script_args=("--steps_per_execution", "4"))
    _check(tmp_path, summaries, names, "multi_worker", 2, single_weights)


@pytest.mark.slow
def test_launch_horovod_and_auto_by_name(tmp_path, single_weights):
    pytest.importorskip("horovod.tensorflow")
    names = ["horovod", "auto"]
    summaries = _launch(tmp_path, 2, names, "--backend", "horovod")
    # Horovod averages evaluate metrics over ranks: exact only when ranks see
    # equal numbers of samples (here the last batch splits 12/11; README).
    _check(tmp_path, summaries, names, "horovod", 2, single_weights, evaluate_atol=1e-3)


@pytest.mark.slow
def test_hand_set_tf_config_with_chief_role(tmp_path, single_weights):
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
    weights, _ = single_weights
    for r in range(2):
        assert summaries[r]["auto-functional"]["strategy"] == "multi_worker"
        arrays = np.load(tmp_path / f"auto-functional-rank{r}.npz")
        for i, want in enumerate(weights):
            np.testing.assert_allclose(arrays[f"arr_{i}"], want, atol=1e-5, rtol=0)
