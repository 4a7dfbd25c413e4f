"""Fault injection on real multi-worker jobs (issue 10): no hang, no silent drift.

Every test runs `keras-distrib launch` for real on localhost (see
tests/helpers.py: free ports, a timeout, the process group killed whatever
happens) and checks the outcome: the error names the rank at fault and what
differed; with `--max-restarts` the final model equals an uninterrupted run
(atol 1e-6); no process and no shared-memory file is left behind.

The fault steps are drawn at random (printed with every failure), as an
operator's kill would land anywhere.
"""

import glob
import os
import random
import re
import time

import numpy as np
import pytest

from helpers import launch

pytestmark = pytest.mark.slow

MISMATCH = "tests/workers/mismatch.py"
FAULTS = "tests/workers/faults.py"
STEPS = 24  # tests/workers/faults.py: 256 samples, batch 32, 3 epochs


def _last_error_line(output):
    lines = [l for l in output.splitlines() if "Error: " in l]
    return lines[-1] if lines else output[-2000:]


# -- mismatched work ends at once, naming what differs ---------------------------


@pytest.mark.parametrize("case, expected", [
    ("fit_vs_evaluate",
     r"worker 1 called evaluate\(batch_size=32, .*\) while worker 0 called fit\("),
    ("batch_size", r"worker 1 called fit\(batch_size=16, .* while worker 0 called "
                   r"fit\(batch_size=32, "),
    ("data_length", r"worker 1 called fit\(.*samples=96.* while worker 0 called fit\(.*"
                    r"samples=128"),
    ("changed_weights", r"replicas disagree at the start of fit: '.*kernel' on worker 1 "),
])
def test_mismatched_work_is_a_one_line_error(tmp_path, case, expected):
    start = time.monotonic()
    code, output = launch(tmp_path, 2, MISMATCH, "--case", case, expect=None, timeout=150)
    took = time.monotonic() - start
    assert code != 0, output[-3000:]
    assert re.search(expected, output), _last_error_line(output)
    assert "done" not in output  # neither rank went on as if all was well
    assert took < 120, took  # ended on its own, far below the launcher's timeout


def test_a_rank_exiting_early_fails_the_waiting_one_naming_it(tmp_path):
    code, output = launch(tmp_path, 2, MISMATCH, "--case", "early_exit", expect=None,
                          timeout=150)
    assert code != 0, output[-3000:]
    assert "rank 1 done" in output
    assert re.search(r"worker 1 \(pid \d+\) exited", output), _last_error_line(output)
