"""Physical ceilings every other figure is read against: host->device copy bandwidth, and the
gradients' exchange between GPUs."""

from __future__ import annotations

import statistics
import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist


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
              line_up: Optional[Callable[[], None]] = None) -> Tuple[float, List[float], int]:
    """Copy `nbytes` from page-locked memory to `device` back to back until `total_bytes` have
    gone: `(start, ends, bytes)`, the wall-clock time (`time.time()`) the copies began, the one
    at which each group of copies ended (an event after each group, read against one recorded
    at `start` on an idle device) and the bytes of a group: ranks copying at the same moment
    add what each copied while all of them were copying (`shared_rate`). `line_up` (a barrier
    across the ranks) runs after the buffers are allocated and one untimed copy is done."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    if line_up is not None:
        line_up()
    copies = max(10, -(-total_bytes // nbytes))
    per = -(-copies // 1024)  # copies between two events: at most ~1024 events, whatever the batch
    events = [torch.cuda.Event(enable_timing=True) for _ in range(-(-copies // per) + 1)]
    events[0].record()  # the device is idle: it runs as it is recorded
    start = time.time()
    for e in events[1:]:
        for _ in range(per):
            dst.copy_(src, non_blocking=True)
        e.record()
    torch.cuda.synchronize(device)
    return start, [start + events[0].elapsed_time(e) / 1e3 for e in events[1:]], per * nbytes


def shared_rate(bursts: Sequence[Tuple[float, Sequence[float], int]]) -> float:
    """GB/s of several ranks' `h2d_burst`s while all of them were copying: the bytes copied from
    the last start to the first end (a group of copies that straddles either edge counts for the
    share of its time inside), over that window. The ranks never start quite together (a barrier
    lets them go some ms apart): counting each over the whole span from the first start to the
    last end would mix in times when only some of them copied. Where the bursts did not overlap
    at all, that whole span is all there is. Each burst has at least one group."""
    begin, finish = max(b[0] for b in bursts), min(b[1][-1] for b in bursts)
    if finish > begin:
        inside = 0.0
        for start, ends, group_bytes in bursts:
            prev = start
            for t in ends:
                if t > prev:
                    inside += group_bytes * max(0.0, min(t, finish) - max(prev, begin)) / (t - prev)
                elif begin <= t <= finish:  # a group the clock could not tell from the one before
                    inside += group_bytes
                prev = t
        return inside / ((finish - begin) * 1e9)
    first, last = min(b[0] for b in bursts), max(b[1][-1] for b in bursts)
    return sum(group_bytes * len(ends) for _, ends, group_bytes in bursts) / ((last - first) * 1e9)


def allreduce_ms(bucket_bytes: Sequence[int], buffer: torch.Tensor, repeats: int = 20) -> float:
    """Median ms to all-reduce float32 buckets of these sizes one after the other on the default
    process group, as DDP exchanges one step's gradients, but alone: no backward to overlap with.
    Every rank must call it at once, with the same sizes. The buckets are views of `buffer`
    (float32, as large as the largest). On CUDA, timed with events on the current stream, which
    waits for each collective; on the CPU (gloo, whose collectives return when done) by the host
    clock. After three untimed rounds: NCCL sets up its channels at the first."""
    device = buffer.device
    buckets = [buffer[:max(1, b // 4)] for b in bucket_bytes]

    def exchange():
        for t in buckets:
            dist.all_reduce(t)
    for _ in range(3):
        exchange()
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            exchange()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    events = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        exchange()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize(device)
    return statistics.median(a.elapsed_time(b) for a, b in events)
