"""The transport registry, read without importing a transport (no TensorFlow).

Each registered transport at work, and its whole interface:
tests/integration/test_transports.py.
"""

import ast
import os

import pytest

from keras_distrib.collectives import registry
from pure_helpers import ROOT

NAMES = ["gloo", "hierarchical", "horovod", "one_process", "shm", "tcp", "tensorflow"]


@pytest.mark.parametrize("name", ["carrier", "SHM", "", None])
def test_an_unknown_transport_is_a_one_line_error_naming_the_choices(name):
    with pytest.raises(ValueError) as raised:
        registry.create(name)
    assert str(raised.value) == f"Unknown transport {name!r}; use one of {NAMES}."


def test_the_names_are_those_of_the_table():
    assert registry.names() == sorted(registry.BUILTIN) == NAMES


def _classes_in(path):
    """{class name: the string its class body assigns to `name`} of a module."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    found = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            found[node.name] = next(
                (
                    statement.value.value
                    for statement in node.body
                    if isinstance(statement, ast.Assign)
                    and [getattr(t, "id", None) for t in statement.targets] == ["name"]
                    and isinstance(statement.value, ast.Constant)
                ),
                None,
            )
    return found


def test_each_name_points_at_a_class_of_that_name_in_the_collectives():
    """One line of the table per transport: the module (in
    keras_distrib/collectives/, one file each) and the class, whose `name`
    is the name it is registered under."""
    modules = set()
    for name, where in registry.BUILTIN.items():
        module, _, cls = where.partition(":")
        assert module.startswith("keras_distrib.collectives."), where
        path = os.path.join(ROOT, *module.split(".")) + ".py"
        assert os.path.isfile(path), where
        assert _classes_in(path).get(cls) == name, where
        modules.add(module)
    assert len(modules) == len(registry.BUILTIN)
