"""The conformance tier: Keras's own tests on DistributedModel (keras_suite).

Every test of Keras's files runs under each strategy, assertions unchanged.
`expected.txt` lists what may not pass, each with its reason
(`expectations`); any other failure is a regression.
"""

import pytest

import expectations


def test_key(item):
    """`(strategy, "file::Class::test")` of a conformance test, or None."""
    cls = getattr(item, "cls", None)
    if getattr(cls, "kd_strategy", None) is None:
        return None
    return cls.kd_strategy, f"{cls.kd_test}::{item.name}"


def pytest_collection_modifyitems(config, items):
    listed = expectations.read()
    for item in items:
        key = test_key(item)
        if key is None:
            continue
        strategy, test = key
        if ("*", test) in listed:
            item.add_marker(pytest.mark.skip(reason=listed[("*", test)]))
        elif key in listed:
            item.add_marker(pytest.mark.xfail(reason=listed[key], strict=True))


@pytest.fixture(autouse=True)
def _same_draws_on_every_rank(request):
    """Under multi_worker every rank runs the same test, as every worker of
    a job runs the same script: Keras's tests draw their data unseeded, so
    each test starts every rank from one seed (its name's)."""
    if getattr(request.cls, "kd_strategy", None) == "multi_worker":
        import zlib

        import keras

        keras.utils.set_random_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def _strategy_for_auto(request, monkeypatch):
    """In a conformance class, `strategy="auto"` (DistributedModel's default)
    means the class's strategy (keras_suite.expose)."""
    name = getattr(request.cls, "kd_strategy", None)
    if name and name != "multi_worker":
        from keras_distrib.strategies import registry

        monkeypatch.setattr(registry, "_auto_name", lambda: name)
