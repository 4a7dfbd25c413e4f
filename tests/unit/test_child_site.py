"""The processes the tests start treat pandas and matplotlib as missing
(tests/child_site/sitecustomize.py): those that inherit the tests'
environment and those given `pure_helpers.CHILD_PYTHONPATH`."""

import json
import os
import subprocess
import sys

from pure_helpers import run_python

CODE = (
    "import importlib.util, json\n"
    "print(json.dumps([importlib.util.find_spec(m) is None "
    "for m in ('pandas', 'matplotlib')]))"
)


def test_a_process_given_the_child_pythonpath_loads_neither():
    proc = run_python(CODE)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [True, True]


def test_a_process_that_inherits_the_environment_loads_neither():
    out = subprocess.run(
        [sys.executable, "-c", CODE],
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=45,
        check=True,
    ).stdout
    assert json.loads(out) == [True, True]


PROBE = """\
import gc
ENABLED_WHILE_LOADING = gc.isenabled()
KEPT = []
for _ in range(1000):
    cycle = []
    cycle.append(cycle)
    KEPT.append(cycle)
"""

IMPORT_PROBE = """\
import gc, json, sys
import frozen_imports
frozen_imports.NAMES.add("kd_probe")
if sys.argv[1] == "off":
    gc.disable()
import kd_probe
print(json.dumps({"while_loading": kd_probe.ENABLED_WHILE_LOADING, "after": gc.isenabled(),
                  "frozen": gc.get_freeze_count(),
                  "covers": sorted(frozen_imports.NAMES & {"tensorflow", "keras"})}))
"""


def test_importing_tensorflow_or_keras_runs_without_the_collector_and_freezes_what_it_made(
    tmp_path,
):
    """tests/child_site/frozen_imports.py, on a stand-in module (this tier
    does not import TensorFlow): the collector is off while it loads, on
    again after, and the objects it made are frozen."""
    (tmp_path / "kd_probe.py").write_text(PROBE)
    proc = run_python(IMPORT_PROBE, "on", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["while_loading"] is False and got["after"] is True, got
    assert got["frozen"] >= 1000, got
    assert got["covers"] == ["keras", "tensorflow"], got


def test_a_process_that_turned_the_collector_off_keeps_it_off(tmp_path):
    (tmp_path / "kd_probe.py").write_text(PROBE)
    proc = run_python(IMPORT_PROBE, "off", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["after"] is False and got["frozen"] == 0, got
