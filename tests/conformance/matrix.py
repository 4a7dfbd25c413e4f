"""The conformance matrix: Keras's test files x strategies, passed / listed.

What the tier asserts makes the matrix computable without running it: a
test not in `expected.txt` must pass, a test listed for a strategy must
fail (strictly), a `*` test is skipped. So a cell is the file's tests under
that strategy split into passed, listed (expected to fail, with a reason)
and skipped (by Keras's own markers, or failing in plain Keras too).
`test_matrix.py` checks that docs/conformance.md shows this table; `make
conformance-matrix` writes it (KD_CONFORMANCE_WRITE_PAGE=1).
"""

from __future__ import annotations

import functools
import os
import unittest

import keras_suite

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE = os.path.join(ROOT, "docs", "conformance.md")
BEGIN, END = "<!-- conformance-matrix:begin -->", "<!-- conformance-matrix:end -->"
# Strategies run in one process (tests/conformance/test_keras_on_<strategy>.py), and
# multi_worker across 2 processes for the files of MULTI_WORKER_FILES.
IN_PROCESS = ("single", "mirrored", "central_storage", "tensor_parallel", "pipeline")
STRATEGIES = IN_PROCESS + ("multi_worker",)


def _skipped_by_keras(method) -> bool:
    for mark in getattr(method, "pytestmark", []):
        if mark.name == "skip" or (mark.name == "skipif" and mark.args and mark.args[0]):
            return True
    return False


@functools.lru_cache(maxsize=None)
def _classes(relpath: str) -> list:
    return sorted(keras_suite.test_classes(keras_suite.load(relpath, None)).items())


def tests_of(relpath: str, strategy: str) -> list[tuple[str, bool]]:
    """`("Class::test", skipped_by_keras)` for every test of Keras's file
    the tier runs under `strategy` (`keras_suite.not_run`)."""
    found = []
    for name, cls in _classes(relpath):
        left_out = keras_suite.not_run(cls, strategy)
        for test in unittest.TestLoader().getTestCaseNames(cls):
            if test not in left_out:
                found.append((f"{name}::{test}", _skipped_by_keras(getattr(cls, test))))
    return found


def cells(listed: dict) -> dict:
    """`{(file, strategy): (passed, listed, skipped)}`."""
    table = {}
    for relpath in keras_suite.FILES:
        for strategy in STRATEGIES:
            if strategy == "multi_worker" and relpath not in keras_suite.MULTI_WORKER_FILES:
                continue
            passed = failing = skipped = 0
            for test, skipped_by_keras in tests_of(relpath, strategy):
                key = f"{relpath}::{test}"
                if skipped_by_keras or ("*", key) in listed:
                    skipped += 1
                elif (strategy, key) in listed:
                    failing += 1
                else:
                    passed += 1
            table[(relpath, strategy)] = (passed, failing, skipped)
    return table


def render(listed: dict) -> str:
    """The matrix as Markdown: one row per Keras file, one column per strategy."""
    table = cells(listed)
    lines = [
        "| Keras's test file | " + " | ".join(f"`{s}`" for s in STRATEGIES) + " |",
        "|---|" + "---|" * len(STRATEGIES),
    ]
    for relpath in keras_suite.FILES:
        row = []
        for strategy in STRATEGIES:
            cell = table.get((relpath, strategy))
            if cell is None:
                row.append("")
                continue
            passed, failing, _ = cell
            row.append(f"{passed} passed" + (f", {failing} listed" if failing else ""))
        lines.append(f"| `{relpath}` | " + " | ".join(row) + " |")
    return "\n".join(lines)
