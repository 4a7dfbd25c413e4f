"""When our engines reduce gradient packs during the backward pass (collectives.overlap)."""

import pytest

from keras_distrib.collectives import overlap


@pytest.mark.parametrize(
    "cores,workers,accelerator,intra,want",
    [
        # TensorFlow's CPU kernels take every core unless told otherwise.
        (2, 1, False, 0, 0),
        (96, 8, False, 0, 0),
        # Two workers of one intra-op thread each on four cores.
        (4, 2, False, 1, 2),
        (2, 2, False, 1, 0),
        # More threads asked for than the host has: all of them.
        (2, 1, False, 8, 0),
        # A GPU per worker: one core each drives its device.
        (96, 8, True, 0, 88),
        (8, 8, True, 0, 0),
    ],
)
def test_spare_cores_are_those_the_workers_compute_on_not(cores, workers, accelerator, intra, want):
    threads = overlap.compute_threads(accelerator, intra, cores)
    assert overlap.spare_cores(cores, workers, threads) == want


def test_packs_during_the_backward_pass_only_where_a_core_is_spare():
    spare = overlap.packing(None, cores=96, workers_on_host=8, accelerator=True)
    assert spare.bytes_per_pack == overlap.OVERLAP_PACK_BYTES
    assert str(spare) == (
        "packs of 1 MiB reduced during the backward pass: 88 core(s) spare "
        "(8 worker(s) x 1 device thread(s) on 96 core(s) of this host)"
    )
    busy = overlap.packing(None, cores=2, workers_on_host=2, intra_op_threads=0)
    assert busy.bytes_per_pack == 0
    assert str(busy) == (
        "one pack after the backward pass: no core spare "
        "(2 worker(s) x 2 intra-op thread(s) on 2 core(s) of this host)"
    )


@pytest.mark.parametrize("asked", [0, 256])
def test_an_explicit_bytes_per_pack_is_taken_as_given(asked):
    # Even where every core is spare.
    got = overlap.packing(asked, cores=96, workers_on_host=1, accelerator=True)
    assert got.bytes_per_pack == asked
    assert f"bytes_per_pack={asked}" in str(got)


def test_intra_op_threads_from_tensorflows_setting_then_its_environment(monkeypatch):
    monkeypatch.delenv("TF_NUM_INTRAOP_THREADS", raising=False)
    assert overlap.intra_op_threads(0) == 0
    monkeypatch.setenv("TF_NUM_INTRAOP_THREADS", "3")
    assert overlap.intra_op_threads(0) == 3
    assert overlap.intra_op_threads(2) == 2  # the setting wins
