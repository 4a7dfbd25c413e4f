"""A chaos campaign: many random faults in a row on a two-host job, and what
was lost.

Each trial runs tests/workers/faults.py (an MLP, Adam on a decaying
learning rate, shuffled arrays, `keras_distrib.callbacks.BackupAndRestore`
every 4 steps) as a `multi_worker` job on two hosts (the test suite's
network namespaces, tests/netns_hosts.py): `keras-distrib launch -n 2
--hosts a:1,b:1 --ssh --min_workers 1 --max_restarts 4`, the launcher on
host a, the backups on a small tmpfs. At a random step of the first
attempt (the workers pause there) it injects one or two faults, drawn from:

  kill_rank        SIGKILL to a rank
  kill_ssh         SIGKILL to the launcher's child that started host b's rank
                   (on this bed the ssh stand-in becomes the rank, as
                   `ssh -tt` carries the kill to the remote process)
  stop_20s         SIGSTOP to a rank, SIGCONT 20 s later
  term             SIGTERM to a rank (its node preempted)
  flap_3s          host b's link down for 3 s
  partition_30s    host b's link down for 30 s
  training_cut_30s host b's training link down for 30 s, its ssh still up
  disk_full        the backups' file system filled up
  truncate_backup  the latest backup's weights cut short, then a rank killed
  corrupt_backup   a byte of the latest backup's weights flipped, then a
                   rank killed
  host_lost        host b's links down for good

and sorts how the trial ended:

  exact   the launcher exits 0 and every rank that finished holds the
          weights of an uninterrupted one-process run (max |dw| <= 1e-5)
          after all its steps;
  clear   the launcher exits non-zero (not its --timeout) with one line
          of its own last (`keras-distrib: ...`);
  other   anything else: a hang past the timeouts, exit 0 with other
          weights, a process left on a host or a file left in /dev/shm.

It prints every trial and the counts (`anything else` must be 0; the exit
code is 1 otherwise), and saves them to benchmarks/results/chaos.json
(RESULTS.md). Trials are drawn from `--seed`, so a campaign can be run
again as it was.

Run (as root):
    python benchmarks/chaos.py [--trials 30] [--seed 1]
"""

from __future__ import annotations

import contextlib
import glob
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

import _harness  # noqa: E402
import fault_job  # noqa: E402
import netns_hosts  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("trials", 30, "Trials.")
flags.DEFINE_integer("seed", 1, "Draws the trials: the same seed, the same faults.")
flags.DEFINE_list("faults", [], "Draw from these faults only (default: all).")
flags.DEFINE_float("timeout", 150.0, "The launcher's --timeout for one trial, seconds.")
flags.DEFINE_float("heartbeat", 5.0, "KERAS_DISTRIB_HEARTBEAT_TIMEOUT, seconds.")
flags.DEFINE_bool("quick", False, "3 trials: tests the chain, counts not for reading.")
flags.DEFINE_string(
    "json",
    os.path.join(_harness.RESULTS_DIR, "chaos.json"),
    "Where to save the results (empty: nowhere).",
)

FAULTS_SCRIPT = os.path.join(ROOT, "tests", "workers", "faults.py")
SAVE_FREQ = 4
TOLERANCE = 1e-5  # max |dw| against the one-process run
BACKUP_DISK = "4m"  # the tmpfs the backups are written to
# Seconds the harness gives the launcher beyond its own --timeout.
MARGIN = 30.0


# -- faults ---------------------------------------------------------------------------


class Trial:
    """One trial's job, while it runs: the bed, its directories, the
    launcher's process."""

    def __init__(
        self,
        bed: netns_hosts.TestBed,
        out: str,
        backup: str,
        proc: subprocess.Popen,
        rng: random.Random,
    ):
        self.bed, self.out, self.backup, self.proc, self.rng = bed, out, backup, proc, rng

    def pid(self, rank: int) -> int:
        """The process of `rank` in the running attempt (its own record)."""
        records = fault_job.attempts(self.out, 2)
        return records[rank][-1].pid

    def signal(self, rank: int, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid(rank), signum)

    def latest_weights(self) -> str:
        backups = sorted(glob.glob(os.path.join(self.backup, "backup-*")))
        return os.path.join(backups[-1], "weights.weights.h5")


def _later(seconds: float, action) -> threading.Thread:
    """Runs `action` `seconds` from now, in a thread."""
    thread = threading.Thread(target=lambda: (time.sleep(seconds), action()), daemon=True)
    thread.start()
    return thread


def kill_rank(t: Trial):
    t.signal(t.rng.randrange(2), signal.SIGKILL)


def kill_ssh(t: Trial):
    children = _children(t.proc.pid)
    local = t.pid(0)
    for child in children:
        if child != local:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)


def stop_20s(t: Trial):
    rank = t.rng.randrange(2)
    pid = t.pid(rank)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGSTOP)

    def resume():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)

    return _later(20, resume)


def term(t: Trial):
    t.signal(t.rng.randrange(2), signal.SIGTERM)


def flap_3s(t: Trial):
    t.bed.cut(1)
    return _later(3, lambda: t.bed.restore(1))


def partition_30s(t: Trial):
    t.bed.cut(1)
    return _later(30, lambda: t.bed.restore(1))


def training_cut_30s(t: Trial):
    t.bed.cut(1, training_only=True)
    return _later(30, lambda: t.bed.restore(1))


def disk_full(t: Trial):
    with open(os.path.join(os.path.dirname(t.backup), "filler"), "wb") as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 65536)
                f.flush()


def truncate_backup(t: Trial):
    path = t.latest_weights()
    os.truncate(path, os.path.getsize(path) * 3 // 4)
    t.signal(t.rng.randrange(2), signal.SIGKILL)


def corrupt_backup(t: Trial):
    path = t.latest_weights()
    with open(path, "r+b") as f:
        f.seek(-os.path.getsize(path) // 3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    t.signal(t.rng.randrange(2), signal.SIGKILL)


def host_lost(t: Trial):
    t.bed.cut(1)


FAULTS = {
    f.__name__: f
    for f in (
        kill_rank,
        kill_ssh,
        stop_20s,
        term,
        flap_3s,
        partition_30s,
        training_cut_30s,
        disk_full,
        truncate_backup,
        corrupt_backup,
        host_lost,
    )
}


def _children(pid: int) -> list[int]:
    found = []
    for task in glob.glob(f"/proc/{pid}/task/*/children"):
        with contextlib.suppress(OSError), open(task) as f:
            found += [int(p) for p in f.read().split()]
    return found


# -- one trial --------------------------------------------------------------------------


def draw(seed: int, index: int, kinds) -> tuple[list[str], int]:
    """Trial `index`'s faults (one or two) and the step they strike after."""
    rng = random.Random(f"{seed}-{index}")
    faults = rng.sample(sorted(kinds), min(rng.choice([1, 2]), len(kinds)))
    return faults, rng.randint(SAVE_FREQ + 1, fault_job.STEPS - 4)


def one_trial(bed: netns_hosts.TestBed, seed: int, index: int, reference) -> dict:
    faults, step = draw(seed, index, FLAGS.faults or FAULTS)
    rng = random.Random(f"{seed}-{index}-act")
    out = tempfile.mkdtemp(prefix="kd-chaos-")
    disk = os.path.join(out, "disk")
    os.mkdir(disk)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={BACKUP_DISK}", "tmpfs", disk], check=True)
    started = time.monotonic()
    log_path = os.path.join(out, "launcher.log")
    try:
        backup = os.path.join(disk, "backup")
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
            "4",
            "--timeout",
            str(FLAGS.timeout),
            FAULTS_SCRIPT,
            "--out",
            out,
            "--backup",
            backup,
            "--save_freq",
            str(SAVE_FREQ),
            "--pause_after_step",
            str(step),
        ]
        env = dict(
            os.environ,
            KERAS_DISTRIB_HEARTBEAT_TIMEOUT=str(FLAGS.heartbeat),
            TF_CPP_MIN_LOG_LEVEL="2",
            PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
        )
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                bed.on(0, argv),
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        trial = Trial(bed, out, backup, proc, rng)
        injected, pending = _inject(trial, faults)
        try:
            code = proc.wait(timeout=FLAGS.timeout + MARGIN)
        except subprocess.TimeoutExpired:
            code = None
        for thread in pending:
            thread.join()
        with open(log_path) as f:
            output = f.read()
        end, why = _judge(code, output, out, reference)
        if not injected:  # the job never paused where its faults were due
            why = f"{why}; no fault injected: {_first_launcher_line(output)}"
        left = _left_behind(bed, proc, out)
        if left:
            end, why = "other", f"{why}; left behind: {left}"
        return {
            "index": index,
            "faults": faults,
            "step": step,
            "injected": injected,
            "end": end,
            "why": why,
            "exit_code": code,
            "seconds": round(time.monotonic() - started, 1),
        }
    finally:
        bed.kill()
        for host in range(bed.n):
            bed.restore(host)
        subprocess.run(["umount", "-l", disk], check=False)
        shutil.rmtree(out, ignore_errors=True)


def _inject(trial: Trial, faults) -> tuple[bool, list]:
    """Waits until both ranks paused after the drawn step, injects the
    faults and lets them go on; returns whether it got there, and the
    threads of faults still under way."""
    deadline = time.monotonic() + FLAGS.timeout
    while len(glob.glob(os.path.join(trial.out, "paused-rank*"))) < 2:
        if trial.proc.poll() is not None or time.monotonic() > deadline:
            return False, []
        time.sleep(0.05)
    pending = [thread for thread in (FAULTS[name](trial) for name in faults) if thread]
    open(os.path.join(trial.out, "go"), "w").close()
    return True, pending


def _first_launcher_line(output: str) -> str:
    """The launcher's first line of its own (a membership change), if any."""
    return next(
        (line for line in output.splitlines() if line.startswith("[launcher] ")),
        "(the launcher said nothing)",
    )


def _judge(code, output: str, out: str, reference) -> tuple[str, str]:
    lines = [line for line in output.splitlines() if line.strip()]
    last = lines[-1] if lines else "(no output)"
    if code is None:
        return "other", f"no end within --timeout + {MARGIN:g}s (a hang)"
    if code == 124:
        return "other", f"the launcher's --timeout: {last}"
    if code != 0:
        if last.startswith("keras-distrib: "):
            return "clear", last
        return "other", f"exit code {code} without a line of the launcher's: {last}"
    finished = sorted(glob.glob(os.path.join(out, "rank*.npz")))
    if not any(p.endswith("rank0.npz") for p in finished):
        return "other", "exit code 0 but rank 0 wrote no final weights"
    worst = 0.0
    for path in finished:
        with np.load(path) as f:
            if int(f["iterations"]) != fault_job.STEPS:
                return "other", f"{os.path.basename(path)}: {int(f['iterations'])} steps"
            weights = [f[k] for k in f.files if k != "iterations"]
        for got, want in zip(weights, reference):
            worst = max(worst, float(np.max(np.abs(got - want))))
    if worst > TOLERANCE:
        return "other", f"exit code 0 with other weights: max |dw| = {worst:.3g}"
    return "exact", f"max |dw| = {worst:.2g}"


def _left_behind(bed, proc, out: str) -> str:
    """What the trial left: processes on the hosts, the shared-memory
    directories of its attempts (each rank records its own)."""
    deadline = time.monotonic() + 15
    while bed.pids() and time.monotonic() < deadline:
        time.sleep(0.2)
    left = []
    pids = bed.pids()
    if pids:
        left.append(f"processes {pids}")
    records = glob.glob(os.path.join(out, "attempts-rank*.txt"))
    shm = {
        a.shm_dir
        for runs in fault_job.attempts(out, len(records)).values()
        for a in runs
        if a.shm_dir != "-"
    }
    files = sorted(d for d in shm if os.path.exists(d))
    if files:
        left.append(f"files {files}")
    if proc.poll() is None:
        left.append("the launcher")
    return ", ".join(left)


def _reference():
    """The final weights of an uninterrupted one-process run."""
    out = tempfile.mkdtemp(prefix="kd-chaos-ref-")
    try:
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "keras_distrib.launch",
                "launch",
                "-n",
                "1",
                FAULTS_SCRIPT,
                "--out",
                out,
                "--backup",
                os.path.join(out, "backup"),
                "--save_freq",
                str(SAVE_FREQ),
            ],
            cwd=ROOT,
            env=env,
            check=True,
            capture_output=True,
            timeout=300,
        )
        return fault_job.results(out, 1)[0][1]
    finally:
        shutil.rmtree(out, ignore_errors=True)


# -- the campaign ---------------------------------------------------------------------


def run() -> int:
    reason = netns_hosts.unavailable()
    if reason:
        print(f"chaos: {reason}", file=sys.stderr)
        return 1
    unknown = sorted(set(FLAGS.faults) - set(FAULTS))
    if unknown:
        print(
            f"chaos: unknown --faults {', '.join(unknown)}; known: {', '.join(FAULTS)}",
            file=sys.stderr,
        )
        return 2
    if FLAGS.quick:
        _harness.quick_defaults(trials=3)
    watch, load = _harness.Stopwatch(), _harness.load_note()
    reference = _reference()
    trials = []
    with netns_hosts.TestBed(2) as bed:
        for index in range(FLAGS.trials):
            trials.append(one_trial(bed, FLAGS.seed, index, reference))
            t = trials[-1]
            print(
                f"  trial {index + 1:2d}: {' + '.join(t['faults']):34s} after step "
                f"{t['step']:2d}: {t['end']:5s} ({t['seconds']:.0f} s) {t['why']}",
                flush=True,
            )
    counts = {end: sum(t["end"] == end for t in trials) for end in ("exact", "clear", "other")}
    injected = [f for t in trials if t["injected"] for f in t["faults"]]
    drawn = sum(len(t["faults"]) for t in trials)
    print(
        f"\n{len(trials)} trials (seed {FLAGS.seed}), 2 hosts x 1 worker, multi_worker, "
        f"--min_workers 1 --max_restarts 4, heartbeat timeout {FLAGS.heartbeat:g} s"
    )
    print(f"faults injected   {len(injected)} of {drawn} drawn ({_harness.name_counts(injected)})")
    print(f"exact ends        {counts['exact']}")
    print(f"clear ends        {counts['clear']}")
    print(f"anything else     {counts['other']} (must be 0)")
    print(f"{load}; wall time {watch.elapsed():.0f} s")
    _harness.save_results(
        FLAGS.json,
        "chaos",
        {
            "seed": FLAGS.seed,
            "heartbeat_s": FLAGS.heartbeat,
            "counts": counts,
            "faults_injected": len(injected),
            "faults_drawn": drawn,
            "trials": trials,
            "misses": [
                f"trial {t['index'] + 1}: {t['why']}" for t in trials if t["end"] == "other"
            ],
        },
        quick=FLAGS.quick,
        load=load,
    )
    return 1 if counts["other"] else 0


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    # Stopped with SIGTERM, the campaign still takes its hosts, mounts and
    # processes down (the `finally` blocks run).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    return run()


if __name__ == "__main__":
    app.run(main)
