"""keras_distrib under a real Slurm cluster: slurmctld, a slurmd on each of
two namespace hosts and munge (tests/slurm_bed.py), jobs submitted with
configs/slurm/train.sbatch, the script the docs give. The workers of
tests/workers/faults.py (`strategy="auto"`) find their cluster in Slurm's
variables alone."""

import glob
import json
import os
import sys
import time

import pytest

import fault_job
from pure_helpers import ROOT

pytestmark = pytest.mark.slow

SBATCH = os.path.join(ROOT, "configs", "slurm", "train.sbatch")


@pytest.fixture(scope="module")
def slurm():
    import slurm_bed

    reason = slurm_bed.unavailable()
    if reason:
        pytest.skip(reason)
    with slurm_bed.SlurmBed(2) as bed:
        yield bed


def _submit(bed, out, *script_flags):
    return bed.sbatch(
        SBATCH,
        "--chdir",
        ROOT,
        "-o",
        str(out / "slurm-%j.out"),
        args=(fault_job.FAULTS, "--out", str(out), "--backup", str(out / "backup"), *script_flags),
        PYTHON=sys.executable,
        TF_CPP_MIN_LOG_LEVEL="2",
    )


def _assert_one_process_weights(out, uninterrupted, traced_job):
    """Both workers end as one process: within the bounds of the job's math
    in other orders (`fault_job.assert_equal_to`)."""
    fault_job.assert_equal_to(fault_job.results(out, 2), uninterrupted(1), traced_job())


def _log(out):
    return "".join(open(p).read() for p in glob.glob(str(out / "slurm-*.out")))[-4000:]


def test_an_sbatch_job_on_two_nodes_trains_as_one_process(
    slurm, tmp_path, uninterrupted, traced_job
):
    job = _submit(slurm, tmp_path)
    assert slurm.wait_for_job(job) == "COMPLETED", _log(tmp_path)
    _assert_one_process_weights(tmp_path, uninterrupted, traced_job)


def test_a_parameter_server_step_trains_and_ends_with_its_chief(slurm, tmp_path):
    """`KERAS_DISTRIB_NUM_PS=1` with 3 tasks on 2 nodes: task 0 the chief
    (the coordinator), task 1 a worker, task 2 the ps; every task runs
    the script, the strategy turns the worker and ps tasks into servers, and
    those end once their chief is gone, so the step and the job end with it."""
    job = slurm.sbatch(
        SBATCH,
        "--chdir",
        ROOT,
        "-o",
        str(tmp_path / "slurm-%j.out"),
        "-N",
        "2",
        "-n",
        "3",
        "--ntasks-per-node=2",
        args=(os.path.join("tests", "workers", "ps_train.py"), "warmup", str(tmp_path)),
        PYTHON=sys.executable,
        TF_CPP_MIN_LOG_LEVEL="2",
        KERAS_DISTRIB_NUM_PS="1",
    )
    assert slurm.wait_for_job(job) == "COMPLETED", _log(tmp_path)
    with open(tmp_path / "warmup.json") as f:
        report = json.load(f)
    for kind in ("float", "schedule"):  # 1500 samples, batch 50, 2 epochs
        assert report[kind]["iterations"] == 60, report
    log = _log(tmp_path)
    for task in ("worker 0", "ps 0"):
        assert f"keras_distrib: {task}: the chief at " in log and "is gone" in log, log


def test_scancel_signal_term_saves_and_the_requeued_job_resumes_exact(
    slurm, tmp_path, uninterrupted, traced_job
):
    """The workers pause after step 6; `scancel --signal=TERM` reaches them
    there; they stop at one step, save, exit 75, Slurm queues the job again,
    and its second run resumes from that backup."""
    job = _submit(slurm, tmp_path, "--pause_after_step", "6")
    deadline = time.monotonic() + 180
    while len(glob.glob(str(tmp_path / "paused-rank*"))) < 2:
        assert time.monotonic() < deadline, _log(tmp_path)
        time.sleep(0.1)
    slurm.slurm("scancel", "--signal=TERM", str(job))
    # The tasks take the signal while they wait; they go on once it landed.
    deadline = time.monotonic() + 60
    while len(glob.glob(str(tmp_path / "sigterm-rank*"))) < 2:
        assert time.monotonic() < deadline, _log(tmp_path)
        time.sleep(0.1)
    (tmp_path / "go").touch()
    # Exit code 75 requeues it (the cluster's RequeueExit=75), and Slurm
    # holds it about two minutes (its BeginTime); an operator in a hurry
    # starts it now.
    assert (
        slurm.wait_for_job(job, until=("PENDING BeginTime", "COMPLETED", "FAILED"))
        == "PENDING BeginTime"
    ), _log(tmp_path)
    deadline = time.monotonic() + 120
    while [a.number for a in fault_job.attempts(tmp_path, 2)[0]] != [0, 1]:
        assert time.monotonic() < deadline, _log(tmp_path)
        # Again while it still waits: an update made while Slurm was still
        # requeueing the job can be overwritten by its hold.
        if slurm.job_state(job) == "PENDING BeginTime":
            slurm.slurm("scontrol", "update", f"JobId={job}", "StartTime=now")
        time.sleep(1)
    assert slurm.wait_for_job(job) == "COMPLETED", _log(tmp_path)
    log = _log(tmp_path)
    assert "keras_distrib: resuming from step" in log, log
    runs = fault_job.attempts(tmp_path, 2)
    assert [[a.number for a in r] for r in runs.values()] == [[0, 1], [0, 1]], runs
    _assert_one_process_weights(tmp_path, uninterrupted, traced_job)


def test_a_node_taken_down_mid_job_stops_every_worker_at_one_step_in_one_line(slurm, tmp_path):
    """n1 is set DOWN while the workers pause: Slurm signals the job's tasks
    (SIGTERM, then SIGKILL after KillWait) and requeues it. The workers stop
    together at the next step, the chief saves there and says so in one
    line; the job waits to run again (cancelled here: the resume itself is
    the test above)."""
    job = _submit(slurm, tmp_path, "--pause_after_step", "6")
    deadline = time.monotonic() + 180
    while len(glob.glob(str(tmp_path / "paused-rank*"))) < 2:
        assert time.monotonic() < deadline, _log(tmp_path)
        time.sleep(0.1)
    try:
        slurm.slurm("scontrol", "update", "NodeName=n1", "State=DOWN", "Reason=test")
        # Slurm's SIGTERM reaches the chief while it waits; it goes on then.
        deadline = time.monotonic() + 60
        while not (tmp_path / "sigterm-rank0").exists():
            assert time.monotonic() < deadline, _log(tmp_path)
            time.sleep(0.1)
        (tmp_path / "go").touch()
        assert (
            slurm.wait_for_job(job, until=("PENDING BeginTime", "COMPLETED", "FAILED"))
            == "PENDING BeginTime"
        )
    finally:
        slurm.slurm("scancel", str(job), check=False)
        slurm.slurm("scontrol", "update", "NodeName=n1", "State=RESUME", check=False)
    log = _log(tmp_path)
    said = [line for line in log.splitlines() if line.startswith("keras_distrib: preempted")]
    assert said == [
        f"keras_distrib: preempted (SIGTERM): every worker stopped at epoch 1, "
        f"step 7; backup in {tmp_path / 'backup'}; exiting with code 75. Run the "
        "same command again to resume."
    ], log
    assert os.listdir(tmp_path / "backup") == ["backup-000000000007"]
    assert not (tmp_path / "rank0.npz").exists()
