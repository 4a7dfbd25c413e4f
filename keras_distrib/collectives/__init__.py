"""How processes reduce tensors together.

* `transport`: the interface of the collectives a strategy calls (its
  `transport`), and `registry`, the transports by name; one module per
  transport: `one_process` (the identity), `tf_collectives` (TensorFlow's,
  through a `tf.distribute` engine), `shared_memory` (between the workers
  of one host), `tcp_collectives` (our ring over TCP, between hosts),
  `hierarchical_collectives` (shared memory within hosts, our TCP ring
  between them) and `horovod_collectives` (Horovod's), with
  `across_processes` (a transport called from outside its replicas);
* `runtime`: this process's TensorFlow collective runtime, started before
  TensorFlow is used (imported by `import keras_distrib`: keep it light);
* `host_allreduce`: all-reduce through shared memory between the worker
  processes of one host (no TensorFlow), built on `shm_files` (the job's
  files), `shm_peers` (joining, barriers) and `shm_layout` (where the
  arrays sit, the result buffers);
* `tcp_ring`: a ring all-reduce over plain TCP sockets between worker
  processes on any hosts (no TensorFlow), on `tcp_links` (the
  authenticated connections, transfers with deadlines);
* `hierarchical`: shared memory within each host, a TCP ring between one
  leader per host, the result handed back within the host (no TensorFlow);
* `engine_choice`: which engine `multi_worker`'s `"auto"` takes across
  hosts, from what its probe measured (no TensorFlow);
* `watchdog`: `collective_timeout` with one thread per process;
* `heartbeats`: the coordination service's heartbeat timeout between
  hosts, and the one line naming the peer whose heartbeats stopped (no
  TensorFlow).

Importing this package imports none of them.
"""
