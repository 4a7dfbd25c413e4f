"""Two "pods" of a Kubernetes Indexed Job on two hosts (network namespaces,
tests/netns_hosts.py): each process gets what Kubernetes gives a pod of
configs/k8s/job.yaml (the host name `train-<index>`, `JOB_COMPLETION_INDEX`,
`KERAS_DISTRIB_WORLD_SIZE` from the manifest, an /etc/hosts naming the pods
by their subdomain, as the cluster's DNS would) and no `TF_CONFIG`. They
find each other by those names and train tests/workers/faults.py as one
`multi_worker` job, to the weights of one process."""

import os
import subprocess
import sys

import pytest

import fault_job
from pure_helpers import ROOT, kill_process_group

pytestmark = pytest.mark.slow

SERVICE = "train-workers"  # configs/k8s/job.yaml's headless Service


def test_indexed_job_pods_train_by_their_stable_names(tmp_path, hosts, uninterrupted, traced_job):
    bed = hosts(2)
    for host in range(2):
        bed.hosts_file(
            host,
            [
                f"{address} train-{i}.{SERVICE}.default.svc.cluster.local train-{i}.{SERVICE} "
                f"train-{i}"
                for i, address in enumerate(bed.addresses)
            ],
        )
    procs = []
    try:
        for index in range(2):
            env = dict(
                os.environ,
                JOB_COMPLETION_INDEX=str(index),
                KERAS_DISTRIB_WORLD_SIZE="2",
                TF_CPP_MIN_LOG_LEVEL="2",
                PYTHONUNBUFFERED="1",
            )
            env.pop("TF_CONFIG", None)
            argv = [
                sys.executable,
                fault_job.FAULTS,
                "--out",
                str(tmp_path),
                "--backup",
                str(tmp_path / "backup"),
            ]
            procs.append(
                subprocess.Popen(
                    bed.on(index, argv, name=f"train-{index}"),
                    cwd=ROOT,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                )
            )
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            kill_process_group(p)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    # As one process: within the bounds of the job's math in other orders.
    fault_job.assert_equal_to(fault_job.results(tmp_path, 2), uninterrupted(1), traced_job())
    assert bed.pids() == []
