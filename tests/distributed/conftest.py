"""The distributed tier: tests that start real processes (the launcher and
its workers, TensorFlow servers, horovodrun, the examples end to end).

Every test here counts as `slow` (the marker setup.cfg defines), also those
not marked one by one, so `pytest -m "not slow"` still leaves the whole
tier out.
"""

import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(items):
    for item in items:
        if os.path.commonpath([str(item.path), HERE]) == HERE:
            item.add_marker(pytest.mark.slow)
