"""benchmarks/_sockets.py, the link's ceiling in benchmarks/multi_host.py:
two real processes exchange a 2-rank ring all-reduce's bytes over TCP on
this host, and the serving side reports a timing per size and repeat."""

import json
import os
import subprocess
import sys

SCRIPT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "benchmarks",
    "_sockets.py",
)
ARGS = ["--sizes=64K,1M", "--repeats=2", "--timeout=30"]


def test_both_sides_exchange_and_the_server_reports_each_size():
    server = subprocess.Popen(
        [sys.executable, SCRIPT, "serve", *ARGS],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(server.stdout.readline())
        client = subprocess.run(
            [sys.executable, SCRIPT, "connect", f"127.0.0.1:{port}", *ARGS],
            capture_output=True,
            text=True,
            timeout=60,
        )
        out, err = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()
    assert client.returncode == 0, client.stderr
    assert server.returncode == 0, err
    cases = json.loads(out)["cases"]
    assert [c["bytes"] for c in cases] == [64 << 10, 1 << 20]
    assert all(len(c["times"]) == 2 and min(c["times"]) > 0 for c in cases)


def test_a_wrong_command_is_a_usage_error():
    done = subprocess.run(
        [sys.executable, SCRIPT, "listen"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0
    assert "use: _sockets.py serve | _sockets.py connect HOST:PORT" in done.stderr
