"""How processes reduce tensors together.

* `runtime`: this process's TensorFlow collective runtime, started before
  TensorFlow is used (imported by `import keras_distrib`: keep it light);
* `host_allreduce`: all-reduce through shared memory between the worker
  processes of one host (no TensorFlow), built on `shm_files` (the job's
  files), `shm_peers` (joining, barriers) and `shm_layout` (where the
  arrays sit, the result buffers);
* `watchdog`: `collective_timeout` with one thread per process;
* `heartbeats`: the coordination service's heartbeat timeout between
  hosts, and the one line naming the peer whose heartbeats stopped (no
  TensorFlow).

Importing this package imports none of them.
"""
