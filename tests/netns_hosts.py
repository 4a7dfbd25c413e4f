"""Several hosts on one machine: Linux network namespaces joined by a bridge.

A `TestBed` of N hosts is N network namespaces, each with its own address
(10.77.0.1, 10.77.0.2, ... on `eth0`, inside the namespaces only: the
machine's own namespace gets no route or address) and a veth link into a
switch namespace that holds a bridge. Workers on two of these hosts reach
each other only over that link, as on two machines: the launcher treats the
addresses as remote (`keras_distrib.cluster.is_local_host`), so a
multi-worker job takes TensorFlow's collectives, not shared memory; a link
can be rate-limited (`tc` token bucket on both ends), cut and restored.
Each host also has a management link (a link of its own at the switch), which
the ssh stand-in below crosses: `cut(host, training_only=True)` leaves it
up, so ssh reaches a host its peers cannot.

`bed.ssh_command` is what `keras-distrib launch --ssh --ssh_command` needs
to start a rank "on" a host: this file run as
`python netns_hosts.py exec PREFIX HOST COMMAND`, which execs
`ip netns exec <PREFIX>-<HOST> sh -c COMMAND` (the rank replaces it, so
killing the child kills the rank, as ssh -tt does). As ssh would, it cannot
reach a host whose management link is cut: it waits for the link up to
`CONNECT_SECONDS`, then exits 255.

`bed.ssh_program(directory)` writes an `ssh` for programs that call it
from PATH themselves (horovodrun); `bed.on(host, argv)` runs a program on
a host (a launcher started "on" host 0 sees it as its own machine).

`close()` kills every process left in the namespaces and deletes them;
it runs even when a test fails (the conftest fixture). Needs root (or
CAP_NET_ADMIN) and iproute2: `unavailable()` says in one line why not.
No TensorFlow here (the unit tier imports it).
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Optional

SUBNET = "10.77.0"
_beds = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> Optional[str]:
    """None when this machine can make network namespaces, else why not."""
    if os.geteuid() != 0:
        return "the multi-host test bed needs root (network namespaces)"
    probe = f"kdprobe{os.getpid()}"
    try:
        made = _ip("netns", "add", probe, check=False)
    except FileNotFoundError:
        return "the multi-host test bed needs iproute2's `ip`"
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


_BITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def bytes_per_second(rate: str) -> float:
    """What a link of `rate` (`tc`'s kbit, mbit or gbit, e.g. "1gbit")
    carries per second, in bytes."""
    for unit, scale in _BITS.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale / 8
    raise ValueError(f"rate {rate!r}: use kbit, mbit or gbit")


def burst_bytes(rate: str) -> int:
    """The token bucket of a link of `rate`: 1 ms of it (at least 16 KB),
    the least the kernel's timers serve at the full rate. A larger bucket
    sends its whole content at once after the link has been idle, as a
    training step's link is during the forward pass: a 1 MB bucket made
    8 ms of a 1 Gbit/s link's transfer free."""
    return max(16384, int(bytes_per_second(rate) / 1000))


class TestBed:
    """`n` hosts as network namespaces on one bridge; see the module doc.

    Example:

    ```python
    with TestBed(2, rate="1gbit") as bed:
        bed.addresses            # ['10.77.0.1', '10.77.0.2']
        bed.run(0, "ping", "-c1", bed.addresses[1])
        bed.cut(1); bed.restore(1)
    ```
    """

    __test__ = False  # not a pytest test class

    def __init__(self, n: int, rate: Optional[str] = None):
        self.n = n
        self.rate = rate
        self.prefix = f"kd{os.getpid()}b{next(_beds)}"
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(n)]
        self.switch = f"{self.prefix}-switch"
        self._made: list[str] = []
        self._etc: list[str] = []  # /etc/netns/<namespace> directories made

    # -- names ------------------------------------------------------------------

    def namespace(self, host: int) -> str:
        return f"{self.prefix}-{self.addresses[host]}"

    @property
    def ssh_command(self) -> str:
        """The `--ssh_command` that starts a command on one of these hosts."""
        return f"{sys.executable} {os.path.abspath(__file__)} exec {self.prefix}"

    def ssh_program(self, directory: str) -> str:
        """Writes `directory/ssh`, a stand-in for OpenSSH's `ssh` reaching
        these hosts, for programs that call `ssh` from PATH (horovodrun);
        returns `directory`, to put first on PATH."""
        path = os.path.join(directory, "ssh")
        with open(path, "w") as f:
            f.write(
                f"#!/bin/sh\nexec {sys.executable} {os.path.abspath(__file__)} ssh "
                f'{self.prefix} "$@"\n'
            )
        os.chmod(path, 0o755)
        return directory

    def on(self, host: int, argv: list[str], name: Optional[str] = None) -> list[str]:
        """`argv` to run on `host` (for Popen), under the host name `name`
        (default: its address)."""
        return [
            "ip",
            "netns",
            "exec",
            self.namespace(host),
            *_own_name(name or self.addresses[host]),
            *argv,
        ]

    def hosts_file(self, host: int, lines: list[str]) -> None:
        """`lines` as `host`'s /etc/hosts: `ip netns exec` mounts
        /etc/netns/<namespace>/hosts over it, so names resolve there as a
        cluster's DNS would resolve them (removed by `close`)."""
        directory = os.path.join("/etc/netns", self.namespace(host))
        os.makedirs(directory, exist_ok=True)
        self._etc.append(directory)
        with open(os.path.join(directory, "hosts"), "w") as f:
            f.write("\n".join(["127.0.0.1 localhost", *lines]) + "\n")

    def hosts_flag(self, slots: int = 1) -> str:
        """`--hosts` for the launcher: every host with `slots` ranks."""
        return ",".join(f"{a}:{slots}" for a in self.addresses)

    # -- life cycle -------------------------------------------------------------

    def __enter__(self) -> "TestBed":
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _make(self) -> None:
        self._add_namespace(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for host in range(self.n):
            ns, port = self.namespace(host), f"p{host}"
            self._add_namespace(ns)
            _ip(
                "-n",
                ns,
                "link",
                "add",
                "eth0",
                "type",
                "veth",
                "peer",
                "name",
                port,
                "netns",
                self.switch,
            )
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{self.addresses[host]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            if self.rate:
                self._limit(ns, "eth0")
                self._limit(self.switch, port)
            # The host's management network, which the ssh stand-in crosses:
            # a link of its own, so that the training link can be cut alone.
            _ip("-n", self.switch, "link", "add", f"m{host}", "type", "bridge")
            _ip("-n", self.switch, "link", "set", f"m{host}", "up")

    def _limit(self, ns: str, dev: str) -> None:
        """A token bucket of `rate` on `dev`'s egress (both ends of a link),
        holding 1 ms of the rate (`burst_bytes`): a link idle for a while
        sends no faster than that after it."""
        subprocess.run(
            [
                "tc",
                "-n",
                ns,
                "qdisc",
                "add",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                self.rate,
                "burst",
                str(burst_bytes(self.rate)),
                "latency",
                "100ms",
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )

    def pids(self, host: Optional[int] = None) -> list[int]:
        """The processes running in one host's namespace (or in any)."""
        names = [self.namespace(host)] if host is not None else self._made
        found = []
        for name in names:
            listed = _ip("netns", "pids", name, check=False).stdout.split()
            found += [int(p) for p in listed]
        return found

    def kill(self, host: Optional[int] = None) -> list[int]:
        """SIGKILLs every process on `host` (or on every host); returns them."""
        pids = self.pids(host)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def close(self) -> None:
        """Kills what runs in the namespaces and deletes them (idempotent)."""
        for _ in range(50):
            if not self.kill():
                break
            time.sleep(0.1)
        for name in reversed(self._made):
            _ip("netns", "del", name, check=False)
        self._made.clear()
        for directory in self._etc:
            shutil.rmtree(directory, ignore_errors=True)
        self._etc.clear()

    # -- the network ------------------------------------------------------------

    def cut(self, host: int, training_only: bool = False) -> None:
        """Takes `host`'s link down at the switch: nothing reaches it or
        leaves it. `training_only`: its management network stays up, so the
        ssh stand-in still reaches it (a firewall on the training ports, a
        dead NIC on the fast fabric)."""
        _ip("-n", self.switch, "link", "set", f"p{host}", "down")
        if not training_only:
            _ip("-n", self.switch, "link", "set", f"m{host}", "down")

    def firewall(self, host: int, first: int = 61000, last: int = 61999) -> None:
        """Stops new TCP connections to `host` on ports `first` to `last`,
        and makes them the ports its processes get when they listen on any
        (its namespace's ephemeral range): a firewall that lets only ports
        named in advance through. The job's own ports, which the launcher
        picks below the ephemeral range (under 32768 elsewhere, under
        `first` there), still connect, and so does every connection `host`
        opens (its replies carry an ACK).
        """
        self.run(host, "sysctl", "-w", f"net.ipv4.ip_local_port_range={first} {last}", check=True)
        rules = (
            "table inet kd_firewall {\n chain input {\n"
            "  type filter hook input priority 0;\n"
            f"  tcp dport {first}-{last} tcp flags & (syn | ack) == syn drop\n }}\n}}\n"
        )
        self.run(host, "nft", "-f", "-", input=rules, check=True)

    def restore(self, host: int) -> None:
        for link in (f"p{host}", f"m{host}"):
            _ip("-n", self.switch, "link", "set", link, "up")

    def run(self, host: int, *argv: str, **kwargs) -> subprocess.CompletedProcess:
        """Runs `argv` on `host` and waits (a 60 s bound)."""
        kwargs.setdefault("timeout", 60)
        return subprocess.run(
            ["ip", "netns", "exec", self.namespace(host), *argv],
            capture_output=True,
            text=True,
            **kwargs,
        )


# How long the ssh stand-in waits for a host whose link is down, as ssh's
# connect keeps trying (OpenSSH's ConnectTimeout); then it fails as ssh does.
CONNECT_SECONDS = 20.0


def _link_up(prefix: str, host: str) -> bool:
    """Whether `host`'s management link at the switch is up (`TestBed.cut`
    takes it down, but for `training_only`)."""
    port = f"m{int(host.rsplit('.', 1)[1]) - 1}"
    shown = _ip("-n", f"{prefix}-switch", "-o", "link", "show", port, check=False).stdout
    flags = shown.split("<", 1)[1].split(">", 1)[0].split(",") if "<" in shown else []
    return "UP" in flags


def _exec(prefix: str, host: str, command: str) -> None:
    """`ssh host command` for a test bed: becomes `command` in `host`'s
    namespace. Like ssh, it cannot reach a host whose link is down: it waits
    for the link up to `CONNECT_SECONDS`, then exits 255 saying so."""
    host = host.strip("[]")
    deadline = time.monotonic() + CONNECT_SECONDS
    while not _link_up(prefix, host):
        if time.monotonic() > deadline:
            sys.stderr.write(f"ssh: connect to host {host} port 22: Connection timed out\n")
            sys.exit(255)
        time.sleep(0.2)
    os.execvp(
        "ip", ["ip", "netns", "exec", f"{prefix}-{host}", *_own_name(host), "sh", "-c", command]
    )


def _own_name(address: str) -> list[str]:
    """The argv prefix that gives a command its host's own host name (the
    address itself, which resolves to itself): processes on two hosts
    would otherwise share this machine's name, and what finds its peers
    by host name (Gloo does) would take them for one host."""
    return ["unshare", "--uts", "sh", "-c", f'hostname {address} && exec "$@"', "sh"]


def ssh_words(argv: list[str]) -> tuple[Optional[str], str]:
    """`(host, command)` of `ssh [-o opt] [-p port] [-i file] [-tt ...] host
    [options] command...` as OpenSSH parses it: options may follow the host,
    as horovodrun puts them, and the words after them are the remote
    shell's command line."""
    words, host = list(argv), None
    while words and (words[0].startswith("-") or host is None):
        if words[0] in ("-o", "-p", "-i"):
            del words[:2]
        elif words[0].startswith("-"):  # a flag without a value: -tt, -q, ...
            del words[0]
        else:
            host = words.pop(0)
    return host, " ".join(words)


def _ssh(prefix: str, argv: list[str]) -> None:
    host, command = ssh_words(argv)
    if host is None:
        sys.exit("netns_hosts.py ssh: no host")
    _exec(prefix, host, command)


USAGE = (
    "usage: netns_hosts.py exec PREFIX HOST COMMAND\n"
    "       netns_hosts.py ssh PREFIX [SSH OPTIONS] HOST COMMAND..."
)

if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "exec":
        _exec(*sys.argv[2:])
    elif len(sys.argv) >= 4 and sys.argv[1] == "ssh":
        _ssh(sys.argv[2], sys.argv[3:])
    sys.exit(USAGE)
