"""Gradient packs reduced during the backward pass where a core is spare
(keras_distrib.collectives.overlap), on two hosts over our TCP ring.

Each worker computes on one intra-op thread and is the only worker on its
host, so a core of the host is spare: with the default `bytes_per_pack`
the step reduces the last layer's 1 MiB of gradients while the backward
pass still makes the first layer's, and the result is what one device
computes (packing changes no sum between two workers).
"""

import json
import os
import sys

import numpy as np
import pytest

import as_reference
from helpers import WORKERS, launch

sys.path.insert(0, WORKERS)
import overlap_model  # noqa: E402

WORKER = os.path.join(WORKERS, "overlap_packs.py")


@pytest.mark.slow
def test_packs_overlap_the_backward_pass_on_hosts_with_a_spare_core(tmp_path, hosts):
    bed = hosts(2)
    across = ("--hosts", bed.hosts_flag(), "--ssh", "--ssh_command", bed.ssh_command)
    launch(
        tmp_path,
        2,
        WORKER,
        "--out",
        str(tmp_path),
        "--intra_op_threads",
        "1",
        launch_flags=across,
        timeout=240,
    )
    ranks, weights = [], []
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.json") as f:
            ranks.append(json.load(f))
        arrays = np.load(tmp_path / f"rank{rank}.npz")
        weights.append([arrays[f"arr_{i}"] for i in range(len(arrays.files))])
    for r in ranks:
        assert r["bytes_per_pack"] == 1 << 20, r
        assert r["packing"].startswith("packs of 1 MiB reduced during the backward pass: "), r
        assert "x 1 intra-op thread(s)" in r["packing"], r
        assert r["describe"].endswith(r["packing"]), r
        # Two packs, the last layer's first: it waits for fewer of the
        # step's matrix products than the other, so it overlaps them.
        counts = r["matmuls_before_each_all_reduce"]
        assert len(counts) == 2 and counts[0] < counts[1], counts
    half = len(weights[0]) // 2
    initial, finals = weights[0][:half], weights[0][half:]
    for got, want in zip(weights[1], weights[0]):
        np.testing.assert_array_equal(got, want)
    import keras

    model = overlap_model.build()
    model.set_weights(initial)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = overlap_model.data()
    reference = as_reference.fit(model, x, y, overlap_model.BATCH, 1)
    as_reference.assert_weights(reference, finals)
