"""The TensorFlow and Keras versions keras_distrib was tested with, and the
warning on any other."""

from __future__ import annotations

import functools
import warnings

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
