"""Every Python block in README.md and docs/ is run by a test or marked as an
excerpt: the README's quickstart (`<!-- quickstart -->` before its fence)
runs in tests/integration/test_readme.py and tests/distributed/
test_package.py; every other block has `<!-- excerpt -->` before its fence.
"""

import glob
import os
import re

from pure_helpers import ROOT

PAGES = [
    os.path.join(ROOT, "README.md"),
    *glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True),
]
MARKERS = ("<!-- quickstart -->", "<!-- excerpt -->")


def _unmarked_python_blocks(text: str) -> list[int]:
    """Line numbers of ```python fences not right after a marker line."""
    lines = text.splitlines()
    found = []
    for i, line in enumerate(lines):
        if re.match(r"\s*```python\s*$", line):
            before = next((prior.strip() for prior in reversed(lines[:i]) if prior.strip()), "")
            if before not in MARKERS:
                found.append(i + 1)
    return found


def test_every_python_block_is_run_or_marked_as_an_excerpt():
    unmarked = {
        os.path.relpath(page, ROOT): lines
        for page in PAGES
        if (lines := _unmarked_python_blocks(open(page).read()))
    }
    assert not unmarked, f"Python blocks neither run nor marked <!-- excerpt -->: {unmarked}"


def test_the_readme_has_one_quickstart_and_stays_short():
    text = open(os.path.join(ROOT, "README.md")).read()
    assert text.count(MARKERS[0]) == 1
    assert len(text.splitlines()) <= 200


def test_the_prose_tells_no_work_history():
    """README, docs, CHANGELOG, code and tests say what the software does,
    not when or in which work item it was done."""
    history = re.compile(r"\b(session|issue) \d+\b|\(issue\b|\bwork period\b", re.IGNORECASE)
    this = os.path.abspath(__file__)
    files = [*PAGES, os.path.join(ROOT, "CHANGELOG.md"), os.path.join(ROOT, "Makefile")]
    for folder in ("keras_distrib", "tests", "benchmarks", "examples", "scripts"):
        files += glob.glob(os.path.join(ROOT, folder, "**", "*.py"), recursive=True)
    found = [
        f"{os.path.relpath(path, ROOT)}:{number}: {line.strip()}"
        for path in files
        if os.path.abspath(path) != this
        for number, line in enumerate(open(path, encoding="utf-8"), 1)
        if history.search(line) and "github.com" not in line
    ]
    assert not found, "\n".join(found)
