"""The public names import in a fresh process that has not imported Keras:
importing Keras imports `keras_distrib.model`, which uses the callbacks'
modules, so a first import from the callbacks must not find one of them
half made."""

import subprocess
import sys

import pytest

from pure_helpers import ROOT, plain_environment


@pytest.mark.parametrize(
    "code",
    [
        "import keras_distrib as kd; kd.callbacks.MetricAverage; kd.DistributedModel",
        "from keras_distrib.callbacks import BackupAndRestore; import keras_distrib.optimizers",
    ],
)
def test_public_names_import_before_keras(code):
    assert "import keras;" not in code
    done = subprocess.run(
        [sys.executable, "-c", code + "; print('imported')"],
        cwd=ROOT,
        env=plain_environment(TF_CPP_MIN_LOG_LEVEL="3"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout.strip() == "imported", done.stderr[-2000:]
