"""A rank that shows what it opens: `python private_net.py OUT`.

Started by `keras-distrib launch -n 2` (tests/distributed/test_private_network.py).
After `import keras_distrib` has started the multi-worker runtime
(TensorFlow's gRPC server, which listens on all interfaces), each rank
writes OUT/ports-rankR.json: the cluster's ports and whether this rank
reaches each peer's. It waits for OUT/go (the test connects meanwhile, from
outside the job), then trains a small model for a few steps, which needs
the peers over loopback, and prints its loss.
"""

import json
import os
import socket
import sys
import time

import keras_distrib as kd  # first: starts the runtime, whose server listens

import keras
import numpy as np

OUT = sys.argv[1]
RANK = int(os.environ["KERAS_DISTRIB_RANK"])


def reaches(address):
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
        return True
    except OSError:
        return False


workers = json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"]
with open(os.path.join(OUT, f"ports-rank{RANK}.json.tmp"), "w") as f:
    json.dump({"workers": workers, "reached": [reaches(a) for a in workers]}, f)
os.replace(
    os.path.join(OUT, f"ports-rank{RANK}.json.tmp"), os.path.join(OUT, f"ports-rank{RANK}.json")
)
deadline = time.monotonic() + 120
while not os.path.exists(os.path.join(OUT, "go")):
    assert time.monotonic() < deadline, "no go"
    time.sleep(0.05)

inputs = keras.Input((4,))
model = kd.DistributedModel(inputs, keras.layers.Dense(1)(inputs), strategy="multi_worker")
model.compile(optimizer="sgd", loss="mse")
x = np.random.rand(32, 4).astype("float32")
history = model.fit(x, x.sum(axis=1, keepdims=True), batch_size=8, epochs=1, verbose=0)
print(f"trained, loss {history.history['loss'][-1]:.4f}")
