"""The host clock: when each step waited, began and ended on the host, and the host's cost.

Every step is timed here (a clock read and a few writes into arrays made before the loop); the
timed region's bounds also read the process's minor page faults and CPU time (`getrusage`), so a
loop whose host side thrashes shows it. The clock is `time.perf_counter` (CLOCK_MONOTONIC), which
every process on the machine shares: the steps of several runs line up (`trainer.tools.turns`).
"""

from __future__ import annotations

import math
import os
import resource
import time
from typing import Optional

import numpy as np

from trainer.validate import available_cores


def host_usage() -> tuple:
    """(minor page faults, CPU seconds user+system) of this process so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_minflt, r.ru_utime + r.ru_stime


def host_load() -> dict:
    """The host's load as a run ends: `host_load_per_core`, the 1-minute load average (threads
    running or waiting for a core, every program's, this one's included) over `host_cores`, the
    cores this process may run on (its CPU affinity, which a container or `taskset` narrows)."""
    cores = available_cores()
    try:
        load = os.getloadavg()[0]
    except OSError:  # no load average on this system
        return {"host_cores": float(cores)}
    return {"host_load_per_core": load / cores, "host_cores": float(cores)}


class HostClock:
    """Per step, on the host clock: when its wait for the batch began (`wait_at`), when the step
    began (`start_at`: the batch was there) and ended (`end_at`), its epoch and samples. Room for
    `capacity` steps is made here; `reserve` adds more."""

    def __init__(self, capacity: int):
        self.wait_at = np.zeros(0)
        self.start_at = np.zeros(0)
        self.end_at = np.zeros(0)
        self.epoch = np.zeros(0, dtype=np.int64)
        self.samples = np.zeros(0, dtype=np.int64)
        self.reserve(capacity)
        self._t_wait = 0.0
        # The timed region: where it began and ended (clock, wall clock at the end, host usage).
        self.t0: Optional[float] = None
        self.usage0 = (0, 0.0)
        self.t_end: Optional[float] = None
        self.t_end_unix = 0.0
        self.usage_end: Optional[tuple] = None
        # The loop thread's own CPU time at both ends (`time.thread_time`: this thread only, none of
        # the DataLoader's worker processes or pin thread): what the loop's thread did per step.
        self.thread0 = self.thread_end = math.nan

    def reserve(self, n: int) -> None:
        """Room for `n` more steps (a copy of what is there: before the loop, or rarely past its plan)."""
        grow = lambda a: np.concatenate([a, np.zeros(n, dtype=a.dtype)])  # noqa: E731
        self.wait_at, self.start_at, self.end_at = grow(self.wait_at), grow(self.start_at), grow(self.end_at)
        self.epoch, self.samples = grow(self.epoch), grow(self.samples)

    # -- the loop: a clock read and one or two writes per call, nothing allocated that lives on ------
    def wait_begin(self) -> None:
        self._t_wait = time.perf_counter()

    def step_begin(self, i: int, samples: int, epoch: int) -> None:
        self.start_at[i] = time.perf_counter()
        self.wait_at[i] = self._t_wait
        self.samples[i] = samples
        self.epoch[i] = epoch

    def step_end(self, i: int) -> None:
        self.end_at[i] = time.perf_counter()

    # -- the timed region -------------------------------------------------------------------------
    def start_timed(self) -> None:
        self.t0, self.usage0, self.thread0 = time.perf_counter(), host_usage(), time.thread_time()

    def end_timed(self) -> None:
        self.t_end, self.t_end_unix, self.usage_end = time.perf_counter(), time.time(), host_usage()
        self.thread_end = time.thread_time()

    def timed_span(self) -> tuple:
        """(wall seconds, page faults, CPU seconds, wall-clock end) of the timed region: up to
        `end_timed`, or up to now when it has not ended (read only, nothing is marked)."""
        if self.t_end is None:
            t1, t1_unix, usage1 = time.perf_counter(), time.time(), host_usage()
        else:
            t1, t1_unix, usage1 = self.t_end, self.t_end_unix, self.usage_end
        return t1 - self.t0, usage1[0] - self.usage0[0], usage1[1] - self.usage0[1], t1_unix

    def loop_thread_cpu_s(self) -> float:
        """CPU seconds of the thread that started and ended the timed region, over it (nan before
        it ended: another thread, e.g. a signal's, would read its own clock)."""
        return self.thread_end - self.thread0
