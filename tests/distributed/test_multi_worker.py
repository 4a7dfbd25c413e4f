"""Multi-worker training: real worker processes on localhost, via the launcher.

The strategy's options and errors, in one process:
tests/integration/test_multi_worker_options.py.
"""

import functools
import glob
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import as_reference
from helpers import CLASSES, ROOT, WORKERS, build, launch, make_data
from keras_distrib import cluster

WORKER = os.path.join(WORKERS, "mw_train.py")
N_SAMPLES = 203


def _write_records(directory, n_files=6):
    os.makedirs(directory)
    per_file = -(-N_SAMPLES // n_files)
    for i in range(n_files):
        with tf.io.TFRecordWriter(os.path.join(directory, f"part-{i}.tfrecord")) as w:
            for j in range(i * per_file, min((i + 1) * per_file, N_SAMPLES)):
                w.write(tf.io.serialize_tensor(tf.constant(float(j))).numpy())


def _launch(out, n, *args, timeout=240, launch_flags=()):
    env = dict(os.environ, TMPDIR=str(out / "tmp"), TF_CPP_MIN_LOG_LEVEL="2")
    os.makedirs(env["TMPDIR"])
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "keras_distrib.launch",
            "launch",
            "-n",
            str(n),
            "--timeout",
            str(timeout - 20),
            *launch_flags,
            WORKER,
            "--out",
            str(out),
            *args,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = []
    for r in range(n):
        with open(out / f"rank{r}.json") as f:
            result = json.load(f)
        arrays = np.load(out / f"rank{r}.npz")
        result["predict"] = arrays["predict"]
        result["weights"] = [arrays[f"arr_{i}"] for i in range(len(arrays.files) - 1)]
        ranks.append(result)
    return ranks, proc.stdout + proc.stderr


@functools.lru_cache(maxsize=None)
def _single_process(batch, epochs=2):
    """(one process with the global batch `batch`, traced: the bounds of
    float32's rounding of its math in other orders, tests/float_bounds.py;
    x, y), once per batch for the tests that compare with it."""
    x, y = make_data()
    return as_reference.fit(build("functional", "single"), x, y, batch, epochs), x, y


# 2 workers on one host on the default path ("auto": shared memory), 3 on
# three hosts (network namespaces, tests/netns_hosts.py), started by the
# launcher's --ssh, on TensorFlow's ring over gRPC; 2 on two hosts with
# implementation="tcp" (our TCP ring); 2 on two hosts with
# implementation="gloo" (Horovod's Gloo, joined without horovodrun); 4 on
# two hosts of two with "auto", which measures TensorFlow's ring, our TCP
# ring, the hierarchical all-reduce and Gloo, and trains on the fastest.
# The 2 workers take a global batch they cannot share evenly (33: 17 and
# 16 rows), which trains as one device's; so do the 4 (30).
@pytest.fixture(
    scope="module",
    params=[
        (2, 33, "one host"),
        (3, 30, "three hosts"),
        (2, 33, "two hosts tcp"),
        (2, 33, "two hosts gloo"),
        (4, 30, "two hosts of two auto"),
    ],
    ids=["2workers-shm", "3hosts-ring", "2hosts-tcp", "2hosts-gloo", "2x2hosts-auto"],
)
def run(request, tmp_path_factory):
    n, batch, where = request.param
    if where in ("two hosts tcp", "two hosts gloo"):
        if where.endswith("gloo"):
            pytest.importorskip("horovod.tensorflow", reason="Gloo is Horovod's (make setup)")
        return (n, batch, *_two_hosts(request, tmp_path_factory, n, batch, where.split()[-1]))
    if where == "two hosts of two auto":
        return (n, batch, *_two_hosts(request, tmp_path_factory, n, batch, "auto", slots=2))
    out = tmp_path_factory.mktemp(f"mw{n}")
    _write_records(str(out / "records"))
    if where == "one host":
        # Gradients in packs on shared memory, each reduced as soon as the
        # backward pass has made it: the results must not change.
        ranks, stdout = _launch(out, n, "--batch", str(batch), "--bytes_per_pack", "256")
        assert [r["implementation"] for r in ranks] == ["shm"] * n
    else:
        request.getfixturevalue("netns_usable")
        from netns_hosts import TestBed

        with TestBed(n) as bed:
            # Gradients in buckets of 256 bytes (several all-reduces per
            # step, the last layer's first, TensorFlow's order; the hidden
            # kernel, 512 bytes, cut in two), as over a slow link
            # (benchmarks/multi_host.py): the results must not change.
            across = ("--hosts", bed.hosts_flag(), "--ssh", "--ssh_command", bed.ssh_command)
            ranks, stdout = _launch(
                out,
                n,
                "--batch",
                str(batch),
                "--bytes_per_pack",
                "256",
                "--implementation",
                "ring",
                launch_flags=across,
            )
        assert [r["implementation"] for r in ranks] == ["ring"] * n
        assert [r["local_hosts"] for r in ranks] == [[a] for a in bed.addresses]
    return n, batch, out, ranks, stdout


def _two_hosts(request, tmp_path_factory, n, batch, implementation, slots=1):
    """`(out, ranks, stdout)` of `n` workers on two hosts (`slots` each)."""
    request.getfixturevalue("netns_usable")
    from netns_hosts import TestBed

    out = tmp_path_factory.mktemp(f"mw{n}{implementation}")
    _write_records(str(out / "records"))
    with TestBed(2) as bed:
        across = ("--hosts", bed.hosts_flag(slots), "--ssh", "--ssh_command", bed.ssh_command)
        # Packs for TensorFlow's ring, should "auto" pick it.
        ranks, stdout = _launch(
            out,
            n,
            "--batch",
            str(batch),
            "--implementation",
            implementation,
            "--bytes_per_pack",
            "256",
            launch_flags=across,
        )
    hosts = [a for a in bed.addresses for _ in range(slots)]
    assert [r["local_hosts"] for r in ranks] == [[h] * slots for h in hosts]
    if implementation == "auto":
        _check_auto(ranks, stdout)
    else:
        assert [r["implementation"] for r in ranks] == [implementation] * n
    return out, ranks, stdout


def _check_auto(ranks, output):
    """Every worker took the engine the chief's first line names, the
    fastest of the three it measured (the times in the line)."""
    line = re.search(
        r"\[rank 0\] keras_distrib: multi_worker: all-reduce by (\w+) \((.*)\)", output
    )
    assert line, output[-3000:]
    name, reason = line[1], line[2]
    times = dict(re.findall(r"(\w+) ([\d.]+) ms", reason))
    assert sorted(times) == ["gloo", "hierarchical", "tcp", "tensorflow"], reason
    assert name == min(times, key=lambda n: float(times[n])), reason
    assert reason.startswith("auto: the fastest all-reduce of 4 MiB + 64 KiB float32"), reason
    want = "auto" if name == "tensorflow" else name
    assert [r["implementation"] for r in ranks] == [want] * len(ranks)
    for r in ranks:
        assert f"; gradients all-reduced by {name} ({reason})" in r["describe"], r


@pytest.mark.slow
def test_workers_end_identical_and_equal_single_process(run):
    n, batch, _, ranks, _ = run
    assert [r["rank"] for r in ranks] == list(range(n))
    assert all(r["world_size"] == n for r in ranks)
    reference, _, _ = _single_process(batch)
    for r in ranks:
        for got, want in zip(r["weights"], ranks[0]["weights"]):
            np.testing.assert_array_equal(got, want)
        as_reference.assert_weights(reference, r["weights"])
        assert r["iterations"] == 2 * -(-N_SAMPLES // batch)
        as_reference.assert_history(reference, r["history"], ("loss", "accuracy"))


@pytest.mark.slow
def test_gradient_packs_start_before_the_backward_pass_ends(run):
    # With gradients in packs, each all-reduce waits only for the
    # gradients it carries: the first (the last layer's) for fewer of the
    # step's matrix products than the last, so it overlaps the rest of the
    # backward pass; on TensorFlow's ring as on shared memory, the TCP ring,
    # the hierarchical all-reduce and Gloo. (Our engines' packs run one
    # after another; Horovod's ops do not wait for each other, so Gloo's
    # last pack need not wait for the first's products.)
    n, _, _, ranks, _ = run
    for r in ranks:
        counts = r["matmuls_before_each_all_reduce"]
        assert len(counts) > 1 and counts == sorted(counts), counts
        assert counts[0] < r["matmuls_in_step"], (counts, r["matmuls_in_step"])


@pytest.mark.slow
def test_evaluate_and_predict_match_single_process_on_every_worker(run):
    _, batch, _, ranks, _ = run
    reference, x, y = _single_process(batch)
    for r in ranks:
        as_reference.assert_evaluate(reference, r["evaluate"], x, y, batch)
        assert r["predict"].shape == (len(x), CLASSES)
        as_reference.assert_predict(reference, r["predict"], x, batch)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["arrays_shuffled", "tf_data", "py_dataset", "tf_files"])
def test_every_sample_seen_once_per_epoch(run, kind):
    _, _, _, ranks, _ = run
    for epoch in range(2):
        per_worker = [r["seen"][kind][epoch] for r in ranks]
        everything = sorted(i for ids in per_worker for i in ids)
        assert everything == list(range(N_SAMPLES)), (kind, epoch)
    if kind in ("arrays_shuffled", "py_dataset"):
        # Shuffled, the same way on all workers, differently each epoch.
        assert ranks[0]["seen"][kind][0] != ranks[0]["seen"][kind][1]


@pytest.mark.slow
def test_only_the_chief_printed_and_wrote_files(run):
    _, _, out, _, stdout = run
    files = out / "files"
    assert sorted(os.listdir(files)) == ["backup", "ckpt-1.keras", "ckpt-2.keras", "log.csv", "tb"]
    # Keras's BackupAndRestore ran as keras_distrib's: the chief's one backup
    # of step 14, and Keras's file names leading to its files.
    assert sorted(os.listdir(files / "backup")) == [
        "backup-000000000014",
        "latest.weights.h5",
        "training_metadata.json",
    ]
    with open(files / "backup" / "training_metadata.json") as f:
        assert json.load(f)["epoch"] == 2
    with open(files / "log.csv") as f:
        assert len(f.read().strip().splitlines()) == 3  # header + 2 epochs, one writer
    assert len(glob.glob(str(files / "tb" / "train" / "events.*"))) == 1
    assert "[rank 0] Epoch 1/2" in stdout
    assert "[rank 1] Epoch" not in stdout
    assert os.listdir(out / "tmp") == []  # non-chief scratch dirs were removed


@pytest.mark.slow
def test_auto_trains_on_tensorflows_ring_where_a_firewall_stops_our_engines(tmp_path, hosts):
    """Host 1 takes new connections only on ports named in advance (the
    job's, which the launcher picks): our TCP ring, which listens where the
    host gives it a port, cannot connect, and `"auto"` trains on
    TensorFlow's collectives, saying why, as one device would."""
    if shutil.which("nft") is None:
        pytest.skip("the test bed's firewall needs nftables' nft (make setup installs it as root)")
    bed = hosts(2)
    bed.firewall(1)
    _write_records(str(tmp_path / "records"))
    across = ("--hosts", bed.hosts_flag(), "--ssh", "--ssh_command", bed.ssh_command)
    ranks, output = _launch(tmp_path, 2, "--batch", "33", launch_flags=across)
    line = re.search(
        r"\[rank 0\] keras_distrib: multi_worker: all-reduce by tensorflow "
        r"\(auto: tcp could not connect: (.*)\)",
        output,
    )
    assert line, output[-3000:]
    assert [r["implementation"] for r in ranks] == ["auto", "auto"]
    reference, _, _ = _single_process(33)
    for r in ranks:
        as_reference.assert_weights(reference, r["weights"])


@pytest.mark.slow
def test_gloo_behind_a_firewall_is_refused_in_one_line_before_horovod_starts(tmp_path, hosts):
    """Horovod ends a process whose Gloo cannot connect (after its
    timeout): with host 1 taking no connection on ports the job did not
    name (where Gloo would listen), both workers say so in one line
    instead, before any Horovod starts."""
    if shutil.which("nft") is None:
        pytest.skip("the test bed's firewall needs nftables' nft (make setup installs it as root)")
    pytest.importorskip("horovod.tensorflow", reason="Gloo is Horovod's (make setup)")
    bed = hosts(2)
    bed.firewall(1)
    _write_records(str(tmp_path / "records"))
    across = ("--hosts", bed.hosts_flag(), "--ssh", "--ssh_command", bed.ssh_command)
    code, output = launch(
        tmp_path,
        2,
        WORKER,
        "--out",
        str(tmp_path),
        "--batch",
        "33",
        "--implementation",
        "gloo",
        launch_flags=across,
        expect=None,
        timeout=200,
    )
    assert code != 0, output[-3000:]
    for rank in range(2):
        assert re.search(
            rf"\[rank {rank}\] \S*ClusterConfigError: implementation='gloo': worker 0 cannot "
            rf"reach worker 1 at {re.escape(bed.addresses[1])}:\d+; open the ports",
            output,
        ), output[-3000:]
    assert "terminate called" not in output and "HTTP request failed" not in output


@pytest.mark.slow
@pytest.mark.timeout(120)
# With TF_CONFIG set, `import keras_distrib` starts the runtime and waits
# KERAS_DISTRIB_PEER_TIMEOUT; opted out, the strategy's peer_timeout applies.
@pytest.mark.parametrize(
    "env", [{"KERAS_DISTRIB_PEER_TIMEOUT": "3"}, {"KERAS_DISTRIB_BOOTSTRAP": "0"}]
)
def test_peer_that_never_answers_is_named(tmp_path, env):
    ports = cluster.free_ports(2)
    tf_config = {
        "cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
        "task": {"type": "worker", "index": 0},
    }
    code = "import keras_distrib as kd\nkd.strategies.get('multi_worker', peer_timeout=3)\n"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=100,
        env=dict(os.environ, TF_CONFIG=json.dumps(tf_config), **env),
    )
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert f"worker 1 at 127.0.0.1:{ports[1]} did not answer" in last


# -- collective_timeout on TensorFlow's collectives -----------------------------------

RING_WATCHDOG = os.path.join(WORKERS, "ring_watchdog.py")


@pytest.mark.slow
def test_steps_do_not_pile_up_timeout_threads(tmp_path):
    # TensorFlow's own timeout would leave a thread sleeping 300 s per
    # collective: ~2 per training step on the ring (415 over these 200
    # steps), ~4 per predict step (800) on any path (predict gathers on
    # TensorFlow's collectives also where the gradients use shared memory).
    from helpers import launch

    out = str(tmp_path / "threads")
    launch(tmp_path, 2, RING_WATCHDOG, "threads", out, "ring", timeout=300)
    for rank in range(2):
        with open(f"{out}.rank{rank}.json") as f:
            report = json.load(f)
        assert report["steps"] == 220
        assert report["after"] - report["before"] < 40, report
        assert report["after_predict"] - report["after"] < 40, report
        assert report["after_evaluate"] - report["after_predict"] < 40, report


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode,implementation,step",
    [
        ("stuck", "ring", "training"),
        # predict's gathers are TensorFlow collectives on every path (here with
        # the gradients on shared memory); fit's error is also predict's.
        ("stuck_predict", "auto", "predict"),
    ],
)
def test_a_stuck_worker_fails_the_step_at_the_collective_timeout(
    tmp_path, mode, implementation, step
):
    from helpers import launch

    out = str(tmp_path / "stuck")
    # Rank 1 sleeps on through the launcher's SIGTERM (a preemption request
    # keras_distrib honours at the next step): a short grace before SIGKILL.
    code, output = launch(
        tmp_path,
        2,
        RING_WATCHDOG,
        mode,
        out,
        implementation,
        launch_flags=("--grace_seconds", "2"),
        timeout=200,
        expect=None,
    )
    assert code != 0, output[-3000:]
    with open(f"{out}.rank0.json") as f:
        error = json.load(f)["error"]
    assert error.startswith(
        f"PeerLostError: multi_worker: a collective of the {step} step "
        "did not complete within collective_timeout=5s"
    ), error
    assert "\n" not in error
