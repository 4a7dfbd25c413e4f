"""How the launcher ends an attempt it resizes (elastic launches), with
small real children that import nothing heavy: a job stopped for a resize
is never taken for a finished one, whatever exit code follows the SIGTERM.
"""

import io
import os
import sys
import time

import pytest

from keras_distrib.launch.config import LaunchConfig
from keras_distrib.launch.endings import Ending
from keras_distrib.launch.output import Printer
from keras_distrib.launch.processes import ChildSpec, SignalTrap
from keras_distrib.launch.restarts import Job, run_attempt

pytestmark = pytest.mark.timeout(60)

# Says it runs, then, like horovodrun whose rank exited 75 on SIGTERM, may
# exit 0 on SIGTERM; or finishes at once.
CHILD = """
import os, signal, sys, time
if sys.argv[2] == "finish":
    sys.exit(0)
signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
open(sys.argv[1], "w").close()
time.sleep(60)
"""


def _attempt(tmp_path, mode, resize):
    ready = str(tmp_path / "ready")
    spec = ChildSpec("horovodrun", [sys.executable, "-c", CHILD, ready, mode], {})
    config = LaunchConfig(nproc=1, script="unused.py", grace_seconds=10)
    with SignalTrap() as trap:
        return run_attempt(Job.of([spec]), 0, config, trap, None, Printer(io.StringIO()),
                           io.StringIO(), resize=lambda: resize(ready))


def test_a_job_stopped_for_a_resize_is_resized_though_it_exits_0(tmp_path):
    result = _attempt(tmp_path, "wait", resize=os.path.exists)
    assert result.ending is Ending.RESIZING


def test_a_job_that_finished_is_not_resized(tmp_path):
    def resize(ready):
        time.sleep(0.5)  # the child, which exits at once, has then exited
        return True
    result = _attempt(tmp_path, "finish", resize)
    assert result.ending is Ending.SUCCEEDED
    assert result.exit_code == 0
