"""The one meter: per-step data wait, host->device copy, compute and wall time, and the host's cost.

On CUDA the copy and the step are timed with CUDA events recorded on the stream that does the
work (the copy stream for side-stream copies, the compute stream for the step). Events are only
*read* in `finish()`, after the timed region, so timing adds no synchronisation to the loop.
Host timers measure what the host experiences: waiting for the next batch, and each step's wall.
Over the timed steps the meter also reads the process's minor page faults and CPU time
(`getrusage`), so a loop whose host side thrashes shows it.

What the meter does per step must cost the loop nothing measurable, and in an eager step every
CUDA call counts: an event record costs the loop's thread about what launching a small kernel
does (20-40 us on the cloud hosts measured), so two of them are 3-4% of an eager step of 50-odd
kernels. The meter therefore times the GPU side in samples: runs of `TIMING_RUN` consecutive
steps, one run in every `gpu_timing_every` (the first run of the timed region always, then every
Nth), with two events per step and two per copy inside a run and none outside it. A step
outside the runs has no `compute_ms` (nan in `steps.csv`, not logged as a metric), and a copy
outside them no `h2d_ms`; the summaries over GPU time (`gpu_busy_fraction`, `median_compute_ms`,
`h2d_GBps`, `hidden_h2d_fraction`) are taken over the timed runs, so they are estimates from a
sample of one step in N. Host timings (`data_wait_ms`, `step_ms`, the wall time) are taken at
every step: they cost a clock read. The step's loss tensor is kept as it is for up to
`LOSS_BATCH` steps and the batch of them is written into the loss log with one stack and one copy.

Nothing the meter keeps grows with the steps: events, the loss log and the host timings are
allocated before the loop for the planned number of steps, and the held losses are a fixed ring.
This matters more than it looks: small allocations made between steps that live on (a CUDA
event, a cloned loss tensor per step) land in the gaps glibc's allocator leaves around each
freed multi-megabyte batch, so the next batch no longer fits in the hole the last one left; the
heap grows, is trimmed back to the OS, and every page of every new batch is faulted in again
(thousands of page faults and milliseconds per step for a 16 MB pageable batch). A plain loop
does not do that, and the meter must not either.
"""

from __future__ import annotations

import math
import resource
import statistics
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np
import torch

from trainer.tools.turns import pause_if_asked

# host_clock_s: when the step began (its wait for the batch), on the host's monotonic clock
# (`time.perf_counter`), which every process on the machine shares: steps of several runs line up.
STEP_COLUMNS = ("step", "epoch", "samples", "data_wait_ms", "h2d_ms", "compute_ms", "step_ms", "loss", "host_clock_s")
PREALLOCATE_MAX = 1 << 17  # steps whose events/slots are made up front; longer runs grow in blocks
_GROW = 4096  # steps added at a time past that (one pause every 4096 steps)
LOSS_BATCH = 32  # losses held as tensors, then written to the loss log together (divides both above)
TIMING_RUN = 32  # consecutive steps timed on the GPU, one run in every `gpu_timing_every`


@dataclass
class MeterResult:
    """What a run measured: one row per step and the summaries over the timed steps."""

    rows: List[Dict[str, float]] = field(default_factory=list)
    summary: Dict[str, float] = field(default_factory=dict)


def host_usage() -> tuple:
    """(minor page faults, CPU seconds user+system) of this process so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_minflt, r.ru_utime + r.ru_stime


class _Events:
    """Timing events made ahead of use; `take()` hands out the next one."""

    def __init__(self, n: int):
        self.pool: List[torch.cuda.Event] = []
        self.used = 0
        self.grow(n)

    def grow(self, n: int) -> None:
        self.pool += [torch.cuda.Event(enable_timing=True) for _ in range(n)]

    def take(self) -> torch.cuda.Event:
        if self.used == len(self.pool):
            self.grow(_GROW)
        self.used += 1
        return self.pool[self.used - 1]


class StepMeter:
    """Call order per step: `wait_begin()`, (loader copies: `copy_begin/copy_end`),
    `step_begin(batch_size)`, `step_end(loss)`. The first `warmup_steps` are excluded from the
    summaries; `start_timed()` is called once, after them. `capacity` is the number of steps the
    loop plans to take: storage for them is allocated here, before the loop."""

    def __init__(self, device: torch.device, warmup_steps: int, capacity: int = 4096, gpu_timing_every: int = 1):
        self.device, self.warmup_steps = device, warmup_steps
        self.cuda = device.type == "cuda"
        self.gpu_timing_every = max(1, gpu_timing_every)
        self._timing = False  # whether the current step is timed on the GPU
        self._copies_seen = 0
        self._copy_timing = False
        self.copy_bytes = 0  # the size of the last copy
        self.epoch = 0
        self.setup_s = 0.0
        self.n = 0  # steps begun
        self._cap = 0
        self._host = np.zeros((0, 5))  # per step: data_wait_ms, step_ms, start, end (host clock), wait began
        self._meta = np.zeros((0, 2), dtype=np.int64)  # per step: epoch, samples
        self._loss_blocks: List[torch.Tensor] = []  # the loss log: one value per step, on the device
        self._held: List[Optional[torch.Tensor]] = [None] * LOSS_BATCH  # losses not yet in the log, by step % LOSS_BATCH
        self._logged = 0  # steps whose loss is in the log
        self.ended = 0  # steps that ran to the end (a step interrupted half-way does not count)
        self._begin = self._end = None
        self._stream = None  # the compute stream, from the first step on
        if self.cuda:
            self._begin, self._end = _Events(0), _Events(0)
            self._copy_events = _Events(0)
            self._ref = torch.cuda.Event(enable_timing=True)
            self._ref.record()
        self.copies: List[tuple] = []  # timed copies: (batch, begin event, end event, bytes), in batch order
        self._reserve(min(max(capacity, 1), PREALLOCATE_MAX))
        self._t_wait = 0.0
        self._t0: Optional[float] = None
        self._timed_from = 0
        self._usage0 = (0, 0.0)
        # Where the timed region ended (`end_timed`): clock, wall clock, host usage.
        self._t_end: Optional[float] = None
        self._t_end_unix = 0.0
        self._usage_end: Optional[tuple] = None

    def _reserve(self, n: int) -> None:
        """Room for `n` more steps (before the loop; past PREALLOCATE_MAX, in blocks)."""
        n = -(-n // LOSS_BATCH) * LOSS_BATCH  # whole loss batches: a batch never spans two blocks
        self._cap += n
        self._host = np.concatenate([self._host, np.zeros((n, 5))])
        self._meta = np.concatenate([self._meta, np.zeros((n, 2), dtype=np.int64)])
        self._loss_blocks.append(torch.zeros(n, device=self.device))
        if self.cuda:
            self._begin.grow(n)
            self._end.grow(n)
            self._copy_events.grow(n + 8)  # copies run up to `depth` batches ahead of the steps

    def gpu_timed(self, i: int) -> bool:
        """Whether step (or batch) `i`, counted from 0, is in a run timed on the GPU. Runs are
        counted from the end of the warm-up (warm-up steps are all timed: they cost no timed time)."""
        k = i - self.warmup_steps
        return k < 0 or (k // TIMING_RUN) % self.gpu_timing_every == 0

    # -- copy probe (called by the loader, on the stream doing the copy) -------------------------
    # Called only for a copy on a CUDA stream (trainer.loaders.base, the Lightning loop).
    def copy_begin(self, stream) -> None:
        self._copy_timing = self.gpu_timed(self._copies_seen)
        if self._copy_timing:
            self._copy_start = self._copy_events.take()
            self._copy_start.record(stream)

    def copy_end(self, stream, nbytes: int) -> None:
        if self._copy_timing:
            end = self._copy_events.take()
            end.record(stream)
            self.copies.append((self._copies_seen, self._copy_start, end, nbytes))
        self._copies_seen += 1
        self.copy_bytes = nbytes

    # -- the loop ----------------------------------------------------------------------------
    def wait_begin(self) -> None:
        self._t_wait = time.perf_counter()

    def step_begin(self, samples: int) -> None:
        now = time.perf_counter()
        i = self.n
        if i == self._cap:
            self._reserve(_GROW)
        self.n += 1
        row = self._host[i]
        row[0] = (now - self._t_wait) * 1e3
        row[4] = self._t_wait
        self._meta[i, 0], self._meta[i, 1] = self.epoch, samples
        if self.cuda:
            self._timing = self.gpu_timed(i)
            if self._timing:
                if self._stream is None:  # the stream the steps run on, looked up once: a lookup builds a Stream object
                    self._stream = torch.cuda.current_stream(self.device)
                self._begin.pool[i].record(self._stream)
        else:
            row[2] = now

    def step_end(self, loss: torch.Tensor) -> None:
        i = self.n - 1
        if self.cuda:
            if self._timing:
                self._end.pool[i].record(self._stream)
        else:
            self._host[i, 3] = time.perf_counter()
        self._host[i, 1] = (time.perf_counter() - self._t_wait) * 1e3
        if not self.cuda:
            # On the host a copy costs nothing, and a held CPU loss would keep a small aligned block
            # of the heap alive across the next batches: the hole-splitting described above.
            self._log_view(i, i + 1).copy_(loss.detach())
            self.ended = self._logged = self.n
            return
        # Held, not copied: no device work per step (see above). The step owns `loss` (a graphed
        # step returns a copy of its static output); detached, it keeps no autograd graph alive.
        k = i % LOSS_BATCH
        self._held[k] = loss.detach()
        self.ended = self.n
        if k == LOSS_BATCH - 1:
            self._log_held()

    def _log_held(self) -> None:
        """Write the held losses of steps `_logged + 1 .. ended` into the log: one stack, one copy."""
        lo, hi = self._logged, self.ended
        if hi <= lo:
            return
        held = self._held[lo % LOSS_BATCH:(hi - 1) % LOSS_BATCH + 1]  # never wraps: logged at every batch's end
        self._log_view(lo, hi).copy_(torch.stack(held))
        self._logged = hi

    def _log_view(self, start: int, stop: int) -> torch.Tensor:
        """The loss log of steps `start + 1 .. stop`, inside one block."""
        lo = 0
        for b in self._loss_blocks:
            if start < lo + len(b):
                return b[start - lo:stop - lo]
            lo += len(b)
        raise IndexError(f"steps {start}..{stop} are past the meter's {self._cap}")

    def losses(self, start: int, stop: int) -> torch.Tensor:
        """Losses of steps `start + 1 .. stop`, unread (still on the device)."""
        if stop > self._logged:
            self._log_held()
        blocks, out, lo = self._loss_blocks, [], 0
        for b in blocks:
            hi = lo + len(b)
            if start < hi and stop > lo:
                out.append(b[max(start, lo) - lo:min(stop, hi) - lo])
            lo = hi
        if len(out) == 1:
            return out[0]
        return torch.cat(out) if out else self._loss_blocks[0][:0]

    def start_timed(self) -> None:
        """Start the timed region: one sync so warm-up work does not leak into it."""
        self._sync()
        pause_if_asked()  # under `trainer.tools.turns`: wait here, stopped, for the process it is compared with
        self._t0 = time.perf_counter()
        self._timed_from = self.n
        self._usage0 = host_usage()

    def end_timed(self) -> None:
        """The loop issued its last step: wait for the device and end the timed region here.
        What follows (the loss check's last verdict, closing the loader's threads and buffers)
        is the run's teardown, which a plain `for x, y in loader` loop does not time either."""
        if self._t_end is not None:
            return
        self._sync()
        self._t_end, self._t_end_unix, self._usage_end = time.perf_counter(), time.time(), host_usage()

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    # -- after the loop ----------------------------------------------------------------------
    def finish(self) -> MeterResult:
        """Wait for the device, read every event and compute the summaries."""
        self.end_timed()  # a loop that broke off (error, Ctrl-C) is timed up to now
        self._sync()  # work queued since (the last loss check, a loader's teardown) ends before events are read
        # t1_unix: the wall-clock end of the timed region (see `timed_start_unix_s`)
        t1, t1_unix, usage1 = self._t_end, self._t_end_unix, self._usage_end
        n = self.n = self.ended  # drop a step interrupted between step_begin and step_end
        losses = self.losses(0, n).float().cpu().tolist() if n else []
        rows, spans = [], []
        copies = {c[0]: c[1:] for c in self.copies}
        for i in range(n):
            wait_ms, step_ms, start, end, clock = self._host[i].tolist()
            h2d_ms, nbytes = (math.nan if i < self._copies_seen else 0.0), 0  # nan: copied, not timed
            if i in copies:
                c0, c1, nbytes = copies[i]
                h2d_ms = c0.elapsed_time(c1)
                spans.append((i, self._ref.elapsed_time(c0), self._ref.elapsed_time(c1)))
            if not self.cuda:
                compute_ms, busy = (end - start) * 1e3, (start, end)
            elif self.gpu_timed(i):
                b, e = self._begin.pool[i], self._end.pool[i]
                compute_ms, busy = b.elapsed_time(e), (self._ref.elapsed_time(b), self._ref.elapsed_time(e))
            else:
                compute_ms, busy = math.nan, None
            rows.append({"step": i + 1, "epoch": int(self._meta[i, 0]), "samples": int(self._meta[i, 1]),
                         "data_wait_ms": wait_ms, "h2d_ms": h2d_ms, "compute_ms": compute_ms, "step_ms": step_ms,
                         "loss": losses[i], "host_clock_s": clock, "_bytes": nbytes, "_busy": busy})
        if self._t0 is None:  # warm-up covered every step: nothing was timed
            return MeterResult(rows=rows, summary=self._untimed(rows))
        timed = rows[self._timed_from:]
        faults, cpu_s = usage1[0] - self._usage0[0], usage1[1] - self._usage0[1]
        summary = self._summarise(timed, t1 - self._t0, [sp for sp in spans if sp[0] >= self._timed_from], faults, cpu_s)
        # When, by the clock, the timed region ran: a comparison marks jobs timed at once on one device.
        summary.update(timed_start_unix_s=t1_unix - (t1 - self._t0), timed_end_unix_s=t1_unix)
        return MeterResult(rows=rows, summary=summary)

    def _untimed(self, rows: List[dict]) -> Dict[str, float]:
        return {"timed_steps": 0, "setup_s": self.setup_s, "total_steps": len(rows),
                "total_samples": sum(r["samples"] for r in rows)}

    def _summarise(self, timed: List[dict], wall_s: float, spans, faults: int, cpu_s: float) -> Dict[str, float]:
        wall_ms = max(wall_s * 1e3, 1e-9)
        samples = sum(r["samples"] for r in timed)
        h2d_ms = sum(r["h2d_ms"] for r in timed if not math.isnan(r["h2d_ms"]))
        nbytes = sum(r["_bytes"] for r in timed)
        steps = max(len(timed), 1)
        med = lambda k: median_of_timed(timed, k)  # noqa: E731
        return {
            "throughput_samples_per_s": samples / (wall_ms / 1e3),
            "data_wait_fraction": sum(r["data_wait_ms"] for r in timed) / wall_ms,
            "gpu_busy_fraction": busy_fraction(timed, wall_ms),
            "h2d_GBps": nbytes / (h2d_ms * 1e6) if h2d_ms > 0 else 0.0,
            "hidden_h2d_fraction": _overlap(timed, spans) if self.cuda else 0.0,
            "host_page_faults_per_step": faults / steps,
            "host_cpu_ms_per_step": cpu_s * 1e3 / steps,
            "timed_wall_s": wall_s,
            "timed_steps": len(timed),
            "ms_per_step": wall_ms / steps,
            "median_step_ms": med("step_ms"),
            "median_compute_ms": med("compute_ms"),
            "median_h2d_ms": med("h2d_ms"),
            "median_data_wait_ms": med("data_wait_ms"),
            "setup_s": self.setup_s,
            "total_steps": self.n,
            "total_samples": int(self._meta[:self.n, 1].sum()),
            "final_loss": timed[-1]["loss"] if timed else math.nan,
        }


def median_of_timed(rows: List[dict], key: str) -> float:
    """The median of `key` over the rows that have it (GPU times: the steps timed on the GPU)."""
    values = [r[key] for r in rows if not math.isnan(r[key])]
    return statistics.median(values) if values else (math.nan if rows else 0.0)


def busy_fraction(rows: List[dict], wall_ms: float) -> float:
    """Share of the wall time the GPU spent in steps: the mean `compute_ms` of the steps timed on
    the GPU, for every step (all of them, when every step was timed)."""
    values = [r["compute_ms"] for r in rows if not math.isnan(r["compute_ms"])]
    if not values:
        return math.nan if rows else 0.0
    # Steps on one stream never overlap, so the share is at most 1; a sample of the steps can
    # still put it a little above (a GPU-bound loop whose sampled runs were slower than the rest).
    return min(1.0, statistics.fmean(values) * len(rows) / wall_ms)


def _overlap(timed: List[dict], spans) -> float:
    """Share of copy time during which the compute stream was busy (from event timestamps), over
    the copies made while timed steps ran: inside a run of steps timed on the GPU, from the first
    step's start to the last one's end (copies outside a run ran beside steps nobody timed)."""
    runs: List[list] = []  # [first start, last end] of each run of consecutive GPU-timed steps
    last = None
    for r in timed:
        if r["_busy"] is None:
            continue
        if last is not None and r["step"] == last + 1:
            runs[-1][1] = r["_busy"][1]
        else:
            runs.append([r["_busy"][0], r["_busy"][1]])
        last = r["step"]
    spans = [(a, b) for _, a, b in spans if any(lo <= a and b <= hi for lo, hi in runs)]
    if not spans:
        return 0.0
    busy = sorted(r["_busy"] for r in timed if r["_busy"] is not None)
    total = hidden = 0.0
    j = 0
    for a, b in sorted(spans):
        total += b - a
        while j < len(busy) and busy[j][1] <= a:
            j += 1
        k = j
        while k < len(busy) and busy[k][0] < b:
            hidden += max(0.0, min(b, busy[k][1]) - max(a, busy[k][0]))
            k += 1
    return hidden / total if total > 0 else 0.0
