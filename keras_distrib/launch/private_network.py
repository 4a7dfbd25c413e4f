"""`--private_network`: a one-host job in a network namespace of its own,
with loopback only.

TensorFlow's gRPC servers (a multi-worker job's coordination service and
collectives, a parameter-server job's tasks) listen on all interfaces and
take commands from anyone who connects (docs/security.md). With
`--private_network` the launcher starts again inside a new network
namespace (`unshare --net`; a user who is not root gets a user namespace
too, `--map-root-user`, where the kernel allows it) that holds only a
loopback interface, which it brings up; every rank it starts lives there.
The ranks reach each other over loopback as before, and nothing any of
them opens (TensorFlow's servers, a port of the user's own) can be reached
from another machine, or from a process of this one outside the job. The
namespace goes with the job's last process: there is nothing to clean up.

The ranks have no network beyond loopback: nothing they download, no
remote host they reach (file systems mounted before the start stay).
Jobs with remote hosts cannot use it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import struct
import subprocess
import sys
from typing import NoReturn, Sequence

from keras_distrib import cluster as cluster_lib
from keras_distrib.launch.config import LaunchConfig, LaunchError
from keras_distrib.launch.plan import parse_hosts

# Set in the launcher started again inside the namespace (and so in its ranks).
ENV = "KERAS_DISTRIB_PRIVATE_NETWORK"

_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_IFREQ = "16sh22x"  # struct ifreq: the name, then ifr_flags in the union


def inside() -> bool:
    """Whether this process runs in a job's private network namespace."""
    return os.environ.get(ENV) == "1"


def check(config: LaunchConfig) -> None:
    """Raises `LaunchError` when `config` is not a one-host job."""
    hosts = parse_hosts(config.hosts, config.nproc) if config.hosts else []
    remote = sorted({h for h in hosts if not cluster_lib.is_local_host(h)})
    if remote:
        raise LaunchError(
            f"--private_network keeps the job on this machine's loopback, but --hosts names "
            f"{', '.join(remote)}; drop --private_network or run the job on one host."
        )


def _unshare_argv() -> list[str]:
    """`unshare --net` (with a user namespace when not root)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        raise LaunchError(
            "--private_network needs util-linux's `unshare`, which is not "
            "installed here; install util-linux or drop --private_network."
        )
    return [unshare, "--net"] + ([] if os.geteuid() == 0 else ["--map-root-user"])


def enter(argv: Sequence[str]) -> NoReturn:
    """Starts this launcher again, as `argv`'s command, in a new network
    namespace (it keeps its process id: `unshare` execs it).

    Raises:
        LaunchError: no namespace can be made here (one line, with why).
    """
    unshare = _unshare_argv()
    probe = subprocess.run([*unshare, "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        why = " ".join(probe.stderr.split()) or f"exit code {probe.returncode}"
        raise LaunchError(
            f"--private_network cannot make a network namespace here ({why}); run as root, "
            "allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1), "
            "or drop --private_network."
        )
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(
        unshare[0],
        [*unshare, "--", sys.executable, "-m", "keras_distrib.launch", *argv[1:]],
        dict(os.environ, **{ENV: "1"}),
    )


def loopback_up() -> None:
    """Brings the namespace's loopback interface up (it starts down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack(_IFREQ, b"lo", 0)
        flags = struct.unpack(_IFREQ, fcntl.ioctl(s, _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | _IFF_UP))
