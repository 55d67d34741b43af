"""Physical ceilings every other figure is read against: host->device copy bandwidth."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Optional, Tuple

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


def h2d_burst(nbytes: int, device: torch.device, total_bytes: int = 4 << 30,
              line_up: Optional[Callable[[], None]] = None) -> Tuple[float, float, int]:
    """Copy `nbytes` from page-locked memory to `device` back to back until `total_bytes` have
    gone: `(start, end, bytes)`, start and end by the wall clock (`time.time()`), so that ranks
    copying at the same moment can add their bytes over the span they shared. `line_up` (a
    barrier across the ranks) runs after the buffers are allocated and one untimed copy is done."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    if line_up is not None:
        line_up()
    copies = max(10, -(-total_bytes // nbytes))
    start = time.time()
    for _ in range(copies):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    return start, time.time(), copies * nbytes
