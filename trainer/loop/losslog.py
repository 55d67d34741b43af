"""The loss log: every step's loss, kept where the step left it, in storage made before the loop.

On CUDA a step's loss tensor is held as it is (no device work per step) for up to `LOSS_BATCH`
steps, and the batch of them is written into the log with one stack and one copy. On the CPU each
loss is copied into the log at once: a held CPU tensor would keep a small block of the heap alive
across the next batches (see `trainer.loop.meter` on heap fragmentation).
"""

from __future__ import annotations

from typing import List, Optional

import torch

LOSS_BATCH = 32  # losses held as tensors, then written to the log together


class LossLog:
    """The losses of steps 1..`count`, on `device`; room for `capacity` steps is made here."""

    def __init__(self, device: torch.device, capacity: int):
        self.device = device
        self.hold = device.type == "cuda"
        self.blocks: List[torch.Tensor] = []  # the log: one value per step, in blocks of whole loss batches
        self.capacity = 0
        self.held: List[Optional[torch.Tensor]] = [None] * LOSS_BATCH  # losses not yet in the log, by step % LOSS_BATCH
        self.count = 0  # losses put
        self.logged = 0  # losses written into the log
        self.reserve(capacity)

    def reserve(self, n: int) -> None:
        """Room for `n` more steps, rounded up to whole loss batches (a batch never spans two blocks)."""
        n = -(-n // LOSS_BATCH) * LOSS_BATCH
        self.blocks.append(torch.zeros(n, device=self.device))
        self.capacity += n

    def put(self, i: int, loss: torch.Tensor) -> None:
        """The loss of step `i` (counted from 0), which must follow step `i - 1`."""
        if not self.hold:
            self._view(i, i + 1).copy_(loss.detach())
            self.count = self.logged = i + 1
            return
        # Held, not copied: no device work per step. The step owns `loss` (a graphed step returns a
        # copy of its static output); detached, it keeps no autograd graph alive.
        k = i % LOSS_BATCH
        self.held[k] = loss.detach()
        self.count = i + 1
        if k == LOSS_BATCH - 1:
            self.flush()

    def flush(self) -> None:
        """Write the held losses of steps `logged + 1 .. count` into the log: one stack, one copy."""
        lo, hi = self.logged, self.count
        if hi <= lo:
            return
        held = self.held[lo % LOSS_BATCH:(hi - 1) % LOSS_BATCH + 1]  # never wraps: flushed at every batch's end
        self._view(lo, hi).copy_(torch.stack(held))
        self.logged = hi

    def read(self, start: int, stop: int) -> torch.Tensor:
        """Losses of steps `start + 1 .. stop`, unread (still on the device)."""
        if stop > self.logged:
            self.flush()
        out, lo = [], 0
        for b in self.blocks:
            hi = lo + len(b)
            if start < hi and stop > lo:
                out.append(b[max(start, lo) - lo:min(stop, hi) - lo])
            lo = hi
        if len(out) == 1:
            return out[0]
        return torch.cat(out) if out else self.blocks[0][:0]

    def _view(self, start: int, stop: int) -> torch.Tensor:
        """The log of steps `start + 1 .. stop`, inside one block."""
        lo = 0
        for b in self.blocks:
            if start < lo + len(b):
                return b[start - lo:stop - lo]
            lo += len(b)
        raise IndexError(f"steps {start}..{stop} are past the loss log's {self.capacity}")
