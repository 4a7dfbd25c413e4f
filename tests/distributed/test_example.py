"""The `make demo` example trains end to end and prints its results."""

import re
import subprocess
import sys

import pytest

from helpers import ROOT


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_digits_example_trains_with_two_workers_through_the_launcher():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "keras_distrib.launch",
            "launch",
            "-n",
            "2",
            "examples/train_digits.py",
            "--config",
            "configs/digits_2workers.json",
            "--epochs",
            "4",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert "[rank 0] strategy=multi_worker replicas=2 workers=2" in out
    assert "[rank 1] strategy=" not in out  # only the chief prints
    accuracy = float(re.search(r"\[rank 0\] validation accuracy: ([0-9.]+)", out).group(1))
    assert accuracy > 0.9
    assert re.search(r"\[rank 0\] throughput: [0-9,]+ samples/s", out)


def _launch_digits(config, *launch_flags):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "keras_distrib.launch",
            "launch",
            *launch_flags,
            "examples/train_digits.py",
            "--config",
            config,
            "--epochs",
            "4",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_digits_example_trains_against_a_parameter_server():
    proc = _launch_digits("configs/digits_ps.json", "--workers", "2", "--ps", "1")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert "[chief] strategy=parameter_server replicas=" in out
    assert "workers=2" in out
    assert re.search(r"\[chief\] steps applied \(asynchronous\): \d+", out)
    accuracy = float(re.search(r"\[chief\] validation accuracy: ([0-9.]+)", out).group(1))
    assert accuracy > 0.85


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_digits_example_trains_under_horovod():
    pytest.importorskip("horovod.tensorflow")
    proc = _launch_digits("configs/digits_horovod.json", "--backend", "horovod", "-n", "2")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert "strategy=horovod replicas=2 workers=2" in out
    accuracy = float(re.search(r"validation accuracy: ([0-9.]+)", out).group(1))
    assert accuracy > 0.85


def _run_split_model(*flags):
    return subprocess.run(
        [
            sys.executable,
            "examples/train_split_model.py",
            "--config",
            "configs/split_model.json",
            *flags,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_split_model_example_fits_the_budget_only_when_split_and_learns():
    proc = _run_split_model("--epochs", "3")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    one, budget = map(
        float,
        re.search(r"one device would need ([0-9.]+) MB .* > budget ([0-9.]+) MB", out).groups(),
    )
    assert one > budget
    # The per-device tables: device, weights, optimizer, total, budget (MB), per strategy.
    rows = re.findall(r"^CPU:\d +([0-9.]+) +([0-9.]+) +([0-9.]+) +([0-9.]+)$", out, re.M)
    assert len(rows) == 4  # 2 devices x (pipeline, tensor_parallel)
    for row in rows:
        weights, optimizer, total, row_budget = map(float, row)
        assert 0 < weights < optimizer <= total <= budget == row_budget
    results = re.findall(r"^result: (\w+): .* validation accuracy ([0-9.]+)", out, re.M)
    assert [name for name, _ in results] == ["pipeline", "tensor_parallel"]
    assert all(float(accuracy) > 0.9 for _, accuracy in results), results
    assert len(re.findall(r"throughput: [0-9,]+ samples/s", out)) == 2


@pytest.mark.timeout(120)
def test_split_model_example_stops_with_one_line_when_a_device_exceeds_the_budget():
    proc = _run_split_model("--strategy", "pipeline", "--device_budget_mb", "1")
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        r"error: pipeline: device CPU:0 holds [0-9.]+ MB \(weights [0-9.]+ \+ "
        r"optimizer [0-9.]+\) > budget 1\.0 MB; .*",
        last,
    ), last
    assert "Epoch 1/" not in proc.stdout  # stopped before training


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sharded_optimizer_example_fits_the_budget_on_two_workers_and_learns():
    """The split-model example's data-parallel sibling: the whole model on
    each of 2 workers, Adam's state sharded over them."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "keras_distrib.launch",
            "launch",
            "-n",
            "2",
            "examples/train_split_model.py",
            "--config",
            "configs/sharded_optimizer.json",
            "--epochs",
            "3",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    one, budget = map(
        float,
        re.search(r"one device would need ([0-9.]+) MB .* > budget ([0-9.]+) MB", out).groups(),
    )
    assert one > budget
    rows = re.findall(
        r"^\[rank (\d)\] worker(\d) +([0-9.]+) +([0-9.]+) +([0-9.]+) +([0-9.]+)$", out, re.M
    )
    assert sorted((rank, worker) for rank, worker, *_ in rows) == [("0", "0"), ("1", "1")]
    for _, _, weights, optimizer, total, _row_budget in rows:
        # Adam's two slots, halved: as many bytes as the weights.
        assert float(optimizer) == float(weights) and float(total) <= budget
    results = re.findall(r"result: multi_worker: .* validation accuracy ([0-9.]+)", out)
    assert len(results) == 2 and all(float(a) > 0.9 for a in results), results
