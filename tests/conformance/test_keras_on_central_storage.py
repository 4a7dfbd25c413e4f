"""Keras's own tests (keras_suite.FILES) on DistributedModel, strategy="central_storage"."""

import keras_suite

keras_suite.expose_all(globals(), "central_storage")
