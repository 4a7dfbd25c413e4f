"""Private TensorFlow/Keras uses are fenced in keras_distrib/_compat/: no
other module of the package uses them (a scan of the sources, no imports).

What _compat itself checks (versions, Keras's hooks) is in
tests/integration/test_compat.py.
"""

import os
import re

from pure_helpers import ROOT

PACKAGE = os.path.join(ROOT, "keras_distrib")
# Private module paths, and private members of TensorFlow/Keras objects.
PRIVATE = re.compile(r"keras\.src|tensorflow\.python|\b(?:model|optimizer|dataset|context|"
                     r"callback|tf_strategy|extended)\._[a-z]")


def _sources():
    for directory, _, files in os.walk(PACKAGE):
        if os.path.basename(directory) == "_compat":
            continue
        for name in files:
            if name.endswith(".py"):
                yield os.path.join(directory, name)


def test_no_private_use_outside_compat():
    offenders = []
    for path in _sources():
        with open(path) as f:
            for number, line in enumerate(f, 1):
                code = line.split("#", 1)[0]
                if PRIVATE.search(code):
                    offenders.append(f"{os.path.relpath(path, PACKAGE)}:{number}: {line.strip()}")
    assert offenders == []
