"""The host heap: keep freed batch-sized buffers in the process instead of handing them back to the OS.

A pageable batch (the DataLoader's collate stacks 64 samples into a new tensor: 16.8 MB on seed
000's workload) is allocated and freed at every step. glibc's malloc moves two thresholds as a
process runs: a block above the *mmap threshold* gets pages of its own, which it loses when freed,
and free memory above the *trim threshold* at the top of the heap is given back to the OS. Both
start low and rise with the largest block the process has freed so far, and where the freed batch
lands against them depends on everything the process allocated before: imports, setup, an earlier
job of a sweep. So the same loop over the same loader lands in one of two modes, from one process
to the next: the next batch reuses the pages of the last one (about 0 minor page faults a step),
or every page of every batch is faulted in and zeroed again (about 2,800 faults and several
milliseconds a step for a 16.8 MB batch, measured on an H100 host and on a 2-core CPU machine).

`keep_freed()` fixes both thresholds for this process (and the DataLoader workers it forks): the
mmap threshold at glibc's ceiling (32 MiB on 64-bit), so batches up to that size come from the
heap, and the trim threshold at 1 GiB, so their pages stay with the process between steps. It is
`engine.steady_heap` (on by default), applied alike by `python -m trainer` and by the plain-loop
reference (`trainer.tools.plain_loop`). The same settings in a loop of your own:
`MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=1073741824 python train.py`.

A run sets them for its own duration only (`steady_heap()`): a later job in the same process (a
sweep, a test, your code calling `run()`) finds glibc's defaults again (128 KiB each; glibc no longer
moves them once they have been set, so they stay there for the rest of the process).
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
from typing import Iterator

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc refuses more on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 1 << 30
GLIBC_DEFAULT = 128 << 10  # both thresholds' starting value in glibc (DEFAULT_MMAP_THRESHOLD_MIN, DEFAULT_TRIM_THRESHOLD)


def keep_freed() -> bool:
    """Fix glibc's mmap and trim thresholds for this process; False where there is no glibc
    `mallopt` (macOS, musl) and nothing was changed. Once set, glibc no longer moves them."""
    return _set_thresholds(MMAP_THRESHOLD, TRIM_THRESHOLD)


@contextlib.contextmanager
def steady_heap(enabled: bool) -> Iterator[str]:
    """`keep_freed()` for the duration of the block, then glibc's defaults again. Yields the
    run's `steady_heap` tag: true, false, or unavailable (no glibc)."""
    if not enabled:
        yield "false"
        return
    if not keep_freed():
        yield "unavailable"
        return
    try:
        yield "true"
    finally:
        _set_thresholds(GLIBC_DEFAULT, GLIBC_DEFAULT)


def _set_thresholds(mmap_threshold: int, trim_threshold: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(M_TRIM_THRESHOLD, trim_threshold))
