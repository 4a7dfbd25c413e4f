"""The processes the tests start treat pandas and matplotlib as missing
(tests/child_site/sitecustomize.py): those that inherit the tests'
environment and those given `pure_helpers.CHILD_PYTHONPATH`."""

import json
import os
import subprocess
import sys

from pure_helpers import run_python

CODE = ("import importlib.util, json\n"
        "print(json.dumps([importlib.util.find_spec(m) is None for m in ('pandas', 'matplotlib')]))")


def test_a_process_given_the_child_pythonpath_loads_neither():
    proc = run_python(CODE)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [True, True]


def test_a_process_that_inherits_the_environment_loads_neither():
    out = subprocess.run([sys.executable, "-c", CODE], env=dict(os.environ),
                         capture_output=True, text=True, timeout=45, check=True).stdout
    assert json.loads(out) == [True, True]
