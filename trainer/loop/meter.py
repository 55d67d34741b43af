"""The one meter: per-step data wait, host->device copy, compute and wall time, and the host's cost.

It is made of parts that each do one thing: the host clock (`trainer.loop.clock`: every step's
wait, start and end, the host's page faults and CPU time over the timed region), the GPU event
sampler (`trainer.loop.sampler`: CUDA events around the steps and copies of sampled runs, on the
stream that does the work, read only after the timed region), the loss log
(`trainer.loop.losslog`) and one pure function from rows to summaries (`trainer.loop.summary`),
which every loop uses. A step outside the sampled runs has no `compute_ms` (nan in `steps.csv`,
not logged as a metric) and a copy outside them no `h2d_ms`; the GPU summaries
(`compute_stream_span_fraction`, `median_compute_ms`, `h2d_GBps`, `h2d_beside_step_fraction`) are estimates from
that sample. Host timings (`data_wait_ms`, `step_ms`, the wall time) are taken at every step.

What the meter does per step must cost the loop nothing measurable: no sync, no device read, and
nothing allocated that lives on. Every event, the loss log and the host timings are made before
the loop for the planned number of steps, and the held losses are a fixed ring. This matters more
than it looks: small allocations made between steps that live on (a CUDA event, a cloned loss
tensor per step) land in the gaps glibc's allocator leaves around each freed multi-megabyte
batch, so the next batch no longer fits in the hole the last one left; the heap grows, is trimmed
back to the OS, and every page of every new batch is faulted in again (thousands of page faults
and milliseconds per step for a 16 MB pageable batch). A plain loop does not do that, and the
meter must not either.

After the loop, `host_result()` builds the rows and summaries from the host's side alone (it
cannot fail on a broken device), and `finish()` adds what the device recorded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch

from trainer.loop.clock import HostClock
from trainer.loop.losslog import LOSS_BATCH, LossLog
from trainer.loop.sampler import EventSampler, Schedule
from trainer.loop.summary import summarise

# host_clock_s: when the step began (its wait for the batch), on the host's monotonic clock
# (`time.perf_counter`), which every process on the machine shares: steps of several runs line up.
STEP_COLUMNS = ("step", "epoch", "samples", "data_wait_ms", "h2d_ms", "compute_ms", "step_ms", "loss", "host_clock_s")
PREALLOCATE_MAX = 1 << 20  # steps whose storage and events are made up front; longer runs grow in blocks
_GROW = 4096  # steps added at a time past that (a multiple of LOSS_BATCH)


@dataclass
class MeterResult:
    """What a run measured: one row per step and the summaries over the timed steps."""

    rows: List[Dict[str, float]] = field(default_factory=list)
    summary: Dict[str, float] = field(default_factory=dict)


class StepMeter:
    """Call order per step: `wait_begin()`, (loader copies: `copy_begin/copy_end`),
    `step_begin(batch_size)`, `step_end(loss)`. `start_timed()` is called once, before the first
    timed step: after the first `warmup_steps` (before the first step when there are none).

    `capacity`: the steps the loop plans to take; storage and events for them are made here.
    `gpu_timing_every` and `seed`: which runs of steps are timed on the GPU (`trainer.loop.sampler`).
    `copies_ahead`: how many batches the loader may copy ahead of the steps.
    `on_timed_start`: functions called, in order, where the timed region begins (after its sync):
    a harness's hooks, such as `trainer.tools.turns.pause_if_asked`."""

    def __init__(self, device: torch.device, warmup_steps: int, capacity: int = 4096, gpu_timing_every: int = 1,
                 seed: int = 0, copies_ahead: int = 8, on_timed_start: Sequence[Callable[[], None]] = ()):
        self.device = device
        self.cuda = device.type == "cuda"
        self.on_timed_start = list(on_timed_start)
        self.epoch = 0
        self.setup_s = 0.0
        self.n = 0  # steps begun
        self.ended = 0  # steps that ran to the end (a step interrupted half-way does not count)
        self.schedule = Schedule(warmup_steps, gpu_timing_every, seed)
        planned = min(max(capacity, 1), PREALLOCATE_MAX)
        self._cap = -(-planned // LOSS_BATCH) * LOSS_BATCH  # whole loss batches
        self.clock = HostClock(self._cap)
        self.loss_log = LossLog(device, self._cap)
        self.sampler = EventSampler(self.schedule, device, planned, copies_ahead) if self.cuda else None
        self._timed_from = 0  # the first timed step

    @property
    def batch_bytes(self) -> int:
        """The size of a full batch's copy (the largest copy so far; 0 without CUDA copies)."""
        return self.sampler.batch_bytes if self.sampler is not None else 0

    # -- copy probe (called by the loader for a copy on a CUDA stream, on the stream doing it) -----
    def copy_begin(self, stream) -> None:
        self.sampler.copy_begin(stream)

    def copy_end(self, stream, nbytes: int) -> None:
        self.sampler.copy_end(stream, nbytes)

    # -- the loop ----------------------------------------------------------------------------
    def wait_begin(self) -> None:
        self.clock.wait_begin()

    def step_begin(self, samples: int) -> None:
        i = self.n
        if i == self._cap:  # past the planned steps
            self.clock.reserve(_GROW)
            self.loss_log.reserve(_GROW)
            self._cap += _GROW
        self.n = i + 1
        self.clock.step_begin(i, samples, self.epoch)
        if self.sampler is not None:
            self.sampler.step_begin(i)

    def step_end(self, loss: torch.Tensor) -> None:
        i = self.n - 1
        if self.sampler is not None:
            self.sampler.step_end()
        self.clock.step_end(i)
        self.loss_log.put(i, loss)
        self.ended = self.n

    def losses(self, start: int, stop: int) -> torch.Tensor:
        """Losses of steps `start + 1 .. stop`, unread (still on the device)."""
        return self.loss_log.read(start, stop)

    def start_timed(self) -> None:
        """Start the timed region: one sync so warm-up work does not leak into it, then the
        `on_timed_start` hooks."""
        self._sync()
        for hook in self.on_timed_start:
            hook()
        self.clock.start_timed()
        self._timed_from = self.n

    def end_timed(self) -> None:
        """The loop issued its last step: wait for the device and end the timed region here.
        What follows (the loss check's last verdict, closing the loader's threads and buffers)
        is the run's teardown, which a plain `for x, y in loader` loop does not time either."""
        if self.clock.t_end is not None:
            return
        self._sync()
        self.clock.end_timed()

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    # -- after the loop ----------------------------------------------------------------------
    def host_result(self) -> MeterResult:
        """The rows and summaries of every ended step from the host's side alone: no device read
        and no sync, so it cannot fail on a broken device. On CUDA the GPU times, the losses and
        the GPU summaries are nan (`finish()` has them)."""
        return self._result(self._host_rows(), copy_spans=None if self.cuda else ())

    def finish(self) -> MeterResult:
        """Wait for the device, read every event and the losses, and compute the summaries."""
        self.end_timed()  # a loop that broke off (error, Ctrl-C) is timed up to now
        self._sync()  # work queued since (the last loss check, a loader's teardown) ends before events are read
        rows = self._host_rows()
        if not self.cuda:
            return self._result(rows, copy_spans=())
        for row, loss in zip(rows, self.losses(0, len(rows)).float().cpu().tolist()):
            row["loss"] = loss
        for i, compute_ms, busy in self.sampler.step_times(len(rows)):
            rows[i]["compute_ms"], rows[i]["_busy"] = compute_ms, busy
        spans = []
        for i, h2d_ms, span, nbytes in self.sampler.copy_times():
            if i < len(rows):
                rows[i]["h2d_ms"], rows[i]["_bytes"] = h2d_ms, nbytes
                if i >= self._timed_from:
                    spans.append(span)
        return self._result(rows, spans)

    def journal_rows(self, first: int) -> list:
        """The host clock's columns of steps `first + 1 .. ended` (`trainer.tracking.journal`): read
        from another thread, behind the loop, which writes only the rows of later steps."""
        n, c = self.ended, self.clock
        return [(i + 1, int(c.epoch[i]), int(c.samples[i]), float(c.wait_at[i]), float(c.start_at[i]),
                 float(c.end_at[i])) for i in range(first, n)]

    def _host_rows(self) -> List[dict]:
        """One row per ended step from the host clock; GPU columns nan, and on CUDA the loss too."""
        n, c = self.ended, self.clock
        wait, start, end = c.wait_at[:n].tolist(), c.start_at[:n].tolist(), c.end_at[:n].tolist()
        epochs, samples = c.epoch[:n].tolist(), c.samples[:n].tolist()
        copied = self.sampler.copies if self.sampler is not None else 0  # copies made, timed or not
        losses = [math.nan] * n if self.cuda else self.losses(0, n).tolist()  # on the CPU the log is host memory
        rows = []
        for i in range(n):
            rows.append({"step": i + 1, "epoch": epochs[i], "samples": samples[i],
                         "data_wait_ms": (start[i] - wait[i]) * 1e3,
                         "h2d_ms": math.nan if i < copied else 0.0,  # nan: copied, not timed
                         "compute_ms": math.nan if self.cuda else (end[i] - start[i]) * 1e3,
                         "step_ms": (end[i] - wait[i]) * 1e3, "loss": losses[i], "host_clock_s": wait[i],
                         "_bytes": 0, "_busy": None if self.cuda else (start[i], end[i])})
        return rows

    def _result(self, rows: List[dict], copy_spans: Optional[list]) -> MeterResult:
        summary = {"setup_s": self.setup_s, "total_steps": len(rows), "total_samples": sum(r["samples"] for r in rows)}
        # Warm-up covered every step: nothing was timed (a region started after the last step, when
        # warm-up ends there, holds no step: figures over it would be a throughput of 0 and a step
        # as long as one sync).
        if self.clock.t0 is None or self._timed_from >= len(rows):
            summary["timed_steps"] = 0
            return MeterResult(rows=rows, summary=summary)
        wall_s, faults, cpu_s, end_unix = self.clock.timed_span()
        summary.update(summarise(rows[self._timed_from:], wall_s, faults, cpu_s, copy_spans,
                                 loop_cpu_s=self.clock.loop_thread_cpu_s()))
        # When, by the clock, the timed region ran: a comparison marks jobs timed at once on one device.
        summary.update(timed_start_unix_s=end_unix - wall_s, timed_end_unix_s=end_unix)
        return MeterResult(rows=rows, summary=summary)
