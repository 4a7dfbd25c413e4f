"""The model zoo across real processes: a representative subset under
`multi_worker` and `horovod` (2 workers) and `parameter_server` (a chief,
2 workers, 1 ps), each against plain Keras trained here from the weights
the workers started from (patterns.py says what each outcome asserts).

Each strategy's patterns (`helpers.ZOO_PROCESS_PATTERNS`) run in one launch
of tests/workers/keras_features.py (probe `zoo`), the one the Keras-feature
probes share under `multi_worker` and `horovod` (tests/conftest.py).
"""

import json
import re

import numpy as np
import pytest

import patterns as zoo
from helpers import KERAS_FEATURES_WORKER, ZOO_PROCESS_PATTERNS, launch

CASES = [(name, strategy) for strategy, names in ZOO_PROCESS_PATTERNS.items() for name in names]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def parameter_server_zoo(tmp_path_factory):
    """The patterns under `parameter_server`: a chief, 2 workers, 1 ps."""
    out = tmp_path_factory.mktemp("zoo_parameter_server")
    launch(
        out,
        2,
        KERAS_FEATURES_WORKER,
        "--out",
        str(out),
        "--probes",
        "zoo",
        "--zoo",
        ",".join(ZOO_PROCESS_PATTERNS["parameter_server"]),
        "--strategy",
        "parameter_server",
        launch_flags=("--ps", "1"),
        timeout=400,
    )
    return out


@pytest.fixture
def runs(request):
    """strategy -> the directory of the launch that ran its patterns."""
    fixtures = {
        "multi_worker": "probes",
        "horovod": "horovod_probes",
        "parameter_server": "parameter_server_zoo",
    }
    return lambda strategy: request.getfixturevalue(fixtures[strategy])


def _ranks(out, name, strategy):
    """Each rank's (result, arrays) for pattern `name` (the chief alone
    under parameter_server: the workers serve)."""
    found = []
    for rank in range(1 if strategy == "parameter_server" else 2):
        with open(out / f"zoo-{name}-rank{rank}.json") as f:
            result = json.load(f)
        path = out / f"zoo-{name}-rank{rank}.npz"
        arrays = dict(np.load(path)) if path.exists() else {}
        found.append((result, arrays))
    return found


def _weights(arrays, kind):
    return [arrays[f"{kind}_{i}"] for i in range(len([k for k in arrays if k.startswith(kind)]))]


@pytest.mark.parametrize("name,strategy", CASES, ids=[f"{n}-{s}" for n, s in CASES])
def test_pattern_across_processes(name, strategy, runs, zoo_results):
    pattern = zoo.BY_NAME[name]
    outcome = pattern.outcome(strategy)
    ranks = _ranks(runs(strategy), name, strategy)
    if zoo.refusal(outcome):
        for result, _ in ranks:
            assert "error" in result, f"{name} under {strategy} trained; expected a refusal"
            assert "\n" not in result["error"].strip()
            assert re.search(zoo.refusal(outcome)[1], result["error"]), result["error"]
        zoo_results[name, strategy] = outcome
        return
    for result, _ in ranks:
        assert "error" not in result, f"{name} under {strategy}: {result['error']}"
    (first, arrays), *others = ranks
    initial, final = _weights(arrays, "initial"), _weights(arrays, "final")
    for _, other in others:  # every worker ends with the same weights, bit for bit
        for a, b in zip(final, _weights(other, "final"), strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"{name} under {strategy}: workers")
    _, expected, logs, bounds = zoo.reference(pattern, initial, [strategy])
    result = {
        "initial": initial,
        "weights": final,
        "logs": first["logs"],
        "replicas_agree": first["replicas_agree"],
    }
    zoo_results[name, strategy] = zoo.check(
        pattern,
        strategy,
        initial,
        expected,
        result,
        None if pattern.batch_logs else logs,
        bounds,
    )
