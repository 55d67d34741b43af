"""`engine.profile=true`: a torch.profiler trace of a few steady-state steps.

Open the trace (an MLflow artifact) in https://ui.perfetto.dev or chrome://tracing to see whether
the host->device copies on the side stream overlap the kernels of the step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch.profiler import ProfilerActivity, profile, schedule


class StepProfiler:
    """Call `step()` once per training step; records `active` steps after `skip` steps."""

    def __init__(self, enabled: bool, out_dir: Path, skip: int, active: int = 5):
        self.trace: Optional[Path] = None
        self._prof = None
        if not enabled:
            return
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self.trace = Path(out_dir) / "trace.json"
        self._prof = profile(activities=activities, schedule=schedule(wait=skip, warmup=1, active=active, repeat=1),
                             on_trace_ready=lambda p: p.export_chrome_trace(str(self.trace)))
        self._prof.__enter__()

    def step(self) -> None:
        if self._prof is not None:
            self._prof.step()

    def close(self) -> Optional[Path]:
        """Stop profiling; returns the trace file if one was written."""
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self._prof = None
        return self.trace if self.trace is not None and self.trace.exists() else None
