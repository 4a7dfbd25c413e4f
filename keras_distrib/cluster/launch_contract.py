"""What `keras-distrib launch` and its workers agree on (no TensorFlow here).

Exit code `PREEMPTED` (75, `EX_TEMPFAIL` of sysexits.h: "try again later"): a worker
stopped because it or a peer was asked to stop (SIGTERM: Kubernetes
eviction, Slurm preemption, the launcher shutting down). Every worker of the
job stopped at the same step and the chief wrote a backup when the script
uses `keras_distrib.callbacks.BackupAndRestore`; running the same script
again resumes from it. The launcher exits with it too when it was asked to
stop, and restarts the job on it under `--max-restarts`.
"""

import os
import re
import tempfile
from typing import Optional

PREEMPTED = 75
# How the lines the launcher reads in its workers' output begin.
LINE_START = "keras_distrib: "
# How each worker's line begins as it exits with PREEMPTED. horovodrun
# exits 1 (or, racing with itself, 0) whatever its ranks' non-zero codes,
# so the launcher tells a preempted horovodrun by its ranks' lines.
PREEMPTED_LINE = LINE_START + "preempted (SIGTERM): "
# How the chief's line begins when `BackupAndRestore` has written a backup,
# `keras_distrib: backup saved at step 12 (epoch 2, step 4).`, printed only
# under the launcher (`RESTART_ENV` set), which keeps it off its output and
# names the step when it restarts the job or changes its workers. The line
# of a resumed run, `RESUMING_LINE`, tells it the same of the backup read.
BACKUP_LINE = LINE_START + "backup saved at "
RESUMING_LINE = LINE_START + "resuming from "
# How a rank's flight-recorder account begins (one line of JSON follows;
# keras_distrib.collectives.flight_recorder), read and left out of the
# output by the launcher, which prints every rank's account as one screen.
FLIGHT_RECORDER_LINE = LINE_START + "flight recorder: "
_POINT = re.compile(
    f"(?:{re.escape(BACKUP_LINE)}|{re.escape(RESUMING_LINE)})"
    r"(step \d+ \(epoch \d+, step \d+\))"
)


def backup_point(line: str) -> Optional[str]:
    """`step 12 (epoch 2, step 4)` from a line holding a `BACKUP_LINE` or a
    `RESUMING_LINE` (after a progress bar's text, say), or None."""
    match = _POINT.search(line)
    return match.group(1) if match else None


# Environment variables the launcher sets for its workers.
# The private directory (mode 0700, removed by the launcher whatever way the
# job ends) where the shared-memory all-reduce keeps its files.
SHM_DIR_ENV = "KERAS_DISTRIB_SHM_DIR"
# The file descriptor (the rank's standard input) on which the launcher asks
# a rank for its flight-recorder account: a line `report <reason>`.
CONTROL_FD_ENV = "KERAS_DISTRIB_CONTROL_FD"
# How many times the launcher has restarted the job (0 on the first run).
RESTART_ENV = "KERAS_DISTRIB_RESTART"


def default_shm_directory() -> str:
    """Where the workers' shared-memory files go when `SHM_DIR_ENV` is not
    set, and where the launcher makes the private directory it sets it to:
    /dev/shm (memory-backed) when present, else the temp directory."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return tempfile.gettempdir()
