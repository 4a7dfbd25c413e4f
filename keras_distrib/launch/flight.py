"""The launcher's side of the flight recorder: every rank's account, one screen.

Each rank keeps an account of where it is (its step, the collectives it
waits in and for how long, every thread's stack; see
`keras_distrib.collectives.flight_recorder`) and prints it as one line
when asked on its control channel (its standard input) or when it stalls
on its own (its collective watchdog fired, it lost a peer). The children's
output streams hand such lines to the printer's `output.Accounts` instead
of printing them.

`show(children, accounts, err, why)` asks every running child for its
account, waits up to `ANSWER_SECONDS` for the answers, and prints one
screen: per rank its step and where it is (the collective it waits in and
for how long, or the innermost line of the user's code its main thread is
at), the ranks that did not answer (stopped by SIGSTOP, or gone), and the
ranks that did not arrive at the collective the others wait in. Then every
thread's stack, rank by rank. The launcher shows it on `kill -USR1
<launcher pid>` (and goes on), when no rank finished a training step for
`--stall_warning` seconds (`NoProgress`; the ranks say they progress in a
short line at most once a second; the job goes on), when an attempt times
out, and when a rank fails after any rank stalled.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence, TextIO

from keras_distrib.launch.output import Accounts
from keras_distrib.launch.processes import describe_stopped

# How long the launcher waits for the ranks' answers.
ANSWER_SECONDS = 5.0


def show(
    children: Sequence,
    accounts: Accounts,
    err: TextIO,
    why: str,
    since: Optional[float] = None,
    seconds: float = ANSWER_SECONDS,
) -> None:
    """Asks the running children for their accounts and prints the screen.

    `since`: accounts given before the request but after this moment (a
    rank that reported its stall and exited) count too.
    """
    asked = time.monotonic()
    # Only children whose recorder said it answers are waited for (a script
    # that does not import keras_distrib has none).
    answering = [c for c in children if c.running and accounts.ready_since(c.label, c.started)]
    for child in answering:
        child.ask_report(why)
    accounts.wait_for([c.label for c in answering], asked, seconds)
    given = accounts.since(asked if since is None else min(since, asked))
    if not answering and not given:
        return  # no rank runs a recorder: nothing to show
    ready = frozenset(c.label for c in answering)
    err.write(render(children, given, why, seconds, ready) + "\n")
    err.flush()


class NoProgress:
    """`--stall_warning`: shows the screen (`show(why)`) when no rank
    finished a training step for `seconds` (> 0), once per stall, the job
    going on. Armed by the first step after `started` (an attempt's start:
    loading and building take as long as they take)."""

    def __init__(self, accounts: Accounts, seconds: float, show, started: float):
        self._accounts, self._seconds, self._show = accounts, seconds, show
        self._started = started
        self._shown_for: Optional[float] = None  # the last progress a screen was shown after

    def check(self) -> None:
        if not self._seconds:
            return
        last = self._accounts.last_progress()
        if last is None or last < self._started or last == self._shown_for:
            return
        if time.monotonic() - last >= self._seconds:
            self._shown_for = last
            self._show(
                f"no rank finished a training step for {self._seconds:g}s "
                "(--stall_warning); the job goes on"
            )


def render(
    children: Sequence, given: dict, why: str, seconds: float, ready: frozenset = frozenset()
) -> str:
    """The screen for `given` accounts (`{label: account}`) of `children`,
    of which those labelled in `ready` have a recorder."""
    lines = [f"keras-distrib: flight recorder ({why}):"]
    for child in children:
        account = given.get(child.label)
        if account is None:
            lines.append(f"  {child.label}: {_silent(child, seconds, child.label in ready)}")
            continue
        lines.append(
            f"  {child.label} (pid {account['pid']} on {account['host']}): "
            f"{_step(account['step'])}; {_waiting(account)}"
        )
        lines.append(f"      at {_where(account)}")
        if not account["asked"]:
            lines.append(f"      reported on its own: {account['reason']}")
    missing = not_arrived(children, given)
    if missing:
        lines.append(
            f"keras-distrib: did not arrive at the collective the others wait in: "
            f"{', '.join(missing)}."
        )
    for child in children:
        account = given.get(child.label)
        if account is not None:
            lines += _stacks(child.label, account)
    return "\n".join(lines)


def not_arrived(children: Sequence, given: dict) -> list[str]:
    """The children not waiting in the collective that waiting ranks of the
    furthest step wait in (those that did not answer included)."""
    waiting = {label: account for label, account in given.items() if account["collectives"]}
    if not waiting:
        return []
    furthest = max(_steps_done(account) for account in waiting.values())
    return [
        c.label
        for c in children
        if c.label not in waiting or _steps_done(waiting[c.label]) < furthest
    ]


def _steps_done(account: dict) -> int:
    return (account["step"] or {}).get("steps_done", 0)


def _silent(child, seconds: float, accounts_ready: bool) -> str:
    if not child.running:
        return f"exited with code {child.exit_code}; no account"
    if not accounts_ready:
        return "no flight recorder (it has not imported keras_distrib)"
    stopped = describe_stopped(child)
    if stopped:
        return f"no answer within {seconds:g}s: {stopped.removeprefix(child.label + ' ')}"
    return (
        f"no answer within {seconds:g}s (its host or the connection to it may be down, "
        "or it holds the GIL in native code)"
    )


def _step(step: Optional[dict]) -> str:
    if step is None:
        return "no training step done yet"
    return f"step {step['steps_done']} done (epoch {step['epoch']}, step {step['step']})"


def _waiting(account: dict) -> str:
    collectives = account["collectives"]
    if not collectives:
        return "in no collective"
    first = collectives[0]
    return f"waiting {first['waited']:.1f}s in {first['what']}"


def _where(account: dict) -> str:
    """The innermost line of the user's code in the main thread (else its
    innermost line)."""
    main = next((t for t in account["threads"] if t["main"]), None)
    if main is None or not main["frames"]:
        return "(no main thread)"
    frames = main["frames"]
    frame = next((f for f in reversed(frames) if f[4]), frames[-1])
    filename, lineno, function, text = frame[:4]
    return f"{filename}:{lineno} in {function}" + (f": {text}" if text else "")


def _stacks(label: str, account: dict) -> list[str]:
    lines = [f"keras-distrib: {label}'s threads (innermost call last):"]
    for thread in account["threads"]:
        lines.append(f"  thread {thread['name']}{' (main)' if thread['main'] else ''}:")
        for filename, lineno, function, text, _ in thread["frames"]:
            lines.append(f"    {filename}:{lineno} in {function}" + (f": {text}" if text else ""))
    return lines
