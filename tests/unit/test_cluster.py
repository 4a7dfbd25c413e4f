"""Cluster discovery: TF_CONFIG, Slurm, explicit lists, and the network checks.

Reading a Slurm job step's node list imports TensorFlow (its parser is
TensorFlow's): those tests are in tests/integration/test_cluster_slurm.py.
"""

import json
import os
import socket
import subprocess
import sys

import pytest

from keras_distrib import cluster
from keras_distrib.cluster import ClusterConfigError, ClusterInfo
from pure_helpers import ROOT, SLURM_2x2, assert_one_line_error, tf_config_environ, worker_cluster

pytestmark = pytest.mark.timeout(60)


# --------------------------------------------------------------------------
# ClusterInfo


def test_cluster_info_properties_and_tf_config_round_trip():
    info = ClusterInfo(["10.0.0.1:2222", "10.0.0.2:2222", "[::1]:2223"], 1)
    assert info.workers == ("10.0.0.1:2222", "10.0.0.2:2222", "[::1]:2223")
    assert (info.rank, info.world_size, info.is_chief) == (1, 3, False)
    assert info.address == "10.0.0.2:2222"
    assert info.peers == ("10.0.0.1:2222", "[::1]:2223")
    assert info.worker_hosts == ("10.0.0.1", "10.0.0.2", "::1")
    assert info.to_tf_config() == {
        "cluster": {"worker": list(info.workers)},
        "task": {"type": "worker", "index": 1},
    }
    assert cluster.from_tf_config({"TF_CONFIG": info.tf_config_json()}) == info
    assert ClusterInfo(("h:1",), 0).is_chief


def test_cluster_info_validates_itself():
    with pytest.raises(ClusterConfigError) as excinfo:
        ClusterInfo(("h:1", "h:2"), 2)
    assert_one_line_error(excinfo, "task_index=2", "out of range", "0..1")
    with pytest.raises(ClusterConfigError) as excinfo:
        ClusterInfo("h:1", 0)
    assert_one_line_error(excinfo, "must be a list")


# --------------------------------------------------------------------------
# TF_CONFIG


@pytest.mark.parametrize("environ", [{}, {"TF_CONFIG": ""}, {"TF_CONFIG": "  "}])
def test_tf_config_unset_or_blank_is_none(environ):
    assert cluster.from_tf_config(environ) is None


def test_tf_config_workers():
    info = cluster.from_tf_config(tf_config_environ(worker_cluster("a:1", "b:2", index=1)))
    assert info == ClusterInfo(("a:1", "b:2"), 1)


def test_tf_config_kubeflow_chief_is_rank_zero_and_evaluator_is_ignored():
    config = worker_cluster("w0:2222", "w1:2222", index=1, chief=["c:2222"], evaluator=["e:2222"])
    config["environment"] = "cloud"
    info = cluster.from_tf_config(tf_config_environ(config))
    assert info.workers == ("c:2222", "w0:2222", "w1:2222")
    assert info.rank == 2
    config["task"] = {"type": "chief", "index": 0}
    assert cluster.from_tf_config(tf_config_environ(config)).rank == 0
    config["task"] = {"type": "master", "index": 0}  # older TFJob name
    config["cluster"]["master"] = config["cluster"].pop("chief")
    assert cluster.from_tf_config(tf_config_environ(config)).rank == 0


MALFORMED = {
    "bad_json": (
        '{"cluster": {"worker": ["a:1"]}, "task": ',
        ["not valid JSON", "line 1 column", "char "],
    ),
    "not_object": ("[1, 2]", ["must be a JSON object", "got list"]),
    "no_cluster": ({"task": {"type": "worker", "index": 0}}, ["no 'cluster'"]),
    "no_task": ({"cluster": {"worker": ["a:1"]}}, ["no 'task'"]),
    "unknown_task_type": (
        worker_cluster("a:1", task_type="boss"),
        ["task.type='boss' is unknown", "'worker' or 'chief'"],
    ),
    "unknown_cluster_type": (
        worker_cluster("a:1", trainer=["t:1"]),
        ["unknown task type 'trainer'", "'chief', 'worker', 'ps' or 'evaluator'"],
    ),
    "missing_type": (
        {"cluster": {"worker": ["a:1"]}, "task": {"index": 0}},
        ["task.type is missing"],
    ),
    "index_out_of_range": (
        worker_cluster("a:1", "b:1", index=2),
        ["task.index=2 is out of range", "2 'worker' tasks", "0..1"],
    ),
    "missing_index": (
        {"cluster": {"worker": ["a:1"]}, "task": {"type": "worker"}},
        ["task.index is missing"],
    ),
    "negative_index": (worker_cluster("a:1", index=-1), ["task.index=-1 is negative"]),
    "string_index": (worker_cluster("a:1", index="0"), ["must be an integer"]),
    "duplicate": (
        worker_cluster("a:1", "b:2", "a:1"),
        ["cluster.worker[0] and TF_CONFIG cluster.worker[2]", "'a:1'", "its own host:port"],
    ),
    "no_port": (worker_cluster("a:1", "b"), ["cluster.worker[1]='b' has no port", "'b:2222'"]),
    "port_not_int": (worker_cluster("a:x1"), ["port 'x1' is not an integer"]),
    "port_zero": (worker_cluster("a:0"), ["port 0 is out of range", "1..65535"]),
    "port_too_big": (worker_cluster("a:65536"), ["port 65536 is out of range"]),
    "empty_host": (worker_cluster(":2222"), ["empty host"]),
    "unbracketed_ipv6": (worker_cluster("fe80::1:2222"), ["IPv6", "'[::1]:2222'"]),
    "bracketed_not_ipv6": (worker_cluster("[host]:2222"), ["not an IPv6 address"]),
    "url_scheme": (worker_cluster("grpc://a:1"), ["URL scheme", "plain 'host:port'"]),
    "not_a_string": (worker_cluster(2222), ["must be a 'host:port' string"]),
    "ps_task_without_ps": (
        worker_cluster("a:1", task_type="ps"),
        ["task.type is 'ps' but cluster lists no 'ps' tasks", "add cluster.ps"],
    ),
    "evaluator_task_without_evaluator": (
        worker_cluster("a:1", task_type="evaluator"),
        ["lists no 'evaluator' tasks"],
    ),
    "ps_index_out_of_range": (
        worker_cluster("a:1", task_type="ps", index=1, ps=["p:1"]),
        ["task.index=1 is out of range", "1 'ps' tasks", "0..0"],
    ),
    "only_ps_and_evaluator": (
        {"cluster": {"ps": ["p:1"], "evaluator": ["e:1"]}, "task": {"type": "ps", "index": 0}},
        ["no 'worker' or 'chief' tasks", "only 'ps' and 'evaluator'"],
    ),
    "chief_and_master": (worker_cluster("a:1", chief=["c:1"], master=["m:1"]), ["2 chief tasks"]),
    "duplicate_across_roles": (
        worker_cluster("a:1", "b:2", ps=["p:1", "B:2"]),
        ["TF_CONFIG cluster.worker[1] and TF_CONFIG cluster.ps[1]", "'B:2'", "its own host:port"],
    ),
    "ps_not_a_list": (worker_cluster("a:1", ps="p:1"), ["cluster.ps must be a list"]),
    "chief_without_chief": (worker_cluster("a:1", task_type="chief"), ["lists no 'chief' task"]),
    "two_chiefs": (worker_cluster("a:1", chief=["c:1", "d:1"]), ["2 chief tasks"]),
    "empty_cluster": (
        {"cluster": {}, "task": {"type": "worker", "index": 0}},
        ["no 'worker' or 'chief' tasks"],
    ),
    "worker_without_workers": (worker_cluster(chief=["c:1"]), ["lists no 'worker' tasks"]),
    "sparse_dict": (
        {"cluster": {"worker": {"1": "a:1"}}, "task": {"type": "worker", "index": 1}},
        ["cluster.worker must be a list"],
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_tf_config_gives_one_line_error(case):
    config, fragments = MALFORMED[case]
    with pytest.raises(ClusterConfigError) as excinfo:
        cluster.from_tf_config(tf_config_environ(config))
    assert_one_line_error(excinfo, *fragments)


def test_bad_json_error_quotes_position():
    text = '{"cluster": {"worker": ["a:1"]},, "task": {}}'
    with pytest.raises(ClusterConfigError) as excinfo:
        cluster.from_tf_config(tf_config_environ(text))
    error = json.JSONDecodeError
    try:
        json.loads(text)
    except error as e:
        expected = f"line {e.lineno} column {e.colno} (char {e.pos})"
    assert_one_line_error(excinfo, expected)


# --------------------------------------------------------------------------
# Roles: chief, worker, ps, evaluator

# A Kubeflow TFJob with a chief, two workers, a parameter server and an
# evaluator, as the operator writes TF_CONFIG into each pod.
KUBEFLOW = {
    "cluster": {
        "chief": ["job-chief-0:2222"],
        "worker": ["job-worker-0:2222", "job-worker-1:2222"],
        "ps": ["job-ps-0:2222"],
        "evaluator": ["job-evaluator-0:2222"],
    },
    "environment": "cloud",
}
TRAINING = ("job-chief-0:2222", "job-worker-0:2222", "job-worker-1:2222")


def _kubeflow(task_type, index):
    return {**KUBEFLOW, "task": {"type": task_type, "index": index}}


@pytest.mark.parametrize(
    "task_type, index, rank, address",
    [
        ("chief", 0, 0, "job-chief-0:2222"),
        ("worker", 0, 1, "job-worker-0:2222"),
        ("worker", 1, 2, "job-worker-1:2222"),
        ("ps", 0, None, "job-ps-0:2222"),
        ("evaluator", 0, None, "job-evaluator-0:2222"),
    ],
)
def test_kubeflow_tf_config_seen_from_each_task(task_type, index, rank, address):
    info = cluster.from_tf_config(tf_config_environ(_kubeflow(task_type, index)))
    assert info.workers == TRAINING
    assert info.ps == ("job-ps-0:2222",)
    assert info.evaluators == ("job-evaluator-0:2222",)
    assert info.has_chief and info.has_ps and info.num_ps == 1
    assert (info.task_type, info.role, info.task_index) == (task_type, task_type, index)
    assert info.address == address
    assert info.world_size == 3
    assert info.is_training_task == (rank is not None)
    assert info.is_chief == (rank == 0)
    assert info.cluster_spec() == KUBEFLOW["cluster"]
    assert info.tasks == (
        ("chief", 0, "job-chief-0:2222"),
        ("worker", 0, "job-worker-0:2222"),
        ("worker", 1, "job-worker-1:2222"),
        ("ps", 0, "job-ps-0:2222"),
        ("evaluator", 0, "job-evaluator-0:2222"),
    )
    # The peers are the training tasks, never the process itself.
    assert info.peers == tuple(a for a in TRAINING if a != address)
    if rank is None:
        with pytest.raises(ClusterConfigError) as excinfo:
            info.rank  # noqa: B018 - the property raises
        assert_one_line_error(
            excinfo,
            f"{task_type!r} task {index} at {address}",
            "not a training task",
            "has no rank",
            "require_training_workers",
        )
    else:
        assert info.rank == rank


@pytest.mark.parametrize(
    "task_type, index", [("chief", 0), ("worker", 0), ("worker", 1), ("ps", 0), ("evaluator", 0)]
)
def test_to_tf_config_round_trips_kubeflow(task_type, index):
    config = _kubeflow(task_type, index)
    info = cluster.from_tf_config(tf_config_environ(config))
    expected = {"cluster": KUBEFLOW["cluster"], "task": config["task"]}
    assert info.to_tf_config() == expected
    assert json.loads(info.tf_config_json()) == expected
    assert cluster.from_tf_config({"TF_CONFIG": info.tf_config_json()}) == info


def test_master_reads_as_chief_and_is_written_as_chief():
    config = {
        "cluster": {"master": ["m:1"], "worker": ["w:1"]},
        "task": {"type": "master", "index": 0},
    }
    info = cluster.from_tf_config(tf_config_environ(config))
    assert (info.task_type, info.has_chief, info.rank) == ("chief", True, 0)
    assert info.to_tf_config() == {
        "cluster": {"chief": ["m:1"], "worker": ["w:1"]},
        "task": {"type": "chief", "index": 0},
    }
    assert cluster.from_tf_config({"TF_CONFIG": info.tf_config_json()}) == info


def test_worker_only_tf_config_is_unchanged_by_roles():
    info = cluster.from_tf_config(tf_config_environ(worker_cluster("a:1", "b:2", index=1)))
    assert info == ClusterInfo(("a:1", "b:2"), 1)
    assert (info.task_type, info.has_chief, info.ps, info.evaluators) == ("worker", False, (), ())
    assert not info.has_ps and info.num_ps == 0 and info.is_training_task
    assert info.cluster_spec() == {"worker": ["a:1", "b:2"]}
    # An empty 'ps' list is no parameter server.
    assert not cluster.from_tf_config(tf_config_environ(worker_cluster("a:1", ps=[]))).has_ps


def test_cluster_info_with_roles():
    info = ClusterInfo(
        ["c:1", "w:1"], 0, ps=["p:1", "p:2"], evaluators=["e:1"], has_chief=True, task_type="ps"
    )
    assert (info.ps, info.evaluators) == (("p:1", "p:2"), ("e:1",))  # stored as tuples
    assert hash(info) == hash(
        ClusterInfo(
            ("c:1", "w:1"),
            0,
            ps=("p:1", "p:2"),
            evaluators=("e:1",),
            has_chief=True,
            task_type="ps",
        )
    )
    assert (info.address, info.num_ps, info.is_chief, info.is_training_task) == (
        "p:1",
        2,
        False,
        False,
    )
    assert info.peers == ("c:1", "w:1")
    worker = ClusterInfo(["c:1", "w:1"], 0, has_chief=True)
    assert (worker.rank, worker.address, worker.is_chief) == (1, "w:1", False)
    assert worker.to_tf_config() == {
        "cluster": {"chief": ["c:1"], "worker": ["w:1"]},
        "task": {"type": "worker", "index": 0},
    }
    chief_only = ClusterInfo(["c:1"], 0, has_chief=True, task_type="chief")
    assert chief_only.is_chief and chief_only.cluster_spec() == {"chief": ["c:1"]}
    # New fields are keyword-only: the old positional form means what it did.
    with pytest.raises(TypeError):
        ClusterInfo(("a:1",), 0, ("p:1",))  # pylint: disable=too-many-function-args


@pytest.mark.parametrize(
    "kwargs, fragments",
    [
        (
            {"workers": ["a:1", "b:1"], "task_index": 0, "ps": ["b:1"]},
            ["workers[1] and ps[0] are both 'b:1'", "its own host:port"],
        ),
        (
            {"workers": ["a:1"], "task_index": 0, "ps": ["p:1"], "evaluators": ["P:1"]},
            ["ps[0] and evaluators[0] are both 'P:1'"],
        ),
        (
            {"workers": ["a:1"], "task_index": 0, "task_type": "boss"},
            ["task_type='boss' is unknown", "'chief', 'worker', 'ps' or 'evaluator'"],
        ),
        (
            {"workers": ["a:1"], "task_index": 0, "task_type": "master"},
            ["task_type='master' is unknown"],
        ),
        (
            {"workers": ["a:1"], "task_index": 0, "task_type": "chief"},
            ["task_type='chief' but has_chief=False", "set has_chief=True"],
        ),
        (
            {"workers": ["a:1"], "task_index": 0, "task_type": "ps"},
            ["task_type='ps' but the cluster has no 'ps' tasks", "add them to ps"],
        ),
        (
            {"workers": ["c:1"], "task_index": 0, "has_chief": True},
            ["task_type='worker' but the cluster has no 'worker' tasks"],
        ),
        (
            {"workers": ["c:1", "w:1"], "task_index": 1, "has_chief": True},
            ["task_index=1 is out of range", "'worker' tasks (after the chief)", "0..0"],
        ),
        (
            {"workers": ["c:1"], "task_index": 1, "has_chief": True, "task_type": "chief"},
            ["task_index=1 is out of range for 1 'chief' tasks"],
        ),
        (
            {"workers": ["a:1"], "task_index": 2, "ps": ["p:1", "p:2"], "task_type": "ps"},
            ["task_index=2 is out of range for 2 'ps' tasks", "0..1"],
        ),
        (
            {"workers": [], "task_index": 0, "ps": ["p:1"], "task_type": "ps"},
            ["'ps'/'evaluator' tasks but no training task"],
        ),
        (
            {"workers": ["a:1"], "task_index": 0, "ps": "p:1"},
            ["ps='p:1' must be a list", "['p:1']"],
        ),
        (
            {"workers": ["a:1"], "task_index": 0, "evaluators": ["e"]},
            ["evaluators[0]='e' has no port"],
        ),
        (
            {"workers": ["a:1"], "task_index": 0, "has_chief": 1},
            ["has_chief=1 must be True or False"],
        ),
    ],
)
def test_cluster_info_validates_roles(kwargs, fragments):
    with pytest.raises(ClusterConfigError) as excinfo:
        ClusterInfo(**kwargs)
    assert_one_line_error(excinfo, *fragments)


# The configs that from_tf_config refused before it knew roles: they parse
# now, and the refusal moved to require_training_workers, same words.
REFUSED_BY_WORKER_STRATEGIES = {
    "ps_in_cluster": (
        worker_cluster("a:1", ps=["p:1"]),
        [
            "'ps' tasks",
            "parameter_server strategy",
            "drop the 'ps' tasks or use strategy='parameter_server'",
        ],
    ),
    "ps_task": (
        worker_cluster("a:1", task_type="ps", ps=["p:1"]),
        ["'ps'", "parameter_server strategy"],
    ),
    "evaluator_task": (
        worker_cluster("a:1", task_type="evaluator", evaluator=["e:1"]),
        ["'evaluator'", "not a training worker", "make this task a 'worker'"],
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED_BY_WORKER_STRATEGIES))
def test_ps_and_evaluator_parse_but_worker_strategies_refuse_them(case):
    config, fragments = REFUSED_BY_WORKER_STRATEGIES[case]
    info = cluster.from_tf_config(tf_config_environ(config))
    assert info.workers == ("a:1",)
    assert info.task_type == config["task"]["type"]
    with pytest.raises(ClusterConfigError) as excinfo:
        cluster.require_training_workers(info, "multi_worker")
    assert_one_line_error(excinfo, "strategy 'multi_worker'", *fragments)


def test_require_training_workers_passes_training_tasks():
    info = ClusterInfo(("a:1", "b:1"), 1)
    assert cluster.require_training_workers(info, "multi_worker") is info
    assert cluster.require_training_workers(None, "multi_worker") is None
    # Evaluators elsewhere in the cluster are not part of training: fine.
    for task_type, index in (("chief", 0), ("worker", 1)):
        config = _kubeflow(task_type, index)
        config["cluster"] = {k: v for k, v in config["cluster"].items() if k != "ps"}
        info = cluster.from_tf_config(tf_config_environ(config))
        assert cluster.require_training_workers(info, "multi_worker") is info
    # Every task of a cluster with parameter servers is refused.
    for task_type, index in (("chief", 0), ("worker", 1), ("ps", 0), ("evaluator", 0)):
        info = cluster.from_tf_config(tf_config_environ(_kubeflow(task_type, index)))
        with pytest.raises(ClusterConfigError, match="parameter_server"):
            cluster.require_training_workers(info, "multi_worker")


# --------------------------------------------------------------------------
# Explicit and resolve()


def test_from_explicit_list_and_dict():
    assert cluster.from_explicit(["a:1", "b:1"], 1) == ClusterInfo(("a:1", "b:1"), 1)
    assert cluster.from_explicit({"worker": ["a:1"]}, 0) == ClusterInfo(("a:1",), 0)


@pytest.mark.parametrize(
    "workers, index, fragments",
    [
        (["a:1"], 1, ["task_index=1 is out of range"]),
        (["a:1"], None, ["task_index is missing"]),
        (["a:1"], True, ["must be an integer"]),
        ([], 0, ["no workers"]),
        ("a:1", 0, ["must be a list"]),
        ({"workers": ["a:1"]}, 0, ["keys ['workers']"]),
        (["a:1", "a:2", "b"], 0, ["cluster[2]='b' has no port"]),
    ],
)
def test_from_explicit_errors(workers, index, fragments):
    with pytest.raises(ClusterConfigError) as excinfo:
        cluster.from_explicit(workers, index)
    assert_one_line_error(excinfo, *fragments)


def test_from_explicit_dict_with_roles():
    roles = {"chief": ["c:1"], "worker": ["w0:1", "w1:1"], "ps": ["p:1"], "evaluator": ["e:1"]}
    info = cluster.from_explicit(roles, 1)  # task_type defaults to worker
    assert (info.task_type, info.rank, info.address) == ("worker", 2, "w1:1")
    assert info.cluster_spec() == roles
    ps = cluster.from_explicit(roles, 0, task_type="ps")
    assert (ps.task_type, ps.address) == ("ps", "p:1")
    assert cluster.from_explicit(roles, 0, "chief").is_chief
    assert cluster.from_explicit(roles, 0, task_type="evaluator").address == "e:1"
    assert ps == cluster.from_tf_config(
        tf_config_environ({"cluster": roles, "task": {"type": "ps", "index": 0}})
    )
    assert cluster.from_explicit({"worker": ["a:1"], "ps": []}, 0) == ClusterInfo(("a:1",), 0)
    assert cluster.resolve(roles, 0, environ={}, task_type="ps") == ps


@pytest.mark.parametrize(
    "workers, index, task_type, fragments",
    [
        (
            {"worker": ["a:1"], "trainer": ["t:1"]},
            0,
            None,
            ["keys ['trainer']", "'chief', 'worker', 'ps' and/or 'evaluator'"],
        ),
        (
            {"chief": ["c:1", "d:1"], "worker": ["a:1"]},
            0,
            None,
            ["cluster['chief'] lists 2 addresses", "at most one chief"],
        ),
        ({"ps": ["p:1"]}, 0, "ps", ["'ps' tasks but no 'worker' or 'chief'"]),
        ({}, 0, None, ["no 'worker' key"]),
        (
            {"worker": ["a:1"], "ps": ["a:1"]},
            0,
            None,
            ["cluster['worker'][0] and cluster['ps'][0] are both 'a:1'"],
        ),
        ({"worker": ["a:1"], "ps": "p:1"}, 0, None, ["cluster['ps']='p:1' must be a list"]),
        (
            {"worker": ["a:1"]},
            0,
            "ps",
            ["task_type='ps' but cluster has no 'ps' tasks", "add cluster['ps']"],
        ),
        (
            {"worker": ["a:1"], "ps": ["p:1"]},
            1,
            "ps",
            ["task_index=1 is out of range", "1 'ps' tasks"],
        ),
        ({"worker": ["a:1"]}, 0, "chief", ["task_type='chief' but cluster has no 'chief'"]),
        (["a:1"], 0, "ps", ["task_type='ps' needs a dict cluster", "only workers"]),
        (
            ["a:1"],
            0,
            "boss",
            ["task_type='boss' is unknown", "'chief', 'worker', 'ps' or 'evaluator'"],
        ),
    ],
)
def test_from_explicit_role_errors(workers, index, task_type, fragments):
    with pytest.raises(ClusterConfigError) as excinfo:
        cluster.from_explicit(workers, index, task_type=task_type)
    assert_one_line_error(excinfo, *fragments)


@pytest.mark.parametrize(
    "args, fragment",
    [
        ((["a:1"], None), "without task_index"),
        ((None, 1), "without cluster"),
    ],
)
def test_resolve_needs_cluster_and_index_together(args, fragment):
    with pytest.raises(ClusterConfigError) as excinfo:
        cluster.resolve(*args, environ={})
    assert_one_line_error(excinfo, fragment)


def test_resolve_task_type_needs_cluster():
    with pytest.raises(ClusterConfigError) as excinfo:
        cluster.resolve(environ={}, task_type="ps")
    assert_one_line_error(excinfo, "task_type='ps' was given without cluster")


def test_resolve_reads_roles_from_tf_config():
    info = cluster.resolve(environ={**SLURM_2x2, **tf_config_environ(_kubeflow("ps", 0))})
    assert (info.task_type, info.address, info.workers) == ("ps", "job-ps-0:2222", TRAINING)


# --------------------------------------------------------------------------
# Slurm, where no node list is read (tests/integration/test_cluster_slurm.py
# reads them)


def test_slurm_not_in_a_step_is_none():
    # salloc / sbatch shells have job variables but no step.
    assert cluster.from_slurm({"SLURM_JOB_ID": "1", "SLURM_NODELIST": "n1"}) is None
    assert cluster.from_slurm({"SLURM_PROCID": "0"}) is None


@pytest.mark.parametrize(
    "num_ps, fragments",
    [
        (
            "3",
            [
                "KERAS_DISTRIB_NUM_PS=3 leaves no chief and worker",
                "4 Slurm tasks",
                "at least 5 tasks",
            ],
        ),
        ("x", ["KERAS_DISTRIB_NUM_PS='x' is not a non-negative integer"]),
        ("-1", ["KERAS_DISTRIB_NUM_PS='-1'"]),
    ],
)
def test_slurm_bad_num_ps(num_ps, fragments):
    with pytest.raises(ClusterConfigError) as excinfo:
        cluster.from_slurm({**SLURM_2x2, "KERAS_DISTRIB_NUM_PS": num_ps})
    assert_one_line_error(excinfo, *fragments)


@pytest.mark.parametrize(
    "task_type, index", [("chief", 0), ("worker", 0), ("worker", 1), ("ps", 0)]
)
def test_resolve_reads_a_launcher_parameter_server_tf_config(task_type, index):
    # As `keras-distrib launch --workers 2 --ps 1` writes it.
    config = {
        "cluster": {
            "chief": ["127.0.0.1:1"],
            "worker": ["127.0.0.1:2", "127.0.0.1:3"],
            "ps": ["127.0.0.1:4"],
        },
        "task": {"type": task_type, "index": index},
    }
    info = cluster.resolve(environ=tf_config_environ(config))
    assert (info.task_type, info.task_index, info.num_ps) == (task_type, index, 1)
    assert info.to_tf_config() == config


def test_module_imports_without_tensorflow():
    # Loaded by path so keras_distrib's own __init__ (which may start the
    # multi-worker runtime) is skipped; every submodule comes in through the
    # package's __init__.
    package = os.path.join(ROOT, "keras_distrib", "cluster")
    code = (
        "import importlib.util, json, os, sys\n"
        "spec = importlib.util.spec_from_file_location('c', "
        f"{os.path.join(package, '__init__.py')!r}, "
        f"submodule_search_locations=[{package!r}])\n"
        "module = sys.modules['c'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "assert module.from_slurm({}) is None\n"
        "config = {'cluster': {'chief': ['c:1'], 'worker': ['w:1'], 'ps': ['p:1']},\n"
        "          'task': {'type': 'ps', 'index': 0}}\n"
        "assert module.from_tf_config({'TF_CONFIG': json.dumps(config)}).address == 'p:1'\n"
        f"names = sorted(f[:-3] for f in os.listdir({package!r}) if f.endswith('.py'))\n"
        "missing = [n for n in names if n != '__init__' and 'c.' + n not in sys.modules]\n"
        "assert not missing, missing\n"
        "assert 'tensorflow' not in sys.modules, 'tensorflow imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


def test_old_module_names_still_exported():
    # `from keras_distrib import cluster; cluster.X` keeps working for every
    # name the single-module version exported.
    old = [
        "ClusterConfigError",
        "ClusterInfo",
        "DEFAULT_SLURM_PORT_BASE",
        "check_own_port_free",
        "free_ports",
        "from_explicit",
        "from_slurm",
        "from_tf_config",
        "is_local_host",
        "parse_address",
        "resolve",
        "wait_for_peers",
    ]
    new = ["require_training_workers", "TASK_TYPES", "TRAINING_TASK_TYPES"]
    for name in old + new:
        assert name in cluster.__all__ and hasattr(cluster, name), name
    assert not os.path.exists(os.path.join(ROOT, "keras_distrib", "cluster.py"))


# --------------------------------------------------------------------------
# Network checks: real sockets


@pytest.fixture
def listener():
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    yield sock
    sock.close()


class _Clock:
    """Virtual time: `sleep` advances `now` at once (after calling
    `on_sleep(now)`, if set). Durations are asserted on it, not on the wall
    clock: a loaded machine cannot make them fail, nor slow the test."""

    def __init__(self):
        self.now = 0.0
        self.on_sleep = None

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        if self.on_sleep is not None:
            self.on_sleep(self.now)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    """The clock keras_distrib.cluster.network waits by (its `time` module)."""
    from keras_distrib.cluster import network

    fake = _Clock()
    monkeypatch.setattr(network, "time", fake)
    return fake


def test_parse_address():
    assert cluster.parse_address("10.0.0.1:2222") == ("10.0.0.1", 2222)
    assert cluster.parse_address("[::1]:2222") == ("::1", 2222)
    assert cluster.parse_address("node-01.example.org:80") == ("node-01.example.org", 80)


def test_is_local_host():
    assert cluster.is_local_host("127.0.0.1")
    assert cluster.is_local_host("127.0.0.2")
    assert cluster.is_local_host("localhost")
    assert cluster.is_local_host(socket.gethostname())
    assert not cluster.is_local_host("node01.invalid")
    assert not cluster.is_local_host("192.0.2.1")  # TEST-NET-1, never assigned


def test_port_in_use_is_detected(listener):
    port = listener.getsockname()[1]
    info = ClusterInfo((f"127.0.0.1:{port}", "127.0.0.1:1"), 0)
    with pytest.raises(ClusterConfigError) as excinfo:
        cluster.check_own_port_free(info)
    assert_one_line_error(
        excinfo, f"worker 0 at 127.0.0.1:{port}", "already in use", "another port"
    )
    # localhost names the same machine.
    with pytest.raises(ClusterConfigError):
        cluster.check_own_port_free(ClusterInfo((f"localhost:{port}",), 0))


def test_free_port_passes_and_remote_host_is_skipped(listener):
    port = listener.getsockname()[1]
    (free,) = cluster.free_ports(1)
    cluster.check_own_port_free(ClusterInfo((f"127.0.0.1:{free}",), 0))
    # Only the own address is probed, and remote hosts are not probed at all.
    cluster.check_own_port_free(ClusterInfo((f"127.0.0.1:{free}", f"127.0.0.1:{port}"), 0))
    cluster.check_own_port_free(ClusterInfo((f"node01.invalid:{port}",), 0))


def test_free_ports_are_distinct_and_bindable():
    ports = cluster.free_ports(4)
    assert len(set(ports)) == 4
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_free_ports_are_below_the_ephemeral_range():
    # Where no outgoing connection (a client dialling the task before it
    # listens, say) can take them meanwhile.
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral = int(f.read().split()[0])
    if ephemeral <= 10001:
        pytest.skip(f"this kernel's ephemeral range starts at {ephemeral}")
    assert all(port < ephemeral for port in cluster.free_ports(8))


def test_wait_for_peers_succeeds_against_listening_peer(listener, clock):
    (own,) = cluster.free_ports(1)
    peer = listener.getsockname()[1]
    info = ClusterInfo((f"127.0.0.1:{own}", f"127.0.0.1:{peer}"), 0)
    cluster.wait_for_peers(info, timeout=10)
    assert clock.now < 2


def test_wait_for_peers_times_out_naming_first_missing_peer(listener, clock):
    own, closed = cluster.free_ports(2)
    up = listener.getsockname()[1]
    info = ClusterInfo((f"127.0.0.1:{own}", f"127.0.0.1:{up}", f"127.0.0.1:{closed}"), 0)
    with pytest.raises(ClusterConfigError) as excinfo:
        cluster.wait_for_peers(info, timeout=0.5, poll=0.05)
    assert clock.now < 5
    assert_one_line_error(
        excinfo, f"worker 2 at 127.0.0.1:{closed}", "did not answer within 0.5s", "is it started?"
    )


def test_port_check_and_peer_wait_name_tasks_by_role(listener):
    up = listener.getsockname()[1]
    own, closed = cluster.free_ports(2)
    # This process is the ps; the chief answers, worker 0 does not, and the
    # evaluator (which runs no server) is not waited for.
    info = ClusterInfo(
        (f"127.0.0.1:{up}", f"127.0.0.1:{closed}"),
        0,
        ps=(f"127.0.0.1:{own}",),
        evaluators=("192.0.2.1:1",),
        has_chief=True,
        task_type="ps",
    )
    cluster.check_own_port_free(info)
    with pytest.raises(ClusterConfigError) as excinfo:
        cluster.wait_for_peers(info, timeout=0.3, poll=0.05)
    assert_one_line_error(excinfo, f"worker 0 at 127.0.0.1:{closed}", "did not answer")
    # A ps whose port is taken is named as the ps task it is.
    busy = ClusterInfo((f"127.0.0.1:{own}",), 0, ps=(f"127.0.0.1:{up}",), task_type="ps")
    with pytest.raises(ClusterConfigError) as excinfo:
        cluster.check_own_port_free(busy)
    assert_one_line_error(
        excinfo, f"ps 0 at 127.0.0.1:{up}", "already in use", "give this ps task another port"
    )
    # A worker waits for the ps tasks too, after every training task.
    worker = ClusterInfo((f"127.0.0.1:{own}", f"127.0.0.1:{up}"), 0, ps=(f"127.0.0.1:{closed}",))
    with pytest.raises(ClusterConfigError) as excinfo:
        cluster.wait_for_peers(worker, timeout=0.3, poll=0.05)
    assert_one_line_error(excinfo, f"ps 0 at 127.0.0.1:{closed}")


# --------------------------------------------------------------------------
# Listening only where the cluster says this task is; unresolvable peers


def _listening_ips(port):
    """Local addresses with a socket listening on TCP `port` (/proc/net/tcp[6])."""
    found = set()
    for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            with open(path) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            hex_ip, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(hex_ip)  # 32-bit words in host byte order
                words = [raw[i : i + 4] for i in range(0, len(raw), 4)]
                if sys.byteorder == "little":
                    words = [w[::-1] for w in words]
                found.add(socket.inet_ntop(family, b"".join(words)))
    return found


def _ipv6_loopback() -> bool:
    return socket.has_ipv6 and cluster.is_local_host("::1")


def _non_loopback_ipv4():
    """A non-loopback IPv4 address of this machine, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("198.51.100.7", 9))  # TEST-NET-2: no packet is sent
        except OSError:
            return None
        ip = s.getsockname()[0]
    return None if ip.startswith("127.") else ip


@pytest.fixture
def fake_dns(monkeypatch):
    """Maps made-up host names to addresses (others resolve for real)."""
    table = {}
    real = socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        if host not in table:
            return real(host, port, *args, **kwargs)
        if table[host] is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [
            (
                socket.AF_INET6 if ":" in ip else socket.AF_INET,
                socket.SOCK_STREAM,
                6,
                "",
                (ip, port or 0),
            )
            for ip in table[host]
        ]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return table


def test_runtime_probe_listens_on_the_own_address_only():
    from keras_distrib.collectives import runtime

    (port,) = cluster.free_ports(1)
    with runtime._listening_on(f"127.0.0.1:{port}"):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        assert _listening_ips(port) <= {"127.0.0.1"}
        # The port is still free on every other address.
        with socket.socket() as other:
            other.bind(("127.0.0.2", port))
        if _ipv6_loopback():
            with socket.socket(socket.AF_INET6) as other:
                other.bind(("::1", port))
        if _non_loopback_ipv4():
            with pytest.raises(OSError):
                socket.create_connection((_non_loopback_ipv4(), port), timeout=2).close()
    # `localhost` is 127.0.0.1 only.
    with runtime._listening_on(f"localhost:{port}"):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        with socket.socket() as other:
            other.bind(("127.0.0.2", port))


def test_runtime_probe_on_ipv6_loopback():
    if not _ipv6_loopback():
        pytest.skip("no IPv6 loopback")
    from keras_distrib.collectives import runtime

    (port,) = cluster.free_ports(1, "::1")
    with runtime._listening_on(f"[::1]:{port}"):
        socket.create_connection(("::1", port), timeout=2).close()
        assert _listening_ips(port) <= {"::1"}
        with socket.socket() as other:
            other.bind(("127.0.0.1", port))


def test_listen_address(fake_dns):
    from keras_distrib.cluster.network import listen_address

    assert listen_address("localhost") == listen_address("LOCALHOST") == "127.0.0.1"
    assert listen_address("127.0.0.1") == "127.0.0.1"
    assert listen_address("127.0.0.2") == "127.0.0.2"
    if _ipv6_loopback():
        assert listen_address("[::1]") == listen_address("::1") == "::1"
    # Every interface where narrowing could hide the task from its peers
    # (TensorFlow's server listens on all of them anyway): wildcards, an
    # address of another machine (NAT, a service IP), a name that does not
    # resolve, or that maps only to loopback here (Debian's 127.0.1.1 line).
    assert listen_address("0.0.0.0") == listen_address("[::]") == ""
    assert listen_address("198.51.100.7") == ""
    fake_dns.update({"svc.test": ["198.51.100.7"], "me.test": ["127.0.1.1"], "gone.test": None})
    assert listen_address("svc.test") == ""
    assert listen_address("me.test") == ""
    assert listen_address("gone.test") == ""
    assert listen_address("nonexistent-host.invalid") == ""
    own = _non_loopback_ipv4()
    if own:
        fake_dns["node-a.test"] = ["198.51.100.7", "127.0.1.1", own]
        assert listen_address("node-a.test") == own
        from keras_distrib.collectives import runtime

        (port,) = cluster.free_ports(1, "node-a.test")
        with runtime._listening_on(f"node-a.test:{port}"):
            socket.create_connection((own, port), timeout=2).close()
            assert _listening_ips(port) <= {own}
            with socket.socket() as other:
                other.bind(("127.0.0.1", port))


def test_port_helpers_probe_where_the_port_is_used(fake_dns, listener):
    # free_ports resolves a name as the probe does: a service name that maps
    # to another machine gets ports free on every interface (the old code
    # failed: it bound the name's remote address).
    fake_dns.update({"svc.test": ["198.51.100.7"], "me.test": ["127.0.1.1"]})
    for host in ("svc.test", "me.test", "localhost", "0.0.0.0"):
        ports = cluster.free_ports(2, host)
        assert len(set(ports)) == 2, host
        for port in ports:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", port))
    own = _non_loopback_ipv4()
    if own:
        fake_dns["node-a.test"] = [own]
        (port,) = cluster.free_ports(1, "node-a.test")
        with socket.socket() as sock:
            sock.bind((own, port))
    # check_own_port_free stays wide on purpose: TensorFlow's server binds
    # [::]:port whatever the address names, so a port taken on another
    # local address must still be reported.
    port = listener.getsockname()[1]
    with pytest.raises(ClusterConfigError) as excinfo:
        cluster.check_own_port_free(ClusterInfo((f"127.0.0.2:{port}",), 0))
    assert_one_line_error(excinfo, f"worker 0 at 127.0.0.2:{port}", "already in use")


def test_wait_for_peers_unresolvable_host_fails_after_grace(monkeypatch, fake_dns, listener, clock):
    from keras_distrib.cluster import network

    monkeypatch.setattr(network, "UNRESOLVED_GRACE", 0.5, raising=False)
    (own,) = cluster.free_ports(1)
    up = listener.getsockname()[1]
    info = ClusterInfo((f"127.0.0.1:{own}", "nonexistent-host.invalid:1234", f"127.0.0.1:{up}"), 0)
    start = clock.now
    with pytest.raises(ClusterConfigError) as excinfo:
        cluster.wait_for_peers(info, timeout=20, poll=0.05)
    elapsed = clock.now - start
    assert 0.5 <= elapsed < 0.5 + 3, elapsed
    assert_one_line_error(
        excinfo,
        "worker 1 at nonexistent-host.invalid:1234",
        "'nonexistent-host.invalid' does not resolve",
        "check the cluster's host names",
        "TF_CONFIG",
        "--hosts",
    )
    # A timeout shorter than the grace still names the cause.
    with pytest.raises(ClusterConfigError) as excinfo:
        cluster.wait_for_peers(info, timeout=0.2, poll=0.05)
    assert_one_line_error(excinfo, "worker 1 at nonexistent-host.invalid:1234", "does not resolve")
    # A peer that resolves but does not answer still gets the whole timeout.
    (closed,) = cluster.free_ports(1)
    closed_info = ClusterInfo((f"127.0.0.1:{own}", f"localhost:{closed}"), 0)
    monkeypatch.setattr(network, "UNRESOLVED_GRACE", 0.1, raising=False)
    start = clock.now
    with pytest.raises(ClusterConfigError) as excinfo:
        cluster.wait_for_peers(closed_info, timeout=1.0, poll=0.05)
    assert clock.now - start >= 1.0
    assert_one_line_error(excinfo, f"worker 1 at localhost:{closed}", "did not answer within 1s")
    # A name that appears within the grace (Kubernetes, Slurm) is waited for.
    monkeypatch.setattr(network, "UNRESOLVED_GRACE", 5.0, raising=False)
    fake_dns["late.test"] = None
    start = clock.now

    def appear_after_0_3s(now):
        if now - start > 0.3:
            fake_dns["late.test"] = ["127.0.0.1"]

    clock.on_sleep = appear_after_0_3s
    cluster.wait_for_peers(
        ClusterInfo((f"127.0.0.1:{own}", f"late.test:{up}"), 0), timeout=10, poll=0.05
    )
    assert 0.3 <= clock.now - start < 3
