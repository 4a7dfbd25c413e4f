"""The shape of the package (docs/design.md, section 2), read from its
source: small files and functions, few modules at the root, no import
circle, and each layer importing only from the layers below it."""

import ast
import os

import pytest

from pure_helpers import ROOT

PACKAGE = os.path.join(ROOT, "keras_distrib")
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60
MAX_ROOT_MODULES = 8

# docs/design.md's picture of the layers, top to bottom, by the first name
# under keras_distrib; a module may import from its own layer and below.
LAYERS = [
    {"__init__"},
    {"model"},
    {"training"},
    {"callbacks", "optimizers"},
    {"strategies"},
    {"arithmetic", "input", "collectives", "placement", "preemption"},
    {"topology", "devices", "replica_seeds", "cluster", "_compat"},
]
# The keras-distrib command stands apart: it never imports TensorFlow.
LAUNCHER, LAUNCHER_MAY_IMPORT = "launch", {"launch", "cluster"}


def _modules():
    """{dotted name: path} of every module of the package."""
    found = {}
    for directory, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                dotted = os.path.relpath(path[:-3], ROOT).replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return found


def _read(path):
    with open(path) as f:
        return f.read()


MODULES = _modules()
SOURCES = {name: _read(path) for name, path in MODULES.items()}
TREES = {name: ast.parse(SOURCES[name], MODULES[name]) for name in MODULES}


def _imported(module, node):
    """The package's modules an import statement of `module` names."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = (
                module if MODULES[module].endswith("__init__.py") else module.rsplit(".", 1)[0]
            )
            for _ in range(node.level - 1):
                package = package.rsplit(".", 1)[0]
            base = package + ("." + base if base else "")
        names = [
            f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
            for alias in node.names
        ]
    found = set()
    for name in names:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)
    return found


def _imports(module, top_level_only):
    """What `module` imports: at import time (`top_level_only`: outside
    functions and classes), or anywhere."""
    if not top_level_only:
        nodes = ast.walk(TREES[module])
    else:
        nodes, stack = [], list(TREES[module].body)
        while stack:
            node = stack.pop()
            nodes.append(node)
            if isinstance(node, (ast.If, ast.Try)):
                stack.extend(
                    node.body
                    + node.orelse
                    + getattr(node, "finalbody", [])
                    + [n for handler in getattr(node, "handlers", []) for n in handler.body]
                )
    return {
        target
        for node in nodes
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for target in _imported(module, node)
    }


def _part(module):
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer(module):
    return next(i for i, names in enumerate(LAYERS) if _part(module) in names)


def test_files_and_functions_are_small():
    lines = {name: len(source.splitlines()) for name, source in SOURCES.items()}
    long_files = [
        f"{name}: {count} lines" for name, count in lines.items() if count > MAX_FILE_LINES
    ]
    long_functions = [
        f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for name, tree in TREES.items()
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert long_files == [] and long_functions == []


def test_few_modules_at_the_root():
    root = [
        name
        for name in MODULES
        if name.count(".") == 1 and not os.path.isdir(os.path.join(PACKAGE, _part(name)))
    ]
    assert len(root) <= MAX_ROOT_MODULES, sorted(root)


def test_no_import_circle():
    graph = {name: _imports(name, top_level_only=True) for name in MODULES}
    done, path = set(), []

    def visit(name):
        if name in path:
            pytest.fail("import circle: " + " -> ".join(path[path.index(name) :] + [name]))
        if name in done:
            return
        path.append(name)
        for target in sorted(graph[name]):
            visit(target)
        path.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)


def test_each_layer_imports_only_from_below():
    up, launcher = [], []
    for name in MODULES:
        if _part(name) == LAUNCHER:
            launcher += [
                f"{name} -> {t}"
                for t in _imports(name, top_level_only=False)
                if t != "keras_distrib" and _part(t) not in LAUNCHER_MAY_IMPORT
            ]
            continue
        up += [
            f"{name} -> {t}"
            for t in _imports(name, top_level_only=False)
            if _part(t) == LAUNCHER or _layer(t) < _layer(name)
        ]
    assert up == [] and launcher == []


def test_the_layers_name_every_part_of_the_package():
    named = set().union(*LAYERS) | {LAUNCHER}
    assert {_part(name) for name in MODULES} <= named
