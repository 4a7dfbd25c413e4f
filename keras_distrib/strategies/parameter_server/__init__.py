"""`strategy="parameter_server"`: asynchronous workers, variables on ps tasks.

* `strategy`: the `ParameterServer` strategy (TensorFlow's
  `ParameterServerStrategy` and `ClusterCoordinator` under Keras's `fit`);
* `scheduled_training`: the steps scheduled as closures on free workers;
* `per_worker_input`: what each worker trains on;
* `sharded_variables`: Keras variables split over ps tasks;
* `task_server`: the server a worker or ps task runs
  (`python -m keras_distrib.strategies.parameter_server.task_server`).

Importing this package imports none of them (the task server's command
must not pay for the strategy's imports).
"""
