"""`keras-distrib launch` without processes: flags, planning, the output printer.

Plain Python (the launcher never imports TensorFlow): config checks, host
lists, a multi-host dry run, how rank output is printed, the usage text.
The one test that starts a process runs a fresh interpreter to check what
importing the launcher loads. Real launches are in
tests/distributed/test_launch.py.
"""

import importlib
import json
import os
import textwrap

import pytest
from pure_helpers import HEAVY_MODULES, rank_pids, rank_script, run_python

from keras_distrib import launch
from keras_distrib.launch import LaunchConfig, LaunchError

# The module of the printer and the output streams.
output_lib = importlib.import_module("keras_distrib.launch.output")

pytestmark = pytest.mark.timeout(60)


# --------------------------------------------------------------------------
# Flags and configuration


@pytest.mark.parametrize(
    "argv, head, tail",
    [
        (
            ["kd", "launch", "-n", "2", "t.py", "-n", "5", "--ssh"],
            ["kd", "launch", "-n", "2"],
            ["t.py", "-n", "5", "--ssh"],
        ),
        (
            ["kd", "-n", "2", "--ssh", "launch", "--hosts", "a,b", "t.py"],
            ["kd", "-n", "2", "--ssh", "launch", "--hosts", "a,b"],
            ["t.py"],
        ),
        (
            ["kd", "launch", "--nproc=2", "--", "-weird.py", "x"],
            ["kd", "launch", "--nproc=2"],
            ["-weird.py", "x"],
        ),
        (["kd", "launch", "-n", "2"], ["kd", "launch", "-n", "2"], []),
        (["kd"], ["kd"], []),
    ],
)
def test_split_argv_keeps_script_flags_away_from_absl(argv, head, tail):
    assert launch.split_argv(argv) == (head, tail)


def test_parse_hosts():
    assert launch.parse_hosts(["a", "b"], 4) == ["a", "a", "b", "b"]
    assert launch.parse_hosts(["a", "b"], 3) == ["a", "a", "b"]
    assert launch.parse_hosts(["a:1", "b:3"], 4) == ["a", "b", "b", "b"]
    assert launch.parse_hosts(["a:4", "b:4"], 2) == ["a", "a"]
    assert launch.parse_hosts(["[fe80::1]:2"], 2) == ["[fe80::1]", "[fe80::1]"]


@pytest.mark.parametrize(
    "hosts, nproc, fragment",
    [
        (["a:1", "b:1"], 3, "gives 2 slots but -n is 3"),
        (["a", "b", "c"], 2, "lists 3 hosts but -n is 2"),
        (["a", "a:2"], 2, "lists 'a' twice"),
        (["a:0"], 1, "slots must be >= 1"),
        (["fe80::1"], 1, "IPv6 hosts in brackets"),
        (["a:x"], 1, "not host or host:slots"),
    ],
)
def test_parse_hosts_errors(hosts, nproc, fragment):
    with pytest.raises(LaunchError, match=fragment):
        launch.parse_hosts(hosts, nproc)


def test_check_config_errors(tmp_path):
    script = rank_script(tmp_path, "")
    # Elastic Horovod: horovodrun again on the hosts that answer.
    launch.check_config(
        LaunchConfig(nproc=2, script=script, min_workers=1, max_restarts=1, backend="horovod")
    )
    for config, fragment in [
        (LaunchConfig(nproc=0, script=script), "must be >= 1, got 0"),
        (LaunchConfig(nproc=1, script=str(tmp_path / "no.py")), "not found"),
        (LaunchConfig(nproc=2, script=script, port_base=65535), "no room for 2 ports"),
        (LaunchConfig(nproc=1, script=script, timeout=-1), "--timeout=-1"),
        (LaunchConfig(nproc=1, script=script, max_restarts=-1), "--max_restarts=-1 must be >= 0"),
        (LaunchConfig(nproc=1, script=script, grace_seconds=-1), "--grace_seconds=-1 must be >= 0"),
        (
            LaunchConfig(nproc=1, script=script, straggler_warning=-1),
            "--straggler_warning=-1 must be >= 0",
        ),
        (
            LaunchConfig(nproc=1, script=script, backend="horovod", max_restarts=1),
            "works with --backend=tf only",
        ),
        (
            LaunchConfig(nproc=2, script=script, min_workers=3, max_restarts=1),
            r"--min_workers=3 must be between 1 and -n \(2\)",
        ),
        (LaunchConfig(nproc=2, script=script, min_workers=1), "give --max_restarts K"),
        (
            LaunchConfig(nproc=2, script=script, min_workers=1, max_restarts=1, ps=1),
            "--min_workers works with workers only",
        ),
    ]:
        with pytest.raises(LaunchError, match=fragment):
            launch.check_config(config)


def test_port_base_in_use_is_refused(tmp_path):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        config = LaunchConfig(nproc=2, script=rank_script(tmp_path, ""), port_base=port)
        with pytest.raises(LaunchError, match=f"port {port} is already in use.*--port_base"):
            launch.launch(config)
    assert not rank_pids(tmp_path)  # refused before starting anything


# --------------------------------------------------------------------------
# Output: progress bars (\r redraws), CRLF, TensorFlow's C++ logs


def _feed(chunks_by_source, hide_tf_noise=False) -> str:
    """What the printer writes for `(source, chunk)` pairs fed in order."""
    import io

    stream = io.StringIO()
    printer = output_lib.Printer(stream, hide_tf_noise=hide_tf_noise)
    tail: list[str] = []
    sources = {}
    for source, chunk in chunks_by_source:
        if source not in sources:
            sources[source] = output_lib.Stream(f"[{source}] ", printer, tail)
        sources[source].feed(chunk)
    for source in sources.values():
        source.close()
    printer.end_line()
    return stream.getvalue()


def test_redraws_show_as_one_updating_line_and_crlf_ends_lines():
    # Keras's progbar: backspaces over the old text, \r, the new text.
    bar = [("r0", "\r0/3"), ("r0", "\b\b\b\r1/3"), ("r0", "\b\b\b\r2/3"), ("r0", "\n")]
    assert _feed(bar) == "\r[r0] 0/3\r[r0] 1/3\r[r0] 2/3\n"
    # ssh -tt: CRLF line ends, also when a read ends between \r and \n.
    assert _feed([("r0", "one\r\ntwo\r\nthree\r"), ("r0", "\nfour\r\n")]) == (
        "[r0] one\n[r0] two\n\r[r0] three\n[r0] four\n"
    )
    # A bar ended by CRLF; several redraws in one read show the last.
    assert _feed([("r0", "\r1/3\r2/3"), ("r0", "\r3/3\r\n")]) == "\r[r0] 2/3\r[r0] 3/3\n"
    # A plain partial line still waits for its end.
    assert _feed([("r0", "Epo"), ("r0", "ch 1\n")]) == "[r0] Epoch 1\n"


def test_banners_left_by_tf_cpp_min_log_level_are_dropped_unless_asked_for():
    banners = (
        "WARNING: All log messages before absl::InitializeLog() is called are "
        "written to STDERR\nI0000 00:00:1795414363.840102   27521 port.cc:153] oneDNN "
        "custom operations are on.\n"
    )
    chunks = [("r0", banners + "Epoch 1/2\n")]
    assert _feed(chunks, hide_tf_noise=True) == "[r0] Epoch 1/2\n"
    assert _feed(chunks).count("[r0] ") == 3


def test_another_sources_line_ends_an_open_redraw_first():
    out = _feed(
        [("r0", "\r1/3"), ("r1", "hello\n"), ("r0", "\r2/3"), ("r0", "\n"), ("r1", "bye\n")]
    )
    assert out == "\r[r0] 1/3\n[r1] hello\n\r[r0] 2/3\n[r1] bye\n"


def test_horovodrun_prefixes_become_rank_labels():
    import io
    from keras_distrib.launch import backends

    stream = io.StringIO()
    printer = output_lib.Printer(stream)
    tail: list = []
    own = output_lib.Stream("[horovodrun] ", printer, tail)
    demux = output_lib.RankDemux(backends.HOROVODRUN_RANK_PREFIX, own, printer, tail)
    # As horovodrun forwards a Keras bar on rank 0 (each piece behind the
    # prefix, ending in \r or \n), reads cut anywhere.
    text = (
        "[0]<stdout>:\r[0]<stdout>:1/2 \b\b\b\b\r[1]<stdout>:hi\n"
        "[0]<stdout>:2/2\n[1]<stderr>:warn\nProcess 1 exit with status code 0.\n"
        "Mon Nov  3 06:13:52 2026[1]<stdout>:stamped\n"
    )
    for i in range(0, len(text), 7):
        demux.feed(text[i : i + 7])
    demux.close()
    assert stream.getvalue() == (
        "\r[rank 0] 1/2 \n[rank 1] hi\n[rank 0] 2/2\n[rank 1] warn\n"
        "[horovodrun] Process 1 exit with status code 0.\n[rank 1] stamped\n"
    )
    assert "[rank 1] warn" in tail


# --------------------------------------------------------------------------
# Multi-host: a dry run (the hosts are remote: nothing starts)


def test_multi_host_dry_run_prints_and_writes_tf_config(tmp_path, capfd):
    script = rank_script(tmp_path, "open(os.path.join(HERE, 'ran'), 'w').close()")
    out_dir = tmp_path / "out"
    config = LaunchConfig(
        nproc=3,
        script=script,
        script_args=("--lr", "0.1"),
        hosts=("node-a.invalid:2", "node-b.invalid"),
        output_dir=str(out_dir),
    )
    assert launch.launch(config) == 0
    out, _ = capfd.readouterr()
    expected_workers = ["node-a.invalid:23456", "node-a.invalid:23457", "node-b.invalid:23456"]
    for rank, host in enumerate(["node-a.invalid", "node-a.invalid", "node-b.invalid"]):
        line = next(
            printed
            for printed in out.splitlines()
            if printed.startswith(f"rank {rank} on {host}: ")
        )
        tf_config = json.loads(line.split("TF_CONFIG=", 1)[1])
        assert tf_config == {
            "cluster": {"worker": expected_workers},
            "task": {"type": "worker", "index": rank},
        }
        assert json.loads((out_dir / f"rank-{rank}.tf_config.json").read_text()) == tf_config
    commands = [line.strip() for line in out.splitlines() if line.startswith("  cd ")]
    assert len(commands) == 3
    assert all(c.endswith(f"{script} --lr 0.1") for c in commands)
    assert "KERAS_DISTRIB_RANK=2" in commands[2]
    host_a = (out_dir / "host-node-a.invalid.sh").read_text()
    assert commands[0] in host_a and commands[1] in host_a and commands[2] not in host_a
    assert (out_dir / "host-node-b.invalid.sh").exists()
    assert not (tmp_path / "ran").exists() and not rank_pids(tmp_path)


# --------------------------------------------------------------------------
# The usage text, and more ranks than cores


def test_usage_lists_flags_and_env_contract():
    text = launch.usage()
    for fragment in (
        "-n,--nproc",
        "--hosts",
        "--port_base",
        "--bind",
        "--ssh",
        "--timeout",
        "--tail_lines",
        "--max_restarts",
        "--grace_seconds",
        "KERAS_DISTRIB_WORLD_SIZE",
        "KERAS_DISTRIB_RESTART",
        "KERAS_DISTRIB_SHM_DIR",
        "TF_CPP_MIN_LOG_LEVEL",
    ):
        assert fragment in text


@pytest.mark.parametrize("nproc,warned", [(3, True), (2, False)])
def test_launcher_warns_when_local_ranks_exceed_cpu_cores(tmp_path, monkeypatch, nproc, warned):
    import importlib
    import io
    import types

    from keras_distrib.launch import LaunchConfig

    cli = importlib.import_module("keras_distrib.launch.cli")
    started = []
    monkeypatch.setattr(
        cli,
        "supervise",
        lambda specs, config, out, err: (
            started.append(len(specs)) or types.SimpleNamespace(exit_code=0)
        ),
    )
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    script = tmp_path / "train.py"
    script.write_text("")
    err = io.StringIO()
    assert cli.launch(LaunchConfig(nproc=nproc, script=str(script)), io.StringIO(), err) == 0
    assert started == [nproc]  # a warning, not an error: the ranks start
    if warned:
        assert err.getvalue() == (
            "keras-distrib: warning: 3 ranks on this machine, which has 2 CPU cores; they "
            "will compete for the cores and train slowly (lower -n, or spread the ranks "
            "with --hosts).\n"
        )
    else:
        assert err.getvalue() == ""


# --------------------------------------------------------------------------
# The launcher never imports TensorFlow or Keras (a fresh process)


def test_importing_the_launcher_imports_no_tensorflow():
    code = textwrap.dedent("""\
        import importlib, json, pkgutil, sys
        import keras_distrib.launch as package
        names = [f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(package.__path__)]
        for name in names:  # __main__ too: it runs nothing unless run as a script
            importlib.import_module(name)
        print(json.dumps({"modules": names,
                          "heavy": [m for m in sys.argv[1:] if m in sys.modules]}))
    """)
    proc = run_python(code, *HEAVY_MODULES)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    for module in ("cli", "plan", "supervise", "backends", "__main__"):
        assert f"keras_distrib.launch.{module}" in result["modules"]
    assert result["heavy"] == [], result


def test_an_elastic_attempt_plans_the_member_slots_only(tmp_path):
    from keras_distrib.launch import elastic

    script = rank_script(tmp_path, "")
    config = LaunchConfig(
        nproc=4, script=script, hosts=("a:2", "b:1", "c:1"), min_workers=2, max_restarts=1
    )
    hosts = elastic.slot_hosts(config)
    assert hosts == ["a", "a", "b", "c"]
    members = elastic._Membership(hosts, [0, 1, 3])
    assert members.spec_config(config).hosts == ("a:2", "c:1")
    assert members.spec_config(config).nproc == 3
    local = LaunchConfig(nproc=3, script=script, min_workers=1, max_restarts=1)
    assert elastic._Membership(elastic.slot_hosts(local), [0, 2]).spec_config(local).nproc == 2


def test_a_private_network_is_for_one_host_jobs(tmp_path):
    from keras_distrib.launch import private_network

    script = rank_script(tmp_path, "")
    private_network.check(LaunchConfig(nproc=2, script=script))
    private_network.check(LaunchConfig(nproc=2, script=script, hosts=("127.0.0.1:2",)))
    with pytest.raises(LaunchError) as excinfo:
        private_network.check(
            LaunchConfig(nproc=2, script=script, hosts=("127.0.0.1:1", "198.51.100.7:1"))
        )
    assert str(excinfo.value) == (
        "--private_network keeps the job on this machine's loopback, but --hosts names "
        "198.51.100.7; drop --private_network or run the job on one host."
    )
