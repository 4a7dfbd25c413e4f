"""Fault injection on real multi-worker jobs: no hang, no silent drift.

Every test runs `keras-distrib launch` for real on localhost (see
tests/helpers.py: free ports, a timeout, the process group killed whatever
happens) and checks the outcome: the error names the rank at fault and what
differed; with `--max-restarts` the final model equals an uninterrupted run
(both within the bounds of float32's rounding of the job's math,
`fault_job.assert_equal_to`); no process and no shared-memory file is left behind.

The fault steps are drawn at random (printed with every failure), as an
operator's kill would land anywhere.
"""

import glob
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest

import fault_job
from fault_job import FAULTS, STEPS
from helpers import ROOT, kill_process_group, launch, process_alive

pytestmark = pytest.mark.slow

MISMATCH = "tests/workers/mismatch.py"


def _last_error_line(output):
    lines = [line for line in output.splitlines() if "Error: " in line]
    return lines[-1] if lines else output[-2000:]


# -- mismatched work ends at once, naming what differs ---------------------------

# One job runs the cases in turn (tests/workers/mismatch.py); the last,
# whose error ends the job, makes TensorFlow's broadcast fail.
MISMATCHES = {
    "fit_vs_evaluate": r"worker 1 called evaluate\(batch_size=32, .*\) while worker 0 called fit\(",
    "batch_size": r"worker 1 called fit\(batch_size=16, .* while worker 0 called "
    r"fit\(batch_size=32, ",
    "data_length": r"worker 1 called fit\(.*samples=96.* while worker 0 called fit\(.*"
    r"samples=128",
    "learning_rate": r"worker 1 compiled the model differently than worker 0: "
    r"optimizer\.learning_rate is 0\.05 on worker 1 but 0\.01 on worker 0",
    "changed_weights": r"replicas disagree at the start of fit: '.*kernel' on worker 1 ",
    "wider_layer": r"worker 1 built a different model than worker 0: variable 1 "
    r"\('.*kernel' here\) is float32 \(8, 5\) on worker 1 but float32 "
    r"\(8, 4\) on worker 0",
    "extra_layer": r"worker 1 built a different model than worker 0: variable 3 .*is "
    r"float32 \(8, 8\) on worker 1 but float32 \(8, 2\) on worker 0 "
    r"\(worker 1 has 6 variables, worker 0 4\)",
    "wider_subclass": r"workers built different models: worker \d made a variable of shape "
    r"\[8,[45]\] where another worker's has shape \[8,[45]\]",
}


@pytest.fixture(scope="module")
def mismatched(tmp_path_factory):
    """(exit code, output) of the one job that runs every case of MISMATCHES."""
    return launch(
        tmp_path_factory.mktemp("mismatch"),
        2,
        MISMATCH,
        "--cases",
        ",".join(MISMATCHES),
        expect=None,
        timeout=200,
    )


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_mismatched_work_is_a_one_line_error_on_every_worker(mismatched, case):
    code, output = mismatched
    lines = [re.search(rf"\[rank {rank}\] case {case}: (\w+): (.*)", output) for rank in (0, 1)]
    said = [
        line
        for line in lines
        if line
        and re.search(MISMATCHES[case], line[2])
        and line[1] in ("WorkersDisagreeError", "ReplicasDisagreeError")
    ]
    # Both ranks, for the cases the job goes on after; for the last, the
    # rank that failed first (the other may see it gone first).
    assert len(said) >= (1 if case == list(MISMATCHES)[-1] else 2), (
        case,
        [line and line[0] for line in lines],
        output[-3000:],
    )
    assert f"case {case}: done" not in output  # no rank went on as if all was well
    # The last case's error ended the job, on its own, not by the launcher's timeout.
    assert code != 0, output[-3000:]
    assert "keras-distrib: timed out after" not in output, output[-3000:]


def test_a_rank_exiting_early_fails_the_waiting_one_naming_it(tmp_path):
    code, output = launch(tmp_path, 2, MISMATCH, "--cases", "early_exit", expect=None, timeout=150)
    assert code != 0, output[-3000:]
    assert "rank 1 done" in output
    assert re.search(r"worker 1 \(pid \d+\) exited", output), _last_error_line(output)


# -- kill -9, SIGSTOP, SIGTERM at a random step: restarts equal an uninterrupted run -----


def _left_running(attempts):
    return [
        a.pid
        for runs in attempts.values()
        for a in runs
        if process_alive(a.pid, zombies_count=False)
    ]


def _left_in_shared_memory(attempts):
    """The attempts' shared-memory directories that still exist (the
    launcher makes one per attempt and removes it after)."""
    return [a.shm_dir for runs in attempts.values() for a in runs if os.path.exists(a.shm_dir)]


# Each fault once on 2 workers (3 equal one process in test_multi_worker.py);
# the rank and the step are drawn at random.
@pytest.mark.parametrize("n, fault", [(2, "kill"), (2, "stop"), (2, "term")])
def test_a_restarted_job_equals_an_uninterrupted_one(tmp_path, uninterrupted, traced_job, n, fault):
    rank, step = random.randrange(n), random.randint(1, STEPS - 1)
    context = dict(workers=n, fault=fault, rank=rank, after_step=step)
    output = launch(
        tmp_path,
        n,
        FAULTS,
        "--out",
        str(tmp_path),
        "--backup",
        str(tmp_path / "backup"),
        "--fault",
        fault,
        "--fault_rank",
        str(rank),
        "--fault_step",
        str(step),
        launch_flags=("--max_restarts", "2"),
        timeout=280,
    )
    assert re.search(r"restart 1/2: rank \d+ ", output), (context, output[-3000:])
    assert "restart 2/2" not in output, context
    fault_job.assert_equal_to(
        fault_job.results(tmp_path, n), uninterrupted(n), traced_job(), context
    )
    attempts = fault_job.attempts(tmp_path, n)
    assert all([a.number for a in attempts[r]] == [0, 1] for r in range(n)), attempts
    assert not _left_running(attempts)
    assert os.listdir(tmp_path / "backup") == []  # removed once the job succeeded
    assert not _left_in_shared_memory(attempts)
    fault_time = float(open(tmp_path / "fault.txt").read().split()[1])
    restarted = min(a.started for runs in attempts.values() for a in runs if a.number == 1)
    print(f"FAULT {context}: workers restarted {restarted - fault_time:.1f}s after the fault")


def test_sigterm_to_the_launcher_preempts_and_the_next_launch_resumes(
    tmp_path, uninterrupted, traced_job
):
    backup = tmp_path / "backup"
    # After the first backup (step 4 of 24) every rank waits until it is
    # sent SIGTERM: the signal below always lands mid-training.
    argv = [
        sys.executable,
        "-m",
        "keras_distrib.launch",
        "launch",
        "-n",
        "2",
        "--timeout",
        "200",
        FAULTS,
        "--out",
        str(tmp_path),
        "--backup",
        str(backup),
        "--hold_after_step",
        "4",
    ]
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 150
        while not glob.glob(str(backup / "backup-*")) and time.monotonic() < deadline:
            time.sleep(0.05)  # training has reached its first backup
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    finally:
        kill_process_group(proc)
    assert proc.returncode == 75, output[-3000:]
    stops = re.findall(r"every worker stopped at epoch (\d+), step (\d+)", output)
    assert len(stops) == 2 and stops[0] == stops[1], output[-3000:]
    saved = glob.glob(str(backup / "backup-*"))
    assert len(saved) == 1
    attempts = fault_job.attempts(tmp_path, 2)
    assert not _left_running(attempts)
    assert not _left_in_shared_memory(attempts)
    state = json.loads(open(os.path.join(saved[0], "state.json")).read())
    assert 4 <= state["global_step"] < STEPS, state
    launch(tmp_path, 2, FAULTS, "--out", str(tmp_path), "--backup", str(backup))
    fault_job.assert_equal_to(fault_job.results(tmp_path, 2), uninterrupted(2), traced_job(), state)
