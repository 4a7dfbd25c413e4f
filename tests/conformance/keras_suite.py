"""Keras's own test files, loaded with Keras's model classes bound to ours.

The keras wheel ships Keras's tests (`keras/src/**/*_test.py`, found through
`keras.__file__`, never copied here). `load(relpath, strategy)` executes one
of them as a fresh module in which every name a Keras model class is
imported under (`Model`, `Functional`, `Sequential`, trainer_test's backend
`Trainer`, and `Model`/`Sequential` read off `keras`, `keras.models` or
`keras.src.models`) means the `DistributedModel` class of that strategy
(`bindings`). The rebinding is an assignment placed right after each import
statement of the file (module level, `if` blocks and function bodies alike),
so classes the file defines at import time already subclass ours. The
assertions are Keras's, unchanged: where keras_distrib differs on purpose,
the test is listed in expected.txt with the reason (`expectations`).

What the tests receive:

* `Model`: `DistributedModel` with `strategy=` defaulting to the strategy
  (a subclass that only sets the default), so `Model(inputs, outputs)`, a
  subclass calling `super().__init__()` and one calling
  `super().__init__(inputs=..., outputs=...)` all make ours.
* `Functional`: the class `Model(inputs, outputs)` makes (so Keras's
  `isinstance(model, Functional)` checks hold).
* `Sequential`: `keras.Sequential` with `DistributedModel` in front.
* `Trainer` (trainer_test's "a model is a layer mixed with a Trainer"):
  `Model`, whose `__init__()` with no arguments leaves the layer the file
  mixed in as it was built and only adds the distribution.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import sys
import types
import unittest

import keras

KERAS_SRC = os.path.join(os.path.dirname(keras.__file__), "src")

# Keras modules whose model classes the tests import by name.
_MODEL_MODULES = {
    "keras.src.models",
    "keras.src.models.model",
    "keras.src.models.functional",
    "keras.src.models.sequential",
    "keras.models",
    "keras",
    "keras.src.backend.tensorflow.trainer",
}
_CLASS_NAMES = {
    "Model": "Model",
    "Functional": "Functional",
    "Sequential": "Sequential",
    "TensorFlowTrainer": "Trainer",
}
# Modules the tests read model classes off (`models.Sequential`, `keras.Model`).
_PROXIED_MODULES = {
    "keras": "keras",
    "keras.models": "keras.models",
    "keras.src.models": "keras.src.models",
}
_BINDINGS = "__kd_conformance_bindings__"
# Names a file uses for Keras's own class, not for a model a user builds:
# sequential_test's `Functional` is the class of Sequential's inner graph.
_KEEP = {"models/sequential_test.py": {"Functional"}}


@functools.lru_cache(maxsize=None)
def bindings() -> dict:
    """The classes (and module stand-ins) Keras's tests see."""
    import keras_distrib as kd

    classes = {
        "Model": kd.DistributedModel,
        "Functional": kd.FunctionalDistributedModel,
        "Sequential": Sequential,
        "Trainer": Trainer,
    }
    proxies = {name: _proxy(name, classes) for name in _PROXIED_MODULES}
    proxies["keras"].models = proxies["keras.models"]
    return {**classes, **proxies}


def _distributed_model():
    import keras_distrib as kd

    return kd.DistributedModel


@keras.saving.register_keras_serializable(package="kd_conformance")
class Sequential(_distributed_model(), keras.Sequential):
    """`keras.Sequential` trained by DistributedModel."""


def _distributed_trainer():
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
    from keras_distrib.model import DistributedTrainer

    return DistributedTrainer, TensorFlowTrainer


class Trainer(*_distributed_trainer()):
    """trainer_test's `Trainer` (Keras's backend trainer, mixed into a
    layer): ours in front of it, on the strategy `"auto"` names."""

    def __init__(self):
        import keras_distrib as kd

        super().__init__()
        self._init_distribution(kd.strategies.get("auto"))


def _proxy(module_name: str, classes: dict) -> types.ModuleType:
    """A stand-in for `module_name` whose model classes are ours."""
    real = importlib.import_module(module_name)

    class Proxy(types.ModuleType):
        def __getattr__(self, name):
            return getattr(real, name)

    proxy = Proxy(module_name)
    for name in ("Model", "Functional", "Sequential"):
        if hasattr(real, name):
            setattr(proxy, name, classes[name])
    return proxy


class _Rebind(ast.NodeTransformer):
    """After each import of a Keras model class or module, an assignment
    binding that name to the strategy's stand-in."""

    def __init__(self, keep=()):
        self.keep = set(keep)

    def _after(self, node, pairs):
        assigns = [ast.parse(f"{local} = {_BINDINGS}[{key!r}]").body[0] for local, key in pairs]
        return [node, *[ast.copy_location(a, node) for a in assigns]] if assigns else node

    def visit_ImportFrom(self, node):
        module = node.module or ""
        pairs = []
        for alias in node.names:
            local = alias.asname or alias.name
            if alias.name in self.keep:
                continue
            if module in _MODEL_MODULES and alias.name in _CLASS_NAMES:
                pairs.append((local, _CLASS_NAMES[alias.name]))
            elif f"{module}.{alias.name}" in _PROXIED_MODULES:
                pairs.append((local, f"{module}.{alias.name}"))
        return self._after(node, pairs)

    def visit_Import(self, node):
        pairs = [
            (alias.asname or alias.name, alias.name)
            for alias in node.names
            if alias.name in _PROXIED_MODULES and "." not in (alias.asname or alias.name)
        ]
        return self._after(node, pairs)


def path_of(relpath: str) -> str:
    """The installed Keras test file `relpath` (relative to `keras/src`)."""
    return os.path.join(KERAS_SRC, relpath)


def load(relpath: str, strategy: str | None) -> types.ModuleType:
    """Keras's test file `relpath` executed with the model classes of
    `strategy` (None: as Keras ships it, the plain-Keras control)."""
    path = path_of(relpath)
    tag = strategy or "keras"
    name = f"kd_conformance.{tag}.{relpath[:-3].replace('/', '.')}"
    with open(path) as f:
        tree = ast.parse(f.read(), filename=path)
    if strategy is not None:
        tree = ast.fix_missing_locations(_Rebind(_KEEP.get(relpath, ())).visit(tree))
    module = types.ModuleType(name)
    module.__file__ = path
    module.__dict__[_BINDINGS] = bindings() if strategy is not None else {}
    sys.modules[name] = module
    with _stand_ins():
        exec(compile(tree, path, "exec"), module.__dict__)
    return module


class _StandIn(types.ModuleType):
    """A module that is only imported: trainer_test imports `jax` at module
    level but uses it only on the JAX backend."""

    def __getattr__(self, name):
        raise AttributeError(f"{self.__name__} is not installed (a stand-in for Keras's tests)")


class _stand_ins:
    """`jax` importable while a Keras test file loads, where it is not installed."""

    def __enter__(self):
        self.added = []
        for name in ("jax",):
            if importlib.util.find_spec(name) is None and name not in sys.modules:
                sys.modules[name] = _StandIn(name)
                self.added.append(name)

    def __exit__(self, *exc):
        for name in self.added:
            sys.modules.pop(name, None)


def test_classes(module: types.ModuleType) -> dict:
    """The TestCase classes `module` defines (not those it imports)."""
    import unittest

    return {
        name: value
        for name, value in vars(module).items()
        if isinstance(value, type)
        and issubclass(value, unittest.TestCase)
        and value.__module__ == module.__name__
    }


# Keras's test files the tier runs (relative to keras/src).
FILES = (
    "models/model_test.py",
    "models/functional_test.py",
    "models/sequential_test.py",
    "trainers/trainer_test.py",
    "callbacks/backup_and_restore_test.py",
    "callbacks/csv_logger_test.py",
    "callbacks/early_stopping_test.py",
    "callbacks/learning_rate_scheduler_test.py",
    "callbacks/model_checkpoint_test.py",
    "callbacks/reduce_lr_on_plateau_test.py",
)


# The files run under multi_worker, in 2 processes: the model classes and
# the callbacks. Not Keras's BackupAndRestore test: it asserts on the backup
# files in each process's own directory, and under multi_worker only the
# chief writes backups (Keras's callback runs as keras_distrib's), so the
# other rank would fail those assertions, skip the test's next `fit` and
# leave the chief waiting in its collectives. Multi-worker backups are
# tested in tests/distributed (test_multi_worker, test_elastic, test_faults).
MULTI_WORKER_FILES = tuple(
    f
    for f in FILES
    if not f.startswith("trainers/") and f != "callbacks/backup_and_restore_test.py"
)


# How much of each of Keras's test functions runs where. Keras
# parametrizes many tests: over execution modes (run_eagerly, tf.function,
# XLA: `_eager`, `_graph_fn`, `_jit`), and over the inputs of its own
# logic (loss and output structures, data adapters, step counts).
# * `single` runs each test function in every mode, in its first
#   parametrization.
# * `mirrored` runs every parametrization in the mode `fit` runs by default
#   (tf.function), except Keras's tests of how the loop counts steps
#   (`_LOOP_COUNTING`: steps_per_execution 3, 8, 32, 101 over known and
#   unknown sizes, which test the loop every strategy shares), of which it
#   runs the first.
# * The others (`central_storage`, `tensor_parallel`, `pipeline`,
#   `multi_worker`) run each test function once, in its first
#   parametrization of the default mode: what they change is where the
#   variables live and how the model is split or the data sharded, which
#   every test function exercises.
# So each of Keras's test functions runs under every strategy, each mode
# under `single` and each parametrization under `mirrored` (where the
# data is split and the gradients reduced), within the tier's time.
ALL_MODES = ("single",)
ALL_PARAMETRIZATIONS = ("mirrored",)
_DEFAULT_MODE = ("_graph_fn", "_non_jit", "_graph")
_LOOP_COUNTING = ("test_steps_per_execution", "test_steps_per_epoch")


def other_mode(name: str, names) -> bool:
    """Whether test `name` is an eager or XLA variant of a test whose
    default-mode variant is among `names`."""
    for suffix in ("_eager", "_jit"):
        if name.endswith(suffix):
            base = name[: -len(suffix)]
            return any(base + mode in names for mode in _DEFAULT_MODE)
    return False


def _function(cls: type, name: str) -> str:
    """The name of the test function Keras parametrized into test `name`."""
    method = getattr(cls, name)
    return getattr(method, "__wrapped__", method).__name__


def not_run(cls: type, strategy: str) -> set:
    """The tests of Keras's TestCase `cls` the tier leaves out under
    `strategy`: other modes' variants and further parametrizations (see
    ALL_MODES, ALL_PARAMETRIZATIONS, _LOOP_COUNTING)."""
    if strategy == "keras":
        return set()
    names = unittest.TestLoader().getTestCaseNames(cls)
    every_mode = strategy in ALL_MODES
    left_out = set() if every_mode else {name for name in names if other_mode(name, names)}
    kept = set()
    for name in names:
        function = _function(cls, name)
        if name in left_out:
            continue
        if strategy in ALL_PARAMETRIZATIONS and not function.startswith(_LOOP_COUNTING):
            continue
        mode = name.rsplit("_", 1)[-1] if other_mode(name, names) else ""
        if (function, mode) in kept:
            left_out.add(name)
        kept.add((function, mode))
    return left_out


def expose_all(namespace: dict, strategy: str, files=FILES) -> None:
    """Every file of `files` under `strategy` into `namespace`."""
    for relpath in files:
        expose(namespace, relpath, [strategy])


def expose(namespace: dict, relpath: str, strategies) -> None:
    """Puts Keras's TestCase classes of `relpath` into `namespace` (a test
    module's globals) once per strategy, as `<Class>__<strategy>` with the
    strategy in `kd_strategy` (what `strategy="auto"` means in its tests,
    conftest.py), and the plain-Keras control as `<Class>__keras`."""
    for strategy in strategies:
        module = load(relpath, None if strategy == "keras" else strategy)
        for name, cls in test_classes(module).items():
            attributes = {
                "kd_strategy": strategy,
                "kd_test": f"{relpath}::{name}",
                "__module__": namespace["__name__"],
            }
            # Not run: unittest collects only callables.
            attributes.update({test: None for test in not_run(cls, strategy)})
            namespace[f"{name}__{strategy}"] = type(f"{name}__{strategy}", (cls,), attributes)
