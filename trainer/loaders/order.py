"""The order in which an epoch visits samples, shared by every strategy.

All strategies draw their epoch permutation from `epoch_order`, so for the same seed a
DataLoader-based strategy and a GPU-resident gather visit the samples in the same order.
"""

from __future__ import annotations

from typing import Iterator

import torch


def epoch_order(n: int, shuffle: bool, seed: int, epoch: int) -> torch.Tensor:
    """Indices 0..n-1 for one epoch: a seeded permutation when shuffling, else in order."""
    if not shuffle:
        return torch.arange(n)
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


class EpochSampler(torch.utils.data.Sampler[int]):
    """DataLoader sampler yielding `epoch_order` for epoch 0, 1, 2, ... on successive passes."""

    def __init__(self, n: int, shuffle: bool, seed: int):
        self.n, self.shuffle, self.seed = n, shuffle, seed
        self.epoch = 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        order = epoch_order(self.n, self.shuffle, self.seed, self.epoch)
        self.epoch += 1
        return iter(order.tolist())
