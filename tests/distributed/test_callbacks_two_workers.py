"""keras_distrib.callbacks across 2 worker processes, through the launcher
(tests/workers/cb_train.py), under `multi_worker` and `horovod`.

In one process ("single"/"mirrored"): tests/integration/test_callbacks.py.
"""

import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from helpers import ROOT, WORKERS, warmup_rate

WORKER = os.path.join(WORKERS, "cb_train.py")
LR = 0.1  # helpers.build's SGD, which the workers train


@pytest.fixture(scope="module", params=["multi_worker", "horovod"])
def two_workers(request, tmp_path_factory):
    backend = request.param
    if backend == "horovod":
        pytest.importorskip("horovod.tensorflow")
    out = tmp_path_factory.mktemp(f"cb2-{backend}")
    env = dict(
        os.environ,
        TF_CPP_MIN_LOG_LEVEL="2",
        PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
    )
    launcher = ["--backend", "horovod"] if backend == "horovod" else []
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "keras_distrib.launch",
            "launch",
            "-n",
            "2",
            *launcher,
            "--timeout",
            "120",
            WORKER,
            "--out",
            str(out),
            "--strategy",
            backend,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    ranks = []
    for r in range(2):
        path = out / f"rank{r}.json"
        assert path.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
        with open(path) as f:
            ranks.append(json.load(f))
    return proc, ranks, out, backend


# How each backend's launcher marks a rank's output lines.
# The launcher labels every rank's lines alike, horovodrun's too.
RANK_PREFIX = "[rank {}] "


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_two_workers_metric_average_equal_on_all_ranks(two_workers):
    _, ranks, _, _ = two_workers
    for r in ranks:
        # rank r wrote 10 * r + epoch: the mean is 5 + epoch.
        assert r["history"]["rank_value"] == [5.0, 6.0]
        assert [logs["rank_value"] for logs in r["epoch_logs"]] == [5.0, 6.0]
        assert r["history"]["note"] == [f"from rank {r['rank']}"] * 2
    for key in ("loss", "accuracy", "samples_per_sec", "step_time", "scaling_efficiency"):
        assert ranks[0]["history"][key] == ranks[1]["history"][key], key
    h = ranks[0]["history"]
    # Exact: a division by 2 (the processes) does not round.
    assert h["samples_per_sec_per_worker"] == [v / 2 for v in h["samples_per_sec"]]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_two_workers_broadcast_makes_ranks_start_equal(two_workers):
    _, ranks, _, _ = two_workers
    for r in ranks:  # rank 1 had added 1.0 to its weights before fit
        for got, want in zip(r["start_weights"], ranks[0]["rank0_initial"]):
            np.testing.assert_array_equal(got, want)
        for got, want in zip(r["final_weights"], ranks[0]["final_weights"]):
            np.testing.assert_array_equal(got, want)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_two_workers_warmup_and_chief_only_summaries(two_workers):
    proc, ranks, out, backend = two_workers
    # Exact: the warmup's rates are the same formula on the same numbers
    # (the optimizer's rate as float32 holds it, `base`); the last one, twice
    # that, is a float32 as it is, which the optimizer keeps.
    base = float(np.float32(LR))
    for r in ranks:  # 2 replicas, 4 steps per epoch, 1 warmup epoch
        assert [s for s, _ in r["lr_history"]] == list(range(5))
        assert [lr for _, lr in r["lr_history"]] == [warmup_rate(s, 2, 4, base) for s in range(5)]
        assert r["batch_lr"][4:] == [2 * base] * 4
        assert r["final_lr"] == 2 * base
    assert len(glob.glob(str(out / "tb" / "events.*"))) == 1  # the throughput monitor's
    prefix = RANK_PREFIX
    assert (
        prefix.format(0) + "Epoch 2: finished gradual learning rate warmup to 0.2." in proc.stdout
    )
    assert prefix.format(1) + "Epoch 2: finished" not in proc.stdout


def _scalars(directory):
    """`{tag: [(step, value)]}` of the event files in `directory`, read
    with TensorBoard's own reader (Keras writes tensor summaries)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    events = EventAccumulator(str(directory), size_guidance={"tensors": 0})
    events.Reload()
    return {
        tag: [
            (e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in events.Tensors(tag)
        ]
        for tag in events.Tags()["tensors"]
        if not tag.startswith("keras") and tag != "batch_2"
    }


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_two_workers_tensorboard_writes_the_chiefs_scalars_once_and_a_profile_per_rank(two_workers):
    _, ranks, out, _ = two_workers
    tb = out / "tb"
    # One run of scalars, the chief's: each epoch's loss once, as in history.
    assert sorted(p.name for p in tb.iterdir() if p.is_dir()) == ["rank-1", "train"]
    assert len(glob.glob(str(tb / "train" / "events.*"))) == 1
    train = _scalars(tb / "train")
    losses = [value for _, value in train["epoch_loss"]]
    # Exact: the summaries hold the float32 logs themselves.
    assert losses == ranks[0]["history"]["loss"]
    # A profile of batch 2 per rank: the chief's in its train run, rank 1's
    # in a run of its own; rank 1 wrote no scalars there.
    assert glob.glob(str(tb / "train" / "plugins" / "profile" / "*" / "*.xplane.pb"))
    assert glob.glob(str(tb / "rank-1" / "train" / "plugins" / "profile" / "*" / "*.xplane.pb"))
    assert not glob.glob(str(tb / "rank-1" / "**" / "events.*"), recursive=True)
    # The throughput monitor's figures beside them: each rank's own rate,
    # and the slowest of the two.
    throughput = _scalars(tb)
    per_rank = [
        [v for _, v in throughput[f"throughput/samples_per_sec_rank_{r}"]] for r in range(2)
    ]
    slowest = [int(v) for _, v in throughput["throughput/slowest_rank"]]
    assert len(slowest) == 2 and all(len(rates) == 2 for rates in per_rank)
    for epoch, rank in enumerate(slowest):
        assert per_rank[rank][epoch] == min(per_rank[0][epoch], per_rank[1][epoch])
    assert ranks[0]["history"]["slowest_rank"] == [float(r) for r in slowest]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_two_workers_nan_and_drift_stop_every_rank(two_workers):
    proc, ranks, _, _ = two_workers
    assert proc.returncode != 0  # the drift error ended the job, no hang
    for r in ranks:
        assert r["nan_error"] == "step 2: non-finite weights on replica 1 (rank 1)"
        assert r["drift_error"].startswith(
            "step 4: replica 1 (rank 1) weights differ from replica 0 (rank 0): checksum"
        )
    assert ranks[0]["drift_error"] == ranks[1]["drift_error"]
    assert "ReplicaDivergenceError: step 4: replica 1 (rank 1)" in proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_two_workers_terminate_on_nan_stops_every_rank_quietly(two_workers):
    # Only rank 1's loss of step 3 is NaN: without a vote rank 1 alone stops
    # and rank 0 waits in step 4's all-reduce.
    _, ranks, _, _ = two_workers
    finite = [[True, True, False], [True, True, False]]
    finite[0][2] = True  # rank 0's forward pass of step 3 had finite weights
    for r in ranks:
        assert r["terminate_on_nan"] == {"batches": 3, "finite": finite[r["rank"]], "epochs": 1}
