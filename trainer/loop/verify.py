"""Checksums of the batches as they reach the device (`engine.verify=true`).

Each sample hashes to one int64 (its bytes, weighted by fixed pseudo-random weights, plus its
label). Two sums are kept on the device and read once at the end, so verifying adds no sync:
- `ordered`: depends on every byte *and* on the order of samples and batches;
- `unordered`: per epoch, the plain sum of sample hashes – equal whenever an epoch covers the
  same samples, whatever their order.
"""

from __future__ import annotations

from typing import List

import torch

_MULT = 0x100000001B3  # FNV-style odd multiplier; int64 arithmetic wraps identically everywhere


class Checksum:
    def __init__(self, device: torch.device):
        self.device = device
        self.ordered = torch.zeros((), dtype=torch.int64, device=device)
        self.epoch_sum = torch.zeros((), dtype=torch.int64, device=device)
        self.epochs: List[torch.Tensor] = []
        self.batches = 0
        self._weights = None

    def _sample_hashes(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        flat = x.contiguous().view(len(x), -1)
        if flat.element_size() * flat.shape[1] % 4 == 0:
            words = flat.view(torch.int32).to(torch.int64)
        else:
            words = flat.view(torch.uint8).to(torch.int64)
        if self._weights is None or len(self._weights) != words.shape[1]:
            g = torch.Generator().manual_seed(1234)
            self._weights = torch.randint(1, 2**31 - 1, (words.shape[1],), generator=g).to(self.device)
        return (words * self._weights).sum(1) + y.to(torch.int64) * 0x9E3779B1

    def update(self, x: torch.Tensor, y: torch.Tensor) -> None:
        h = self._sample_hashes(x, y)
        position = torch.arange(1, len(h) + 1, device=h.device, dtype=torch.int64)
        self.ordered = self.ordered * _MULT + (h * position).sum()
        self.epoch_sum = self.epoch_sum + h.sum()
        self.batches += 1

    def end_epoch(self) -> None:
        self.epochs.append(self.epoch_sum)
        self.epoch_sum = torch.zeros((), dtype=torch.int64, device=self.device)

    def result(self) -> dict:
        """Read once, after the timed loop."""
        epochs = [int(e) for e in self.epochs]
        return {"data_checksum": f"{int(self.ordered) & (2**64 - 1):016x}",
                "epoch_checksums": [f"{e & (2**64 - 1):016x}" for e in epochs],
                "verified_batches": self.batches}
