"""`expected.txt`: Keras's tests that may not pass on DistributedModel.

One line each: `<strategy or *> <keras file>::<TestCase>::<test> <reason>`.
`*` marks a test plain Keras fails here too (skipped under every
strategy); a strategy's name, a documented refusal or known gap of that
strategy (expected to fail, strictly: a listed test that passes fails the
tier, so the list only shrinks).
"""

from __future__ import annotations

import os

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "expected.txt")


def read(path: str = PATH) -> dict:
    """`{(strategy, "file::Class::test"): reason}`."""
    found = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split(maxsplit=2)
            if len(parts) != 3:
                raise ValueError(
                    f"{path}:{number}: want '<strategy> <test> <reason>', got {line!r}"
                )
            found[(parts[0], parts[1])] = parts[2]
    return found
