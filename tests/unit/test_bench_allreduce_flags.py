"""benchmarks/allreduce.py's `--variants`: the variants its workers time
(benchmarks/multi_host.py times ours and raw TensorFlow's each alone). An
unknown name, or a subset given to the driver, whose table compares all
three, is refused in one line before any worker starts."""

import os
import subprocess
import sys

SCRIPT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "benchmarks",
    "allreduce.py",
)


def _run(*flags):
    return subprocess.run(
        [sys.executable, SCRIPT, *flags], capture_output=True, text=True, timeout=60
    )


def test_an_unknown_variant_is_refused_naming_the_known_ones():
    result = _run("--variants=ours,fastest")
    assert result.returncode != 0
    assert "--variants takes some of raw, batched, ours" in result.stderr


def test_the_driver_refuses_a_subset_before_launching_workers():
    result = _run("--variants=ours")
    assert result.returncode == 2
    assert "this table compares all of raw, batched, ours: leave it out" in result.stderr
    assert "all-reduce benchmark" not in result.stdout
