"""The one meter: per-step data wait, host->device copy, compute and wall time.

On CUDA the copy and the step are timed with CUDA events recorded on the stream that does the
work (the copy stream for side-stream copies, the compute stream for the step). Events are only
*read* in `finish()`, after the timed region, so timing adds no synchronisation to the loop.
Host timers measure what the host experiences: waiting for the next batch, and each step's wall.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

STEP_COLUMNS = ("step", "epoch", "samples", "data_wait_ms", "h2d_ms", "compute_ms", "step_ms", "loss")


@dataclass
class MeterResult:
    """What a run measured: one row per step and the summaries over the timed steps."""

    rows: List[Dict[str, float]] = field(default_factory=list)
    summary: Dict[str, float] = field(default_factory=dict)


class StepMeter:
    """Call order per step: `wait_begin()`, (loader copies: `copy_begin/copy_end`),
    `step_begin(batch_size)`, `step_end(loss)`. The first `warmup_steps` are excluded from the
    summaries; `start_timed()` is called once, after them."""

    def __init__(self, device: torch.device, warmup_steps: int):
        self.device, self.warmup_steps = device, warmup_steps
        self.cuda = device.type == "cuda"
        self.copies: List[tuple] = []  # (begin event, end event, bytes), in batch order
        self.steps: List[list] = []  # [epoch, samples, data_wait_ms, start, end, step_ms, loss]
        self.epoch = 0
        self.setup_s = 0.0
        self._t_wait = self._t_step = 0.0
        self._t0: Optional[float] = None
        self._wall_s = 0.0
        self._ref = self._event() if self.cuda else None
        if self._ref is not None:
            self._ref.record()

    def _event(self):
        return torch.cuda.Event(enable_timing=True)

    # -- copy probe (called by the loader, on the stream doing the copy) -------------------------
    def copy_begin(self, stream) -> None:
        self._copy_start = self._event()
        self._copy_start.record(stream)

    def copy_end(self, stream, nbytes: int) -> None:
        end = self._event()
        end.record(stream)
        self.copies.append((self._copy_start, end, nbytes))

    # -- the loop ----------------------------------------------------------------------------
    def wait_begin(self) -> None:
        self._t_wait = time.perf_counter()

    def step_begin(self, samples: int) -> None:
        now = time.perf_counter()
        start = None
        if self.cuda:
            start = self._event()
            start.record()
        self.steps.append([self.epoch, samples, (now - self._t_wait) * 1e3, start or now, None, 0.0, None])

    def step_end(self, loss: torch.Tensor) -> None:
        row = self.steps[-1]
        if self.cuda:
            row[4] = self._event()
            row[4].record()
        else:
            row[4] = time.perf_counter()
        row[5] = (time.perf_counter() - self._t_wait) * 1e3
        row[6] = loss.detach().clone()  # read in finish(); clone: a graphed step reuses its output

    def losses(self, start: int, stop: int) -> List[torch.Tensor]:
        """Loss tensors of steps `start + 1 .. stop`, unread (still on the device)."""
        return [r[6] for r in self.steps[start:stop]]

    def start_timed(self) -> None:
        """Start the timed region: one sync so warm-up work does not leak into it."""
        self._sync()
        self._t0 = time.perf_counter()
        self._timed_from = len(self.steps)

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    # -- after the loop ----------------------------------------------------------------------
    def finish(self) -> MeterResult:
        """Wait for the device, read every event and compute the summaries."""
        self._sync()
        t1 = time.perf_counter()
        t1_unix = time.time()  # wall-clock end of the timed region (see `timed_start_unix_s`)
        if self.steps and self.steps[-1][6] is None:  # interrupted between step_begin and step_end
            self.steps.pop()
        if self._t0 is None:  # fewer steps than warm-up: summarise all of them
            self._t0, self._timed_from = t1, 0
            wall = sum(r[5] for r in self.steps) / 1e3
        else:
            wall = t1 - self._t0
        rows, spans = [], []
        losses = torch.stack([r[6] for r in self.steps]).float().cpu().tolist() if self.steps else []
        for i, (epoch, samples, wait_ms, start, end, step_ms, _) in enumerate(self.steps):
            h2d_ms, nbytes = 0.0, 0
            if i < len(self.copies):
                c0, c1, nbytes = self.copies[i]
                h2d_ms = c0.elapsed_time(c1)
                spans.append((self._ref.elapsed_time(c0), self._ref.elapsed_time(c1)))
            if self.cuda:
                compute_ms = start.elapsed_time(end)
                busy = (self._ref.elapsed_time(start), self._ref.elapsed_time(end))
            else:
                compute_ms, busy = (end - start) * 1e3, (start, end)
            rows.append({"step": i + 1, "epoch": epoch, "samples": samples, "data_wait_ms": wait_ms,
                         "h2d_ms": h2d_ms, "compute_ms": compute_ms, "step_ms": step_ms, "loss": losses[i],
                         "_bytes": nbytes, "_busy": busy})
        summary = self._summarise(rows[self._timed_from:], wall, spans)
        # When, by the clock, the timed region ran: a comparison marks jobs timed at once on one device.
        summary.update(timed_start_unix_s=t1_unix - wall, timed_end_unix_s=t1_unix)
        return MeterResult(rows=rows, summary=summary)

    def _summarise(self, timed: List[dict], wall_s: float, spans) -> Dict[str, float]:
        wall_ms = max(wall_s * 1e3, 1e-9)
        samples = sum(r["samples"] for r in timed)
        h2d_ms = sum(r["h2d_ms"] for r in timed)
        nbytes = sum(r["_bytes"] for r in timed)
        med = lambda k: statistics.median(r[k] for r in timed) if timed else 0.0  # noqa: E731
        summary = {
            "throughput_samples_per_s": samples / (wall_ms / 1e3),
            "data_wait_fraction": sum(r["data_wait_ms"] for r in timed) / wall_ms,
            "gpu_busy_fraction": sum(r["compute_ms"] for r in timed) / wall_ms,
            "h2d_GBps": nbytes / (h2d_ms * 1e6) if h2d_ms > 0 else 0.0,
            "hidden_h2d_fraction": _overlap(timed, spans[self._timed_from:]) if self.cuda else 0.0,
            "timed_wall_s": wall_s,
            "timed_steps": len(timed),
            "median_step_ms": med("step_ms"),
            "median_compute_ms": med("compute_ms"),
            "median_h2d_ms": med("h2d_ms"),
            "median_data_wait_ms": med("data_wait_ms"),
            "setup_s": self.setup_s,
            "total_steps": len(self.steps),
            "total_samples": sum(r[1] for r in self.steps),
            "final_loss": timed[-1]["loss"] if timed else math.nan,
        }
        return summary


def _overlap(timed: List[dict], spans) -> float:
    """Share of copy time during which the compute stream was busy (from event timestamps)."""
    if not spans:
        return 0.0
    busy = sorted(r["_busy"] for r in timed)
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
