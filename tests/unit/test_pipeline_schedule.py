"""The pipeline's schedules, pure Python (keras_distrib.strategies.pipeline.schedule).

GPipe and 1F1B orders of forward and backward passes, the activations each
keeps alive, the bubble, and how layers are partitioned into stages. The
pipelined models themselves are in tests/integration/test_pipeline.py.
"""

import pytest

from keras_distrib.strategies.pipeline import schedule as pipeline_schedule


def test_peak_live_activations_gpipe_vs_1f1b():
    gpipe = pipeline_schedule.stage_orders("gpipe", num_micro_batches=8, num_stages=2)
    one_f_one_b = pipeline_schedule.stage_orders("1f1b", num_micro_batches=8, num_stages=2)
    assert pipeline_schedule.peak_live_activations(gpipe) == [8, 8]
    assert pipeline_schedule.peak_live_activations(one_f_one_b) == [2, 1]
    deeper = pipeline_schedule.stage_orders("1f1b", num_micro_batches=8, num_stages=4)
    assert pipeline_schedule.peak_live_activations(deeper) == [4, 3, 2, 1]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("m,p", [(1, 1), (1, 3), (4, 2), (8, 2), (3, 5)])
def test_every_pass_once_in_an_order_that_respects_the_data(schedule, m, p):
    orders = pipeline_schedule.stage_orders(schedule, m, p)
    for order in orders:
        assert sorted(order) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
        assert all(order.index(("F", i)) < order.index(("B", i)) for i in range(m))
    emitted = pipeline_schedule.emission_order(orders)
    assert len(emitted) == 2 * m * p
    # With unit-time passes the ideal pipeline takes 2 (m + p - 1) steps.
    assert emitted[-1][0] + 1 == 2 * (m + p - 1)
    assert pipeline_schedule.bubble_fraction(m, p) == (p - 1) / (m + p - 1)


def test_partition_balances_parameters():
    assert pipeline_schedule.partition([10, 0, 10, 10], 2) == [0, 0, 0, 1]
    assert pipeline_schedule.partition([100, 1, 1, 100], 2) == [0, 0, 1, 1]
    assert pipeline_schedule.partition([5] * 6, 3) == [0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="Cannot cut 2 layers into 3 stages"):
        pipeline_schedule.partition([1, 1], 3)
