"""`keras-distrib launch --workers N --ps M` without processes: planning and flags.

Plain Python: the chief, worker and ps tasks the launcher plans, with their
TF_CONFIG and commands; refused settings; a multi-host dry run; the usage
text. Jobs that run are in tests/distributed/test_launch_parameter_server.py.
"""

import json
import sys

import pytest
from pure_helpers import write_script

from keras_distrib import launch
from keras_distrib.launch import LaunchConfig, LaunchError

SERVER_MODULE = ["-m", "keras_distrib.strategies.parameter_server.task_server"]

pytestmark = pytest.mark.timeout(60)


def test_plan_lays_out_chief_workers_and_ps_with_their_commands(tmp_path):
    script = write_script(tmp_path, "")
    config = LaunchConfig(nproc=2, ps=1, script=script, script_args=("--lr", "1"))
    plans = launch.plan(config)
    assert [p.label for p in plans] == ["chief", "worker 0", "worker 1", "ps 0"]
    assert [(p.info.task_type, p.info.task_index) for p in plans] == [
        ("chief", 0),
        ("worker", 0),
        ("worker", 1),
        ("ps", 0),
    ]
    configs = [json.loads(p.env()["TF_CONFIG"]) for p in plans]
    cluster = configs[0]["cluster"]
    assert set(cluster) == {"chief", "worker", "ps"}
    assert (len(cluster["chief"]), len(cluster["worker"]), len(cluster["ps"])) == (1, 2, 1)
    addresses = cluster["chief"] + cluster["worker"] + cluster["ps"]
    assert len(set(addresses)) == 4 and all(a.startswith("127.0.0.1:") for a in addresses)
    for p, tf_config, address in zip(plans, configs, addresses):
        assert tf_config == {
            "cluster": cluster,
            "task": {"type": p.info.task_type, "index": p.info.task_index},
        }
        assert p.info.address == address
    envs = [p.env() for p in plans]
    assert [e.get("KERAS_DISTRIB_RANK") for e in envs] == ["0", "1", "2", None]
    assert [e.get("KERAS_DISTRIB_WORLD_SIZE") for e in envs] == ["3", "3", "3", None]
    assert launch.task_argv(plans[0], config) == [sys.executable, script, "--lr", "1"]
    for p in plans[1:]:
        assert launch.task_argv(p, config) == [sys.executable, *SERVER_MODULE]
    kubeflow = LaunchConfig(nproc=2, ps=1, script=script, ps_tasks_run_script=True)
    for p in launch.plan(kubeflow):
        assert launch.task_argv(p, kubeflow) == [sys.executable, script]
    # Without --ps nothing changes: ranks, all running the script.
    sync = launch.plan(LaunchConfig(nproc=2, script=script))
    assert [p.label for p in sync] == ["rank 0", "rank 1"]
    assert json.loads(sync[1].env()["TF_CONFIG"])["task"] == {"type": "worker", "index": 1}


def test_check_config_refuses_bad_parameter_server_settings(tmp_path):
    script = write_script(tmp_path, "")
    for config, fragment in [
        (LaunchConfig(nproc=0, ps=1, script=script), "--workers must be >= 1 with --ps"),
        (LaunchConfig(nproc=1, ps=-1, script=script), "--ps=-1 must be >= 0"),
        (
            LaunchConfig(nproc=2, script=script, ps_tasks_run_script=True),
            "--ps_tasks_run_script needs --ps",
        ),
        (
            LaunchConfig(nproc=1, ps=1, script=script, backend="horovod"),
            "--ps=1 works with --backend=tf only",
        ),
        (LaunchConfig(nproc=2, ps=1, script=script, port_base=65533), "no room for 4 ports"),
    ]:
        with pytest.raises(LaunchError, match=fragment):
            launch.check_config(config)
    with pytest.raises(LaunchError, match="the job has 4 tasks .* raise --workers"):
        launch.plan(
            LaunchConfig(
                nproc=2, ps=1, script=script, hosts=tuple(f"h{i}.invalid" for i in range(5))
            )
        )


def test_multi_host_dry_run_names_each_task_by_role(tmp_path, capfd):
    script = write_script(tmp_path, "open('ran', 'w').close()")
    out_dir = tmp_path / "out"
    config = LaunchConfig(
        nproc=2, ps=1, script=script, hosts=("a.invalid:2", "b.invalid:2"), output_dir=str(out_dir)
    )
    assert launch.launch(config) == 0
    out, _ = capfd.readouterr()
    assert out.startswith("keras-distrib: 4 tasks, not started: a.invalid, b.invalid are remote")
    expected = {
        "chief": ["a.invalid:23456"],
        "worker": ["a.invalid:23457", "b.invalid:23456"],
        "ps": ["b.invalid:23457"],
    }
    for label, host, name, task in [
        ("chief", "a.invalid", "chief-0", {"type": "chief", "index": 0}),
        ("worker 0", "a.invalid", "worker-0", {"type": "worker", "index": 0}),
        ("worker 1", "b.invalid", "worker-1", {"type": "worker", "index": 1}),
        ("ps 0", "b.invalid", "ps-0", {"type": "ps", "index": 0}),
    ]:
        lines = out.splitlines()
        at = next(i for i, line in enumerate(lines) if line.startswith(f"{label} on {host}: "))
        tf_config = json.loads(lines[at].split("TF_CONFIG=", 1)[1])
        assert tf_config == {"cluster": expected, "task": task}
        assert json.loads((out_dir / f"{name}.tf_config.json").read_text()) == tf_config
        command = lines[at + 1].strip()
        runs_script = label == "chief"
        assert command.endswith(
            script if runs_script else "-m keras_distrib.strategies.parameter_server.task_server"
        ), command
    host_b = (out_dir / "host-b.invalid.sh").read_text()
    assert "tasks worker 1, ps 0 of 4" in host_b and host_b.count("task_server") == 2
    assert not (tmp_path / "ran").exists()


def test_usage_documents_parameter_servers():
    text = launch.usage()
    for fragment in (
        "--workers",
        "--ps",
        "--ps_tasks_run_script",
        "keras_distrib.strategies.parameter_server.task_server",
        "[chief]",
        "[worker I]",
        "[ps I]",
        "(100 when 0)",
        "0: up to 100",
    ):
        assert fragment in text, fragment
