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


@pytest.mark.parametrize(
    "threads,variable",
    [
        (overlap.intra_op_threads, "TF_NUM_INTRAOP_THREADS"),
        (overlap.inter_op_threads, "TF_NUM_INTEROP_THREADS"),
    ],
)
def test_threads_from_tensorflows_setting_then_its_environment(monkeypatch, threads, variable):
    monkeypatch.delenv(variable, raising=False)
    assert threads(0) == 0
    monkeypatch.setenv(variable, "3")
    assert threads(0) == 3
    assert threads(2) == 2  # the setting wins


def test_one_inter_op_thread_means_one_pack_even_with_cores_spare():
    # A pack's collective holds the TensorFlow thread that runs it until the
    # reduction ends: with one inter-op thread nothing runs beside it.
    got = overlap.packing(None, cores=8, workers_on_host=1, intra_op_threads=2, inter_op_threads=1)
    assert got.bytes_per_pack == 0
    assert str(got) == (
        "one pack after the backward pass: one inter-op thread, which a pack's "
        "collective holds until it ends"
    )
    # Left unset, TensorFlow takes one inter-op thread per core.
    unset = overlap.packing(None, cores=8, workers_on_host=1, intra_op_threads=2)
    assert unset.bytes_per_pack == overlap.OVERLAP_PACK_BYTES


def test_an_explicit_bytes_per_pack_is_kept_and_told_when_it_cannot_overlap():
    got = overlap.packing(256, cores=1, workers_on_host=1, accelerator=True)
    assert got.bytes_per_pack == 256
    assert str(got) == (
        "packs of 256 bytes (bytes_per_pack=256); with one inter-op thread, which a "
        "pack's collective holds until it ends, each after the backward pass"
    )
