"""strategy='parameter_server' in one process: configuration errors, how
failures are reported, and the task server's refusal and configuration.

The jobs that run (real clusters started by the launcher) are in
tests/distributed/test_parameter_server.py and
tests/distributed/test_launch_parameter_server.py.
"""

import json

import pytest

import keras_distrib as kd
from keras_distrib import cluster
from keras_distrib.strategies.parameter_server import task_server


def test_no_cluster_is_a_one_line_error(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(
        ValueError,
        match=r"needs a cluster with 'chief', 'worker' and 'ps' "
        r"tasks .* keras-distrib launch --workers 2 --ps 1",
    ) as e:
        kd.strategies.get("parameter_server")
    assert "\n" not in str(e.value)


def test_a_cluster_without_ps_is_a_one_line_error(monkeypatch):
    monkeypatch.setenv(
        "TF_CONFIG",
        json.dumps(
            {
                "cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
                "task": {"type": "worker", "index": 0},
            }
        ),
    )
    with pytest.raises(ValueError, match="needs 'ps' tasks in the cluster, and it has none"):
        kd.strategies.get("ps")


def test_a_cluster_without_chief_is_a_one_line_error(monkeypatch):
    monkeypatch.setenv(
        "TF_CONFIG",
        json.dumps(
            {
                "cluster": {"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]},
                "task": {"type": "worker", "index": 0},
            }
        ),
    )
    with pytest.raises(ValueError, match="needs a 'chief' task"):
        kd.strategies.get("parameter_server")


def test_auto_picks_parameter_server_when_the_cluster_has_ps(monkeypatch):
    from keras_distrib.strategies import registry

    monkeypatch.setenv(
        "TF_CONFIG",
        json.dumps(
            {
                "cluster": {
                    "chief": ["127.0.0.1:1"],
                    "worker": ["127.0.0.1:2"],
                    "ps": ["127.0.0.1:3"],
                },
                "task": {"type": "chief", "index": 0},
            }
        ),
    )
    assert registry._auto_name() == "parameter_server"
    monkeypatch.setenv(
        "TF_CONFIG",
        json.dumps(
            {
                "cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
                "task": {"type": "worker", "index": 0},
            }
        ),
    )
    assert registry._auto_name() == "multi_worker"


def test_a_remote_failure_is_summed_up_in_one_line():
    from keras_distrib.cluster import ClusterInfo
    from keras_distrib.strategies.parameter_server.strategy import failure_summary

    info = ClusterInfo(
        ("c:2222", "w0:2222", "w1:2222"), 0, ps=("p:2222",), has_chief=True, task_type="chief"
    )
    # What TensorFlow raised in a CI run (a chief's fetch from worker 1).
    text = (
        "2 root error(s) found.\n"
        "  (0) INTERNAL: {{function_node __wrapped__Identity_device_/job:chief/replica:0/"
        "task:0/device:CPU:0}} Unable to parse request\n"
        "Additional GRPC error information from remote target /job:worker/replica:0/task:1/"
        "device:CPU:0 while calling /tensorflow.eager.EagerService/RunComponentFunction:\n"
        ':UNKNOWN:Error received from peer  {grpc_status:13, grpc_message:"Unable to parse '
        'request"}\n'
        "  (1) CANCELLED: {{function_node __wrapped__Identity_device_/job:chief/replica:0/"
        "task:0/device:CPU:0}} RecvFromRemoteAsync is cancelled.\n"
        "0 successful operations.\n0 derived errors ignored. [Op:Identity] name: "
    )
    assert failure_summary(text, info) == (
        "INTERNAL: Unable to parse request (reported by worker 1, w1:2222)"
    )
    assert failure_summary("Socket closed", info) == "Socket closed"
    assert failure_summary("", info) == "unknown error"


def test_only_errors_of_a_lost_task_are_called_a_lost_ps():
    """An error of the program that names a ps variable (XLA's "Trying to
    access resource ... located in device /job:ps/...") was reported as
    "parameter server ps 0 failed; its variables are lost"."""
    import tensorflow as tf

    from keras_distrib.strategies.parameter_server.strategy import _looks_like_a_lost_task

    where = "/job:ps/replica:0/task:0/device:CPU:0"
    assert not _looks_like_a_lost_task(
        tf.errors.InvalidArgumentError(
            None,
            None,
            f"Trying to access resource dense/kernel/0 located in device {where} "
            "from device /job:chief/replica:0/task:0/device:CPU:0",
        )
    )
    assert not _looks_like_a_lost_task(ValueError(where))
    assert _looks_like_a_lost_task(
        tf.errors.UnavailableError(None, None, f"failed to connect to all addresses; {where}")
    )
    assert _looks_like_a_lost_task(
        tf.errors.InvalidArgumentError(
            None, None, f"Unable to find the relevant tensor remote_handle: {where}"
        )
    )


# -- the task server (`python -m keras_distrib.strategies.parameter_server.task_server`) ---


def test_serve_refuses_a_chief_and_server_config_has_enough_inter_op_threads():
    info = cluster.ClusterInfo(
        ("127.0.0.1:1", "127.0.0.1:2"), 0, ps=("127.0.0.1:3",), has_chief=True, task_type="chief"
    )
    with pytest.raises(ValueError) as excinfo:
        task_server.serve(info)
    assert "\n" not in str(excinfo.value) and "'chief' task" in str(excinfo.value)
    assert task_server.server_config().inter_op_parallelism_threads >= 4
