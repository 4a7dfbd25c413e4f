"""An elastic job losing a host and taking it back: how long it trains on no
host, and how many steps it does again.

Two hosts (the test suite's network namespaces, tests/netns_hosts.py),
one worker each, started by `keras-distrib launch --min_workers 1
--max_restarts 3` through the bed's ssh stand-in. The job is
tests/workers/faults.py (an MLP, Adam, a backup every `--save_freq`
steps). After step `--lose_after` of the first attempt, host 1's link is
cut for good: both workers stop when the coordination service's
heartbeat times out (`--heartbeat`, seconds; TensorFlow's default is
10), the launcher finds host 1 does not answer (its probe gives a host
10 s) and starts the job on host 0 alone. Once it has trained up to step
`--lose_after` again there, the link comes back; the launcher's probe
(every 5 s) sees it, the job saves and stops, and starts again on both
hosts.

Measured per run, from the workers' own step log (`--step_log`):

  loss -> training   seconds from the cut to the first step done on the
                     one host left (target: under 30 s);
  steps redone       steps trained twice after the loss: those since the
                     last backup (at most `--save_freq` - 1);
  return -> training seconds from the link's return to the first step on
                     both hosts again;
  steps redone on return  (0: the job saved where it stopped).

Run (as root):
    python benchmarks/elastic.py [--repeats 3] [--heartbeat 10]
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from absl import app, flags  # noqa: E402

import _harness  # noqa: E402
import netns_hosts  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("repeats", 3, "Runs.")
flags.DEFINE_float("heartbeat", 10.0, "KERAS_DISTRIB_HEARTBEAT_TIMEOUT, seconds.")
flags.DEFINE_integer("lose_after", 6, "The first attempt's step after which host 1 is lost.")
flags.DEFINE_integer("save_freq", 4, "Steps between backups.")
flags.DEFINE_float("timeout", 300.0, "Seconds one run may take.")
flags.DEFINE_bool("quick", False, "One run: tests the chain, numbers not for reading.")
flags.DEFINE_string(
    "json",
    os.path.join(_harness.RESULTS_DIR, "elastic.json"),
    "Where to save the measurements (empty: nowhere).",
)

FAULTS = os.path.join(ROOT, "tests", "workers", "faults.py")
TARGET = 30.0  # seconds from a host's loss to training again, at most


def _wait_for(out: str, name: str, proc: subprocess.Popen, deadline: float) -> None:
    while not glob.glob(os.path.join(out, name)):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the job ended or timed out before {name}")
        time.sleep(0.02)


def _attempts(out: str, rank: int) -> dict:
    """{attempt: (the step count it started from, [(step count after a step
    that trained, time), ...])} of `rank` (the worker's `--step_log`)."""
    found: dict = {}
    with open(os.path.join(out, f"steps-rank{rank}.txt")) as f:
        for attempt, what, count, when in (line.split() for line in f):
            if what == "begin":
                found[int(attempt)] = (int(count), [])
            else:
                found[int(attempt)][1].append((int(count), float(when)))
    return found


def one_run() -> dict:
    out = tempfile.mkdtemp(prefix="kd-elastic-")
    with netns_hosts.TestBed(2) as bed:
        argv = [
            sys.executable,
            "-m",
            "keras_distrib.launch",
            "launch",
            "-n",
            "2",
            "--hosts",
            bed.hosts_flag(),
            "--ssh",
            "--ssh_command",
            bed.ssh_command,
            "--min_workers",
            "1",
            "--max_restarts",
            "3",
            "--timeout",
            str(FLAGS.timeout),
            FAULTS,
            "--out",
            out,
            "--backup",
            os.path.join(out, "backup"),
            "--save_freq",
            str(FLAGS.save_freq),
            "--step_log",
            "--pause_after_step",
            str(FLAGS.lose_after),
            "--hold_after_step",
            str(FLAGS.lose_after),
            "--hold_on_attempt",
            "1",
        ]
        env = dict(
            os.environ,
            KERAS_DISTRIB_HEARTBEAT_TIMEOUT=str(FLAGS.heartbeat),
            TF_CPP_MIN_LOG_LEVEL="2",
        )
        log = open(os.path.join(out, "launcher.log"), "w")
        proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + FLAGS.timeout
        try:
            for rank in (0, 1):
                _wait_for(out, f"paused-rank{rank}", proc, deadline)
            bed.cut(1)
            lost = time.time()
            open(os.path.join(out, "go"), "w").close()
            _wait_for(out, "held-rank0", proc, deadline)
            bed.restore(1)
            back = time.time()
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if proc.poll() is None:  # the launcher's group: it and what it started here
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()
        if code != 0:
            with open(os.path.join(out, "launcher.log")) as f:
                tail = f.read()[-4000:]
            shutil.rmtree(out)
            raise RuntimeError(f"the job exited {code}:\n{tail}")
    runs = _attempts(out, 0)
    shutil.rmtree(out)
    (_, lost_run), (resumed, alone), (returned, both) = runs[0], runs[1], runs[2]
    return {
        "loss_to_training_s": alone[0][1] - lost,
        "steps_redone": max(c for c, _ in lost_run) - resumed,
        "return_to_training_s": both[0][1] - back,
        "steps_redone_on_return": max(c for c, _ in alone) - returned,
    }


def run() -> int:
    reason = netns_hosts.unavailable()
    if reason:
        print(f"elastic: {reason}", file=sys.stderr)
        return 1
    if FLAGS.quick:
        _harness.quick_defaults(repeats=1)
    watch, load = _harness.Stopwatch(), _harness.load_note()
    runs = []
    for k in range(FLAGS.repeats):
        runs.append(one_run())
        print(f"  run {k + 1}: {runs[-1]}", flush=True)
    keys = ("loss_to_training_s", "steps_redone", "return_to_training_s", "steps_redone_on_return")
    print(
        f"\n2 hosts, 1 worker each; heartbeat timeout {FLAGS.heartbeat:g} s, backup every "
        f"{FLAGS.save_freq} steps, host 1 lost after step {FLAGS.lose_after}"
    )
    line, met = _harness.target_line(
        "seconds from the loss to training again",
        [r["loss_to_training_s"] for r in runs],
        TARGET,
        at_least=False,
    )
    print(line)
    for key, label in (
        ("steps_redone", "steps trained again after the loss"),
        ("return_to_training_s", "seconds from the return to training on both"),
        ("steps_redone_on_return", "steps trained again after the return"),
    ):
        print(f"{label:44s} {_harness.fmt_stats([r[key] for r in runs]):^22s}")
    print(f"{load}; wall time {watch.elapsed():.0f} s")
    _harness.save_results(
        FLAGS.json,
        "elastic",
        {
            "heartbeat_s": FLAGS.heartbeat,
            "save_freq": FLAGS.save_freq,
            "lose_after": FLAGS.lose_after,
            "measures": {k: _harness.run_summary([r[k] for r in runs]) for k in keys},
            "target_s": TARGET,
            "target_met": met,
            "misses": [] if met else [f"loss to training over {TARGET:g} s"],
        },
        quick=FLAGS.quick,
        load=load,
    )
    return 0


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    return run()


if __name__ == "__main__":
    app.run(main)
