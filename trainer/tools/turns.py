"""Processes that take turns on one machine, so that the machine's changing speed hits them alike.

Two runs of a host-bound loop, one after the other, do not see the same machine. On the cloud
hosts this project is measured on, the same thread runs the same Python loop up to twice as fast
in one second as in the next (neighbours on the host, frequency), so two fresh processes timed
a minute apart differ by up to 25% with nothing changed. Run at once, they would compete for
the GPU and the host instead. `take_turns` runs them at once but lets only one run at a time:

1. each process starts with `PAUSE_ENV` set; its loop stops itself (SIGSTOP to its own process
   group: its threads and any DataLoader workers) right where its timed region begins, so
   imports and setup, which take different times, are not part of the comparison;
2. once all have stopped there, they are resumed in turn: every `turn_s` the running one is
   stopped and the next continued, until one of them has finished its loop; the rest then run
   on alone.

Each process records the host's monotonic clock (`time.perf_counter`, CLOCK_MONOTONIC: one clock
for every process on the machine) when each of its steps began. `turn_rates` keeps a step only
when it ran wholly inside one of its own turns, at least `settle_s` after the turn began (so
the other process's GPU work still queued at the switch has drained), and before any process
finished its timed loop: both sides' steps are then drawn from the same seconds of the machine.
Adjacent turns of the two sides make a pair, and their ratios give an interval.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

PAUSE_ENV = "FEEDBENCH_PAUSE_AT_TIMED"  # set: a loop stops itself where its timed region begins


def pause_if_asked() -> None:
    """Called by a loop right before its timed region: under `take_turns`, stop here (the whole
    process group) until resumed. Does nothing otherwise."""
    if os.environ.get(PAUSE_ENV):
        os.killpg(os.getpgrp(), signal.SIGSTOP)


@dataclass
class Turn:
    """Process `who` ran from `start` to `end` (host monotonic clock, seconds)."""

    who: int
    start: float
    end: float


def _state(pid: int) -> str:
    """The process's state letter from /proc ('T': stopped; '' once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the process group: its threads and its DataLoader workers too
    except ProcessLookupError:
        pass


def take_turns(cmds: Sequence[Sequence[str]], logs: Sequence[Path], cwd: Path, turn_s: float = 0.1,
               env: Optional[Dict[str, str]] = None, poll_s: float = 0.005) -> List[Turn]:
    """Run `cmds` (their output to `logs`), one at a time from where each one's timed region
    begins, switching every `turn_s`. Returns the turns; raises `RuntimeError` naming the command
    when one fails. On any error or interrupt, every process is resumed and ended."""
    env = dict(os.environ if env is None else env, **{PAUSE_ENV: "1"})
    procs: List[subprocess.Popen] = []
    try:
        for cmd, log in zip(cmds, logs):
            with open(log, "w") as out:
                procs.append(subprocess.Popen(list(cmd), cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        # Setup: all run at once until each has stopped itself at its timed region (or ended).
        while any(p.poll() is None and _state(p.pid) != "T" for p in procs):
            time.sleep(poll_s)
        _check(procs, cmds, logs)
        turns: List[Turn] = []
        who = 0
        while all(p.poll() is None for p in procs):
            start = time.perf_counter()
            _signal(procs[who], signal.SIGCONT)
            try:
                procs[who].wait(timeout=turn_s)
                end = time.perf_counter()  # it finished during its turn
            except subprocess.TimeoutExpired:
                end = time.perf_counter()
                _signal(procs[who], signal.SIGSTOP)
                # Stopping is asynchronous: the next process starts only once this one is still.
                while _state(procs[who].pid) not in ("T", "") and procs[who].poll() is None:
                    time.sleep(0.0002)
            turns.append(Turn(who, start, end))
            who = (who + 1) % len(procs)
        # One has ended. Failed, it is said now, and the others are ended (below), not waited for;
        # else it finished its loop (and its run): the others run on, alone, to their end.
        _check(procs, cmds, logs)
        for p in procs:
            _signal(p, signal.SIGCONT)
        for p in procs:
            p.wait()
        _check(procs, cmds, logs)
        return turns
    finally:
        for p in procs:
            if p.poll() is None:  # an error or an interrupt here: leave nothing stopped behind
                _signal(p, signal.SIGCONT)
                _signal(p, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                _signal(p, signal.SIGKILL)
                p.wait()


def _check(procs, cmds, logs) -> None:
    for p, cmd, log in zip(procs, cmds, logs):
        if p.poll() not in (None, 0):
            tail = Path(log).read_text()[-2000:]
            raise RuntimeError(f"{' '.join(cmd[2:])} failed (exit {p.returncode}):\n{tail}")


def turn_rates(starts: Sequence[np.ndarray], turns: Sequence[Turn], settle_s: float = 0.02) -> dict:
    """Per process, ms per step over the steps that ran wholly inside its own turns.

    `starts[k]`: when each of process k's timed steps began, on the host's monotonic clock (a
    step lasts until the next one begins, so the last entry only ends the step before). Steps count from
    `settle_s` after their turn began to its end, and only before the first process's last step
    (after that the others run alone). Returns `ms_per_step` per process, `steps` counted per
    process, `pair_ratios` (process 1's ms/step ÷ process 0's, in adjacent turns) and `turns`.
    """
    ends = [s[-1] for s in starts if len(s) > 1]
    window_end = min(ends) if len(ends) == len(starts) else -np.inf
    per_turn: List[tuple] = []  # (who, ms/step in that turn, steps)
    for t in turns:
        s = starts[t.who]
        begin, end = s[:-1], s[1:]
        keep = (begin >= t.start + settle_s) & (end <= min(t.end, window_end))
        if keep.any():
            per_turn.append((t.who, float((end[keep] - begin[keep]).sum()) * 1e3, int(keep.sum())))
    ms, steps = [], []
    for k in range(len(starts)):
        total = sum(m for w, m, _ in per_turn if w == k)
        n = sum(c for w, _, c in per_turn if w == k)
        ms.append(total / n if n else float("nan"))
        steps.append(n)
    pairs = []  # each turn of process 1 against the turn of process 0 just before it
    for a, b in zip(per_turn, per_turn[1:]):
        if a[0] == 0 and b[0] == 1:
            pairs.append((b[1] / b[2]) / (a[1] / a[2]))
    return {"ms_per_step": ms, "steps": steps, "pair_ratios": pairs, "turns": len(per_turn)}
