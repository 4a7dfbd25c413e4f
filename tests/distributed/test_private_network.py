"""`keras-distrib launch --private_network`: a one-host job whose ranks
live in a network namespace of their own. They train over loopback as
before, and the TensorFlow server each opens (listening on all
interfaces) cannot be reached from outside the job
(tests/workers/private_net.py)."""

import glob
import json
import os
import socket
import time

import pytest

from pure_helpers import WORKERS, launch

pytestmark = pytest.mark.slow

SCRIPT = os.path.join(WORKERS, "private_net.py")


def _refused(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        return False
    except OSError:
        return True


def test_nothing_a_rank_opens_is_reachable_from_outside_the_job(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("the test makes a network namespace as root")
    seen = {}

    def during(proc):
        deadline = time.monotonic() + 150
        while len(glob.glob(str(tmp_path / "ports-rank*.json"))) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "no ports written"
            time.sleep(0.05)
        for rank in range(2):
            seen[rank] = json.loads((tmp_path / f"ports-rank{rank}.json").read_text())
        ports = [int(a.rsplit(":", 1)[1]) for a in seen[0]["workers"]]
        seen["refused outside"] = [_refused(p) for p in ports]
        (tmp_path / "go").touch()

    output = launch(
        tmp_path, 2, SCRIPT, str(tmp_path), during=during, launch_flags=("--private_network",)
    )
    # Inside the job every rank reaches every server; from here, none.
    assert seen[0]["reached"] == seen[1]["reached"] == [True, True], seen
    assert seen["refused outside"] == [True, True], output[-3000:]
    assert "[rank 0] trained, loss" in output and "[rank 1] trained, loss" in output, output
