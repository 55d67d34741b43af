"""Physical ceilings every other figure is read against: host->device copy bandwidth."""

from __future__ import annotations

import statistics

import torch


def h2d_bandwidth(nbytes: int, pinned: bool, device: torch.device, repeats: int = 10) -> float:
    """Median GB/s of copying `nbytes` from host (pinned or pageable) to `device`, timed with
    CUDA events around each copy after one untimed copy."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    src.fill_(1)  # touch the pages: a pageable buffer is otherwise faulted in during the copy
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=pinned)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=pinned)
        end.record()
        times.append((start, end))
    torch.cuda.synchronize(device)
    ms = statistics.median(a.elapsed_time(b) for a, b in times)
    return nbytes / (ms * 1e6)
