"""Keras's own model and callback tests under multi_worker, in a real
2-process job (`keras-distrib launch -n 2`, tests/workers/keras_conformance.py).

The chief's results must be the tier's: every test passes unless
tests/conformance/expected.txt lists it for multi_worker (then it must
fail) or for every strategy (skipped).
"""

import os
import sys
import xml.etree.ElementTree as ET

import pytest

from helpers import WORKERS, launch

pytestmark = pytest.mark.slow

CONFORMANCE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conformance"
)


def _tests_the_tier_runs():
    """`{"Class::test"}` the tier runs under multi_worker (keras_suite)."""
    if CONFORMANCE not in sys.path:
        sys.path.insert(0, CONFORMANCE)
    import keras_suite
    import matrix

    return {
        name
        for relpath in keras_suite.MULTI_WORKER_FILES
        for name, _ in matrix.tests_of(relpath, "multi_worker")
    }


def _outcomes(path):
    """`{"Class::test": outcome}` from a JUnit XML file."""
    found = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        cls = case.get("classname").rsplit(".", 1)[-1].split("__")[0]
        name = f"{cls}::{case.get('name')}"
        kinds = {child.tag for child in case}
        found[name] = (
            "failed"
            if kinds & {"failure", "error"}
            else "skipped"
            if "skipped" in kinds
            else "passed"
        )
    return found


def test_keras_model_and_callback_tests_pass_under_multi_worker(tmp_path):
    launch(tmp_path, 2, os.path.join(WORKERS, "keras_conformance.py"), str(tmp_path), timeout=900)
    chief = _outcomes(tmp_path / "rank0.xml")
    missing = sorted(_tests_the_tier_runs() - set(chief))
    assert not missing, f"the chief did not run {len(missing)} tests: {missing[:5]}"
    failed = sorted(name for name, outcome in chief.items() if outcome == "failed")
    assert not failed, f"{len(failed)} of Keras's tests failed under multi_worker: {failed}"
    assert os.path.exists(tmp_path / "rank1.xml"), "rank 1 wrote no results"
