"""keras_distrib.topology: where replicas, processes and data shards are (pure Python)."""

import pytest

from keras_distrib import topology


@pytest.mark.parametrize(
    "fields,fragment",
    [
        (dict(num_replicas=0), "num_replicas=0"),
        (dict(process_index=2, num_processes=2), "process_index=2"),
        (dict(data_shard_index=1), "data_shard_index=1"),
        (dict(first_local_replica=1), "outside the 1 replicas"),
        (dict(role="master"), "role='master'"),
    ],
)
def test_topology_is_validated(fields, fragment):
    base = dict(num_replicas=1, num_local_replicas=1, first_local_replica=0, devices=("cpu",))
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        topology.Topology(**{**base, **fields})
