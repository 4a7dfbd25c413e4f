"""Private TensorFlow/Keras names are used in keras_distrib/_compat/ only.

A scan of the syntax trees of every module of keras_distrib outside
_compat (no imports). Each private name used there (one leading
underscore, not a dunder) must be one of ours:

- an attribute of `self`, `cls` or `super()` that keras_distrib defines
  itself outside _compat (`def _x` or `_x = ...` in a class or module
  body, `self._x = ...`, `setattr(self, "_x", ...)`,
  `self.__dict__["_x"] = ...`), or one of the Keras Trainer methods
  `DistributedModel` overrides or calls on purpose, declared with their
  reasons in `_compat/keras_trainer.py` (`KERAS_HOOKS`, checked at import);
- a module-level name of a keras_distrib module, read as `module._x`;
- a `_kd_*` attribute: the prefix keras_distrib gives what it sets on
  objects it does not own (functions, Keras objects);
- a name on `OURS_ON_OTHER_OBJECTS`: our own private attributes used on an
  object other than `self`.

Uses are attributes (`X._x`), names given as strings (`getattr(X, "_x")`,
`X.__dict__.get("_x")`, `kwargs.get("_x")`) and imports of private modules
(`keras.src`, `tensorflow.python`). Anything else belongs to TensorFlow or
Keras (`layer._inbound_nodes`, `getattr(model, "_functional")`,
`self._jit_compile` in a `keras.Model` subclass) and goes through a
function of `_compat` that declares it in its module's `PRIVATE`.

A private name of ours that Keras or TensorFlow also uses on a class we
subclass is told apart where Keras is imported:
tests/integration/test_compat.py.
"""

import ast
import functools
import os

import pytest

from pure_helpers import ROOT

PACKAGE = os.path.join(ROOT, "keras_distrib")
COMPAT = os.path.join(PACKAGE, "_compat")
SELF = {"self", "cls"}
# Private modules of TensorFlow and Keras (their public API lives elsewhere).
PRIVATE_MODULES = ("keras.src", "tensorflow.python", "tensorflow.core", "tensorflow.compiler")
# Our own private attributes used on an object other than `self`.
OURS_ON_OTHER_OBJECTS = {
    # CentralStorage.around sets it on the instance it makes without __init__.
    "_compute_devices",
}
# Python's own functions spelled with an underscore, documented as public.
PYTHON_PRIVATE = {
    ("os", "_exit"),  # ends a process without cleanup (a forked task server)
    ("sys", "_current_frames"),  # every thread's stack (the flight recorder's dump)
}
FIX = (
    "a private TensorFlow/Keras name outside keras_distrib/_compat/: move the use into a "
    "small function of the fitting _compat module (declared in its PRIVATE, with a "
    "docstring saying what it reads and why) and call that; a private name of "
    "keras_distrib's own used on another object goes on OURS_ON_OTHER_OBJECTS in "
    "tests/unit/test_compat_fence.py, a Keras Trainer method DistributedModel overrides "
    "or calls on purpose on KERAS_HOOKS in keras_distrib/_compat/keras_trainer.py"
)


def _private(name) -> bool:
    return (
        isinstance(name, str)
        and name.isidentifier()
        and name.startswith("_")
        and name.strip("_") != ""
        and not name.startswith("__")
    )


def _modules() -> dict:
    """{dotted name: path} of every module of the package."""
    found = {}
    for directory, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                dotted = os.path.relpath(path[:-3], ROOT).replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return found


@functools.lru_cache(maxsize=None)
def _parse(path: str) -> ast.Module:
    with open(path) as f:
        return ast.parse(f.read(), path)


_WALKED: dict = {}


def _walk(tree: ast.Module) -> list:
    """Every node of `tree` (walked once per tree: the scan walks each often)."""
    if id(tree) not in _WALKED:
        _WALKED[id(tree)] = (tree, list(ast.walk(tree)))
    return _WALKED[id(tree)][1]


def keras_hooks() -> set:
    """`KERAS_HOOKS` of _compat/keras_trainer.py, read from its source."""
    for node in _parse(os.path.join(COMPAT, "keras_trainer.py")).body:
        if isinstance(node, ast.Assign) and [_dotted(t) for t in node.targets] == ["KERAS_HOOKS"]:
            return set(ast.literal_eval(node.value))
    raise AssertionError("_compat/keras_trainer.py declares no KERAS_HOOKS")


# -- what keras_distrib defines --------------------------------------------------------


def _dotted(node):
    """ "a.b.c" for a chain of names and attributes, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return None if inner is None else f"{inner}.{node.attr}"
    return None


def _is_self(node) -> bool:
    return (isinstance(node, ast.Name) and node.id in SELF) or (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
    )


def _body_names(body) -> set:
    """Names a module or class body binds (not inside its functions)."""
    names, stack = set(), list(body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            stack.extend(ast.iter_child_nodes(node))
        elif isinstance(node, ast.ExceptHandler):
            stack.extend(node.body)
    return names


def _named_on_self(node):
    """The name `node` stores on self/cls by string (`setattr(self, "_x", v)`,
    `object.__setattr__(self, ...)`, `self.__dict__["_x"] = v`,
    `self.__dict__.setdefault("_x", v)`), else None."""
    if isinstance(node, ast.Call):
        call = _dotted(node.func)
        if (
            call in ("setattr", "object.__setattr__")
            and len(node.args) >= 2
            and _is_self(node.args[0])
            and isinstance(node.args[1], ast.Constant)
        ):
            return node.args[1].value
        if (
            call in ("self.__dict__.setdefault", "cls.__dict__.setdefault")
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            return node.args[0].value
    if (
        isinstance(node, ast.Subscript)
        and isinstance(node.ctx, ast.Store)
        and _is_self(_dict_of(node.value))
        and isinstance(node.slice, ast.Constant)
    ):
        return node.slice.value
    return None


def defined(trees) -> set:
    """Every private name keras_distrib defines in `trees` (see the module
    docstring)."""
    names = set()
    for tree in trees:
        names |= _body_names(tree.body)
        for node in _walk(tree):
            if isinstance(node, ast.ClassDef):
                names |= _body_names(node.body)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and _is_self(node.value)
            ):
                names.add(node.attr)
            else:
                names.add(_named_on_self(node))
    return {name for name in names if _private(name)}


# -- the uses ---------------------------------------------------------------------------


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module if is_package else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return package + ("." + node.module if node.module else "")


def _imports(module: str, is_package: bool, tree: ast.Module) -> dict:
    """{local name: dotted name} of everything `module` imports, anywhere."""
    bound = {}
    for node in _walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:
                    bound[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node)
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{base}.{alias.name}"
    return bound


def _foreign_imports(module: str, is_package: bool, tree: ast.Module):
    """(node, what) for each import of a private TensorFlow/Keras module or name."""
    for node in _walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node)
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] != "keras_distrib" and (
                name.startswith(PRIVATE_MODULES) or any(map(_private, name.split(".")))
            ):
                yield node, f"import {name}"


def _private_module_uses(tree: ast.Module, imports: dict):
    """(node, what) for each `keras.src` or `tf.python` reached as an
    attribute of an imported module."""
    for node in _walk(tree):
        dotted = _dotted(node) if isinstance(node, ast.Attribute) else None
        root, _, rest = (dotted or "").partition(".")
        if root in imports and f"{imports[root]}.{rest}" in PRIVATE_MODULES:
            yield node, f"{dotted} (a private module)"


_STRING_NAMED = {
    "getattr",
    "hasattr",
    "setattr",
    "delattr",
    "object.__setattr__",
    "object.__getattribute__",
    "object.__delattr__",
}


def _uses(tree: ast.Module):
    """(node, object or None, private name) of each private name used:
    `X._x`, `getattr(X, "_x")`, `X.__dict__["_x"]`, `vars(X).get("_x")`,
    and any other string that is a private name (object None)."""
    named = set()
    for node in _walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            yield node, node.value, node.attr
        elif isinstance(node, ast.JoinedStr):
            named.update(id(part) for part in node.values)
        elif (
            isinstance(node, ast.Call)
            and len(node.args) >= 2
            and _dotted(node.func) in _STRING_NAMED
            and _private(getattr(node.args[1], "value", None))
        ):
            named.add(id(node.args[1]))
            yield node, node.args[0], node.args[1].value
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("get", "pop", "setdefault")
            and node.args
        ):
            owner = _dict_of(node.func.value)
            if owner is not None and _private(getattr(node.args[0], "value", None)):
                named.add(id(node.args[0]))
                yield node, owner, node.args[0].value
        elif (
            isinstance(node, ast.Subscript)
            and _dict_of(node.value) is not None
            and _private(getattr(node.slice, "value", None))
        ):
            named.add(id(node.slice))
            yield node, _dict_of(node.value), node.slice.value
    for node in _walk(tree):
        if isinstance(node, ast.Constant) and _private(node.value) and id(node) not in named:
            yield node, None, node.value


def _dict_of(node):
    """X for `X.__dict__` or `vars(X)`, else None."""
    if isinstance(node, ast.Attribute) and node.attr == "__dict__":
        return node.value
    if isinstance(node, ast.Call) and _dotted(node.func) == "vars" and len(node.args) == 1:
        return node.args[0]
    return None


# -- the check --------------------------------------------------------------------------


class Fence:
    """Tells our private names from TensorFlow's and Keras's in the
    modules outside _compat (`modules`: {dotted name: path}, every module
    of the package)."""

    def __init__(self, modules: dict):
        self.modules = modules
        self.trees = {name: _parse(path) for name, path in modules.items()}
        outside = [tree for name, tree in self.trees.items() if not self._in_compat(name)]
        self.ours = defined(outside)
        self.hooks = keras_hooks()
        self.top_level = {name: _body_names(tree.body) for name, tree in self.trees.items()}

    def _in_compat(self, module: str) -> bool:
        return module == "keras_distrib._compat" or module.startswith("keras_distrib._compat.")

    def is_ours(self, owner, name: str, imports: dict) -> bool:
        """Whether `owner._name` (`owner` None: the name as a string) is ours."""
        if name.startswith("_kd_"):
            return True
        if owner is None:
            return name in self.ours
        if _is_self(owner):
            return name in self.ours or name in self.hooks
        if isinstance(owner, ast.Name) and owner.id in imports:
            target = imports[owner.id]
            if target in self.modules:
                return name in self.top_level[target]
            if not target.startswith("keras_distrib."):
                return (target, name) in PYTHON_PRIVATE
        return name in OURS_ON_OTHER_OBJECTS and name in self.ours

    def offenders(self) -> list:
        """`file:line: what` of each foreign private name used outside _compat."""
        found = []
        for module, tree in self.trees.items():
            if self._in_compat(module):
                continue
            path = os.path.relpath(self.modules[module], ROOT)
            is_package = path.endswith("__init__.py")
            imports = _imports(module, is_package, tree)
            for node, what in _foreign_imports(module, is_package, tree):
                found.append((path, node.lineno, what))
            for node, what in _private_module_uses(tree, imports):
                found.append((path, node.lineno, what))
            for node, owner, name in _uses(tree):
                if not self.is_ours(owner, name, imports):
                    shown = name if owner is None else f"{ast.unparse(owner)}.{name}"
                    found.append((path, node.lineno, f"{shown} ({ast.unparse(node)[:60]})"))
        return [f"{path}:{line}: {what}" for path, line, what in sorted(set(found))]


@pytest.fixture(scope="module")
def fence():
    return Fence(_modules())


def test_no_private_tensorflow_or_keras_name_outside_compat(fence):
    offenders = fence.offenders()
    assert offenders == [], f"{len(offenders)} uses of {FIX}:\n  " + "\n  ".join(offenders)


def test_the_allowances_are_in_use(fence):
    assert OURS_ON_OTHER_OBJECTS <= fence.ours
    used = {
        (_dotted(owner), name)
        for module, tree in fence.trees.items()
        if not fence._in_compat(module)
        for _, owner, name in _uses(tree)
        if owner is not None
    }
    assert {name for _, name in used} >= OURS_ON_OTHER_OBJECTS
    assert used >= PYTHON_PRIVATE


SAMPLE = """
import os
import keras
import tensorflow as tf
from keras.src import backend
from keras_distrib import placement


class Model(keras.Model):
    _declared: int

    def __init__(self):
        self._mine = 1
        self.__dict__["_cached"] = None

    def step(self, layer, fn, kwargs):
        self._mine, self._declared, self.__dict__.get("_cached")   # ours
        super()._make_function, self._symbolic_build                # declared hooks
        placement._copy_layer, fn._kd_pinned, os._exit               # ours, Python's
        self._jit_compile                                            # Keras's from here on
        layer._inbound_nodes
        getattr(layer, "_functional", None)
        vars(layer).get("_losses")
        kwargs.get("_use_cached_eval_dataset")
        placement._no_such_name
        os._exists
        layer._mine
        keras.src.backend.standardize_dtype, tf.python.framework
"""


def test_the_check_tells_foreign_names_from_ours(tmp_path):
    """A module added to the package: what the scan finds in it, in order."""
    path = tmp_path / "sample.py"
    path.write_text(SAMPLE)
    found = Fence({**_modules(), "keras_distrib.sample": str(path)}).offenders()
    mine = [
        line.split(": ", 1)[1].split(" (")[0]
        for line in found
        if line.startswith(os.path.relpath(str(path), ROOT) + ":")
    ]
    assert mine == [
        "import keras.src.backend",
        "self._jit_compile",
        "layer._inbound_nodes",
        "layer._functional",
        "layer._losses",
        "_use_cached_eval_dataset",
        "placement._no_such_name",
        "os._exists",
        "layer._mine",
        "keras.src",
        "tf.python",
    ]
