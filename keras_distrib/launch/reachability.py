"""Whether a host can take part in training: ssh reaches it, and it reaches
the job's rendezvous over the training network.

An elastic launch (`--min_workers`) counts a host as present when its ranks
could train, not only when ssh answers: ssh may cross a management network
while the training traffic goes over another (a separate data network, a
firewall on the training ports, a dead NIC on the fast fabric). So the
launcher holds the job's rendezvous, a TCP port open on its own address
among the job's hosts (the address the ranks use to reach each other), for
the life of the job, and a probe run on the host through `--ssh_command`
connects to it:

    ssh b python -S -c '<connect to 10.0.0.1:41234>'

The probe's exit code says which: 0, the host reaches the rendezvous;
`UNREACHED`, ssh works but the rendezvous did not answer within
`CONNECT_SECONDS` (the probe tries again meanwhile); anything else (ssh's 255, no end within
`PROBE_SECONDS`), the host does not answer at all. This machine is always
present.

When the launcher's machine is not one of the job's hosts there is no
address of the training network to hold the rendezvous on; the probe is
then ssh's alone, and the ranks' own diagnosis (`keras_distrib.launch.blame`)
still decides whom an attempt's failure is charged to.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
from typing import Optional, Sequence

from keras_distrib import cluster as cluster_lib

PROBE_SECONDS = 10.0  # the whole probe, ssh included
CONNECT_SECONDS = 5.0  # the probe's connection to the rendezvous
UNREACHED = 3  # the probe's exit code when ssh worked and the rendezvous did not answer

# What the probe runs on the host: stdlib only, without site (-S), so that
# it starts in milliseconds. It tries again until its time is up: right
# after a link comes back the first attempt can fail at once ("No route to
# host" while the neighbour entry is still marked failed).
_CONNECT = (
    "import socket, sys, time\n"
    "deadline = time.monotonic() + float(sys.argv[3])\n"
    "while True:\n"
    "    try:\n"
    "        socket.create_connection((sys.argv[1], int(sys.argv[2])), "
    "timeout=max(0.1, deadline - time.monotonic())).close()\n"
    "        break\n"
    "    except OSError:\n"
    "        if time.monotonic() >= deadline:\n"
    f"            sys.exit({UNREACHED})\n"
    "        time.sleep(0.2)\n"
)

# Why a host is out, for one host and for several.
NO_ANSWER = ("it does not answer", "they do not answer")


class Rendezvous:
    """The job's rendezvous and the probe that asks hosts to reach it.

    `address` is `host:port` of the port the launcher holds, None when this
    machine is not among `hosts` (the probe is then ssh's alone). Close it
    (or use it as a context manager) when the job ends.

    Example:

    ```python
    with Rendezvous(["10.0.0.1", "10.0.0.2"], "ssh") as rendezvous:
        rendezvous.why_out("10.0.0.2")   # None, or ("it does not answer", ...)
    ```
    """

    def __init__(self, hosts: Sequence[str], ssh_command: str):
        self._ssh = shlex.split(ssh_command)
        self._server: Optional[socket.socket] = None
        self.address: Optional[str] = None
        self._lock = threading.Lock()
        self._probes: set = set()  # the probes under way (Popen)
        self._closed = False
        own = next((h for h in hosts if cluster_lib.is_local_host(h)), None)
        if own is None or all(cluster_lib.is_local_host(h) for h in hosts):
            return  # nothing to reach it from, or nowhere to hold it
        bare = own.strip("[]")
        family = socket.AF_INET6 if ":" in bare else socket.AF_INET
        self._server = socket.create_server((bare, 0), family=family)
        self._host, self._port = bare, self._server.getsockname()[1]
        self.address = (
            f"[{bare}]:{self._port}" if family == socket.AF_INET6 else f"{bare}:{self._port}"
        )
        threading.Thread(target=self._accept, daemon=True, name="keras_distrib-rendezvous").start()

    def _accept(self) -> None:
        server = self._server
        assert server is not None  # started once the port is held
        while True:
            try:
                connection, _ = server.accept()
            except OSError:
                return  # closed
            connection.close()

    def close(self) -> None:
        """Closes the port and kills the probes under way (one waiting for a
        host that is gone would outlive the launcher)."""
        with self._lock:
            self._closed = True
            probes = list(self._probes)
        for probe in probes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(probe.pid, signal.SIGKILL)
            probe.wait()
        if self._server is not None:
            try:  # wakes the accept() under way, which would keep the port open
                self._server.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._server.close()

    def __enter__(self) -> "Rendezvous":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def why_out(self, host: str) -> Optional[tuple[str, str]]:
        """None when `host` is present; else why not, for one host and for several."""
        if cluster_lib.is_local_host(host):
            return None
        command = "true"
        if self.address is not None:
            command = shlex.join(
                [
                    sys.executable,
                    "-S",
                    "-c",
                    _CONNECT,
                    self._host,
                    str(self._port),
                    f"{CONNECT_SECONDS:g}",
                ]
            )
        code = self._run([*self._ssh, host.strip("[]"), command])
        if code == 0:
            return None
        if code == UNREACHED and self.address is not None:
            where = f"the job's rendezvous at {self.address} on the training network"
            return (
                f"ssh reaches it, but it cannot reach {where}",
                f"ssh reaches them, but they cannot reach {where}",
            )
        return NO_ANSWER

    def _run(self, argv: Sequence[str]) -> Optional[int]:
        """The probe's exit code; None when it did not end within
        `PROBE_SECONDS` (it is killed) or the rendezvous is closed."""
        with self._lock:
            if self._closed:
                return None
            probe = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            self._probes.add(probe)
        try:
            return probe.wait(timeout=PROBE_SECONDS)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(probe.pid, signal.SIGKILL)
            probe.wait()
            return None
        finally:
            with self._lock:
                self._probes.discard(probe)

    def out(self, hosts: Sequence[str]) -> dict[str, tuple[str, str]]:
        """`{host: why}` for the hosts among `hosts` that are not present,
        asked all at once."""
        hosts = list(dict.fromkeys(hosts))
        if not hosts:
            return {}
        with concurrent.futures.ThreadPoolExecutor(len(hosts)) as pool:
            why = list(pool.map(self.why_out, hosts))
        return {h: w for h, w in zip(hosts, why) if w is not None}
