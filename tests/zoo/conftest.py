"""Shared state of the zoo's tests: what each (pattern, strategy) did.

The zoo runs in-process (test_zoo.py) and across processes
(test_zoo_processes.py); test_zoo_readme.py then checks that the matrix
in docs/zoo.md says what this run found.
"""

import pytest


@pytest.fixture(scope="session")
def zoo_results():
    """(pattern name, strategy) -> the outcome the test asserted."""
    return {}
