"""The `make demo` example trains end to end and prints its results."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_digits_example_trains_on_two_replicas():
    out = subprocess.run(
        [sys.executable, "examples/train_digits.py", "--config", "configs/digits.json",
         "--epochs", "8"],
        cwd=ROOT, capture_output=True, text=True, timeout=280, check=True,
    ).stdout
    assert "strategy=mirrored replicas=2" in out
    accuracy = float(re.search(r"validation accuracy: ([0-9.]+)", out).group(1))
    assert accuracy > 0.9
    assert re.search(r"throughput: [0-9,]+ samples/s", out)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_digits_example_trains_with_two_workers_through_the_launcher():
    proc = subprocess.run(
        [sys.executable, "-m", "keras_distrib.launch", "launch", "-n", "2",
         "examples/train_digits.py", "--config", "configs/digits_2workers.json", "--epochs", "8"],
        cwd=ROOT, capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert "[rank 0] strategy=multi_worker replicas=2 workers=2" in out
    assert "[rank 1] strategy=" not in out  # only the chief prints
    accuracy = float(re.search(r"\[rank 0\] validation accuracy: ([0-9.]+)", out).group(1))
    assert accuracy > 0.9
