"""An Embedding's gradient as rows (sparse) against the whole table (dense), 2 workers.

The model is a recommender's core: one id per sample looked up in an
`Embedding(--vocab, --dim)` table (1,000,000 x 64 by default: 256 MB in
float32), then a `Dense(1, "sigmoid")`. Three configurations, each in its
own launch, alternating:

  sparse   `strategy="multi_worker"`, 2 workers: the gradient of the table
           travels as the batch's rows (`Strategy.gather_sparse_gradients`);
  dense    the same, but the table's gradient made dense before the
           reduction (how it travelled before: the whole table every step);
  plain    plain Keras, one process, the same global batch (the peer).

Per configuration: time per step (median over the timed epochs' steps) and
the bytes each worker hands the step's reductions (read from the tensors
the strategy's `reduce_gradients` and `all_reduce` were given when the
step was traced, with the batch's rows for the unknown dimension). Ratios are paired by repetition.

Run:
    python benchmarks/sparse_embeddings.py [--repeats 3] [--vocab 1000000] [--dim 64]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app, flags  # noqa: E402

import _harness  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_enum("config", "sparse", ["sparse", "dense", "plain"], "Worker only.")
flags.DEFINE_integer("vocab", 1_000_000, "Rows of the embedding table.")
flags.DEFINE_integer("dim", 64, "Columns of the embedding table.")
flags.DEFINE_integer("batch", 1024, "Global batch (ids per step).")
flags.DEFINE_integer("steps", 10, "Steps per timed epoch.")
flags.DEFINE_integer("epochs", 3, "Epochs per launch (the first is warm-up).")
flags.DEFINE_integer("repeats", 3, "Launches per configuration.")
flags.DEFINE_enum("optimizer", "sgd", ["sgd", "adam"], "The optimizer of the step.")
flags.DEFINE_integer("timeout", 900, "Seconds per launch.")
flags.DEFINE_string(
    "json",
    os.path.join(_harness.RESULTS_DIR, "sparse_embeddings.json"),
    "Where the driver saves its measurements ('' for nowhere).",
)
flags.DEFINE_bool("quick", False, "Few small steps: tests the chain, numbers not for reading.")

CONFIGS = ("sparse", "dense", "plain")


def run_worker() -> None:
    rank = _harness.worker_rank()
    _harness.worker_setup(pin_core=rank)
    import numpy as np
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")
    import keras

    plain = FLAGS.config == "plain"
    if not plain:
        import keras_distrib as kd

    rng = np.random.default_rng(0)
    samples = FLAGS.batch * FLAGS.steps
    x = rng.integers(0, FLAGS.vocab, (samples, 1)).astype("int32")
    y = rng.integers(0, 2, (samples, 1)).astype("float32")

    def graph():
        inputs = keras.Input((1,), dtype="int32")
        h = keras.layers.Flatten()(keras.layers.Embedding(FLAGS.vocab, FLAGS.dim)(inputs))
        return inputs, keras.layers.Dense(1, activation="sigmoid")(h)

    sent_shapes = []
    if plain:
        model = keras.Model(*graph())
        world = 1
    else:

        class DenseTable(kd.DistributedModel):
            """The table's gradient made dense before the reduction."""

            def reduce_gradients(self, gradients, num_samples):
                gradients = [
                    tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                    for g in gradients
                ]
                return super().reduce_gradients(gradients, num_samples)

        cls = DenseTable if FLAGS.config == "dense" else kd.DistributedModel
        model = cls(*graph(), strategy="multi_worker")
        world = model.strategy.world_size
        all_reduce = model.strategy.all_reduce

        def recording(values, op="sum"):
            sent_shapes.extend(
                (tuple(tf.TensorShape(v.shape).as_list()), v.dtype.size) for v in values
            )
            return all_reduce(values, op)

        model.strategy.all_reduce = recording
        reduce_gradients = model.strategy.reduce_gradients

        def recording_dense(gradients, num_samples, compression=None):
            # The dense gradients and the sample count travel here, through
            # shared memory or TensorFlow's collectives (whose all_reduce
            # calls are not counted twice).
            sent_shapes.extend(
                (tuple(tf.TensorShape(g.shape).as_list()), g.dtype.size) for g in gradients
            )
            sent_shapes.append(((), 4))
            model.strategy.all_reduce = all_reduce
            try:
                return reduce_gradients(gradients, num_samples, compression)
            finally:
                model.strategy.all_reduce = recording

        model.strategy.reduce_gradients = recording_dense
    optimizer = (
        keras.optimizers.SGD(0.1) if FLAGS.optimizer == "sgd" else keras.optimizers.Adam(1e-3)
    )
    model.compile(optimizer=optimizer, loss="binary_crossentropy")

    steps = _harness.steady_step_seconds(
        model, x, y, batch_size=FLAGS.batch, epochs=FLAGS.epochs, shuffle=False, verbose=0
    )
    rows = FLAGS.batch // world  # the unknown (batch) dimension of what was sent
    sent = sum(
        int(np.prod([rows if d is None else d for d in shape])) * size
        for shape, size in sent_shapes
    )
    _harness.write_result(
        FLAGS.out_dir,
        rank,
        {
            "rank": rank,
            "world_size": world,
            "step_ms": 1000 * float(np.median(steps)),
            "bytes_per_step": sent,
        },
    )


def run_config(name: str) -> dict:
    nproc = 1 if name == "plain" else 2
    args = [
        "--config",
        name,
        "--vocab",
        str(FLAGS.vocab),
        "--dim",
        str(FLAGS.dim),
        "--batch",
        str(FLAGS.batch),
        "--steps",
        str(FLAGS.steps),
        "--epochs",
        str(FLAGS.epochs),
        "--optimizer",
        FLAGS.optimizer,
    ]
    out_dir, _ = _harness.launch_workers(
        os.path.abspath(__file__), nproc, args, timeout=FLAGS.timeout
    )
    results = _harness.read_results(out_dir, nproc)
    return {
        "step_ms": max(r["step_ms"] for r in results),
        "bytes_per_step": results[0]["bytes_per_step"],
    }


def run_driver() -> None:
    watch, load = _harness.Stopwatch(), _harness.load_note()
    if FLAGS.quick:
        _harness.quick_defaults(repeats=1, vocab=10_000, steps=4, epochs=2)
    runs = _harness.interleaved(CONFIGS, FLAGS.repeats, run_config)
    if runs is None:
        return
    print(
        f"\nEmbedding({FLAGS.vocab:,} x {FLAGS.dim}), global batch {FLAGS.batch}, "
        f"{FLAGS.optimizer}; 2 workers (multi_worker) or 1 process (plain Keras)"
    )
    print(
        f"{'config':8s} {'step ms median [min, max]':^30s} {'MB to the reductions per step':>30s}"
    )
    for name in CONFIGS:
        r = runs[name]
        mb = r[0]["bytes_per_step"] / 2**20
        print(f"{name:8s} {_harness.fmt_stats([x['step_ms'] for x in r], 1):^30s} {mb:30.3f}")
    ratios = {
        "dense/sparse step time": _harness.paired_ratios(
            runs["dense"], runs["sparse"], key="step_ms"
        ),
        "sparse/plain step time": _harness.paired_ratios(
            runs["sparse"], runs["plain"], key="step_ms"
        ),
    }
    for label, values in ratios.items():
        print(f"{label:28s} {_harness.fmt_stats(values)}")
    traffic = runs["dense"][0]["bytes_per_step"] / max(runs["sparse"][0]["bytes_per_step"], 1)
    print(f"{'dense/sparse bytes':28s} {traffic:.0f}")
    print(f"load: {load}; wall time {watch.elapsed():.0f} s")
    _harness.save_results(
        FLAGS.json,
        "sparse_embeddings",
        {
            "vocab": FLAGS.vocab,
            "dim": FLAGS.dim,
            "batch": FLAGS.batch,
            "optimizer": FLAGS.optimizer,
            "configs": {
                n: {
                    "step_ms": _harness.run_summary([x["step_ms"] for x in runs[n]]),
                    "bytes_per_step": runs[n][0]["bytes_per_step"],
                }
                for n in CONFIGS
            },
            "ratios": {k: _harness.run_summary(v) for k, v in ratios.items()},
            "bytes_ratio_dense_over_sparse": traffic,
        },
        quick=FLAGS.quick,
        load=load,
    )


def main(argv):
    del argv
    if FLAGS.role == "worker":
        run_worker()
    else:
        run_driver()


if __name__ == "__main__":
    app.run(main)
