"""Strategy "horovod" in one process: without horovodrun, and without Horovod.

One process without horovodrun trains like "single" (skips where
`horovod.tensorflow` cannot be imported); the missing-Horovod error is
tested everywhere, in fresh interpreters. Real ranks under horovodrun and
the launcher: tests/distributed/test_horovod.py.
"""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest

from helpers import ROOT, graph, make_data, train_single

import as_reference
import keras_distrib as kd

BATCH, EPOCHS, SEED = 32, 2, 100
NOT_INSTALLED = (
    "strategy 'horovod' needs Horovod, which is not installed; build it with "
    "`scripts/install_horovod.sh .venv` (Horovod 0.28.1 against TF 2.21)"
)


def test_single_process_without_horovodrun_trains_like_single(hvd):
    strategy = kd.strategies.get("horovod")
    assert kd.strategies.get("hvd") is strategy  # one per process, alias
    assert (strategy.name, strategy.rank, strategy.world_size, strategy.num_replicas) == (
        "horovod",
        0,
        1,
        1,
    )
    assert strategy.num_local_replicas == 1 and strategy.first_local_replica == 0
    assert strategy.topology.num_processes == 1 and strategy.is_chief
    assert strategy.devices == ("/device:CPU:0",)
    x, y = make_data()
    keras.utils.set_random_seed(SEED)
    reference = keras.Model(*graph())
    model = kd.DistributedModel(reference.input, reference.output, strategy=strategy)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    assert all(strategy.holds(v) for v in model.variables)
    initial = model.get_weights()
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    # Within the bounds of float32's rounding of the same math in other
    # orders (the traced "single" run's, tests/float_bounds.py).
    single, _, _ = train_single(initial, 203, BATCH, EPOCHS)
    as_reference.assert_weights(single, model)
    as_reference.assert_history(single, history.history, ("loss",))
    as_reference.assert_predict(
        single, model.predict(x, batch_size=BATCH, verbose=0), x, batch_size=BATCH
    )
    assert strategy.sync_sum([np.float32(2), np.arange(3)])[1].tolist() == [0, 1, 2]
    assert strategy.agree_on_seed(5) == 5
    np.testing.assert_array_equal(
        strategy.local_replica_values(model.variables[0])[0], model.get_weights()[0]
    )


def test_bad_device_is_a_clear_error(hvd):
    from keras_distrib.strategies.horovod import Horovod

    with pytest.raises(ValueError, match="device '/cpu:9' does not exist"):
        Horovod(device="/cpu:9")


# -- no Horovod ------------------------------------------------------------------


_BLOCKERS = {
    "none_in_sys_modules": "sys.modules['horovod'] = None\n",
    "meta_path_blocker": (
        "class Blocker:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'horovod' or name.startswith('horovod.'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Blocker())\n"
    ),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("blocker", sorted(_BLOCKERS))
def test_without_horovod_get_gives_one_line_error(blocker):
    code = (
        "import sys\n" + _BLOCKERS[blocker] + "import keras_distrib as kd\n"
        "try:\n"
        "    kd.strategies.get('horovod')\n"
        "except ImportError as e:\n"
        "    assert isinstance(e, ValueError)\n"
        "    print('CAUGHT', str(e))\n"
        "kd.strategies.get('horovod')\n"
    )
    env = dict(
        os.environ,
        TF_CPP_MIN_LOG_LEVEL="2",
        PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=100
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"CAUGHT {NOT_INSTALLED}\n" in proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert last == f"keras_distrib.strategies.horovod.HorovodUnavailableError: {NOT_INSTALLED}"
    assert "During handling" not in proc.stderr  # no chained ModuleNotFoundError
