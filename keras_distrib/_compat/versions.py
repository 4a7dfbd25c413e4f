"""The TensorFlow and Keras versions keras_distrib was tested with, the
warning on any other, and the import-time probe of the private names the
other `_compat` modules declare.

Each `_compat` module lists the private TensorFlow/Keras names its shims
use in `PRIVATE`, as `"module.path:Dotted.attribute"`. `check_private`
resolves each one: the module is imported (every declared module is one
`import tensorflow` / `import keras` already loads, so nothing new is
imported), then each dotted step is an attribute. The last step may also
be an instance attribute, which only exists once an object is made (a
model's `_compile_loss`, set by `compile`): it resolves when the code of
the class named before it (its methods and their bases', nested functions
included) assigns an attribute of that name. That is a check of the
name, not of an object; the shims' tests exercise the objects.
"""

from __future__ import annotations

import dis
import functools
import importlib
import types
import warnings
from typing import Iterable, Iterator

# Minor versions the whole suite ran on (setup.cfg pins the same ranges).
TESTED = {"tensorflow": "2.21", "keras": "3.15"}


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def _found() -> dict:
    import keras
    import tensorflow as tf

    return {"tensorflow": tf.__version__, "keras": keras.__version__}


@functools.lru_cache(maxsize=None)
def warn_if_untested() -> None:
    """Warns once when TensorFlow or Keras is a minor version we never tested."""
    for name, version in _found().items():
        if _minor(version) != TESTED[name]:
            warnings.warn(
                f"keras_distrib was tested with {name} {TESTED[name]}.x but found "
                f"{name} {version}; private {name} internals it relies on may have "
                "changed (see keras_distrib/_compat/).",
                RuntimeWarning,
                stacklevel=2,
            )


# -- the probe of declared private names ---------------------------------------------

_MISSING = object()


def resolves(spec: str) -> bool:
    """Whether `"module.path:Dotted.attribute"` names something on the
    installed versions (see the module docstring for instance attributes)."""
    module_name, _, path = spec.partition(":")
    try:
        owner: object = importlib.import_module(module_name)
    except ImportError:
        return False
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent, _MISSING)
        if owner is _MISSING:
            return False
    if hasattr(owner, name):
        return True
    return isinstance(owner, type) and _assigned_by(owner, name)


def _assigned_by(cls: type, name: str) -> bool:
    """Whether the code of `cls` or a base assigns an attribute `name`
    (a `STORE_ATTR` of it in a method, property or nested function)."""
    for klass in cls.__mro__[:-1]:  # not `object`
        for value in vars(klass).values():
            for code in _code_objects(value):
                if name in code.co_names and _stores(code, code.co_names.index(name)):
                    return True
    return False


_STORE_ATTR = dis.opmap["STORE_ATTR"]
_EXTENDED_ARG = dis.opmap["EXTENDED_ARG"]


def _stores(code: types.CodeType, name_index: int) -> bool:
    """Whether `code` has a `STORE_ATTR` of `code.co_names[name_index]`
    (read from the raw bytecode: `dis.get_instructions` is far slower, and
    the probe runs at every import)."""
    raw, extended = code.co_code, 0
    for offset in range(0, len(raw), 2):
        op, arg = raw[offset], raw[offset + 1] | extended
        extended = arg << 8 if op == _EXTENDED_ARG else 0
        if op == _STORE_ATTR and arg == name_index:
            return True
    return False


def _code_objects(value) -> Iterator[types.CodeType]:
    """The code of a class attribute that is a function, static or class
    method or property (through decorators' `__wrapped__`), and of the
    functions nested in it."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    functions = [value.fget, value.fset, value.fdel] if isinstance(value, property) else [value]
    for function in functions:
        for _ in range(8):  # a decorator chain; bounded against odd `__wrapped__`s
            if function is None:
                break
            code = getattr(function, "__code__", None)
            if isinstance(code, types.CodeType):
                yield from _nested(code)
            function = getattr(function, "__wrapped__", None)


def _nested(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            yield from _nested(constant)


def missing_message(spec: str, where: str) -> str:
    """The one-line error for a declared name `spec` that does not resolve,
    declared in `keras_distrib/_compat/<where>.py`."""
    module_name, _, path = spec.partition(":")
    package = module_name.split(".")[0]
    found = _found()
    tested = " and ".join(f"{name} {TESTED[name]}.x" for name in TESTED)
    installed = " and ".join(f"{name} {found[name]}" for name in TESTED)
    return (
        f"{package} {found[package]} has no {path} ({module_name}), which keras_distrib "
        f"relies on (keras_distrib/_compat/{where}.py); keras_distrib was tested with "
        f"{tested} but found {installed}; install {package}=={TESTED[package]}.*."
    )


def check_private(modules: Iterable[types.ModuleType]) -> None:
    """Raises a one-line ImportError naming the first name some module's
    `PRIVATE` declares that the installed TensorFlow/Keras lack."""
    for module in modules:
        for spec in module.PRIVATE:
            if not resolves(spec):
                raise ImportError(missing_message(spec, module.__name__.rsplit(".", 1)[-1]))
