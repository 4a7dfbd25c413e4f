"""How the launcher reads the end of an attempt, with small real children
that import nothing heavy: a job stopped for a resize is never taken for a
finished one, and horovodrun whose ranks were preempted counts as
preempted (exit code 75), whatever exit code it gives itself.
"""

import io
import os
import signal
import sys
import time

import pytest

from keras_distrib.cluster.launch_contract import PREEMPTED, PREEMPTED_LINE
from keras_distrib.launch.backends import HOROVODRUN_RANK_PREFIX
from keras_distrib.launch.config import LaunchConfig
from keras_distrib.launch.endings import Ending, SuperviseResult, end
from keras_distrib.launch.output import Printer
from keras_distrib.launch.processes import ChildSpec, SignalTrap, start
from keras_distrib.launch.restarts import Job, run_attempt

pytestmark = pytest.mark.timeout(60)

CONFIG = LaunchConfig(nproc=2, script="unused.py", grace_seconds=10)

# Says it runs, then, like horovodrun whose rank exited 75 on SIGTERM, may
# exit 0 on SIGTERM.
RESIZED = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
open(sys.argv[1], "w").close()
time.sleep(60)
"""


def _attempt(tmp_path, resize):
    ready = str(tmp_path / "ready")
    spec = ChildSpec("horovodrun", [sys.executable, "-c", RESIZED, ready], {})
    with SignalTrap() as trap:
        return run_attempt(
            Job.of([spec]),
            0,
            CONFIG,
            trap,
            None,
            Printer(io.StringIO()),
            io.StringIO(),
            resize=lambda: resize(ready),
        )


def test_a_job_stopped_for_a_resize_is_resized_though_it_exits_0(tmp_path):
    result = _attempt(tmp_path, resize=os.path.exists)
    assert result.ending is Ending.RESIZING


def test_a_job_that_finished_before_the_request_is_not_resized(tmp_path):
    child = start(
        ChildSpec("rank 0", [sys.executable, "-c", "pass"], {}), 40, Printer(io.StringIO())
    )
    child.proc.wait()
    with SignalTrap() as trap:
        result = end(
            SuperviseResult(Ending.RESIZING, PREEMPTED),
            [child],
            CONFIG,
            trap,
            Printer(io.StringIO()),
            io.StringIO(),
        )
    assert result.ending is Ending.SUCCEEDED
    assert result.exit_code == 0


# horovodrun's output as horovodrun writes it: each rank's pieces behind
# `[rank]<stream>:`. The ranks in `argv[1]` say they were preempted, as
# keras_distrib's workers do, on SIGTERM or at once (`argv[2]`); then it
# exits `argv[3]`, as horovodrun does for ranks that exited 75.
HOROVODRUN = (
    """
import signal, sys, time
def preempted(*args):
    for rank in sys.argv[1].split(","):
        print(f"[{rank}]<stderr>:%severy worker stopped at epoch 1, step 4", flush=True)
    sys.exit(int(sys.argv[3]))
if sys.argv[2] == "now":
    preempted()
signal.signal(signal.SIGTERM, preempted)
print("[0]<stdout>:training", flush=True)
time.sleep(60)
"""
    % PREEMPTED_LINE
)


def _horovodrun(ranks, when, code):
    spec = ChildSpec(
        "horovodrun",
        [sys.executable, "-c", HOROVODRUN, ranks, when, str(code)],
        {},
        rank_prefix=HOROVODRUN_RANK_PREFIX,
        ranks=2,
    )
    return start(spec, 40, Printer(io.StringIO()))


@pytest.mark.parametrize("code", [1, 0])
def test_horovodrun_whose_ranks_were_preempted_ends_a_stopped_launch_with_75(code):
    child = _horovodrun("0,1", "on_sigterm", code)
    deadline = time.monotonic() + 30  # until it runs (its SIGTERM handler is set)
    while not any("training" in line for line in child.tail):
        assert time.monotonic() < deadline and child.running
        time.sleep(0.01)
    with SignalTrap() as trap:
        result = end(
            SuperviseResult(Ending.INTERRUPTED, 128 + signal.SIGTERM, signum=signal.SIGTERM),
            [child],
            CONFIG,
            trap,
            Printer(io.StringIO()),
            io.StringIO(),
        )
    assert result.exit_code == PREEMPTED


@pytest.mark.parametrize("ranks, expected", [("0,1", PREEMPTED), ("0", 1)])
def test_horovodrun_is_preempted_only_when_every_rank_says_so(ranks, expected):
    child = _horovodrun(ranks, "now", 1)
    child.proc.wait()
    assert child.exit_code == expected
