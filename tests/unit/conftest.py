"""The unit tier: pure Python, no TensorFlow.

Its tests import keras_distrib's pure modules (cluster, launch, topology,
pipeline_schedule, host_allreduce, ...) and tests/pure_helpers.py, never
tests/helpers.py. When a run collects only this tier, TensorFlow must not
be in sys.modules after collection, nor after any test; a run that also
collects the other tiers has imported it already, and checks nothing.
"""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _in_this_tier(item) -> bool:
    return os.path.commonpath([str(item.path), HERE]) == HERE


def pytest_collection_finish(session):
    if (
        session.items
        and all(_in_this_tier(item) for item in session.items)
        and "tensorflow" in sys.modules
    ):
        raise pytest.UsageError(
            "tests/unit imported TensorFlow while collecting; unit tests must import only "
            "pure modules (tests/pure_helpers.py, not tests/helpers.py)"
        )


@pytest.fixture(autouse=True)
def _no_tensorflow():
    """Fails a unit test that imports TensorFlow (when it was not already)."""
    before = "tensorflow" in sys.modules
    yield
    if not before and "tensorflow" in sys.modules:
        pytest.fail(
            "this unit test imported TensorFlow; move it to tests/integration", pytrace=False
        )
