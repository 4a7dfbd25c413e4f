"""A rank of the flight-recorder tests (`keras-distrib launch -n 2`).

`--mode sleep`: rank 1 sleeps for good in a callback after step 4 (the
`time.sleep` line is what the launcher's screen must name); `stop`: rank 1
stops itself (SIGSTOP) there; `slow`: every step takes 0.2 s, and each rank
writes `<out>/step` as it goes, so the test can ask the launcher for the
screen (SIGUSR1) while the job trains on to its end.
"""

import os
import signal
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

import keras_distrib as kd  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_enum("mode", None, ["sleep", "stop", "slow"], "The fault.")
flags.DEFINE_string("out", None, "Where `slow` writes its progress.")


class Stall(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        rank = self.model.strategy.rank
        if FLAGS.mode == "slow":
            time.sleep(0.2)
            with open(os.path.join(FLAGS.out, f"step-rank{rank}"), "w") as f:
                f.write(str(batch))
        elif batch == 3 and rank == 1:
            if FLAGS.mode == "sleep":
                time.sleep(3600)  # the line the flight recorder names
            os.kill(os.getpid(), signal.SIGSTOP)


def main(argv):
    del argv
    strategy = kd.strategies.get("multi_worker", collective_timeout=8)
    model = kd.DistributedModel.from_model(
        keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]), strategy=strategy
    )
    model.compile("sgd", "mse")
    x, y = np.random.rand(128, 4), np.random.rand(128, 2)
    epochs = 2 if FLAGS.mode == "slow" else 1
    model.fit(x, y, batch_size=8, epochs=epochs, verbose=0, callbacks=[Stall()])


if __name__ == "__main__":
    flags.mark_flag_as_required("mode")
    app.run(main)
