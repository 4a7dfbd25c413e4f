"""`multi_worker(implementation="gloo")`: Horovod's Gloo between real workers.

Training on it equals one process, across two hosts of the namespace bed
(tests/distributed/test_multi_worker.py, "2hosts-gloo"), and `"auto"`
measures it (there, "2x2hosts-auto"). Here: a worker killed by SIGKILL
mid-training ends the other in one line naming it, as our own engines do,
and a worker that cannot load Horovod is named before Horovod starts.
"""

import os
import re

import pytest

from helpers import WORKERS, launch

pytest.importorskip("horovod.tensorflow", reason="Gloo is Horovod's (make setup)")

FAULTS = os.path.join(WORKERS, "faults.py")
MW_TRAIN = os.path.join(WORKERS, "mw_train.py")


def _failed_job(out, script, *args):
    """The output of 2 workers of `script` on Gloo, which must fail on
    their own (not by the launcher's timeout)."""
    code, output = launch(
        out,
        2,
        script,
        "--out",
        str(out),
        "--implementation",
        "gloo",
        *args,
        expect=None,
        timeout=150,
    )
    assert code != 0, output[-3000:]
    assert "keras-distrib: timed out after" not in output, output[-3000:]
    return output


@pytest.mark.slow
def test_a_killed_worker_is_named_in_one_line(tmp_path):
    output = _failed_job(
        tmp_path,
        FAULTS,
        "--backup",
        str(tmp_path / "backup"),
        "--strategy",
        "auto",
        "--fault",
        "kill",
        "--fault_rank",
        "1",
        "--fault_step",
        "3",
    )
    line = re.search(r"\[rank 0\] \S*PeerLostError: (.*)", output)
    assert line, output[-3000:]
    assert re.fullmatch(
        r"multi_worker: worker 1 at 127\.0\.0\.1:\d+ is gone \(its server does not answer\): "
        r"Horovod's Gloo collectives stopped",
        line[1].strip(),
    ), line[1]


@pytest.mark.slow
def test_a_worker_without_horovod_is_named_in_one_line_on_every_worker(tmp_path):
    """`import horovod` fails on rank 1 only, as where it is not installed:
    rank 1 says what it lacks, rank 0 names rank 1, and neither starts
    Horovod (whose rendezvous would wait for rank 1 for good)."""
    output = _failed_job(tmp_path, MW_TRAIN, "--without_horovod", "1")
    assert re.search(
        r"\[rank 1\] \S*HorovodUnavailableError: implementation='gloo' needs Horovod, "
        r"which is not installed; build it with `scripts/install_horovod.sh \.venv`",
        output,
    ), output[-3000:]
    assert re.search(
        r"\[rank 0\] \S*HorovodUnavailableError: implementation='gloo' needs Horovod on "
        r"every worker; worker 1 cannot load it",
        output,
    ), output[-3000:]
