"""What tests/workers/faults.py leaves in its `--out` directory, read back:
each rank's final state and each attempt's record (for the fault tests of
tests/distributed: test_faults.py on one host, test_network_faults.py
across hosts). No TensorFlow."""

import collections
import os

import numpy as np

FAULTS = "tests/workers/faults.py"
STEPS = 24  # tests/workers/faults.py: 240 samples, batch 30, 3 epochs

# One line of a worker's attempts-rank<r>.txt.
Attempt = collections.namedtuple("Attempt", "number pid started shm_dir")


def results(out, n):
    """[(iterations, weights)] of ranks 0..n-1."""
    finals = []
    for rank in range(n):
        with np.load(os.path.join(out, f"rank{rank}.npz")) as f:
            finals.append((int(f["iterations"]), [f[k] for k in f.files if k != "iterations"]))
    return finals


def attempts(out, n):
    """{rank: [Attempt, ...]} from the workers' own records."""
    found = {}
    for rank in range(n):
        with open(os.path.join(out, f"attempts-rank{rank}.txt")) as f:
            found[rank] = [
                Attempt(int(a), int(p), float(t), d) for a, p, t, d in (line.split() for line in f)
            ]
    return found


def assert_equal_to(finals, reference, context=None):
    """Every rank took all STEPS steps and ends with `reference`'s rank 0
    weights (atol 1e-6)."""
    for rank, (iterations, weights) in enumerate(finals):
        assert iterations == STEPS, (context, rank, iterations)
        for got, want in zip(weights, reference[0][1]):
            np.testing.assert_allclose(got, want, atol=1e-6, rtol=0, err_msg=str(context))
