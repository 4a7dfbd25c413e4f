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
