"""What `keras-distrib launch` and its workers agree on (no TensorFlow here).

Exit code `PREEMPTED` (75, `EX_TEMPFAIL` of sysexits.h: "try again later"): a worker
stopped because it or a peer was asked to stop (SIGTERM: Kubernetes
eviction, Slurm preemption, the launcher shutting down). Every worker of the
job stopped at the same step and the chief wrote a backup when the script
uses `keras_distrib.callbacks.BackupAndRestore`; running the same script
again resumes from it. The launcher exits with it too when it was asked to
stop, and restarts the job on it under `--max-restarts`.
"""

PREEMPTED = 75
# How each worker's line begins as it exits with PREEMPTED. horovodrun
# exits 1 (or, racing with itself, 0) whatever its ranks' non-zero codes,
# so the launcher tells a preempted horovodrun by its ranks' lines.
PREEMPTED_LINE = "keras_distrib: preempted (SIGTERM): "

# Environment variables the launcher sets for its workers.
# The private directory (mode 0700, removed by the launcher whatever way the
# job ends) where the shared-memory all-reduce keeps its files.
SHM_DIR_ENV = "KERAS_DISTRIB_SHM_DIR"
# How many times the launcher has restarted the job (0 on the first run).
RESTART_ENV = "KERAS_DISTRIB_RESTART"
