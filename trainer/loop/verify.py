"""Checksums of the batches as they reach the device (`engine.verify=true`).

Each sample hashes to one int64 (its bytes, weighted by fixed pseudo-random weights, plus its
label). Two sums are kept on the device and read once at the end, so verifying adds no sync:
- `ordered`: depends on every byte *and* on the order of samples and batches;
- `unordered`: per epoch, the plain sum of sample hashes – equal whenever an epoch covers the
  same samples, whatever their order.

With several ranks (torchrun) each rank hashes its own shard and `combine_ranks` joins them:
the per-epoch sums add up to a single process's (the ranks together cover each epoch's samples
exactly once), while the ordered checksum becomes the ranks' ordered checksums chained in rank
order. That one pins down every rank's own order, so it equals another run's with the same
seed and number of ranks, but not a single process's: with N ranks no one process sees the
epoch's order, and which rank takes which batch changes with N.
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


def combine_ranks(results: List[dict]) -> dict:
    """One `result()` from every rank's, in rank order (see the module docstring)."""
    mask = 2**64 - 1
    ordered = 0
    for r in results:
        ordered = (ordered * _MULT + int(r["data_checksum"], 16)) & mask
    epochs = max(len(r["epoch_checksums"]) for r in results)
    sums = [sum(int(r["epoch_checksums"][e], 16) for r in results if e < len(r["epoch_checksums"])) & mask
            for e in range(epochs)]
    return {"data_checksum": f"{ordered:016x}", "epoch_checksums": [f"{e:016x}" for e in sums],
            "verified_batches": sum(r["verified_batches"] for r in results),
            "data_checksum_by_rank": ",".join(r["data_checksum"] for r in results)}
