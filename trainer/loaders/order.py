"""The order in which an epoch visits samples, shared by every strategy, and its split over ranks.

All strategies draw their epoch permutation from `epoch_order`, so for the same seed a
DataLoader-based strategy and a GPU-resident gather visit the samples in the same order.

With several processes (torchrun), every rank computes the same `epoch_order` and keeps its
`Shard` of it: positions `rank, rank + world_size, rank + 2 * world_size, ...` (as PyTorch's
DistributedSampler, without its padding). Every sample is visited exactly once per epoch across
the ranks, and the same seed gives the same split. Ranks may then hold one batch more or fewer
than each other; `Shard.steps` says how many each has, so the loop can plan for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch


def epoch_order(n: int, shuffle: bool, seed: int, epoch: int) -> torch.Tensor:
    """Indices 0..n-1 for one epoch: a seeded permutation when shuffling, else in order."""
    if not shuffle:
        return torch.arange(n)
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


@dataclass(frozen=True)
class Shard:
    """This rank's share of every epoch: every `world_size`-th position, starting at `rank`."""

    rank: int = 0
    world_size: int = 1

    @property
    def whole(self) -> bool:
        return self.world_size == 1

    def take(self, order: torch.Tensor) -> torch.Tensor:
        """This rank's positions of `order` (all of it in a world of one)."""
        return order if self.whole else order[self.rank::self.world_size]

    def size(self, n: int, rank: int = -1) -> int:
        """How many of `n` positions rank `rank` (default: this one) gets."""
        rank = self.rank if rank < 0 else rank
        return len(range(rank, n, self.world_size))

    def batches(self, n: int, batch_size: int, drop_last: bool, rank: int = -1) -> int:
        """Batches of `batch_size` that rank `rank` forms from its share of `n` samples."""
        size = self.size(n, rank)
        return size // batch_size if drop_last else math.ceil(size / batch_size)


def epoch_shard(n: int, shuffle: bool, seed: int, epoch: int, shard: Shard) -> torch.Tensor:
    """This rank's part of `epoch_order(n, shuffle, seed, epoch)`."""
    return shard.take(epoch_order(n, shuffle, seed, epoch))


class EpochSampler(torch.utils.data.Sampler[int]):
    """DataLoader sampler yielding this rank's share of `epoch_order` for epoch 0, 1, 2, ... on
    successive passes."""

    def __init__(self, n: int, shuffle: bool, seed: int, shard: Shard = Shard()):
        self.n, self.shuffle, self.seed, self.shard = n, shuffle, seed, shard
        self.epoch = 0

    def __len__(self) -> int:
        return self.shard.size(self.n)

    def __iter__(self) -> Iterator[int]:
        order = epoch_shard(self.n, self.shuffle, self.seed, self.epoch, self.shard)
        self.epoch += 1
        return iter(order.tolist())
