"""`engine.profile=true`: a torch.profiler trace of the last warm-up steps, and what it says about
the copies.

Open the trace (an MLflow artifact) in https://ui.perfetto.dev or chrome://tracing to see whether
the host->device copies on the side stream overlap the kernels of the step; `copy_overlap` reads
the same answer out of it as two metrics.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional, Tuple

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


def copy_overlap(trace: Path) -> Dict[str, float]:
    """Did the host->device copies of a chrome trace run while the GPU computed? (Seed 001's
    question: "have you checked asynchronous transfer actually occurs?")

    `trace_h2d_copies`: the HtoD memcpy events in the trace. `trace_h2d_overlap_fraction` (when
    there is at least one): the share of their GPU time during which a kernel was running on the
    same device, on any stream. A copy queued on the compute stream waits for that stream's
    kernels, so copies made in line with the step give ~0; copies on a side stream that run
    behind the step give close to 1.
    """
    events = json.loads(Path(trace).read_text()).get("traceEvents", [])
    copies: Dict[object, List[Span]] = defaultdict(list)
    kernels: Dict[object, List[Span]] = defaultdict(list)
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        if str(e.get("name", "")).startswith("Memcpy HtoD"):
            copies[e.get("pid")].append(span)
        elif str(e.get("cat", "")).lower() == "kernel":
            kernels[e.get("pid")].append(span)
    total = hidden = 0.0
    for device, spans in copies.items():
        busy = _union(kernels.get(device, []))
        for a, b in spans:
            total += b - a
            hidden += sum(max(0.0, min(b, d) - max(a, c)) for c, d in busy if c < b and d > a)
    result = {"trace_h2d_copies": float(sum(len(s) for s in copies.values()))}
    if total > 0:
        result["trace_h2d_overlap_fraction"] = hidden / total
    return result


def _union(spans: List[Span]) -> List[Span]:
    """Overlapping spans merged (kernels of several streams may run at once)."""
    merged: List[list] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]
