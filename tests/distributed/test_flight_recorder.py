"""The flight recorder: where every rank is when a job stalls, on one screen.

Real 2-rank jobs through `keras-distrib launch` (tests/workers/stall.py):
a rank asleep in a user callback, a rank stopped by SIGSTOP, and a screen
asked for with `kill -USR1 <launcher>` while the job trains on. A rank
whose link is cut: tests/distributed/test_network_faults.py.
"""

import glob
import os
import re
import signal
import time

import pytest

from helpers import WORKERS, launch

pytestmark = pytest.mark.slow

STALL = os.path.join(WORKERS, "stall.py")


def _screen(output):
    start = output.index("keras-distrib: flight recorder (")
    return output[start:]


@pytest.mark.timeout(240)
def test_a_rank_asleep_in_a_callback_is_named_with_the_line_it_sleeps_on(tmp_path):
    code, output = launch(
        tmp_path,
        2,
        STALL,
        "--mode",
        "sleep",
        expect=None,
        timeout=180,
        # Rank 1 sleeps on through SIGTERM: SIGKILL after 2 s, not 30.
        launch_flags=("--stall_warning", "3", "--grace_seconds", "2"),
    )
    assert code != 0, output[-3000:]
    # First the launcher saw no step for 3 s (before rank 0's collective
    # watchdog, at 8 s): the screen, the job going on; then the failure's.
    screen = _screen(output)
    assert screen.startswith(
        "keras-distrib: flight recorder (no rank finished a training step "
        "for 3s (--stall_warning); the job goes on):"
    ), screen[:500]
    assert "flight recorder (rank 0 failed after a stall):" in screen, screen
    # rank 0 reported its own stall; rank 1 answered the launcher.
    assert re.search(
        r"  rank 0 \(pid \d+ on \S+\): step 4 done \(epoch 1, step 4\); waiting "
        r"[\d.]+s in the shared-memory all-reduce, \d+ bytes",
        screen,
    ), screen
    assert re.search(
        r"  rank 1 \(pid \d+ on \S+\): step 4 done \(epoch 1, step 4\); "
        r"in no collective\n      at \S*stall\.py:\d+ in on_train_batch_end: "
        r"time\.sleep\(3600\)",
        screen,
    ), screen
    assert "did not arrive at the collective the others wait in: rank 1." in screen
    assert "keras-distrib: rank 1's threads (innermost call last):" in screen
    assert "keras_distrib: flight recorder: {" not in output  # read, not printed


@pytest.mark.timeout(240)
def test_a_stopped_rank_is_named_as_stopped(tmp_path):
    code, output = launch(tmp_path, 2, STALL, "--mode", "stop", expect=None, timeout=180)
    assert code != 0, output[-3000:]
    screen = _screen(output)
    assert re.search(
        r"  rank 1: no answer within [\d.]+s: \(pid \d+\) was stopped \(SIGSTOP\)", screen
    ), screen
    assert "did not arrive at the collective the others wait in: rank 1." in screen


@pytest.mark.timeout(240)
def test_sigusr1_to_the_launcher_shows_the_screen_and_the_job_goes_on(tmp_path):
    def ask(proc):
        deadline = time.monotonic() + 150
        while len(glob.glob(str(tmp_path / "step-rank*"))) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "no rank trained"
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGUSR1)

    # --stall_warning: a job whose steps go on (0.2 s each) shows no stall.
    output = launch(
        tmp_path,
        2,
        STALL,
        "--mode",
        "slow",
        "--out",
        str(tmp_path),
        during=ask,
        timeout=180,
        launch_flags=("--stall_warning", "2"),
    )
    screen = _screen(output)
    assert "flight recorder (the launcher got SIGUSR1; the job goes on):" in screen
    assert "--stall_warning" not in output, output[-3000:]
    for rank in (0, 1):
        assert re.search(
            rf"  rank {rank} \(pid \d+ on \S+\): (step \d+ done|no training step)", screen
        ), screen
        assert f"keras-distrib: rank {rank}'s threads" in screen
