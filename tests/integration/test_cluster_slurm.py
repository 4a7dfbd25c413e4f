"""Cluster discovery under Slurm: a job step's node list and tasks per node.

keras_distrib.cluster reads them with TensorFlow's Slurm parser, which
imports TensorFlow: these tests are not in the unit tier with the rest of
the cluster's (tests/unit/test_cluster.py).
"""

import os
import subprocess
import sys

import pytest

from keras_distrib import cluster
from keras_distrib.cluster import ClusterConfigError, ClusterInfo
from pure_helpers import SLURM_2x2, assert_one_line_error, tf_config_environ, worker_cluster

pytestmark = pytest.mark.timeout(60)


def test_resolve_order_explicit_then_tf_config_then_slurm():
    tf_env = {**SLURM_2x2, **tf_config_environ(worker_cluster("t:1", "t:2", index=1))}
    assert cluster.resolve(["x:1"], 0, environ=tf_env) == ClusterInfo(("x:1",), 0)
    assert cluster.resolve(environ=tf_env) == ClusterInfo(("t:1", "t:2"), 1)
    assert cluster.resolve(environ=SLURM_2x2).workers[0] == "node01:8888"
    assert cluster.resolve(environ={"HOME": "/root"}) is None


def test_slurm_two_nodes_two_tasks_each():
    info = cluster.from_slurm(SLURM_2x2)
    assert info.workers == ("node01:8888", "node01:8889", "node02:8888", "node02:8889")
    assert info.rank == 3
    info = cluster.from_slurm(
        {**SLURM_2x2, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURMD_NODENAME": "node01"},
        port_base=20000,
    )
    assert info.address == "node01:20000" and info.is_chief
    # Slurm has no roles: every task is a worker.
    assert (info.task_type, info.has_chief, info.ps, info.evaluators) == ("worker", False, (), ())


def test_slurm_works_in_a_script_that_has_not_imported_keras():
    # Importing Keras imports keras_distrib.model, which needs the module
    # from_slurm uses complete: it used to be half-imported here.
    code = (
        "import keras_distrib\n"
        "from keras_distrib.cluster import from_slurm\n"
        f"print(from_slurm({SLURM_2x2!r}).address)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "node02:8889"


def test_slurm_uneven_tasks_per_node():
    env = {
        "SLURM_PROCID": "2",
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_STEP_NODELIST": "gpu-a,gpu-b",
        "SLURM_STEP_TASKS_PER_NODE": "3,1",
        "SLURM_LOCALID": "2",
        "SLURMD_NODENAME": "gpu-a",
    }
    info = cluster.from_slurm(env)
    assert info.workers == ("gpu-a:8888", "gpu-a:8889", "gpu-a:8890", "gpu-b:8888")
    assert info.address == "gpu-a:8890"


def test_slurm_does_not_touch_process_environment():
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    cluster.from_slurm(SLURM_2x2)
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == before


@pytest.mark.parametrize(
    "changes, fragments",
    [
        ({"SLURM_STEP_NUM_TASKS": "5"}, ["adds up to 4", "SLURM_STEP_NUM_TASKS=5"]),
        ({"SLURM_STEP_NODELIST": None}, ["SLURM_STEP_NODELIST is not set", "srun"]),
        ({"SLURM_STEP_TASKS_PER_NODE": "2,2,2"}, ["2 node(s)", "3 count(s)"]),
        ({"SLURM_STEP_TASKS_PER_NODE": "two"}, ["Invalid tasks-per-node"]),
        ({"SLURM_PROCID": "x"}, ["SLURM_PROCID='x'"]),
        ({"SLURM_PROCID": "4"}, ["SLURM_PROCID=4 is out of range"]),
        # --distribution=cyclic: task 3 landed on node01, not where block puts it.
        ({"SLURMD_NODENAME": "node01"}, ["--distribution=block"]),
        ({"SLURM_LOCALID": "0"}, ["--distribution=block"]),
    ],
)
def test_slurm_errors(changes, fragments):
    env = {**SLURM_2x2, **changes}
    env = {k: v for k, v in env.items() if v is not None}
    with pytest.raises(ClusterConfigError) as excinfo:
        cluster.from_slurm(env)
    assert_one_line_error(excinfo, *fragments)


SLURM_PLACES = {0: ("node01", "0"), 1: ("node01", "1"), 2: ("node02", "0"), 3: ("node02", "1")}


@pytest.mark.parametrize(
    "num_ps, roles",
    [
        ("1", [("chief", 0), ("worker", 0), ("worker", 1), ("ps", 0)]),
        ("2", [("chief", 0), ("worker", 0), ("ps", 0), ("ps", 1)]),
    ],
)
def test_slurm_num_ps_makes_task_0_the_chief_and_the_last_tasks_ps(num_ps, roles):
    all_tasks = ("node01:8888", "node01:8889", "node02:8888", "node02:8889")
    m = int(num_ps)
    for procid, (task_type, index) in enumerate(roles):
        node, local_id = SLURM_PLACES[procid]
        env = {
            **SLURM_2x2,
            "SLURM_PROCID": str(procid),
            "SLURMD_NODENAME": node,
            "SLURM_LOCALID": local_id,
            "KERAS_DISTRIB_NUM_PS": num_ps,
        }
        info = cluster.from_slurm(env)
        assert (info.task_type, info.task_index) == (task_type, index)
        assert info.workers == all_tasks[:-m] and info.ps == all_tasks[-m:]
        assert info.has_chief and info.address == all_tasks[procid]
        assert info.cluster_spec() == {
            "chief": [all_tasks[0]],
            "worker": list(all_tasks[1:-m]),
            "ps": list(all_tasks[-m:]),
        }
        assert cluster.resolve(environ=env) == info


@pytest.mark.parametrize("num_ps", ["", " ", "0"])
def test_slurm_without_num_ps_is_all_workers(num_ps):
    info = cluster.from_slurm({**SLURM_2x2, "KERAS_DISTRIB_NUM_PS": num_ps})
    assert info == cluster.from_slurm(SLURM_2x2)
    assert (info.task_type, info.rank, info.ps) == ("worker", 3, ())


def test_slurm_port_base_checked():
    with pytest.raises(ClusterConfigError) as excinfo:
        cluster.from_slurm(SLURM_2x2, port_base=65535)
    assert_one_line_error(excinfo, "needs port 65536")
    with pytest.raises(ClusterConfigError) as excinfo:
        cluster.from_slurm(SLURM_2x2, port_base=0)
    assert_one_line_error(excinfo, "port_base=0")
