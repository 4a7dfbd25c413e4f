"""Shared plumbing of the benchmarks (allreduce, weak_scaling, strong_scaling, ...).

A benchmark script is both the driver and the worker: the driver (no
`--role` flag) starts N copies of itself as workers through
`keras-distrib launch`, each worker writes its measurements as JSON into a
directory the driver names, and the driver reads them back and prints a
table. The driver then saves what it measured as JSON under
`benchmarks/results/` (`save_results`), from which `benchmarks/_plots.py`
draws the figures. Nothing here imports TensorFlow, so the driver stays
light.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

from absl import flags

# Every script built on this file is its own driver and worker.
flags.DEFINE_enum(
    "role",
    "driver",
    ["driver", "worker"],
    "driver: start the workers through keras-distrib launch and "
    "print the table; worker: one rank (started by the driver).",
)
flags.DEFINE_string("out_dir", None, "Worker only: where to write rank{R}.json.")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Where the drivers save their measurements (JSON) and _plots.py its figures.
RESULTS_DIR = os.path.join(REPO_ROOT, "benchmarks", "results")

# Environment every worker gets: quiet TensorFlow, and the repository on the
# path so `keras_distrib` imports from a checkout without installing it.
_QUIET_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1"}


class WorkersFailed(RuntimeError):
    """The launcher (or a worker) failed or timed out; carries their output."""

    def __init__(self, message: str, output: str):
        super().__init__(message)
        self.output = output


def launch_workers(
    script: str,
    nproc: int,
    worker_args: Sequence[str],
    timeout: float,
    extra_env: Optional[dict] = None,
    launch_flags: Sequence[str] = (),
    prefix: Sequence[str] = (),
) -> tuple[str, str]:
    """Runs `keras-distrib launch -n nproc [launch_flags] script --role worker ...`
    (after the argv `prefix`, e.g. `ip netns exec NS` to run it on another host).

    Every worker gets `--out_dir DIR` and should write `rank{R}.json` there.

    Returns:
        `(out_dir, launcher_output)`; the caller reads and then removes
        `out_dir` (see `read_results`).

    Raises:
        WorkersFailed: non-zero exit or `timeout` seconds passed. The
            launcher's own `--timeout` stops the workers; should the launcher
            itself hang, it gets SIGTERM (it stops every worker's process
            group), then SIGKILL, and workers die with it (see
            `worker_setup`).
    """
    out_dir = tempfile.mkdtemp(prefix="kd-bench-")
    env = {**os.environ, **_QUIET_ENV, **(extra_env or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH", "")) if p)
    argv = [
        *prefix,
        sys.executable,
        "-m",
        "keras_distrib.launch",
        "launch",
        "-n",
        str(nproc),
        "--timeout",
        str(timeout),
        *launch_flags,
        script,
        "--role=worker",
        f"--out_dir={out_dir}",
        *worker_args,
    ]
    proc = subprocess.Popen(
        argv,
        cwd=REPO_ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        # The launcher stops the ranks itself at `timeout` (SIGTERM, then
        # SIGKILL after its grace period); this is the backstop.
        output, _ = proc.communicate(timeout=timeout + 30)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the launcher forwards it to all ranks
        try:
            output, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        raise WorkersFailed(
            f"the launcher did not end within {timeout + 30:g}s", output or ""
        ) from None
    except BaseException:  # Ctrl-C: the launcher got it too; make sure it ends
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    if proc.returncode == 124:
        raise WorkersFailed(f"workers did not finish within {timeout:g}s (--timeout)", output)
    if proc.returncode != 0:
        raise WorkersFailed(f"launcher exited with code {proc.returncode}", output)
    return out_dir, output


def read_results(out_dir: str, nproc: int) -> list[dict]:
    """The JSON each rank wrote, in rank order; removes `out_dir`."""
    try:
        results = []
        for rank in range(nproc):
            with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
                results.append(json.load(f))
        return results
    finally:
        for name in os.listdir(out_dir):
            os.remove(os.path.join(out_dir, name))
        os.rmdir(out_dir)


def run_json_workers(argvs: Sequence[Sequence[str]], timeout: float) -> list[dict]:
    """Runs every `argv` at once (the processes of one measurement, started
    directly, not through the launcher) and returns the JSON each printed as
    the last line of its standard output, in order.

    Their output goes to files, not pipes, so that none blocks on a full
    pipe while the others wait for it in a collective. Whatever still runs
    after `timeout` seconds or a failure is killed.

    Raises:
        WorkersFailed: a process exited non-zero, or `timeout` passed
            (carries their standard error).
    """
    env = {**os.environ, **_QUIET_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH", "")) if p)
    with tempfile.TemporaryDirectory(prefix="kd-bench-") as out:
        logs = [
            (open(os.path.join(out, f"{i}.out"), "w+"), open(os.path.join(out, f"{i}.err"), "w+"))
            for i in range(len(argvs))
        ]
        procs: list = []
        failed = ""
        try:
            for argv, (stdout, stderr) in zip(argvs, logs):
                procs.append(subprocess.Popen(list(argv), stdout=stdout, stderr=stderr, env=env))
            deadline = time.monotonic() + timeout
            for proc in procs:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            failed = f"the processes did not finish within {timeout:g}s"
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        texts = []
        for stdout, stderr in logs:
            for f in (stdout, stderr):
                f.seek(0)
            texts.append((stdout.read(), stderr.read()))
            stdout.close()
            stderr.close()
    codes = [proc.returncode for proc in procs]
    if not failed and any(codes):
        failed = f"the processes exited with codes {codes}"
    if failed:
        raise WorkersFailed(failed, "\n".join(err for _, err in texts))
    return [json.loads(text.strip().splitlines()[-1]) for text, _ in texts]


def slowest_rank(results: Sequence[dict], pick) -> list[float]:
    """Per repetition, the slowest rank's time (a collective ends when every
    rank's does): `pick(result)` is one rank's list of times."""
    return [max(ts) for ts in zip(*(pick(r) for r in results))]


def write_result(out_dir: str, rank: int, result: dict) -> None:
    """Writes this rank's result atomically (temp file + rename)."""
    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


def steady_step_seconds(model, x, y, **fit_kwargs) -> list[float]:
    """`model.fit(x, y, **fit_kwargs)` timed step by step: the seconds of
    every step after the first epoch (which includes tracing). Worker only
    (imports Keras)."""
    import keras

    class StepTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.epochs = []

        def on_epoch_begin(self, epoch, logs=None):
            self.epochs.append([])

        def on_train_batch_begin(self, batch, logs=None):
            self._start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.epochs[-1].append(time.perf_counter() - self._start)

    timer = StepTimer()
    model.fit(x, y, callbacks=[timer], **fit_kwargs)
    return [t for epoch in timer.epochs[1:] for t in epoch]


def worker_rank() -> int:
    """This worker's rank, as `keras-distrib launch` tells it (0 if unset)."""
    return int(os.environ.get("KERAS_DISTRIB_RANK", "0"))


def worker_setup(pin_core: Optional[int] = None) -> None:
    """First thing a worker does, before importing TensorFlow.

    Dies with its parent (the launcher), so no worker outlives a killed
    driver; optionally pins itself to one core (TensorFlow sizes its thread
    pools from the cores it may use when it starts, so pin first); and keeps
    Python-side logging at warnings.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    _die_with_parent()
    if pin_core is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {pin_core % os.cpu_count()})
    from absl import logging

    logging.set_verbosity(logging.WARNING)


def _die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def stats(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


def fmt_stats(values: Sequence[float], digits: int = 2) -> str:
    med, lo, hi = stats(values)
    return f"{med:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def load_note() -> str:
    """The 1-minute load average: other work on the machine skews timings."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return "load average unknown"
    busy = " (the machine is busy: expect noise)" if load > 1.0 else ""
    return f"1-min load average at start {load:.2f} on {os.cpu_count()} cores{busy}"


class Stopwatch:
    """Wall time of the whole benchmark, printed at the end."""

    def __init__(self):
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def chosen_configs(names: Sequence[str], valid) -> list[str]:
    """The `--configs` names, stripped; an unknown one is a usage error."""
    from absl import app

    configs = [c.strip() for c in names]
    unknown = sorted(set(configs) - set(valid))
    if unknown:
        raise app.UsageError(f"unknown --configs {unknown}; valid: {sorted(valid)}.")
    return configs


def interleaved(configs: Sequence[str], repeats: int, run_config) -> Optional[dict]:
    """`{config: [result of run_config(config), ...]}` over `repeats` rounds,
    the order rotated each round so no config always runs first (or after
    the same one). A failed run prints its workers' output to stderr and
    gives None."""
    runs: dict = {c: [] for c in configs}
    for rep in range(repeats):
        shift = rep % len(configs)
        for name in list(configs[shift:]) + list(configs[:shift]):
            try:
                runs[name].append(run_config(name))
            except WorkersFailed as e:
                print(
                    f"{name} (repetition {rep + 1}): {e}; worker output:\n{e.output}",
                    file=sys.stderr,
                )
                return None
    return runs


def quick_defaults(**values) -> None:
    """`--quick`: sets the given flags, except those given on the command line."""
    for name, value in values.items():
        if not flags.FLAGS[name].present:
            setattr(flags.FLAGS, name, value)


def paired_ratios(
    a: Sequence[dict], b: Sequence[dict], scale: float = 1.0, key: str = "throughput"
) -> list[float]:
    """`a[i][key] / (scale * b[i][key])` for each repetition i."""
    return [x[key] / (scale * y[key]) for x, y in zip(a, b)]


def fastest_per_repetition(
    runs: dict, candidates: Sequence[str], key: str = "throughput"
) -> tuple[list[dict], list[str]]:
    """For each repetition, the run with the highest `key` among the
    `candidates` present in `runs`, and its configuration's name.

    The honest baseline of a scaling ratio: N workers are compared with the
    fastest way this run found to train on one worker, not with the slowest.
    """
    present = [c for c in candidates if c in runs]
    if not present:
        return [], []
    best, names = [], []
    for rep in range(min(len(runs[c]) for c in present)):
        name = max(present, key=lambda c: runs[c][rep][key])
        best.append(runs[name][rep])
        names.append(name)
    return best, names


def name_counts(names: Sequence[str]) -> str:
    """`["single", "raw1", "single"]` -> `"single (2 of 3), raw1 (1 of 3)"`."""
    counts: dict = {}
    for n in names:
        counts[n] = counts.get(n, 0) + 1
    ordered = sorted(counts.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{n} ({k} of {len(names)})" for n, k in ordered)


def verdict(value: float, target: float, at_least: bool = True) -> bool:
    """Whether a median `value` meets `target` (`>=` or, `at_least=False`, `<=`)."""
    return value >= target if at_least else value <= target


def target_line(
    label: str, values: Sequence[float], target: float, at_least: bool = True, width: int = 44
) -> tuple[str, bool]:
    """One printed line `label  median [min, max]  target >= T: target met`
    (judged on the median) and whether it is met."""
    met = verdict(stats(values)[0], target, at_least)
    op = ">=" if at_least else "<="
    return (
        f"{label:{width}s} {fmt_stats(values):^22s}  target {op} {target:g}: "
        f"{'target met' if met else 'TARGET NOT MET'}"
    ), met


def run_summary(values: Sequence[float]) -> dict:
    """`{"median", "min", "max", "values"}` of one measured quantity, for JSON."""
    med, lo, hi = stats(values)
    return {"median": med, "min": lo, "max": hi, "values": list(values)}


def save_results(
    path: Optional[str], name: str, payload: dict, quick: bool = False, load: Optional[str] = None
) -> Optional[str]:
    """Writes a driver's measurements as JSON (atomically) and returns the path.

    `path`: the `--json` flag; None or "" writes nothing. Adds what the
    figures and a reader need to judge the numbers: the benchmark's name,
    when, the command line, the machine's cores and load, and whether it was
    a `--quick` run (whose numbers are for testing the chain, not for
    reading).
    """
    if not path:
        return None
    meta = {
        "benchmark": name,
        "time": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "argv": sys.argv,
        "cpus": os.cpu_count(),
        "load": load if load is not None else load_note(),
        "quick": bool(quick),
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump({"meta": meta, **payload}, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)
    shown = os.path.relpath(path)
    print(f"measurements saved to {path if shown.startswith('..') else shown}")
    return path


def parse_size(text: str) -> int:
    """`"64KB"` -> 65536."""
    text = text.strip().upper().removesuffix("B")
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in "KMG" else text
    return int(float(number) * scale)


def human(nbytes: float) -> str:
    """65536 -> `"64 KB"`."""
    for unit, scale in (("MB", 2**20), ("KB", 2**10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.2f} {unit}"
    return f"{nbytes:.0f} B"


def driver_or_worker(argv, run_worker, run_driver) -> int:
    """The `main` of a benchmark that is both its own driver and worker (`--role`)."""
    from absl import app

    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if flags.FLAGS.role == "worker":
        run_worker()
        return 0
    return run_driver()
