"""One GPU per process (keras_distrib/cluster/gpu_share.py): the
`CUDA_VISIBLE_DEVICES` each process of a host gets, from what its launcher
(ours, srun, mpirun) says of its place. No GPU here: the environment is
what is checked (a real `import keras_distrib` too, at the end)."""

import os
import subprocess
import sys

import pytest

from keras_distrib.cluster import ClusterConfigError, gpu_share
from keras_distrib.launch import LaunchConfig
from keras_distrib.launch.plan import plan


@pytest.mark.parametrize(
    "place, visible, expected",
    [
        ((0, 2, 1), None, "0"),
        ((1, 2, 1), None, "1"),
        ((1, 2, 2), None, "2,3"),
        ((3, 4, 2), None, "6,7"),
        # A share of the GPUs the job may use on the host.
        ((1, 2, 1), "4,5", "5"),
        ((1, 2, 2), "0, 2, 4, 6", "4,6"),
        # Already this process's own (a scheduler bound it): kept.
        ((1, 2, 1), "3", None),
        ((1, 4, 1), "0,1", None),
        # One process on the host keeps all; 0 opts out.
        ((0, 1, 1), None, None),
        ((1, 2, 0), None, None),
    ],
)
def test_each_process_of_a_host_gets_its_own_gpus(place, visible, expected):
    local_rank, local_size, per_worker = place
    assert gpu_share.share(local_rank, local_size, per_worker, visible) == expected


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({"KERAS_DISTRIB_LOCAL_RANK": "1", "KERAS_DISTRIB_LOCAL_WORLD_SIZE": "2"}, (1, 2)),
        ({"OMPI_COMM_WORLD_LOCAL_RANK": "3", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, (3, 4)),
        # srun: 2 tasks on each of 2 nodes, then 1; this is node 2.
        (
            {"SLURM_LOCALID": "0", "SLURM_STEP_TASKS_PER_NODE": "2(x2),1", "SLURM_NODEID": "2"},
            (0, 1),
        ),
        ({"SLURM_LOCALID": "1", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_NODEID": "1"}, (1, 2)),
        # horovodrun's ranks pick their GPU themselves.
        ({"HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2"}, None),
        ({}, None),
    ],
)
def test_the_place_on_the_host_comes_from_the_launcher(environ, expected):
    assert gpu_share.local_place(environ) == expected


def test_assign_sets_the_variable_and_respects_an_opt_out():
    environ = {"SLURM_LOCALID": "1", "SLURM_STEP_TASKS_PER_NODE": "4", "SLURM_NODEID": "0"}
    assert gpu_share.assign(environ) == "1" and environ["CUDA_VISIBLE_DEVICES"] == "1"
    opted_out = {
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "KERAS_DISTRIB_GPUS_PER_WORKER": "0",
    }
    assert gpu_share.assign(opted_out) is None and "CUDA_VISIBLE_DEVICES" not in opted_out
    with pytest.raises(
        ClusterConfigError,
        match=r"^KERAS_DISTRIB_GPUS_PER_WORKER='two' must "
        r"be a whole number >= 0",
    ):
        gpu_share.assign({**opted_out, "KERAS_DISTRIB_GPUS_PER_WORKER": "two"})


def test_the_launcher_gives_each_rank_of_a_host_its_gpus(tmp_path, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text("")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    config = LaunchConfig(
        nproc=4, script=str(script), hosts=("198.51.100.7:2", "198.51.100.8:2"), gpus_per_worker=2
    )
    envs = [p.env() for p in plan(config)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0,1", "2,3", "0,1", "2,3"]
    assert {e["KERAS_DISTRIB_LOCAL_WORLD_SIZE"] for e in envs} == {"2"}
    # This machine's own list is shared out among its ranks; 0 opts out.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    local = LaunchConfig(nproc=2, script=str(script))
    assert [p.env()["CUDA_VISIBLE_DEVICES"] for p in plan(local)] == ["4", "5"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    none = plan(LaunchConfig(nproc=2, script=str(script), gpus_per_worker=0))
    assert ["CUDA_VISIBLE_DEVICES" in p.env() for p in none] == [False, False]


def test_import_keras_distrib_picks_the_gpus_of_an_mpirun_rank():
    """What `mpirun -np 2` gives its second process on a host, before
    TensorFlow starts."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update(
        OMPI_COMM_WORLD_LOCAL_RANK="1",
        OMPI_COMM_WORLD_LOCAL_SIZE="2",
        KERAS_DISTRIB_GPUS_PER_WORKER="2",
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, keras_distrib; print(os.environ.get('CUDA_VISIBLE_DEVICES'))",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.stdout.strip() == "2,3", proc.stderr
