"""The Strategy interface: self-registration, topology, and what a new strategy needs.

Topology's own checks (pure Python) are in tests/unit/test_topology.py.
"""

import os
import subprocess
import sys
import textwrap

import pytest

import keras_distrib as kd
from helpers import CHILD_PYTHONPATH
from keras_distrib.strategies import registry
from keras_distrib.strategies.per_process import PerProcessStrategy


def test_builtin_strategies_registered_themselves():
    names = kd.strategies.available()
    assert {
        "auto",
        "single",
        "mirrored",
        "central_storage",
        "multi_worker",
        "horovod",
        "tpu",
    } <= set(names)


def test_a_subclass_with_a_name_registers_and_gets_built_by_name():
    class Pinned(PerProcessStrategy):
        name = "test_pinned"
        aliases = ("test_pin",)
        description = "One CPU (test)."

        def __init__(self, device: str = "/cpu:0"):
            super().__init__(device)

    try:
        assert kd.strategies.available()["test_pinned"] == "One CPU (test)."
        assert isinstance(kd.strategies.get("test-pin"), Pinned)
        with pytest.raises(ValueError, match=r"does not take option\(s\) \['cores'\]"):
            kd.strategies.get("test_pinned", cores=2)
    finally:
        registry._CLASSES.pop("test_pinned")
        registry._ALIASES.pop("test_pin")


@pytest.mark.parametrize("taken", ["single", "one_device", "auto"])
def test_a_taken_name_is_an_error(taken):
    with pytest.raises(ValueError, match=f"Strategy name '{taken}' .* is already taken"):

        class Clash(PerProcessStrategy):  # noqa: F841
            name = taken


def test_a_taken_alias_is_an_error():
    with pytest.raises(ValueError, match="'mirror' .* is already taken by Mirrored"):

        class Clash(PerProcessStrategy):  # noqa: F841
            name = "test_clash"
            aliases = ("mirror",)

    assert "test_clash" not in kd.strategies.available()


def test_an_incomplete_strategy_cannot_be_created():
    class Half(kd.strategies.Strategy):  # no name: not registered
        pass

    with pytest.raises(TypeError, match="abstract"):
        Half()


def test_topologies_of_the_builtin_strategies():
    single = kd.strategies.get("single").topology
    assert (single.num_replicas, single.num_processes, single.num_data_shards) == (1, 1, 1)
    mirrored = kd.strategies.get("mirrored").topology  # two logical CPUs here
    assert (mirrored.num_replicas, mirrored.num_local_replicas, len(mirrored.devices)) == (2, 2, 2)
    assert (mirrored.num_processes, mirrored.num_data_shards, mirrored.role) == (1, 1, "chief")


def test_auto_picks_horovod_under_horovodrun(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.setenv("HOROVOD_RANK", "0")
    monkeypatch.setenv("HOROVOD_SIZE", "2")
    assert registry._auto_name() == "horovod"
    monkeypatch.setenv("HOROVOD_SIZE", "1")
    assert registry._auto_name() == "mirrored"


def test_auto_takes_no_options():
    with pytest.raises(ValueError, match="takes no options"):
        kd.strategies.get("auto", devices=["/cpu:0"])


def test_a_strategy_is_imported_when_first_asked_for(tmp_path):
    """Registration is lazy: importing `keras_distrib.strategies` imports no
    strategy module (nor TensorFlow); asking for a built-in name imports
    that strategy's module only (`registry.BUILTIN`); a user's module that
    subclasses `Strategy` with a `name` is available by that name once
    imported."""
    (tmp_path / "my_plugin.py").write_text(
        textwrap.dedent("""\
        from keras_distrib.strategies.per_process import PerProcessStrategy

        class Plugin(PerProcessStrategy):
            name = "zz_test_plugin"
            description = "A strategy of the user's own."
    """)
    )
    code = textwrap.dedent("""\
        import sys
        import keras_distrib as kd
        from keras_distrib import strategies
        loaded = lambda: sorted(m for m in sys.modules if m.startswith("keras_distrib.strategies."))
        print("tensorflow" in sys.modules, loaded())
        strategies.get("single")
        print(loaded())
        import my_plugin
        print(strategies.available()["zz_test_plugin"],
              type(strategies.get("zz_test_plugin")).__name__)
    """)
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": CHILD_PYTHONPATH},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()[-3:]
    assert lines[0] == "False []"
    assert "keras_distrib.strategies.single" in lines[1]
    assert "keras_distrib.strategies.mirrored" not in lines[1]
    assert "keras_distrib.strategies.pipeline.strategy" not in lines[1]
    assert lines[2] == "A strategy of the user's own. Plugin"


def test_the_builtin_table_names_each_strategy_where_it_lives():
    for name, module in registry.BUILTIN.items():
        cls = registry.strategy_class(name)
        assert (cls.name, cls.__module__) == (name, module)
    assert sorted(registry.available()) == sorted([registry.AUTO, *registry.BUILTIN])


# -- what passes between the model and its strategy -----------------------------------


class _Recording(PerProcessStrategy):
    """Single-device training that records what the model hands it (no name:
    not registered)."""

    def __init__(self):
        super().__init__("/cpu:0")
        self.steps, self.fit_inputs = [], []

    def distribute_fit_input(self, fit):
        self.fit_inputs.append(fit)
        return super().distribute_fit_input(fit)

    def make_step_function(self, model, step, keras_make_function):
        self.steps.append((step.kind, step.custom, step.applies))
        return super().make_step_function(model, step, keras_make_function)

    def make_predict_function(self, model, step, keras_make_predict_function):
        self.steps.append((step.kind, step.custom, step.applies))
        return super().make_predict_function(model, step, keras_make_predict_function)


def _tiny(model_class=None, strategy="single", **compile_kwargs):
    import keras

    inputs = keras.Input((3,))
    outputs = keras.layers.Dense(1)(inputs)
    model = (model_class or kd.DistributedModel)(inputs, outputs, strategy=strategy)
    model.compile(optimizer=compile_kwargs.pop("optimizer", "sgd"), loss="mse", **compile_kwargs)
    return model


def test_the_strategy_gets_typed_steps_and_fit_input():
    """The strategy learns a step's kind, whether it is the user's own and
    whether it applies from the `Step` it is handed, and `fit`'s input as a
    `FitInput` (no names or identities to compare)."""
    import numpy as np

    from keras_distrib.input.fit_input import FitInput

    class OwnStep(kd.DistributedModel):
        def train_step(self, data):
            return super().train_step(data)

    x, y = np.ones((8, 3), "float32"), np.ones((8, 1), "float32")
    plain = _Recording()
    model = _tiny(strategy=plain)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, validation_split=0.25)
    model.predict(x, verbose=0)
    assert plain.steps == [("train", False, True), ("test", False, True), ("predict", False, True)]
    (given,) = plain.fit_inputs
    assert isinstance(given, FitInput)
    assert (given.batch_size, given.validation_split, given.resumable) == (4, 0.25, False)

    own = _Recording()
    _tiny(OwnStep, strategy=own).fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert own.steps == [("train", True, True)]

    accumulating = _Recording()
    optimizer = kd.optimizers.DistributedOptimizer(
        __import__("keras").optimizers.SGD(0.1), backward_passes_per_step=2
    )
    _tiny(strategy=accumulating, optimizer=optimizer).fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert sorted(accumulating.steps) == [("train", False, False), ("train", False, True)]


def test_a_fit_keeps_its_state_in_one_object_and_callbacks_resume_by_protocol(tmp_path):
    """`model.fit_state` exists for the duration of a `fit` call only; a
    callback of the user's own with `resume_point` / `record_seed` (the
    `Resumable` protocol) tells `fit` where to resume, as
    `keras_distrib.callbacks.BackupAndRestore` does."""
    import keras
    import numpy as np

    from keras_distrib.input.fit_input import Start
    from keras_distrib.training.fit_state import FitState

    seen = {}

    class ResumeAtEpoch1(keras.callbacks.Callback):
        backup_dir = str(tmp_path)

        def resume_point(self, model):
            return Start(epoch=1, step=0, seed=5)

        def record_seed(self, seed):
            seen["seed"] = seed

        def on_epoch_begin(self, epoch, logs=None):
            seen.setdefault("epochs", []).append(epoch)
            seen["state"] = self.model.fit_state

    model = _tiny()
    x, y = np.ones((8, 3), "float32"), np.ones((8, 1), "float32")
    assert model.fit_state is None
    model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[ResumeAtEpoch1()])
    assert seen["epochs"] == [1] and seen["seed"] == 5
    assert isinstance(seen["state"], FitState) and isinstance(seen["state"].backup, ResumeAtEpoch1)
    assert model.fit_state is None
    with pytest.raises(ValueError, match="Pass one backup callback per fit, not 2"):
        model.fit(x, y, batch_size=4, verbose=0, callbacks=[ResumeAtEpoch1(), ResumeAtEpoch1()])
