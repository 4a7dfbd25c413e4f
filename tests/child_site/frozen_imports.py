"""Importing TensorFlow and Keras leaves some 400,000 objects that live as
long as the process, and Python's cyclic garbage collector walks all of
them at each of its full collections: many while the import runs, and
again and again while Keras traces a training step (about a third of a
small training process's CPU time). `install()` turns the collector off
while `tensorflow` or `keras` is imported, then moves what the import made
to the permanent generation (`gc.freeze()`, as servers do before they
fork) and turns it back on: later collections walk only what the process
makes after. What a process does is unchanged; it costs less.

Installed by tests/child_site/sitecustomize.py in every process the tests
start, and by tests/conftest.py in the pytest processes, where the
in-process tests run. Neither TensorFlow nor Keras is imported here.
"""

import gc
import importlib.machinery
import sys

NAMES = {"tensorflow", "keras"}


class _Finder:
    """A `sys.meta_path` finder: a module of `NAMES` loads as usual, with
    the collector off until the outermost of them has loaded, and what it
    made frozen. A process that turned the collector off itself keeps it
    off."""

    def find_spec(self, name, path=None, target=None):
        if name not in NAMES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or not hasattr(spec.loader, "exec_module"):
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            outermost = gc.isenabled()
            gc.disable()
            try:
                load(module)
            finally:
                if outermost:
                    gc.freeze()
                    gc.enable()

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Puts the finder first on `sys.meta_path` (once)."""
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
