"""The conformance tier: Keras's own tests on DistributedModel (see keras_suite)."""


def pytest_configure(config):
    # The markers Keras's own conftest.py (not in the wheel) declares; under
    # the TensorFlow backend neither skips anything.
    config.addinivalue_line("markers", "requires_trainable_backend: Keras's marker")
    config.addinivalue_line("markers", "multi_device: Keras's marker")


import pytest


@pytest.fixture(autouse=True)
def _strategy_for_auto(request, monkeypatch):
    """In a conformance class, `strategy="auto"` (DistributedModel's default)
    means the class's strategy (keras_suite.expose)."""
    name = getattr(request.cls, "kd_strategy", None)
    if name and name != "keras":
        from keras_distrib.strategies import registry

        monkeypatch.setattr(registry, "_auto_name", lambda: name)
