"""Kubernetes without TFJob: the cluster of an Indexed Job's pod
(keras_distrib/cluster/kubernetes.py), and configs/k8s/ validated against
Kubernetes' own schemas (kubernetes-validate). Real pods' names, resolved
through a namespace bed, train in tests/distributed/test_kubernetes_pods.py."""

import os

import pytest
import yaml

from keras_distrib.cluster import ClusterConfigError, from_indexed_job, resolve

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
POD = {"JOB_COMPLETION_INDEX": "1", "KERAS_DISTRIB_WORLD_SIZE": "3"}


def _names(host, fqdn):
    return dict(hostname=lambda: host, fqdn=lambda: fqdn)


def test_a_pod_finds_its_rank_and_peers_by_their_stable_names():
    info = from_indexed_job(POD, **_names("train-1", "train-1.train-workers.ml.svc.cluster.local"))
    assert info.workers == (
        "train-0.train-workers:8888",
        "train-1.train-workers:8888",
        "train-2.train-workers:8888",
    )
    assert (info.rank, info.world_size, info.is_chief) == (1, 3, False)
    # A JobSet's pods: <jobset>-<replicated job>-<job index>-<index>, another port.
    info = from_indexed_job(
        {**POD, "KERAS_DISTRIB_PORT": "2222"},
        **_names("train-workers-0-1", "train-workers-0-1.train.ml.svc"),
    )
    assert info.workers[0] == "train-workers-0-0.train:2222"


def test_outside_an_indexed_job_asking_for_a_cluster_there_is_none():
    assert from_indexed_job({}) is None
    assert from_indexed_job({"JOB_COMPLETION_INDEX": "0"}) is None  # a sweep of single runs
    assert resolve(environ={"JOB_COMPLETION_INDEX": "0"}) is None


@pytest.mark.parametrize(
    "environ, names, message",
    [
        (
            {**POD, "KERAS_DISTRIB_WORLD_SIZE": "two"},
            ("train-1", "train-1.s.ns.svc"),
            "KERAS_DISTRIB_WORLD_SIZE='two' must be a whole number (set it in the pod template to "
            "the Job's completions).",
        ),
        (
            {**POD, "JOB_COMPLETION_INDEX": "3"},
            ("train-3", "train-3.s.ns.svc"),
            "JOB_COMPLETION_INDEX",
        ),
        (
            POD,
            ("worker", "worker.s.ns.svc"),
            "the pod's host name 'worker' does not end in '-1' (JOB_COMPLETION_INDEX=1)",
        ),
        (POD, ("train-1", "train-1"), "the pod 'train-1' has no subdomain"),
        (
            {**POD, "KERAS_DISTRIB_PORT": "70000"},
            ("train-1", "train-1.s.ns.svc"),
            "KERAS_DISTRIB_PORT=70000 must be a port in 1..65535.",
        ),
    ],
)
def test_a_pod_that_cannot_be_placed_is_one_line_with_the_fix(environ, names, message):
    with pytest.raises(ClusterConfigError) as error:
        from_indexed_job(environ, **_names(*names))
    assert message in str(error.value) and "\n" not in str(error.value)


def _validate(resource):
    import kubernetes_validate

    kubernetes_validate.validate(resource, "1.30.0", strict=True)


def _documents(name):
    with open(os.path.join(REPO, "configs", "k8s", name)) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def test_the_manifests_validate_against_kubernetes_schemas():
    job_file = _documents("job.yaml")
    assert [d["kind"] for d in job_file] == ["Service", "Job"]
    for resource in job_file:
        _validate(resource)
    service, job = job_file
    pod = job["spec"]["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"]
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
    assert env["KERAS_DISTRIB_WORLD_SIZE"] == str(job["spec"]["completions"])
    # The JobSet's schema is its own project's (a CRD); the Job it runs is
    # validated as Kubernetes' Job.
    (jobset,) = _documents("jobset.yaml")
    for replicated in jobset["spec"]["replicatedJobs"]:
        _validate(
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": {"name": "x"},
                **replicated["template"],
            }
        )


def test_the_validator_rejects_a_broken_manifest():
    import kubernetes_validate

    _, job = _documents("job.yaml")
    job["spec"]["completionMode"] = {"indexed": True}  # not a string
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(job)
