"""docs/conformance.md shows the matrix the tier asserts (matrix.py)."""

import os
import re

import expectations
import matrix


def test_the_docs_page_shows_the_conformance_matrix():
    table = matrix.render(expectations.read())
    with open(matrix.PAGE) as f:
        text = f.read()
    found = re.search(re.escape(matrix.BEGIN) + r"\n(.*?)" + re.escape(matrix.END), text, re.DOTALL)
    assert found, f"docs/conformance.md has no {matrix.BEGIN} ... {matrix.END} section"
    if os.environ.get("KD_CONFORMANCE_WRITE_PAGE"):
        with open(matrix.PAGE, "w") as f:
            f.write(text[: found.start(1)] + table + "\n" + text[found.end(1) :])
        return
    assert found.group(1) == table + "\n", (
        "docs/conformance.md's matrix is not what tests/conformance/expected.txt says; "
        "write it anew with `make conformance-matrix`"
    )


def test_every_listed_test_runs_under_its_strategy():
    # A listed test the tier does not run could never start passing, and
    # the list would not shrink.
    not_run = sorted(
        f"{strategy} {test}"
        for (strategy, test) in expectations.read()
        if strategy != "*"
        and test.split("::", 1)[1]
        not in {name for name, _ in matrix.tests_of(test.split("::", 1)[0], strategy)}
    )
    assert not not_run, f"expected.txt lists tests the tier does not run: {not_run}"
