"""`optimizer_sharding="optimizer"` (ZeRO stage 1) and `"gradients"` (stage
2) on 2 real workers: `multi_worker` and `horovod` train as without sharding
and as plain Keras on one device, with the optimizers whose sharded step
communicates differently (every elementwise Keras optimizer is trained
sharded over two devices of one process in
tests/integration/test_optimizer_sharding_mirrored.py: the update of a part
is the same code whichever engine carried its gradients); each
worker holds its part of the slots (and in stage 2 of the reduced
gradients); files hold whole values; a resumed run ends where an
uninterrupted one does. "As" is within the bounds of float32's rounding of
the case's math in other orders around plain Keras's run, traced
(`sharding_cases.plain_run`, tests/float_bounds.py: for the optimizers that
normalize each gradient element, as large as their steps where a gradient
is about as small as its rounding).

One launch per engine and setting serves every test
(tests/workers/optimizer_sharding.py); plain Keras runs here.
"""

import json
import os

import keras
import numpy as np
import pytest

import sharding_cases as cases
from float_bounds import assert_within
from helpers import WORKERS, launch, make_data

WORKER = os.path.join(WORKERS, "optimizer_sharding.py")
# The cases the unsharded and the Horovod runs repeat: Adam, weight decay,
# the two clippings that need whole norms, and sparse gradients.
COMPARED = [
    "adam",
    "adamw_decay",
    "sgd_momentum_clipnorm",
    "rmsprop_global_clipnorm",
    *cases.EMBEDDING,
]
# The sharded run: those, and the optimizers that wrap another (moving
# averages, loss scaling).
TWO_WORKERS = [*COMPARED, "adam_ema", "adam_loss_scale"]
SAVED, RESUMED = "adamw_decay", "adam"
# Stage 2 under Horovod: its reducescatter, and a global norm from partial sums.
HOROVOD_STAGE2 = ["adam", "rmsprop_global_clipnorm"]

pytestmark = pytest.mark.slow


def _run(out, *args, launch_flags=()):
    launch(out, 2, WORKER, "--out", str(out), *args, launch_flags=launch_flags, timeout=400)
    return out


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return _run(
        tmp_path_factory.mktemp("sharded"),
        "--cases",
        ",".join(TWO_WORKERS),
        "--save",
        SAVED,
        "--resume",
        RESUMED,
    )


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory, sharded):
    """From the sharded run's initial weights."""
    return _run(
        tmp_path_factory.mktemp("unsharded"),
        "--sharding",
        "none",
        "--cases",
        ",".join(COMPARED),
        "--initial_from",
        str(sharded),
    )


@pytest.fixture(scope="module")
def stage2(tmp_path_factory, sharded):
    """optimizer_sharding="gradients", from the sharded run's initial weights."""
    return _run(
        tmp_path_factory.mktemp("stage2"),
        "--sharding",
        "gradients",
        "--cases",
        ",".join(COMPARED),
        "--initial_from",
        str(sharded),
    )


@pytest.fixture(scope="module")
def ring(tmp_path_factory, sharded):
    """Stage 2 on TensorFlow's collectives instead of shared memory (as
    between hosts): its all-reduce in place of a reduce-scatter, and stage
    1's all-gather."""
    return _run(
        tmp_path_factory.mktemp("ring"),
        "--implementation",
        "ring",
        "--sharding",
        "gradients",
        "--cases",
        "adam,sgd_momentum_clipnorm",
        "--initial_from",
        str(sharded),
    )


@pytest.fixture(scope="module")
def horovod(tmp_path_factory):
    pytest.importorskip("horovod.tensorflow")
    return _run(
        tmp_path_factory.mktemp("horovod"),
        "--strategy",
        "horovod",
        "--cases",
        ",".join(COMPARED),
        "--resume",
        RESUMED,
        launch_flags=("--backend", "horovod"),
    )


@pytest.fixture(scope="module")
def horovod_stage2(tmp_path_factory, horovod):
    """Horovod's reducescatter, from the stage-1 run's initial weights."""
    return _run(
        tmp_path_factory.mktemp("horovod2"),
        "--strategy",
        "horovod",
        "--sharding",
        "gradients",
        "--cases",
        ",".join(HOROVOD_STAGE2),
        "--initial_from",
        str(horovod),
        launch_flags=("--backend", "horovod"),
    )


def _plain(out, names):
    """Plain Keras on one device from the initial weights of `out`'s run,
    for each case in `names`, traced: {case: (weights, optimizer variables,
    (their bounds))} (`sharding_cases.plain_run`)."""
    x, y = make_data()
    return {case: cases.plain_run(case, _initial(out, case), x, y, bounds=True) for case in names}


@pytest.fixture(scope="module")
def plain(sharded):
    """From the sharded run's initial weights (every multi_worker run's)."""
    return _plain(sharded, TWO_WORKERS)


@pytest.fixture(scope="module")
def horovod_plain(horovod):
    """From the Horovod run's initial weights (its stage 2's too)."""
    return _plain(horovod, COMPARED)


def _initial(out, case):
    arrays = np.load(out / f"{case}-initial.npz")
    return [arrays[f"arr_{i}"] for i in range(len(arrays.files))]


def _ranks(out, case, prefix="w"):
    """Per rank: the `prefix` arrays of `<case>-rank<r>.npz`, in order."""
    result = []
    for r in range(2):
        arrays = np.load(out / f"{case}-rank{r}.npz")
        count = sum(name.startswith(prefix) for name in arrays.files)
        result.append([arrays[f"{prefix}{i}"] for i in range(count)])
    return result


def _assert_trains_as_one_device(got, plain, case):
    """Weights of 2 workers (`got`) against one device's (`plain`, the
    case's in `_plain`): the sums of the all-reduce round differently from
    one device's, within the bounds."""
    want, _, (bounds, _) = plain
    assert len(got) == len(want) == len(bounds), case
    for i, (a, b, bound) in enumerate(zip(got, want, bounds)):
        assert_within(a, b, bound, f"{case} weight {i}")


@pytest.mark.parametrize("case", TWO_WORKERS)
def test_multi_worker_sharded_trains_as_one_device(sharded, plain, case):
    for got in _ranks(sharded, case):
        _assert_trains_as_one_device(got, plain[case], case)


@pytest.mark.parametrize("case", COMPARED)
def test_multi_worker_sharded_equals_unsharded(sharded, unsharded, plain, case):
    _assert_equal_runs(sharded, unsharded, plain, case)


@pytest.mark.parametrize("case", COMPARED)
def test_multi_worker_stage2_equals_unsharded(stage2, unsharded, plain, case):
    """optimizer_sharding="gradients": the reduce-scattered gradients, and
    the norms of clipnorm and global_clipnorm from partial sums."""
    _assert_equal_runs(stage2, unsharded, plain, case)


@pytest.mark.parametrize("case", ["adam", "sgd_momentum_clipnorm"])
def test_sharded_on_tensorflows_collectives_equals_shared_memory(stage2, ring, plain, case):
    _assert_equal_runs(ring, stage2, plain, case)


@pytest.mark.parametrize("case", HOROVOD_STAGE2)
def test_horovod_stage2_equals_stage1(horovod, horovod_stage2, horovod_plain, case):
    _assert_equal_runs(horovod_stage2, horovod, horovod_plain, case)


def _assert_equal_runs(out, reference, plain, case):
    """Both runs' ranks (from the same initial weights) end as one device
    (`_assert_trains_as_one_device`): no further apart than twice its
    bounds, which allow their other orders of sums (a norm of clipnorm from
    partial sums, the reductions of another engine)."""
    for run in (reference, out):
        for got in _ranks(run, case):
            _assert_trains_as_one_device(got, plain[case], case)


@pytest.mark.parametrize("case", COMPARED)
def test_horovod_sharded_trains_as_one_device(horovod, horovod_plain, case):
    for got in _ranks(horovod, case):
        _assert_trains_as_one_device(got, horovod_plain[case], case)


def _joined(out, case, shapes):
    """The two workers' optimizer variables, their parts joined end to end
    into variables of `shapes` (what an unsharded optimizer holds)."""
    mine, theirs = _ranks(out, case, "o")
    joined = []
    for a, b, shape in zip(mine, theirs, shapes):
        if a.shape == tuple(shape):  # the step count, the learning rate
            np.testing.assert_array_equal(a, b)
            joined.append(a)
            continue
        size = int(np.prod(shape))
        assert a.shape == b.shape == (-(-size // 2),), case
        joined.append(np.concatenate([a, b])[:size].reshape(shape))
    return joined


def _has_slots(case) -> bool:
    """Whether the case's optimizer keeps slots (plain SGD keeps only its
    step count and learning rate, which every replica holds whole)."""
    return any(len(v.shape) for v in cases.plain_optimizer_shapes(case))


def test_each_worker_holds_its_part_of_the_slots(sharded, unsharded, plain):
    """The parts of the two workers, end to end, are the unsharded run's
    slots (both within the bounds of one device's, `plain`); `describe`
    reports at most 1/2 + 5% of the unsharded bytes."""
    for case in COMPARED:
        whole = _ranks(unsharded, case, "o")[0]
        joined = _joined(sharded, case, [w.shape for w in whole])
        assert len(joined) == len(whole)
        _, slots, (_, bounds) = plain[case]
        assert len(slots) == len(whole)
        for i, (got, want, value, bound) in enumerate(zip(joined, whole, slots, bounds)):
            assert_within(want, value, bound, f"{case} unsharded slot {i}")
            assert_within(got, value, bound, f"{case} sharded slot {i}")
        memory = [json.load(open(sharded / f"{case}-rank{r}.json")) for r in range(2)]
        full = json.load(open(unsharded / f"{case}-rank0.json"))
        for m in memory:
            assert m["weights"] == full["weights"] and m["gradients"] == full["gradients"]
            if _has_slots(case):
                assert m["optimizer"] <= (0.5 + 0.05) * full["optimizer"], (m, full)
            assert "per replica: weights" in m["str"]


def test_stage2_holds_its_part_of_the_gradients_and_slots(stage2, unsharded):
    for case in COMPARED:
        full = json.load(open(unsharded / f"{case}-rank0.json"))
        for r in range(2):
            m = json.load(open(stage2 / f"{case}-rank{r}.json"))
            assert m["weights"] == full["weights"], (m, full)
            assert m["gradients"] <= (0.5 + 0.05) * full["gradients"], (m, full)
            if _has_slots(case):
                assert m["optimizer"] <= (0.5 + 0.05) * full["optimizer"], (m, full)


def _assert_holds_the_saved_run(model, out, case, whole_optimizer):
    """`model` loaded the file `out`'s run wrote: its weights, and its
    optimizer's state whole (`whole_optimizer(variable, value)` compares one)."""
    for a, b in zip(model.get_weights(), _ranks(out, case)[0]):
        np.testing.assert_array_equal(a, b)
    saved = _joined(out, case, [v.shape for v in cases.plain_optimizer_shapes(case)])
    assert len(model.optimizer.variables) == len(saved)
    for variable, want in zip(model.optimizer.variables, saved):
        whole_optimizer(np.asarray(variable), want)


def test_a_file_written_sharded_loads_whole_into_plain_keras(sharded):
    model = keras.Model(*cases.graph())
    model.compile(**cases.compile_kwargs(SAVED))
    model.optimizer.build(model.trainable_variables)
    model.load_weights(sharded / f"{SAVED}.weights.h5")
    _assert_holds_the_saved_run(model, sharded, SAVED, np.testing.assert_array_equal)


def test_a_file_written_by_two_workers_loads_into_one_sharded_replica(sharded):
    """Another number of replicas: one (`mirrored` on one device), whose
    part of each slot is all of it."""
    import keras_distrib as kd

    strategy = kd.strategies.get("mirrored", devices=["/cpu:0"], optimizer_sharding="optimizer")
    model = kd.DistributedModel(*cases.graph(), strategy=strategy)
    model.compile(**cases.compile_kwargs(SAVED))
    model.optimizer.build(model.trainable_variables)
    model.load_weights(sharded / f"{SAVED}.weights.h5")
    _assert_holds_the_saved_run(
        model,
        sharded,
        SAVED,
        lambda got, want: np.testing.assert_array_equal(got.reshape(want.shape), want),
    )


@pytest.mark.parametrize("engine", ["multi_worker", "horovod"])
def test_a_resumed_sharded_run_ends_as_an_uninterrupted_one(request, engine):
    """The backup holds whole slots; each worker resumes with its part and
    ends with the weights of the same run's uninterrupted fit."""
    out = request.getfixturevalue("sharded" if engine == "multi_worker" else "horovod")
    # Exact: both runs are the same sharded steps of the same worker process
    # on the same rows and shapes (the same kernels, so the same sums), and
    # the backup holds the values themselves.
    for r, uninterrupted in enumerate(_ranks(out, RESUMED)):
        arrays = np.load(out / f"{RESUMED}-resumed-rank{r}.npz")
        for i, want in enumerate(uninterrupted):
            np.testing.assert_array_equal(arrays[f"arr_{i}"], want, err_msg=f"rank {r}")
