"""Private TensorFlow/Keras uses are fenced in keras_distrib/_compat.py.

That nothing else uses them (a scan of the sources) is checked in
tests/unit/test_compat_fence.py; here, what _compat does about versions and
Keras's hooks.
"""

import os
import warnings

import keras
import pytest

from helpers import ROOT
from keras_distrib import _compat

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
