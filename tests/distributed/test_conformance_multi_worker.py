"""Keras's own model and callback tests under multi_worker, in a real
2-process job (`keras-distrib launch -n 2`, tests/workers/keras_conformance.py).

The chief's results must be the tier's: every test passes unless
tests/conformance/expected.txt lists it for multi_worker (then it must
fail) or for every strategy (skipped).
"""

import os
import xml.etree.ElementTree as ET

import pytest

from helpers import WORKERS, launch

pytestmark = pytest.mark.slow


def _outcomes(path):
    """`{"Class::test": outcome}` from a JUnit XML file."""
    found = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname').rsplit('.', 1)[-1]}::{case.get('name')}"
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
    assert len(chief) > 140, f"the chief ran only {len(chief)} tests"
    failed = sorted(name for name, outcome in chief.items() if outcome == "failed")
    assert not failed, f"{len(failed)} of Keras's tests failed under multi_worker: {failed}"
    assert os.path.exists(tmp_path / "rank1.xml"), "rank 1 wrote no results"
