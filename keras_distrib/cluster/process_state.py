"""What became of a process of this machine, by pid: the launcher naming a
stopped rank, the shared-memory engine watching its peers, a worker
deleting the scratch directories of workers killed before their cleanup.
Linux's /proc, no TensorFlow."""

from __future__ import annotations

import os
from typing import Optional

__all__ = ["process_state", "state_letter"]


def state_letter(pid: int) -> Optional[str]:
    """The state letter in /proc/PID/stat (R, S, D, T, Z...); None off Linux or when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # "PID (COMMAND) STATE ...": the command may hold spaces and parentheses.
    return stat[stat.rfind(")") + 2 :][:1] or None


def process_state(pid: Optional[int]) -> str:
    """'exited', 'stopped' (SIGSTOP, a debugger) or 'running' (also: unknown,
    another user's, or no pid).

    Example:

    ```python
    process_state(os.getpid())  # 'running'
    ```
    """
    if pid is None:
        return "running"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "exited"
    except PermissionError:
        pass
    # A zombie (exited, not yet reaped by its parent) still answers kill().
    state = state_letter(pid)
    if state in ("Z", "X"):
        return "exited"
    return "stopped" if state in ("T", "t") else "running"
