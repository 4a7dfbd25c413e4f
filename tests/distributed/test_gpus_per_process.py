"""One GPU per process, seen from the strategies: on a machine of 4 GPUs
(TensorFlow's device lists answering as CUDA would, tests/workers/fake_gpus.py;
this machine has none), each of the launcher's 2 ranks with
`--gpus_per_worker 2` replicates over its own 2 GPUs, and one process alone
keeps all 4 for `mirrored`. The environment each launcher gives its ranks
is tested in tests/unit/test_gpu_share.py and tests/distributed/test_mpirun.py."""

import os
import re
import subprocess
import sys

import pytest

from pure_helpers import ROOT, WORKERS, launch

pytestmark = pytest.mark.slow

FAKE = os.path.join(WORKERS, "fake_gpus.py")
LINE = re.compile(
    r"^(?:\[rank \d\] )?rank (\S+) visible (\S+) mirrored (\S+) auto (\S+)$", re.MULTILINE
)


def test_each_rank_of_a_host_replicates_over_its_own_gpus(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    output = launch(
        tmp_path, 2, FAKE, launch_flags=("--gpus_per_worker", "2"), env={"FAKE_GPUS": "4"}
    )
    ranks = sorted(LINE.findall(output))
    assert ranks == [("0", "0,1", "GPU:0,GPU:1", "-"), ("1", "2,3", "GPU:0,GPU:1", "-")], output[
        -3000:
    ]


def test_one_process_keeps_every_gpu_for_mirrored():
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "CUDA_VISIBLE_DEVICES" and not k.startswith("KERAS_DISTRIB_")
    }
    proc = subprocess.run(
        [sys.executable, FAKE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(env, FAKE_GPUS="4", TF_CPP_MIN_LOG_LEVEL="2"),
    )
    assert LINE.findall(proc.stdout) == [
        ("-", "-", "GPU:0,GPU:1,GPU:2,GPU:3", "mirrored:GPU:0,GPU:1,GPU:2,GPU:3")
    ], proc.stderr
