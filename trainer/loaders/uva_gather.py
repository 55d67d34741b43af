"""The gather kernel of `pinned_uva`: one launch copies a batch's rows, read straight out of
page-locked host memory over PCIe, into a device buffer (and the rows' labels alongside).

With unified virtual addressing a page-locked host tensor is addressable from the device, and
Triton takes it as a pointer argument (its launcher asks the driver for the device address of
every `data_ptr()`; pageable memory is refused as "cannot be accessed from Triton (cpu tensor?)").

The kernel runs on a bounded grid of `ctas` thread blocks; block p copies rows p, p + ctas,
p + 2 * ctas, ... Each block mostly waits on PCIe reads while it holds its SM, so the number of
blocks trades copy bandwidth against the step running beside it (measured on an H100 with 64
rows of 256 KiB: 4 blocks gathered at 39 GB/s and slowed a GPU-bound step by 1%; 8 blocks at
50 GB/s, 6%; a full grid at 50 GB/s, 40%). Rows are moved as the widest integer lanes that
divide them (8, 4, 2 or 1 bytes), so any dtype is copied bit for bit and a row whose size is a
multiple of 16 bytes moves in 16-byte vectors.

Importing this module imports Triton: `pinned_uva` imports it only once a CUDA run asks for it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_BYTES = 32 << 10  # bytes a block reads per iteration: enough loads in flight to cover PCIe's latency
NUM_WARPS = 8  # 256 threads per block: 128 bytes (eight 16-byte loads) each per iteration
# Reads the whole grid keeps in flight to reach the link's rate: 4 blocks of 32 KiB did on 256 KiB
# rows (H100, 50 GB/s). A block reads one row at a time, so small rows need more blocks for the same.
IN_FLIGHT_BYTES = 4 * BLOCK_BYTES
AUTO_CTAS = (4, 32)  # the fewest and the most blocks `auto_ctas` picks

_LANES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


# idx: a slice of the epoch's order, 16-byte aligned or not by batch: no recompile for either
@triton.jit(do_not_specialize=["n_rows"], do_not_specialize_on_alignment=["idx"])
def _gather_rows(src, labels, idx, out, out_labels, n_rows, ROW: tl.constexpr, BLOCK: tl.constexpr):
    """Row `idx[r]` of `src` into row r of `out`, and `labels[idx[r]]` into `out_labels[r]`, for
    r < n_rows; rows of ROW lanes each, block p taking rows p, p + grid, p + 2 * grid, ..."""
    lanes = tl.arange(0, BLOCK)
    for r in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row = tl.load(idx + r).to(tl.int64)  # int64 offsets: a dataset may be far past 2 GiB
        source = src + row * ROW
        target = out + tl.cast(r, tl.int64) * ROW
        for start in range(0, ROW, BLOCK):
            offsets = start + lanes
            if ROW % BLOCK == 0:  # no mask: the compiler then vectorizes freely
                tl.store(target + offsets, tl.load(source + offsets))
            else:
                inside = offsets < ROW
                tl.store(target + offsets, tl.load(source + offsets, mask=inside), mask=inside)
        tl.store(out_labels + r, tl.load(labels + row))


def auto_ctas(row_bytes: int) -> int:
    """Thread blocks for rows of `row_bytes` (`loader.ctas=0`): enough to keep `IN_FLIGHT_BYTES` of
    PCIe reads in flight, from 4 (rows of 32 KiB and more: the step keeps the other SMs) to 32
    (rows of 4 KiB and less). 3 KiB rows (CIFAR's uint8 images) with 4 blocks gathered at 8.5 GB/s
    on an H200, with 32 at 37 GB/s."""
    per_block = max(1, min(row_bytes, BLOCK_BYTES))  # bytes one block has in flight: one row, or a block's worth of it
    low, high = AUTO_CTAS
    return max(low, min(high, -(-IN_FLIGHT_BYTES // per_block)))


def lane_dtype(row_bytes: int) -> torch.dtype:
    """The widest integer type whose size divides `row_bytes`."""
    return next(dtype for size, dtype in _LANES.items() if row_bytes % size == 0)


def as_lanes(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` (contiguous, one sample per row) as a `(rows, lanes)` view of `dtype`, sharing memory."""
    return t.reshape(len(t), -1).view(torch.uint8).view(dtype)


class RowGather:
    """Gathers rows of `src` (page-locked host or device memory, one sample per row) and of
    `labels` (device) by device indices, one kernel launch per call, on the current stream."""

    def __init__(self, src: torch.Tensor, labels: torch.Tensor, ctas: int, block_bytes: int = BLOCK_BYTES,
                 num_warps: int = NUM_WARPS):
        row_bytes = src[0].nbytes
        self.dtype = lane_dtype(row_bytes)
        self.src, self.labels = as_lanes(src, self.dtype), labels
        self.row = row_bytes // self.dtype.itemsize  # lanes per row
        self.block = min(triton.next_power_of_2(max(1, block_bytes // self.dtype.itemsize)),
                         triton.next_power_of_2(self.row))
        self.ctas, self.num_warps = ctas, num_warps

    def lanes(self, t: torch.Tensor) -> torch.Tensor:
        """A destination buffer (`rows` samples shaped like `src`'s) as the view the kernel writes."""
        return as_lanes(t, self.dtype)

    def __call__(self, idx: torch.Tensor, out: torch.Tensor, out_labels: torch.Tensor) -> None:
        """Rows `idx` (int64, on the device) into the first `len(idx)` rows of `out` (from `lanes()`)."""
        m = len(idx)
        _gather_rows[(min(self.ctas, m),)](self.src, self.labels, idx, out, out_labels, m,
                                            ROW=self.row, BLOCK=self.block, num_warps=self.num_warps)
