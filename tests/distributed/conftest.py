"""The distributed tier: tests that start real processes (the launcher and
its workers, TensorFlow servers, horovodrun, the examples end to end).

Every test here counts as `slow` (the marker setup.cfg defines), also those
not marked one by one, so `pytest -m "not slow"` still leaves the whole
tier out.
"""

import contextlib
import os
import shutil

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(items):
    for item in items:
        if os.path.commonpath([str(item.path), HERE]) == HERE:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def netns_usable():
    """Skips (one line) where this machine cannot make network namespaces."""
    from netns_hosts import unavailable

    reason = unavailable()
    if reason:
        pytest.skip(reason)


@pytest.fixture
def hosts(netns_usable):
    """`hosts(n, rate=None)` -> a `netns_hosts.TestBed` of n hosts, torn down
    (its processes killed, its namespaces deleted) after the test, however
    it ends."""
    from netns_hosts import TestBed

    with contextlib.ExitStack() as beds:
        yield lambda n, rate=None: beds.enter_context(TestBed(n, rate))


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    """`uninterrupted(n, *script_flags)`: the final state of
    tests/workers/faults.py (with `script_flags`) run by n workers on this
    host without a fault, what the fault tests compare with. Made once per
    run for each `(n, script_flags)`: under pytest-xdist the workers share
    one directory (the run's base temp directory's parent), and the first
    worker to need a reference makes it there while the others wait on its
    lock."""
    import fcntl
    import hashlib

    import fault_job
    from helpers import launch

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    finals = {}

    def run(n, *script_flags):
        key = (n, script_flags)
        if key not in finals:
            name = hashlib.sha256(repr(key).encode()).hexdigest()[:12]
            out = root / f"uninterrupted{n}-{name}"
            with open(root / f"uninterrupted{n}-{name}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not (out / "done").exists():
                    shutil.rmtree(out, ignore_errors=True)
                    out.mkdir()
                    launch(
                        out,
                        n,
                        fault_job.FAULTS,
                        "--out",
                        str(out),
                        "--backup",
                        str(out / "backup"),
                        *script_flags,
                    )
                    (out / "done").touch()
            finals[key] = fault_job.results(out, n)
        return finals[key]

    return run


@pytest.fixture(scope="session")
def traced_job():
    """`traced_job(*script_flags)`: the math of tests/workers/faults.py with
    `script_flags`' optimizer, run and traced in this process
    (`fault_job.traced`), whose bounds `fault_job.assert_equal_to` takes.
    Made once per run for each optimizer (the other flags change how the
    job runs, not its math)."""
    import fault_job

    made = {}

    def run(*script_flags):
        name = fault_job.optimizer_of(script_flags)
        if name not in made:
            made[name] = fault_job.traced(name)
        return made[name]

    return run
