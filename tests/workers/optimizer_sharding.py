"""Trains one small model per optimizer case (tests/sharding_cases.py) under `--strategy`
(`multi_worker` or `horovod`) with `optimizer_sharding=--sharding` (one
strategy per process), run by `keras-distrib launch -n 2`.

For each case rank 0 writes the initial weights (`<case>-initial.npz`) and
every rank its final weights and its optimizer variables
(`<case>-rank<r>.npz`: `w<i>` and `o<i>`) and the bytes `describe` reports
(`<case>-rank<r>.json`). For the cases in `--save` every worker saves the
trained model (the chief's is the file: `<case>.weights.h5`); for those
in `--resume` a first fit of one epoch leaves a backup and a new model's
fit of two epochs resumes from it (`<case>-resumed-rank<r>.npz`). The
test trains the same cases with plain Keras (`plain_run`).
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from sharding_cases import BATCH, CASES, EPOCHS, compile_kwargs, graph, inputs  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Directory for results.")
flags.DEFINE_string("strategy", "multi_worker", "Strategy name.")
flags.DEFINE_string("sharding", "optimizer", "optimizer_sharding ('none': None).")
flags.DEFINE_string("implementation", None, "multi_worker's implementation (default: auto).")
flags.DEFINE_list("cases", list(CASES), "Cases to train.")
flags.DEFINE_list("save", [], "Cases whose model is saved after training.")
flags.DEFINE_list("resume", [], "Cases also trained again, resuming from a backup.")
flags.DEFINE_string("initial_from", None, "Directory whose <case>-initial.npz to start from.")


def main(argv):
    del argv
    import keras_distrib as kd
    from helpers import make_data

    options = {"implementation": FLAGS.implementation} if FLAGS.implementation else {}
    x, y = make_data()
    sharding = None if FLAGS.sharding == "none" else FLAGS.sharding
    strategy = kd.strategies.get(FLAGS.strategy, optimizer_sharding=sharding, **options)
    for case in FLAGS.cases:
        _train(kd, strategy, case, x, y, FLAGS.out, FLAGS.initial_from)


def _train(kd, strategy, case, x, y, out, initial_from):
    x = inputs(case, x)
    model = kd.DistributedModel(*graph(case), strategy=strategy)
    if initial_from:
        model.set_weights(_initial(initial_from, case))
    if strategy.is_chief:
        np.savez(os.path.join(out, f"{case}-initial.npz"), *model.get_weights())
    model.compile(**compile_kwargs(case))
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    arrays = {f"w{i}": w for i, w in enumerate(model.get_weights())}
    arrays.update({f"o{i}": np.asarray(v) for i, v in enumerate(model.optimizer.variables)})
    np.savez(os.path.join(out, f"{case}-rank{strategy.rank}.npz"), **arrays)
    memory = strategy.describe(model)
    with open(os.path.join(out, f"{case}-rank{strategy.rank}.json"), "w") as f:
        json.dump(
            {
                "weights": memory.weights,
                "gradients": memory.gradients,
                "optimizer": memory.optimizer,
                "str": str(memory),
            },
            f,
        )
    if case in FLAGS.save:
        model.save_weights(os.path.join(out, f"{case}.weights.h5"))
    if case in FLAGS.resume:
        _resume(kd, strategy, case, x, y, out)


def _initial(directory, case):
    arrays = np.load(os.path.join(directory, f"{case}-initial.npz"))
    return [arrays[f"arr_{i}"] for i in range(len(arrays.files))]


def _resume(kd, strategy, case, x, y, out):
    backup = os.path.join(out, f"{case}-backup")
    first = kd.DistributedModel(*graph(case), strategy=strategy)
    first.set_weights(_initial(out, case))
    first.compile(**compile_kwargs(case))
    first.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[kd.callbacks.BackupAndRestore(backup, delete_checkpoint=False)],
    )
    again = kd.DistributedModel(*graph(case), strategy=strategy)
    again.compile(**compile_kwargs(case))
    again.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=[kd.callbacks.BackupAndRestore(backup)],
    )
    np.savez(os.path.join(out, f"{case}-resumed-rank{strategy.rank}.npz"), *again.get_weights())


if __name__ == "__main__":
    flags.mark_flag_as_required("out")
    app.run(main)
