"""Profiler traces and what they say.

`engine.profile=true`: a torch.profiler trace of the last warm-up steps, and whether its
host->device copies overlapped kernels (`copy_overlap`). Open the trace (an MLflow artifact) in
https://ui.perfetto.dev or chrome://tracing.

`engine.kernel_window_steps=N` (`KernelWindow`): after the timed region, N more steps under a
CUDA-only profiler, and what the kernels themselves did in them (`kernel_figures`): the honest
device figures that CUDA events around a step cannot give, since an eager, launch-bound step's
events also span the host's gaps between its launches.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch.profiler import ProfilerActivity, profile, schedule


class StepProfiler:
    """Call `step()` once per training step; records up to `active` steps ending with step `skip`.

    The traced steps are the last ones of the warm-up (after one profiler warm-up step), so the
    timed steps run unprofiled and the trace is written before the timed region starts. A warm-up
    of fewer than 2 steps leaves no room: the trace then covers the first timed steps.
    """

    def __init__(self, enabled: bool, out_dir: Path, skip: int, active: int = 5):
        self.trace: Optional[Path] = None
        self._prof = None
        self.steps = 0
        self.sync_after: Tuple[int, ...] = ()  # steps after which the device is synced (see below)
        self._cuda = False
        if not enabled:
            return
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        else:
            # Kineto, the profiler's C++ side, prints its start and stop on stderr and, without a GPU
            # driver, "gpuGetDeviceCount failed": noise on a CPU run. It reads this when it first
            # starts; 6 is above its highest level (a value the user set is kept).
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        active = min(active, max(1, skip - 1))
        wait = max(0, skip - active - 1)
        # The device is synced right before recording starts and right before it stops (on the
        # steps that end there), while still in the warm-up. A loop that runs ahead of the GPU
        # would otherwise record copies that ran beside kernels launched before the window
        # (which the trace does not hold) and kernels that ran after it: the copies would look
        # serialised when they were hidden. The timed steps are not synced.
        self.sync_after = tuple(n for n in (wait + 1, wait + 1 + active) if n <= skip)
        self._cuda = torch.cuda.is_available()
        self.trace = Path(out_dir) / "trace.json"
        self._prof = profile(activities=activities, schedule=schedule(wait=wait, warmup=1, active=active, repeat=1),
                             on_trace_ready=lambda p: p.export_chrome_trace(str(self.trace)))
        self._prof.__enter__()

    def step(self) -> None:
        if self._prof is not None:
            self.steps += 1
            if self._cuda and self.steps in self.sync_after:
                torch.cuda.synchronize()
            self._prof.step()

    def close(self) -> Optional[Path]:
        """Stop profiling; returns the trace file if one was written."""
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self._prof = None
        return self.trace if self.trace is not None and self.trace.exists() else None


Span = Tuple[float, float]
# The figures of a kernel window, nan when it was not taken (`KernelWindow.reason` says why).
WINDOW_FIGURES = ("gpu_kernel_busy_fraction", "gpu_kernel_ms_per_step", "gpu_gap_in_step_ms_per_step",
                  "gpu_idle_between_steps_ms_per_step", "launch_gap_ms", "h2d_overlapped_by_kernels_fraction",
                  "kernel_window_ms_per_step")
WINDOW_TRACE = "kernel_window.json"


def cupti_detaches() -> bool:
    """Whether this build's CUDA lets CUPTI be detached when a trace ends (`TEARDOWN_CUPTI=1`):
    from CUDA 12.6 on. Before it, detaching crashes a process that replays CUDA graphs
    (pytorch#112507), and CUPTI left attached slows every later launch of the process by 10-20%
    (pytorch#144455)."""
    version = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2] if v.isdigit())
    return version >= (12, 6)


class KernelWindow:
    """`engine.kernel_window_steps=N`: after the timed region, one more step and then N steps under
    a CUDA-only profiler (kernels, copies and CUDA runtime calls; no CPU operator is recorded,
    which would slow the very launches it measures). `kernel_figures` reads the trace.

    Why after the timed region rather than among its steps: attaching CUPTI costs the host up to
    seconds, its buffers and the trace's processing reshape the host heap that the timed steps'
    page faults depend on (`trainer.loop.meter`), and CUPTI left attached slows every later
    launch. After the timed region nothing timed follows, and CUPTI is detached when the trace
    ends, so a sweep's next job in this process runs as if no window had been. The window's
    steps continue the run's loader where the timed region left it; they are not metered, not
    checksummed and not counted in `total_steps`.

    The device is idle when the window begins and when it ends (a sync each side), and the
    loop thread marks every step boundary in the trace with `cudaStreamQuery` on the compute
    stream (a runtime call that does no device work), so each kernel can be given to the step
    that launched it. `reason`: why there are no figures ("" when the window was taken).
    """

    def __init__(self, steps: int, device: torch.device, out_dir: Path, off_because: str = ""):
        self.steps, self.device = steps, device
        self.trace = Path(out_dir) / WINDOW_TRACE
        self.wall_s = math.nan
        self.done = 0  # steps traced
        self.reason = off_because or (_cannot_trace(device) if steps > 0 else "off (engine.kernel_window_steps=0)")

    @property
    def enabled(self) -> bool:
        return not self.reason

    def run(self, step_fn: Callable, batches: Iterable) -> None:
        """Take the window over the next `steps` + 1 `batches`. A failure never fails the run:
        its figures are then nan and `reason` says why."""
        if not self.enabled:
            return
        try:
            self._record(step_fn, iter(batches))
        except Exception as e:
            self.done, self.reason = 0, f"failed: {type(e).__name__}: {' '.join(str(e).split())[:200]}"

    def _record(self, step_fn: Callable, batches) -> None:
        first = next(batches, None)
        if first is None:
            self.reason = "no batch left to trace"
            return
        stream = torch.cuda.current_stream(self.device)
        os.environ.setdefault("TEARDOWN_CUPTI", "1")  # detach CUPTI when the trace ends (`cupti_detaches`)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step_fn(*first)  # traced, not counted: the first launches after CUPTI attaches pay for it
            del first
            torch.cuda.synchronize(self.device)
            start = time.perf_counter()
            stream.query()  # marks where the window begins (the device is idle)
            for x, y in itertools.islice(batches, self.steps):
                step_fn(x, y)
                stream.query()  # marks the end of this step's launches
                self.done += 1
            torch.cuda.synchronize(self.device)  # every kernel of the window has ended
            self.wall_s = time.perf_counter() - start
        prof.export_chrome_trace(str(self.trace))

    def figures(self) -> Dict[str, float]:
        """`WINDOW_FIGURES` of the trace; nan when the window was not taken."""
        if self.enabled and self.done and self.trace.is_file():
            try:
                return kernel_figures(self.trace, self.done, self.wall_s)
            except (ValueError, KeyError, TypeError) as e:  # a trace this reader does not understand
                self.reason = f"failed: its trace could not be read ({type(e).__name__}: {e})"
        return dict.fromkeys(WINDOW_FIGURES, math.nan)


def _cannot_trace(device: torch.device) -> str:
    """Why this process cannot take a kernel window ("" when it can)."""
    if device.type != "cuda":
        return "no CUDA: a CPU run has no kernels to trace"
    if not torch.autograd.kineto_available():
        return "this PyTorch was built without Kineto, the profiler that traces kernels"
    if not cupti_detaches():
        return (f"CUDA {torch.version.cuda} < 12.6: CUPTI cannot be detached after a trace there, and left "
                f"attached it slows every later step of this process")
    return ""


def kernel_figures(trace: Path, steps: int, wall_s: float) -> Dict[str, float]:
    """What the kernels did in a `KernelWindow` trace of `steps` steps that took `wall_s` seconds.

    - `gpu_kernel_busy_fraction`: the union of the kernels' intervals (any stream) over the
      window's wall time: how much of the time the device computed;
    - `gpu_kernel_ms_per_step`: that union per step, the device time the step needs;
    - `gpu_gap_in_step_ms_per_step`, `gpu_idle_between_steps_ms_per_step`: per step, the time
      no kernel ran inside a step's span on the device, and outside every step's span (the
      device waiting for the next batch or the host's next step); with `gpu_kernel_ms_per_step`
      they add up to `kernel_window_ms_per_step` (nan when the trace lacks the step markers);
    - `launch_gap_ms`: per step, the time between the first and the last kernel the step
      launched during which none ran: the device waiting for the host's next launch (nan when
      the trace lacks the step markers);
    - `h2d_overlapped_by_kernels_fraction`: the share of the host->device copies' time during
      which a kernel ran on their device (nan: no copy in the window);
    - `kernel_window_ms_per_step`: the window's own wall time per step; against `ms_per_step`,
      what tracing cost the steps.
    """
    events = _complete_events(trace)
    _, markers = _step_markers(events, steps + 1)
    # Before the first marker the device only finished the untraced step (a sync came between).
    start = markers[0] if markers else -math.inf
    launched_at = {e["args"]["correlation"]: e["ts"] for e in events
                   if e["cat"] in ("cuda_runtime", "cuda_driver") and "correlation" in e["args"]}
    kernels: Dict[object, List[Span]] = defaultdict(list)  # by device
    copies: Dict[object, List[Span]] = defaultdict(list)
    on_device = []  # (span, when launched) of the work that keeps the device's engines busy
    for e in events:
        if e["ts"] < start:
            continue
        span = (e["ts"], e["ts"] + e["dur"])
        if e["name"].startswith("Memcpy HtoD"):
            copies[e["pid"]].append(span)
        # Copies within the device (a graphed step's input copy) and memsets fill a step too;
        # a copy over PCIe does not: the device may idle while one runs on a side stream.
        if e["cat"] == "kernel" or e["cat"] == "gpu_memset" or e["name"].startswith("Memcpy DtoD"):
            on_device.append((span, launched_at.get(e["args"].get("correlation"))))
            if e["cat"] == "kernel":
                kernels[e["pid"]].append(span)
    kernel_spans = [span for spans in kernels.values() for span in spans]
    busy_us = _length(_union(kernel_spans))
    hidden, total = _overlap(copies, kernels)
    gap_in_step = idle_between = launch_gap = math.nan
    if markers:
        by_step = _work_by_step(on_device, markers, steps)
        launch_gap = sum((work[-1][1] - work[0][0]) - _length(work) for work in by_step.values()) / 1e3 / steps
        # Where the device's wall time went, each instant counted once: a kernel ran; else it lay
        # inside a step's span (`_work_by_step`: from the start of the first to the end of the last
        # kernel, memset or copy within the device that the step launched), a gap in the step;
        # else between steps: before the first step's work, between one step's last work and the
        # next one's first (where a copy from the host in line with the step falls), after the
        # last. The wall is the host's clock around the window, which begins before the first
        # marker and ends after the closing sync: it holds every span, so the rest is >= 0.
        in_steps_us = _length(_union(kernel_spans + [(work[0][0], work[-1][1]) for work in by_step.values()]))
        gap_in_step = (in_steps_us - busy_us) / 1e3 / steps
        idle_between = (wall_s * 1e6 - in_steps_us) / 1e3 / steps
    return {"gpu_kernel_busy_fraction": min(1.0, busy_us / (wall_s * 1e6)) if wall_s > 0 else math.nan,
            "gpu_kernel_ms_per_step": busy_us / 1e3 / steps,
            "gpu_gap_in_step_ms_per_step": gap_in_step,
            "gpu_idle_between_steps_ms_per_step": idle_between,
            "launch_gap_ms": launch_gap,
            "h2d_overlapped_by_kernels_fraction": hidden / total if total > 0 else math.nan,
            "kernel_window_ms_per_step": wall_s * 1e3 / steps}


def _step_markers(events: List[dict], count: int) -> Tuple[Optional[tuple], List[float]]:
    """The thread (pid, tid) that made the `count` step markers (`cudaStreamQuery`) and their
    times, in order; (None, []) when no thread made exactly that many (another caller's queries
    mixed in)."""
    by_thread: Dict[tuple, List[float]] = defaultdict(list)
    for e in events:
        if e["cat"] == "cuda_runtime" and e["name"].startswith("cudaStreamQuery"):
            by_thread[(e["pid"], e["tid"])].append(e["ts"])
    found = [(thread, sorted(ts)) for thread, ts in by_thread.items() if len(ts) == count]
    return found[0] if len(found) == 1 else (None, [])


def step_annotated_trace(trace: Path, steps: int, out: Path) -> Path:
    """Write at `out` a copy of a `KernelWindow` trace of `steps` steps for tools that find steps
    where torch.profiler's `step()` marks them (Holistic Trace Analysis, docs/metrics.md): the
    window's steps only, each spanned by a `ProfilerStep#i` range on the thread that marked it."""
    thread, markers = _step_markers(_complete_events(trace), steps + 1)
    if thread is None:
        raise ValueError(f"{trace}: no thread made the {steps + 1} step markers of a {steps}-step kernel window")
    data = json.loads(Path(trace).read_text())
    kept = [e for e in data.get("traceEvents", []) if e.get("ph") == "M" or float(e.get("ts", 0)) >= markers[0]]
    end = max(float(e["ts"]) + float(e.get("dur", 0)) for e in kept if e.get("ph") != "M")
    # One more range, from the last marker to the end: such tools leave a trace's last step out
    # as unfinished, and this one holds only the closing sync.
    bounds = markers + [max(end, markers[-1])]
    kept += [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{i}", "pid": thread[0], "tid": thread[1],
              "ts": a, "dur": b - a, "args": {"Record function id": 0}} for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    data["traceEvents"] = kept
    data.setdefault("distributedInfo", {"rank": 0})  # where HTA reads a trace's rank
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data))
    return out


def _work_by_step(on_device: List[tuple], markers: List[float], steps: int) -> Dict[int, List[Span]]:
    """The device work (`(span, launch time)`) of each step that launched some, merged: step i's
    is what was launched between markers i and i + 1 (a launch time of None: not known, left
    out). Its first span's start and last span's end bound the step on the device."""
    per_step: Dict[int, List[Span]] = defaultdict(list)
    for span, launched in on_device:
        if launched is None:
            continue
        i = bisect.bisect_right(markers, launched) - 1  # launched after marker i, before marker i + 1
        if 0 <= i < steps:
            per_step[i].append(span)
    return {i: _union(spans) for i, spans in per_step.items()}


def _complete_events(trace: Path) -> List[dict]:
    """The trace's complete events ("ph": "X"), with `cat` lower-cased and `args` always there."""
    out = []
    for e in json.loads(Path(trace).read_text()).get("traceEvents", []):
        if e.get("ph") != "X" or "dur" not in e or "ts" not in e:
            continue
        out.append({"name": str(e.get("name", "")), "cat": str(e.get("cat", "")).lower(), "ts": float(e["ts"]),
                    "dur": float(e["dur"]), "pid": e.get("pid"), "tid": e.get("tid"), "args": e.get("args") or {}})
    return out


def copy_overlap(trace: Path) -> Dict[str, float]:
    """Did the host->device copies of a chrome trace run while the GPU computed? (PyTorch
    Lightning issue #1316's question: "have you checked asynchronous transfer actually occurs?")

    `trace_h2d_copies`: the HtoD memcpy events in the trace. `trace_h2d_overlap_fraction` (when
    there is at least one): the share of their GPU time during which a kernel was running on the
    same device, on any stream. A copy queued on the compute stream waits for that stream's
    kernels, so copies made in line with the step give ~0; copies on a side stream that run
    behind the step give close to 1.

    `trace_kernel_busy_fraction` (when a kernel ran): the share of the traced span, from the
    device's first copy or kernel to its last, during which a kernel ran. Well below 1, the
    device waited for the host between steps: a copy then finds no kernel to hide behind,
    wherever it is queued, and costs nothing either (the loop runs at the host's pace).
    """
    copies: Dict[object, List[Span]] = defaultdict(list)
    kernels: Dict[object, List[Span]] = defaultdict(list)
    for e in _complete_events(trace):
        span = (e["ts"], e["ts"] + e["dur"])
        if e["name"].startswith("Memcpy HtoD"):
            copies[e["pid"]].append(span)
        elif e["cat"] == "kernel":
            kernels[e["pid"]].append(span)
    hidden, total = _overlap(copies, kernels)
    result = {"trace_h2d_copies": float(sum(len(s) for s in copies.values()))}
    if total > 0:
        result["trace_h2d_overlap_fraction"] = hidden / total
    busy = span = 0.0
    for device, spans in kernels.items():
        busy += _length(_union(spans))
        every = spans + copies.get(device, [])
        span += max(b for _, b in every) - min(a for a, _ in every)
    if span > 0:
        result["trace_kernel_busy_fraction"] = busy / span
    return result


def _overlap(copies: Dict[object, List[Span]], kernels: Dict[object, List[Span]]) -> Tuple[float, float]:
    """(time during which a kernel of the same device ran, total time) of the copies."""
    total = hidden = 0.0
    for device, spans in copies.items():
        busy = _union(kernels.get(device, []))
        for a, b in spans:
            total += b - a
            hidden += sum(max(0.0, min(b, d) - max(a, c)) for c, d in busy if c < b and d > a)
    return hidden, total


def _union(spans: List[Span]) -> List[Span]:
    """Overlapping spans merged (kernels of several streams may run at once)."""
    merged: List[list] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _length(merged: List[Span]) -> float:
    return sum(b - a for a, b in merged)


def busy_time(spans: List[Span]) -> float:
    """How long any of `spans` ran: their union's length, each instant counted once."""
    return _length(_union(spans))
