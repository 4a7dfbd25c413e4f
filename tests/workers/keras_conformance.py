"""A rank of the multi_worker conformance run (`keras-distrib launch -n 2`).

Runs Keras's own test files of `keras_suite.MULTI_WORKER_FILES` with
pytest, on the strategy `"auto"` resolves to in a launched job
(multi_worker), and writes this rank's results to
`<out>/rank<R>.xml` (JUnit XML). Every rank runs the same tests in the same
order, so their collectives meet; it exits 0 whatever the tests found, so a
rank that ends first does not stop the others (the launcher stops a job
whose rank failed), and the caller reads the results.

The chief's results are the conformance. The other rank writes its files
too (`chief_only_side_effects = False`): Keras's tests assert on the files a
fit wrote, and a rank whose assertion failed would skip the test's next
`fit` and leave the chief waiting in its collectives.
"""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
CONFORMANCE = os.path.join(os.path.dirname(HERE), "conformance")


def main(out: str) -> int:
    rank = os.environ["KERAS_DISTRIB_RANK"]
    if rank != "0":
        from keras_distrib.model import DistributedTrainer

        DistributedTrainer.chief_only_side_effects = False
    pytest.main(
        [
            os.path.join(CONFORMANCE, "multi_worker_suite.py"),
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            "--confcutdir",
            CONFORMANCE,
            "--rootdir",
            CONFORMANCE,
            "-o",
            "timeout=300",
            f"--junitxml={os.path.join(out, f'rank{rank}.xml')}",
        ]
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
