"""Private TensorFlow/Keras uses are fenced in keras_distrib/_compat/.

That nothing else uses them (a scan of the sources) is checked in
tests/unit/test_compat_fence.py; here, what _compat does about versions,
Keras's hooks and the private names it declares (checked at import), and
that no private name of ours is also one of a Keras or TensorFlow class
we subclass (which the scan of our sources alone cannot tell).
"""

import ast
import functools
import importlib
import inspect
import os
import re
import subprocess
import sys
import textwrap
import types
import warnings

import keras
import pytest
import tensorflow as tf

from helpers import ROOT
from keras_distrib import _compat
from keras_distrib._compat import versions

PACKAGE = os.path.join(ROOT, "keras_distrib")


def test_untested_version_warns_once_naming_it(monkeypatch):
    monkeypatch.setattr(keras, "__version__", "3.99.0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _compat.warn_if_untested.__wrapped__()
    messages = [str(w.message) for w in caught if w.category is RuntimeWarning]
    assert len(messages) == 1
    assert "tested with keras 3.15.x but found keras 3.99.0" in messages[0]


def test_tested_versions_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _compat.warn_if_untested.__wrapped__()


def test_missing_keras_hook_is_a_one_line_error(monkeypatch):
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    monkeypatch.delattr(TensorFlowTrainer, "_make_function")
    with pytest.raises(ImportError, match=r"has no TensorFlowTrainer\._make_function") as raised:
        _compat.check_hooks()
    assert "\n" not in str(raised.value)


def test_setup_cfg_bounds_the_tested_versions():
    with open(os.path.join(os.path.dirname(PACKAGE), "setup.cfg")) as f:
        setup = f.read()
    assert f"tensorflow-cpu=={_compat.TESTED['tensorflow']}.*" in setup
    major, minor = _compat.TESTED["keras"].split(".")
    assert f"keras>={major}.{minor},<{major}.{int(minor) + 1}" in setup


def test_every_declared_private_name_resolves():
    declared = [spec for module in _compat.MODULES for spec in module.PRIVATE]
    assert all(re.fullmatch(r"[\w.]+:[\w.]+", spec) for spec in declared)
    assert [spec for spec in declared if not versions.resolves(spec)] == []
    assert all(module.PRIVATE for module in _compat.MODULES)


def test_missing_declared_name_is_a_one_line_import_error(monkeypatch):
    from keras.src.losses import loss as loss_module

    monkeypatch.delattr(loss_module, "unscale_loss_for_distribution")
    with pytest.raises(ImportError) as raised:
        _compat.check_private()
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(
        f"keras {keras.__version__} has no unscale_loss_for_distribution (keras.src.losses.loss)"
    )
    assert "(keras_distrib/_compat/keras_trainer.py)" in message
    tested = _compat.TESTED
    assert (
        f"keras_distrib was tested with tensorflow {tested['tensorflow']}.x and keras "
        f"{tested['keras']}.x but found tensorflow {tf.__version__} and keras "
        f"{keras.__version__}"
    ) in message


def test_import_fails_in_one_line_when_a_declared_name_is_missing():
    """In a fresh process: importing Keras (and so TensorFlow) has loaded every
    module the declarations name, so the probe imports nothing; with Keras
    imported, `import keras_distrib` imports the model module, which imports
    `_compat`, whose probe fails the import in one line."""
    modules = sorted({spec.split(":")[0] for m in _compat.MODULES for spec in m.PRIVATE})
    code = (
        "import sys, keras\n"
        "print(repr([name for name in sys.argv[1:] if name not in sys.modules]))\n"
        "from keras.src.trainers import trainer\n"
        "del trainer.Trainer._compute_loss\n"
        "try:\n"
        "    import keras_distrib\n"
        "except ImportError as error:\n"
        "    print(repr(str(error)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *modules],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "KERAS_DISTRIB_BOOTSTRAP": "0"},
    )
    assert done.returncode == 0, done.stderr
    not_loaded, error = done.stdout.splitlines()
    assert not_loaded == "[]"
    assert "has no TensorFlowTrainer._compute_loss (keras.src.backend.tensorflow.trainer)" in error
    assert "\\n" not in error


def _assigner():
    def decorate(function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            return function(*args, **kwargs)

        return wrapper

    class Base:
        def __init__(self):
            self._made_by_init = 1

        @decorate
        def compile(self):
            def nested():
                self._made_by_nested = 2

            nested()

        def read(self):
            return self._only_read

    class Child(Base):
        pass

    module = types.ModuleType("kd_fake_module")
    module.Child = Child
    module.value = 3
    return module


def test_instance_attributes_resolve_where_the_class_assigns_them(monkeypatch):
    monkeypatch.setitem(sys.modules, "kd_fake_module", _assigner())
    assert versions.resolves("kd_fake_module:value")
    assert versions.resolves("kd_fake_module:Child.read")
    assert versions.resolves("kd_fake_module:Child._made_by_init")  # a base's __init__
    assert versions.resolves("kd_fake_module:Child._made_by_nested")  # decorated, nested
    assert not versions.resolves("kd_fake_module:Child._only_read")  # read, never set
    assert not versions.resolves("kd_fake_module:Child._absent")
    assert not versions.resolves("kd_fake_module:Absent.read")
    assert not versions.resolves("kd_no_such_module:value")


# -- our private names on classes that subclass Keras's or TensorFlow's ------------------


def _our_modules():
    """Every module of keras_distrib outside _compat and the launcher (which
    never imports TensorFlow), imported."""
    found = []
    for directory, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            dotted = os.path.relpath(os.path.join(directory, name), ROOT)[:-3].replace(os.sep, ".")
            if name.endswith(".py") and not dotted.startswith(
                ("keras_distrib._compat", "keras_distrib.launch")
            ):
                found.append(importlib.import_module(dotted.removesuffix(".__init__")))
    return found


def _classes_on_keras() -> list:
    """Our classes with a TensorFlow/Keras class among their bases: those
    our modules define, and those made at run time from a mixin of ours
    (`DistributedOptimizer`'s, over any Keras optimizer)."""
    from keras_distrib import optimizers

    found = [
        cls
        for module in _our_modules()
        for cls in vars(module).values()
        if isinstance(cls, type)
        and cls.__module__ == module.__name__
        and any(map(_is_foreign, cls.__mro__))
    ]
    return found + [type("Wrapped", (optimizers._Distributed, keras.optimizers.Optimizer), {})]


def _is_foreign(cls) -> bool:
    return cls.__module__.split(".")[0] in ("keras", "tensorflow")


def _private_names_on_self(cls) -> set:
    """The private names the body of our class `cls` defines, and that its
    methods use on `self`, `cls` or `super()` (attributes, `getattr(self, "_x")`)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    names = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    names |= {
        target.id
        for node in tree.body
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        for target in getattr(node, "targets", [getattr(node, "target", None)])
        if isinstance(target, ast.Name)
    }
    for node in ast.walk(tree):
        owner, name = None, None
        if isinstance(node, ast.Attribute):
            owner, name = node.value, node.attr
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) >= 2
        ):
            owner, name = node.args[0], getattr(node.args[1], "value", None)
        if getattr(owner, "id", None) in ("self", "cls") or (
            isinstance(owner, ast.Call) and getattr(owner.func, "id", None) == "super"
        ):
            names.add(name)
    return {n for n in names if isinstance(n, str) and n.startswith("_") and not n.startswith("__")}


def _keras_uses(cls, name: str) -> bool:
    """Whether a TensorFlow/Keras class among `cls`'s bases has `name`, or
    its code names it (as an attribute, a global or a string)."""
    for klass in filter(_is_foreign, cls.__mro__):
        if name in vars(klass):
            return True
        for value in vars(klass).values():
            for code in versions._code_objects(value):
                if name in code.co_names or name in code.co_consts:
                    return True
    return False


def test_our_private_names_on_keras_subclasses_are_ours_or_declared_hooks():
    """A private name our code defines or uses on `self` in a class that
    subclasses a TensorFlow or Keras class is that class's too when its
    code has it: then it is one of the Keras hooks `DistributedModel`
    overrides or calls on purpose (`_compat.KERAS_HOOKS`), else it goes
    through `_compat` (tests/unit/test_compat_fence.py checks the rest
    from the sources alone)."""
    shared, hooks_used = [], set()
    for cls in _classes_on_keras():
        ours = [
            k
            for k in cls.__mro__
            if k.__module__.startswith("keras_distrib.")
            and not k.__module__.startswith("keras_distrib._compat")
        ]
        for name in sorted(set().union(*map(_private_names_on_self, ours))):
            if _keras_uses(cls, name):
                hooks_used.add(name)
                if name not in _compat.KERAS_HOOKS:
                    shared.append(f"{cls.__module__}.{cls.__qualname__}.{name}")
    assert shared == [], (
        "private names our classes share with the Keras/TensorFlow classes they subclass: "
        "read or set them through keras_distrib/_compat/, or declare an override of a Keras "
        f"hook in _compat.KERAS_HOOKS: {shared}"
    )
    # The scan sees DistributedModel's overrides of Keras's trainer.
    assert {"_make_function", "_maybe_symbolic_build", "_resolve_auto_jit_compile"} <= hooks_used
