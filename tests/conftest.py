"""Test set-up shared by every tier (tests/unit, tests/integration,
tests/distributed, tests/zoo) in this process.

The tests that use TensorFlow see two logical CPUs, so that `"mirrored"`
runs two real replicas with real cross-device reductions. That must happen
before TensorFlow initialises its devices: here, just before pytest imports
the first test module outside tests/unit (while pytest captures the
collection's output, which TensorFlow's start-up banners go to). The unit
tier never imports TensorFlow (tests/unit/conftest.py checks that), so
nothing here imports it at import time either.

The collector skips what importing TensorFlow and Keras leaves, in the
pytest processes as in those the tests start
(tests/child_site/frozen_imports.py).
"""

import os

import pytest

from child_site import frozen_imports
from pure_helpers import CHILD_SITE

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
frozen_imports.install()

UNIT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "unit")
_logical_cpus_configured = False


def _split_the_cpu_in_two() -> None:
    global _logical_cpus_configured
    if _logical_cpus_configured:
        return
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    _logical_cpus_configured = True


@pytest.hookimpl(tryfirst=True)
def pytest_make_collect_report(collector):
    """Runs before pytest imports each test module (returns None: pytest
    then collects it as usual)."""
    if (
        isinstance(collector, pytest.Module)
        and os.path.commonpath([str(collector.path), UNIT]) != UNIT
    ):
        _split_the_cpu_in_two()


# -- running in parallel (pytest-xdist) ------------------------------------------------

# Test files that share a session fixture: they run in one xdist worker, so
# the fixture is made once. The Keras-feature probes (`probes`,
# `horovod_probes`) serve the zoo and tests/distributed; the zoo's page
# check reads what its other tests found (`zoo_results`); the fault tests
# compare with one uninterrupted run (`uninterrupted`).
_SHARING = {
    "probes_and_zoo": ("tests/zoo/", "tests/distributed/test_keras_features_multi_worker.py"),
    "fault_job": ("tests/distributed/test_faults.py", "tests/distributed/test_network_faults.py"),
}


# Files whose tests share no module fixture and mostly wait (heartbeat and
# probe timeouts, links cut and restored): a group per test, so that their
# waits overlap other workers' work instead of queueing in one worker.
_EACH_TEST_ALONE = ("tests/distributed/test_elastic.py",)


def _group(path: str, item) -> str:
    """The xdist group of test `item` of the file at `path` (from the
    rootdir): its file's, or its `_SHARING` group's. The conformance
    tier's files share no fixture: a group per Keras file they run, so the
    workers share their long runs evenly; `_EACH_TEST_ALONE`'s tests go
    one by one."""
    for name, prefixes in _SHARING.items():
        if path.startswith(prefixes):
            return name
    if path in _EACH_TEST_ALONE:
        return f"{path}::{item.name}"
    keras_test = getattr(getattr(item, "cls", None), "kd_test", None)
    if keras_test is not None:
        return f"{path}::{keras_test.split('::')[0]}"
    return path


# The order in which the xdist workers are handed groups (`make test` passes
# --no-loadscope-reorder, so xdist keeps it): the long ones first, so that
# the last to be handed out, when the other workers may already be idle,
# are short. A group's place is its first file's.
_FIRST = (
    "probes_and_zoo",
    "fault_job",
    "tests/conformance/test_keras_on_single.py::trainers/",
    "tests/conformance/test_",
    "tests/distributed/",
    "tests/zoo/",
    "tests/integration/",
    "tests/unit/",
)


def _rank(group: str) -> int:
    return next((i for i, start in enumerate(_FIRST) if group.startswith(start)), len(_FIRST))


# `make test-float` runs the float comparisons with oneDNN capped at another
# CPU's instructions (ONEDNN_MAX_CPU_ISA). TensorFlow still picks its
# float16 kernels by this CPU's: on one with AVX512-FP16, a cap below it
# makes oneDNN abort the process at the first float16 matmul ("could not
# create a primitive descriptor"), which the real older CPU never meets.
_FLOAT16_CAPS = (
    "AVX512_CORE_FP16",
    "AVX512_CORE_AMX_FP16",
    "AVX10_1_512_AMX_FP16",
    "DEFAULT",
    "ALL",
)


def _float16_kernels_capped() -> str:
    """Why float16 kernels cannot run here, or ""."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if not cap or cap in _FLOAT16_CAPS:
        return ""
    try:
        with open("/proc/cpuinfo") as f:
            fp16 = " avx512_fp16" in f.read()
    except OSError:
        return ""
    return (
        f"ONEDNN_MAX_CPU_ISA={cap} on a CPU with AVX512-FP16: oneDNN aborts the "
        "float16 kernels TensorFlow picks for this CPU (run them without the cap)"
        if fp16
        else ""
    )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """When pytest-xdist runs the tests (`make test`: `--dist loadgroup`),
    keeps each test file in one worker (`_group`): a file's module fixtures (one
    launch of real workers that serves several tests) run once, and the
    files of `_SHARING` go together; the groups are ordered by `_FIRST`.
    Tests run in file order within a file, as without xdist. Tests of
    float16 training skip where `_float16_kernels_capped` says why."""
    capped = _float16_kernels_capped()
    for item in items if capped else ():
        if "float16" in item.nodeid:
            item.add_marker(pytest.mark.skip(reason=capped))
    if not config.pluginmanager.hasplugin("xdist"):
        return
    groups = {}
    for item in items:
        groups[item] = _group(os.path.relpath(item.path, config.rootpath), item)
        item.add_marker(pytest.mark.xdist_group(groups[item]))
    # The workers' collections are what xdist schedules (a worker's own
    # `dist` option reads "no"; `loadgroup` says how the run distributes).
    if os.environ.get("PYTEST_XDIST_WORKER") and getattr(config.option, "loadgroup", False):
        items.sort(key=lambda item: _rank(groups[item]))  # stable: file order kept


def pytest_configure(config):
    """Stops a `--dist loadgroup` run on pytest 9.2 or later, where
    pytest-xdist's groups silently do nothing (it marks a group in the
    test's id, which pytest 9.2 ignores; pytest-dev/pytest-xdist#1386): the
    module fixtures would run in several workers, and the zoo's page check
    would see half the zoo."""
    version = tuple(int(part) for part in pytest.__version__.split(".")[:2])
    if getattr(config.option, "dist", None) == "loadgroup" and version >= (9, 2):
        raise pytest.UsageError(
            f"pytest-xdist's --dist loadgroup does not group tests under pytest "
            f"{pytest.__version__} (pytest-dev/pytest-xdist#1386); install the test extra "
            "(pytest<9.2): pip install -e '.[test]'"
        )


# -- where the suite's CPU time goes ------------------------------------------------------

# `KD_CPU_REPORT=FILE make test` appends a line per test to FILE: the CPU
# seconds (user + system) of this pytest process and of the processes it
# started and reaped meanwhile (launched workers, beds), the wall seconds,
# when it started and in which xdist worker (to see the run's tail). The
# suite runs on two cores, so its time is its CPU time: this is how to find
# what to share or trim (a processes' cost lands on the test that reaps
# them; a session fixture's on the first test that asks for it).
_CPU_REPORT = os.environ.get("KD_CPU_REPORT")


def _cpu_seconds() -> float:
    import resource

    own, children = (
        resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


if _CPU_REPORT:

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        import json
        import time

        cpu, wall, started = _cpu_seconds(), time.monotonic(), time.time()
        yield
        with open(_CPU_REPORT, "a") as f:
            f.write(
                json.dumps(
                    {
                        "test": item.nodeid,
                        "cpu": round(_cpu_seconds() - cpu, 2),
                        "wall": round(time.monotonic() - wall, 2),
                        "start": round(started, 1),
                        "worker": os.environ.get("PYTEST_XDIST_WORKER"),
                    }
                )
                + "\n"
            )


# -- fixtures shared by the tiers ------------------------------------------------------


@pytest.fixture(scope="session", autouse=True)
def child_site():
    """Every process a test starts keeps modules it does not use from
    loading (tests/child_site/sitecustomize.py); tests that set their own
    PYTHONPATH use `pure_helpers.CHILD_PYTHONPATH`. Set where tests run,
    not in pytest-xdist's controller, whose workers run in-process tests
    that may import them."""
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (CHILD_SITE, os.environ.get("PYTHONPATH")) if p
    )


@pytest.fixture(scope="module")
def data(request):
    """`helpers.make_data()` for the test module: 203 samples, or the
    module's `DATA_SAMPLES`."""
    from helpers import make_data

    samples = getattr(request.module, "DATA_SAMPLES", None)
    return make_data() if samples is None else make_data(samples)


@pytest.fixture(scope="module")
def hvd():
    """`horovod.tensorflow`; the test skips where it cannot be imported."""
    return pytest.importorskip("horovod.tensorflow")


# -- launches shared by several test modules -------------------------------------------

_FEATURE_PROBES = (
    "metric_objects",
    "unseeded_shuffle",
    "load_model",
    "batch_norm",
    "seeded_shuffle",
    "sparse_input",
    "pydataset_workers",
    "ragged_input",
    "metric_aggregation",
    "adapted_per_worker",
    "vocabulary_per_worker",
    "replica_dropout",
    "remat",
)


@pytest.fixture(scope="session")
def probes(tmp_path_factory):
    """One `keras-distrib launch -n 2` of tests/workers/keras_features.py
    under `multi_worker`: every Keras-feature probe and the model zoo's
    multi-process patterns."""
    from helpers import KERAS_FEATURES_WORKER, ZOO_PROCESS_PATTERNS, launch

    out = tmp_path_factory.mktemp("keras_features")
    launch(
        out,
        2,
        KERAS_FEATURES_WORKER,
        "--out",
        str(out),
        "--probes",
        ",".join(_FEATURE_PROBES + ("zoo",)),
        "--zoo",
        ",".join(ZOO_PROCESS_PATTERNS["multi_worker"]),
        timeout=540,
    )
    return out


@pytest.fixture(scope="session")
def horovod_probes(tmp_path_factory):
    """The same under `horovod`, 2 ranks (Gloo): the probes of the
    `BY_STRATEGY` tests and the zoo's patterns."""
    from helpers import KERAS_FEATURES_WORKER, ZOO_PROCESS_PATTERNS, launch

    pytest.importorskip("horovod.tensorflow")
    out = tmp_path_factory.mktemp("keras_features_horovod")
    launch(
        out,
        2,
        KERAS_FEATURES_WORKER,
        "--out",
        str(out),
        "--probes",
        "sparse_input,ragged_input,metric_aggregation,adapted_per_worker,"
        "vocabulary_per_worker,replica_dropout,remat,zoo",
        "--zoo",
        ",".join(ZOO_PROCESS_PATTERNS["horovod"]),
        "--strategy",
        "horovod",
        launch_flags=("--backend", "horovod"),
        timeout=540,
    )
    return out
