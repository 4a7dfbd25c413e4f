"""DistributedOptimizer across 2 processes (tests/workers/mw_optimizer.py), under
`multi_worker` and `horovod`: accumulation and compression equal one process.

In one process: tests/integration/test_optimizers.py.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import as_reference
from helpers import ROOT, WORKERS, build

DATA_SAMPLES = 192  # the `data` fixture's size (tests/conftest.py)

# Dtypes the gradient all-reduce runs in, per backend. Horovod has no
# bfloat16 all-reduce kernel: bf16-rounded gradients travel as float32 there.
WIRE_DTYPES = {
    "multi_worker": {"fp16": ["float16", "float32"], "bf16": ["bfloat16", "float32"]},
    "horovod": {"fp16": ["float16", "float32"], "bf16": ["float32"]},
}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["multi_worker", "horovod"])
def test_two_processes_accumulation_and_compression(backend, tmp_path, data):
    if backend == "horovod":
        pytest.importorskip("horovod.tensorflow")
    launcher = ["--backend", "horovod"] if backend == "horovod" else []
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "keras_distrib.launch",
            "launch",
            "-n",
            "2",
            "--timeout",
            "240",
            *launcher,
            os.path.join(WORKERS, "mw_optimizer.py"),
            "--out",
            str(tmp_path),
            "--strategy",
            backend,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    x, y = data
    # One traced run of batch 64 for all three: the accumulated steps add
    # its rows in another order; the compressed ones round besides
    # (`float_bounds.Reference.compressed`).
    reference = as_reference.fit(build("functional", "single"), x, y, 64)
    bounds = {c: reference.compressed(c) for c in ("fp16", "bf16")}
    count = len(reference.model.get_weights())
    for rank in range(2):
        arrays = np.load(tmp_path / f"opt{rank}.npz")
        with open(tmp_path / f"opt{rank}.json") as f:
            results = json.load(f)
        assert results["accumulate"]["iterations"] == 3
        for run, bound in [("accumulate", reference), *bounds.items()]:
            got = [arrays[f"{run}_{i}"] for i in range(count)]
            as_reference.assert_weights(bound, got, err_msg=f"rank {rank} {run} weight")
        for compression in ("fp16", "bf16"):
            assert results[compression]["dtypes"] == WIRE_DTYPES[backend][compression]
