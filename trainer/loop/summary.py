"""The summaries of a run: one pure function from the timed steps' rows to figures, for every loop.

A row is one step, as in `steps.csv` (`trainer.loop.meter.STEP_COLUMNS`), plus the meter's
private `_bytes` (bytes of the step's batch copy, when that copy was timed on the GPU) and `_busy`
(`(start, end)` of the step's span on the compute stream in ms on the meter's reference clock, or
None when not timed). A GPU time that was not taken is nan: the GPU figures are taken over the
steps that have one, so with `engine.gpu_timing_every=N` they are estimates from a sample of the
steps.

The GPU figures here come from CUDA events around the step on the compute stream: they span the
step from its first launch to its last, so for an eager step whose host launches slower than the
device runs them, they include the host's gaps between launches. Their names say so
(`compute_stream_span_fraction`, `h2d_beside_step_fraction`); what the kernels themselves did is
measured by the kernel window (`trainer.loop.profiling.kernel_figures`).
"""

from __future__ import annotations

import math
import statistics
from typing import Dict, List, Optional, Sequence, Tuple

# Figures only a CUDA device gives (its copies' rate and overlap, its compute stream): nan on a CPU
# run, never a 0 that reads as measured. (`median_h2d_ms` stays 0 there: no copy takes no time.)
GPU_FIGURES = ("compute_stream_span_fraction", "h2d_GBps", "h2d_beside_step_fraction")
BLOCKS = 10  # blocks of consecutive steps for the interval of ms_per_step (fewer when fewer steps)
# Student's t, 97.5th percentile, for 1..BLOCKS-1 degrees of freedom: a 95% interval from few blocks.
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262)


def summarise(rows: List[dict], wall_s: float, faults: int = 0, cpu_s: float = 0.0,
              copy_spans: Optional[Sequence[Tuple[float, float]]] = (), loop_cpu_s: float = math.nan) -> Dict[str, float]:
    """Figures over the timed steps `rows`, which took `wall_s` seconds and cost the process
    `faults` minor page faults and `cpu_s` CPU seconds, `loop_cpu_s` of them on the loop's own
    thread (nan: not read). `copy_spans`: `(start, end)` of each timed
    copy on the reference clock of `_busy` (None: unknown, `h2d_beside_step_fraction` is nan).
    Rows with a `lightning_ms` column (the Lightning loop) add `lightning_fraction` and its median."""
    wall_ms = max(wall_s * 1e3, 1e-9)
    steps = max(len(rows), 1)
    total = lambda k: sum(r[k] for r in rows)  # noqa: E731
    med = lambda k: median_of_timed(rows, k)  # noqa: E731
    summary = {
        "throughput_samples_per_s": total("samples") / (wall_ms / 1e3),
        "data_wait_fraction": total("data_wait_ms") / wall_ms,
        "compute_stream_span_fraction": stream_span_fraction(rows, wall_ms),
        "h2d_GBps": h2d_rate(rows),
        "h2d_beside_step_fraction": math.nan if copy_spans is None else beside_step_fraction(rows, copy_spans),
        "host_page_faults_per_step": faults / steps,
        "host_cpu_ms_per_step": cpu_s * 1e3 / steps,
        # The loop thread's busy time per step: what its own work (launching, the feed's work in
        # `next`, a copy it waits on) costs; a wait on workers or on the device that sleeps is not in it.
        "loop_thread_cpu_ms_per_step": loop_cpu_s * 1e3 / steps,
        "host_cpu_s_per_wall_s": cpu_s / (wall_ms / 1e3),  # 1: one core's worth all along; less: the process waited
        "timed_wall_s": wall_s,
        "timed_steps": len(rows),
        "ms_per_step": wall_ms / steps,
        **step_interval(rows, wall_s),
        "median_step_ms": med("step_ms"),
        # The host's time in the step itself, its batch in hand: on a GPU, what launching the
        # step's work costs the loop's thread (a graph's replay: tens of microseconds).
        "median_host_step_ms": statistics.median(r["step_ms"] - r["data_wait_ms"] for r in rows) if rows else 0.0,
        "median_compute_ms": med("compute_ms"),
        "median_h2d_ms": med("h2d_ms"),
        "median_data_wait_ms": med("data_wait_ms"),
        "final_loss": rows[-1]["loss"] if rows else math.nan,
    }
    if rows and "lightning_ms" in rows[0]:
        summary.update(lightning_fraction=total("lightning_ms") / wall_ms, median_lightning_ms=med("lightning_ms"))
    return summary


def step_interval(rows: List[dict], wall_s: float) -> Dict[str, float]:
    """`ms_per_step_ci_low/high`: the 95% interval of ms per step over `rows`, the timed steps,
    which took `wall_s` seconds from the first one's wait (see the module's docstring); nan with
    fewer than 2 steps. Built on the log of each block's ms per step: a time is positive, and one
    stalled block makes the spread of the times, not a negative lower bound (the plain batch-means
    interval of 170 ms/step measured ±184 on a busy host); the interval is centred, on that scale,
    on ms_per_step, and never reaches 0."""
    n = len(rows)
    blocks = min(BLOCKS, n)
    if blocks < 2:
        return {"ms_per_step_ci_low": math.nan, "ms_per_step_ci_high": math.nan}
    firsts = [round(b * n / blocks) for b in range(blocks + 1)]  # sizes differ by one step at most
    starts = [rows[i]["host_clock_s"] for i in firsts[:-1]] + [rows[0]["host_clock_s"] + wall_s]
    per_step = [(starts[b + 1] - starts[b]) * 1e3 / (firsts[b + 1] - firsts[b]) for b in range(blocks)]
    logs = [math.log(max(ms, 1e-9)) for ms in per_step]  # (a block's span is > 0 on a monotonic clock)
    half = T_975[blocks - 2] * statistics.stdev(logs) / math.sqrt(blocks)
    ms = wall_s * 1e3 / n  # centred on ms_per_step, the figure it qualifies
    return {"ms_per_step_ci_low": ms * math.exp(-half), "ms_per_step_ci_high": ms * math.exp(half)}


def median_of_timed(rows: List[dict], key: str) -> float:
    """The median of `key` over the rows that have it (GPU times: the steps timed on the GPU)."""
    values = [r[key] for r in rows if not math.isnan(r[key])]
    return statistics.median(values) if values else (math.nan if rows else 0.0)


def stream_span_fraction(rows: List[dict], wall_ms: float) -> float:
    """Share of the wall time the compute stream spent between a step's first and last launch:
    the mean `compute_ms` of the steps timed on the GPU, for every step (all of them, when every
    step was timed). Not the device's busy time: an eager step's host gaps count too."""
    values = [r["compute_ms"] for r in rows if not math.isnan(r["compute_ms"])]
    if not values:
        return math.nan if rows else 0.0
    # Steps on one stream never overlap, so the share is at most 1; a sample of the steps can
    # still put it a little above (a GPU-bound loop whose sampled runs were slower than the rest).
    return min(1.0, statistics.fmean(values) * len(rows) / wall_ms)


def h2d_rate(rows: List[dict]) -> float:
    """GB/s of the timed copies; 0 when no step copied, nan when copies were made but none timed."""
    timed = [r for r in rows if not math.isnan(r["h2d_ms"])]
    ms = sum(r["h2d_ms"] for r in timed)
    if ms > 0:
        return sum(r["_bytes"] for r in timed) / (ms * 1e6)
    return math.nan if len(timed) < len(rows) else 0.0


def beside_step_fraction(rows: List[dict], copy_spans: Sequence[Tuple[float, float]]) -> float:
    """Share of copy time that fell within a step's span on the compute stream (from event
    timestamps), which is not time a kernel ran (`h2d_overlapped_by_kernels_fraction` is), over
    the copies made while timed steps ran: inside a run of steps timed on the GPU, from the first
    step's start to the last one's end (copies outside a run ran beside steps nobody timed)."""
    runs: List[list] = []  # [first start, last end] of each run of consecutive GPU-timed steps
    last = None
    for r in rows:
        if r["_busy"] is None:
            continue
        if last is not None and r["step"] == last + 1:
            runs[-1][1] = r["_busy"][1]
        else:
            runs.append([r["_busy"][0], r["_busy"][1]])
        last = r["step"]
    spans = [(a, b) for a, b in copy_spans if any(lo <= a and b <= hi for lo, hi in runs)]
    if not spans:
        return 0.0
    busy = sorted(r["_busy"] for r in rows if r["_busy"] is not None)
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
