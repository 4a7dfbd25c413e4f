"""The user's input, turned into what each replica trains on.

* `data`: global and per-replica batch arithmetic (the split rule) and the
  checks `fit` makes of its input;
* `sharding`: each sample of an epoch seen once, by one worker, across
  processes.

The parameter-server strategy's own input (one stream per asynchronous
worker) lives with it: `keras_distrib.strategies.parameter_server.per_worker_input`.
"""
