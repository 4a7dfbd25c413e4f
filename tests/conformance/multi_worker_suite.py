"""Keras's model and callback test files under multi_worker: run in every
rank of a 2-process job by tests/workers/keras_conformance.py (not
collected on its own: its name is not a test file's)."""

import keras_suite

keras_suite.expose_all(globals(), "multi_worker", keras_suite.MULTI_WORKER_FILES)
