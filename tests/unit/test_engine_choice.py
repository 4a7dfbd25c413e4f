"""`multi_worker(implementation="auto")`'s choice across hosts, from measured
times (keras_distrib/collectives/engine_choice.py; no TensorFlow). The
probe itself runs on the namespace bed: tests/distributed/
test_multi_worker.py ("2x2hosts-auto")."""

import pytest

from keras_distrib.collectives import engine_choice
from keras_distrib.collectives.engine_choice import GLOO, HIERARCHICAL, TCP, TENSORFLOW

TWO_BY_TWO = ["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2"]
ONE_PER_HOST = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]


def test_the_candidates_depend_on_how_many_workers_share_a_host():
    assert engine_choice.candidates(TWO_BY_TWO) == [HIERARCHICAL, TCP, TENSORFLOW]
    assert engine_choice.candidates(ONE_PER_HOST) == [TCP, TENSORFLOW]
    assert engine_choice.candidates(["a", "b", "b"]) == [HIERARCHICAL, TCP, TENSORFLOW]


def test_gloo_is_a_candidate_where_horovod_loads_and_tensorflow_stays_last():
    assert engine_choice.candidates(TWO_BY_TWO, gloo=True) == [HIERARCHICAL, TCP, GLOO, TENSORFLOW]
    assert engine_choice.candidates(ONE_PER_HOST, gloo=True) == [TCP, GLOO, TENSORFLOW]


def test_the_slowest_worker_counts_for_each_timing():
    per_worker = [[0.010, 0.002, 0.5], [0.030, 0.001, 0.1]]
    assert engine_choice.slowest(per_worker) == [0.030, 0.002, 0.5]


@pytest.mark.parametrize(
    "timings,want",
    [
        # (4 MiB, 64 KiB) for hierarchical, tcp, tensorflow in turn.
        ([0.020, 0.002, 0.035, 0.001, 0.090, 0.004], HIERARCHICAL),
        ([0.040, 0.002, 0.035, 0.001, 0.090, 0.004], TCP),
        ([0.040, 0.002, 0.035, 0.003, 0.030, 0.004], TENSORFLOW),
        # The total counts: the small tensor's latency can outweigh the large one.
        ([0.020, 0.030, 0.035, 0.001, 0.090, 0.004], TCP),
        # A tie goes to the first candidate.
        ([0.010, 0.001, 0.010, 0.001, 0.010, 0.001], HIERARCHICAL),
    ],
)
def test_the_fastest_total_wins_and_the_reason_gives_every_time(timings, want):
    names = engine_choice.candidates(TWO_BY_TWO)
    choice = engine_choice.choose(names, timings)
    assert choice.name == want
    assert choice.seconds == pytest.approx(
        {n: timings[2 * i] + timings[2 * i + 1] for i, n in enumerate(names)}
    )
    text = str(choice)
    assert text.startswith(f"{want} (auto: the fastest all-reduce of 4 MiB + 64 KiB float32 (")
    for name in names:
        assert f"{name} {1e3 * choice.seconds[name]:.1f} ms" in text
    assert "\n" not in text
    assert "; probe 0.42 s)" in str(engine_choice.choose(names, timings, 0.42))


def test_timings_that_do_not_fit_the_candidates_are_refused():
    with pytest.raises(ValueError, match="3 timings for 2 engines x 2 sizes"):
        engine_choice.choose([TCP, TENSORFLOW], [0.1, 0.2, 0.3])


def test_skipping_the_probe_picks_by_the_layout():
    assert engine_choice.probe_wanted({})
    assert not engine_choice.probe_wanted({engine_choice.PROBE_ENV: "0"})
    assert engine_choice.rule(TWO_BY_TWO, "skipped").name == HIERARCHICAL
    assert engine_choice.rule(ONE_PER_HOST, "skipped").name == TCP
    assert "not measured (skipped)" in str(engine_choice.rule(ONE_PER_HOST, "skipped"))
