"""The zoo x strategy matrix in docs/zoo.md is what this run of the zoo found.

It runs after the zoo's other tests (pytest runs the files in name order)
and renders their outcomes; a docs/zoo.md that says anything else fails,
naming the command that writes it anew (`make zoo-matrix`, which runs the
zoo with KD_ZOO_WRITE_README=1).
"""

import os
import re

import pytest

import patterns as zoo
from helpers import ROOT
from test_zoo_processes import CASES

# The documentation page that holds the matrix, between BEGIN and END.
ZOO_PAGE = os.path.join(ROOT, "docs", "zoo.md")
BEGIN, END = "<!-- zoo-matrix:begin -->", "<!-- zoo-matrix:end -->"
STRATEGIES = zoo.IN_PROCESS + zoo.MULTI_PROCESS
EXPECTED = {(p.name, s) for p in zoo.PATTERNS for s in zoo.IN_PROCESS} | set(CASES)


def _cell(outcome):
    if outcome is None:
        return ""
    if outcome == zoo.EXACT:
        return "exact"
    if outcome == zoo.AGREES:
        return "agrees"
    if outcome == zoo.SKIPPED:
        return "not run"
    return f"refused: {zoo.refusal(outcome)[0]}"


def render(results) -> str:
    """The matrix as Markdown: one row per pattern, one column per strategy."""
    lines = [
        "| model (as users write it) | " + " | ".join(f"`{s}`" for s in STRATEGIES) + " |",
        "|---|" + "---|" * len(STRATEGIES),
    ]
    for pattern in zoo.PATTERNS:
        cells = [_cell(results.get((pattern.name, s))) for s in STRATEGIES]
        lines.append(f"| {pattern.what} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def test_zoo_page_matrix_is_what_the_zoo_found(zoo_results):
    missing = EXPECTED - set(zoo_results)
    if missing:
        pytest.skip(
            f"the zoo did not run whole ({len(missing)} cases missing, e.g. "
            f"{sorted(missing)[0]}); a whole run checks docs/zoo.md's matrix"
        )
    table = render(zoo_results)
    with open(ZOO_PAGE) as f:
        text = f.read()
    found = re.search(re.escape(BEGIN) + r"\n(.*?)" + re.escape(END), text, re.DOTALL)
    assert found, f"docs/zoo.md has no {BEGIN} ... {END} section"
    if os.environ.get("KD_ZOO_WRITE_README"):
        with open(ZOO_PAGE, "w") as f:
            f.write(text[: found.start(1)] + table + "\n" + text[found.end(1) :])
        return
    assert found.group(1) == table + "\n", (
        "docs/zoo.md's zoo matrix is not what this run found; write it anew with `make zoo-matrix`"
    )
