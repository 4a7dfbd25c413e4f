"""`mpirun -np 2 python train.py` (Open MPI, Debian's packages installed by
`make setup`): the processes find each other through mpi4py and train
tests/workers/faults.py as one `multi_worker` job to the weights of one
process, on this host and across two hosts of the namespace bed (mpirun on
host 0 starts host 1's daemon through the bed's ssh stand-in, as it would
through ssh). The rank-side derivation is tested in tests/unit/test_openmpi.py."""

import os
import shutil
import subprocess
import sys

import pytest

import fault_job
from pure_helpers import ROOT, kill_process_group

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("mpirun") is None,
        reason="Open MPI's mpirun is not installed (make setup installs it as root)",
    ),
]

# mpirun refuses to run as root unless told twice; the suite runs as root.
ROOT_OK = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def _mpirun(argv, env, timeout=240):
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output = proc.communicate(timeout=timeout)[0]
    finally:
        kill_process_group(proc)
    return proc.returncode, output


def _job(out):
    return [sys.executable, fault_job.FAULTS, "--out", str(out), "--backup", str(out / "backup")]


def _environment(**extra):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1", **ROOT_OK, **extra)
    env.pop("TF_CONFIG", None)
    return env


def test_mpirun_on_one_host_trains_as_one_process(tmp_path, uninterrupted, traced_job):
    code, output = _mpirun(["mpirun", "-np", "2", *_job(tmp_path)], _environment())
    assert code == 0, output[-3000:]
    assert "127.0.0.1" in output  # one host: the workers listen on loopback
    fault_job.assert_equal_to(fault_job.results(tmp_path, 2), uninterrupted(1), traced_job())


def test_mpirun_across_two_hosts_trains_as_one_process(tmp_path, hosts, uninterrupted, traced_job):
    bed = hosts(2)
    path = bed.ssh_program(str(tmp_path)) + os.pathsep + os.environ["PATH"]
    argv = bed.on(0, ["mpirun", "--host", ",".join(bed.addresses), "-np", "2", *_job(tmp_path)])
    code, output = _mpirun(argv, _environment(PATH=path))
    assert code == 0, output[-3000:]
    workers = [f"'{address}:" for address in bed.addresses]
    assert all(worker in output for worker in workers), output[-3000:]
    fault_job.assert_equal_to(fault_job.results(tmp_path, 2), uninterrupted(1), traced_job())
    assert bed.pids() == []


def test_mpirun_gives_each_process_of_a_host_its_own_gpu():
    # One write per line: mpirun forwards the ranks' output as it comes, and
    # an unbuffered print writes its pieces one by one.
    report = (
        "import os, keras_distrib; os.write(1, ('rank %s sees %s\\n' % ("
        "os.environ['OMPI_COMM_WORLD_RANK'], os.environ.get('CUDA_VISIBLE_DEVICES'))"
        ").encode())"
    )
    code, output = _mpirun(
        ["mpirun", "-np", "2", sys.executable, "-c", report], _environment(), timeout=120
    )
    assert code == 0, output[-3000:]
    lines = sorted(line for line in output.splitlines() if line.startswith("rank "))
    assert lines == ["rank 0 sees 0", "rank 1 sees 1"]
