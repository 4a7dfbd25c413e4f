"""The Strategy interface: self-registration, topology, and what a new strategy needs.

Topology's own checks (pure Python) are in tests/unit/test_topology.py.
"""

import os
import subprocess
import sys
import textwrap

import pytest

import keras_distrib as kd
from helpers import ROOT
from keras_distrib.strategies import registry
from keras_distrib.strategies.per_process import PerProcessStrategy


def test_builtin_strategies_registered_themselves():
    names = kd.strategies.available()
    assert {"auto", "single", "mirrored", "central_storage", "multi_worker", "horovod",
            "tpu"} <= set(names)


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


def test_a_new_strategy_is_one_file(tmp_path):
    """Dropping a module into keras_distrib/strategies makes it available by name."""
    package = os.path.join(ROOT, "keras_distrib", "strategies")
    path = os.path.join(package, "zz_test_plugin.py")
    with open(path, "w") as f:
        f.write(textwrap.dedent("""\
            from keras_distrib.strategies.per_process import PerProcessStrategy

            class Plugin(PerProcessStrategy):
                name = "zz_test_plugin"
                description = "A strategy added as one file."
        """))
    try:
        code = ("import keras_distrib as kd\n"
                "print(kd.strategies.available()['zz_test_plugin'])\n"
                "print(type(kd.strategies.get('zz_test_plugin')).__name__)\n")
        proc = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), capture_output=True,
                              text=True, timeout=120)
    finally:
        os.remove(path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-2:] == ["A strategy added as one file.", "Plugin"]
