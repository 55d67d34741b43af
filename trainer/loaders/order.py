"""The order in which an epoch visits samples, shared by every strategy, and its split over ranks.

All strategies draw their epoch permutation from `epoch_order`, so for the same seed a
DataLoader-based strategy and a GPU-resident gather visit the samples in the same order.

An epoch's order is cut once into the batches one process would form: batch j holds positions
j*B .. j*B+B-1, and with `loader.drop_last` the partial batch at the end is dropped, once. With
several processes (torchrun) every rank cuts the same order and is dealt whole batches in turn:
the epoch's batch j goes to rank j % world_size (`Shard`). So a run on W ranks trains on exactly
the batches of a run in one process, dealt round-robin, whatever the strategy: across the ranks
every sample is visited once per epoch (with drop_last, all but the one process's partial batch),
and the same seed gives the same split. A rank may hold one batch more than another;
`Shard.batches` says how many each has, so the loop can plan for it. (`pinned_chunk` deals its own
sequence of batches the same way; when it shuffles, that sequence is its own: see its docstring.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator

import torch

from trainer.loaders.host_copy import HostPeers


def epoch_order(n: int, shuffle: bool, seed: int, epoch: int) -> torch.Tensor:
    """Indices 0..n-1 for one epoch: a seeded permutation when shuffling, else in order."""
    if not shuffle:
        return torch.arange(n)
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


@dataclass(frozen=True)
class Shard:
    """This rank's share of every epoch: the epoch's batches `rank`, `rank + world_size`, ...;
    and the ranks it shares its host with (`peers`: for a host copy of the dataset they share)."""

    rank: int = 0
    world_size: int = 1
    peers: HostPeers = field(default=HostPeers(), compare=False)

    @property
    def whole(self) -> bool:
        return self.world_size == 1

    def owns(self, batch: int) -> bool:
        """Whether the epoch's batch number `batch` (counted over all ranks) is this rank's."""
        return batch % self.world_size == self.rank

    def batches(self, n: int, batch_size: int, drop_last: bool, rank: int = -1) -> int:
        """Batches rank `rank` (default: this one) gets of an epoch of `n` samples."""
        total = n // batch_size if drop_last else math.ceil(n / batch_size)
        return len(range(self.rank if rank < 0 else rank, total, self.world_size))

    def samples(self, n: int, batch_size: int, drop_last: bool) -> int:
        """Samples this rank gets of an epoch of `n`: its batches' rows."""
        full = self.batches(n, batch_size, drop_last) * batch_size
        partial = n % batch_size
        if partial and not drop_last and self.owns(n // batch_size):  # the epoch's last batch is short
            return full - batch_size + partial
        return full

    def take(self, order: torch.Tensor, batch_size: int, drop_last: bool) -> torch.Tensor:
        """This rank's batches of the epoch `order`, end to end: its own batch i is rows
        i*B .. i*B+B-1 of the result (the last one may be short, without drop_last)."""
        full = len(order) - len(order) % batch_size
        if self.whole:
            return order[:full] if drop_last else order
        mine = order[:full].reshape(-1, batch_size)[self.rank::self.world_size].reshape(-1)
        if drop_last or not self.owns(full // batch_size):
            return mine
        return torch.cat([mine, order[full:]])  # the epoch's partial batch (empty when there is none)


def epoch_shard(n: int, shuffle: bool, seed: int, epoch: int, shard: Shard, batch_size: int,
                drop_last: bool) -> torch.Tensor:
    """This rank's batches of `epoch_order(n, shuffle, seed, epoch)`, end to end (`Shard.take`)."""
    return shard.take(epoch_order(n, shuffle, seed, epoch), batch_size, drop_last)


class EpochSampler(torch.utils.data.Sampler[int]):
    """DataLoader sampler yielding this rank's batches of `epoch_order`, end to end, for epoch 0,
    1, 2, ... on successive passes (the DataLoader cuts them again, with `drop_last=False`)."""

    def __init__(self, n: int, shuffle: bool, seed: int, shard: Shard, batch_size: int, drop_last: bool):
        self.n, self.shuffle, self.seed, self.shard = n, shuffle, seed, shard
        self.batch_size, self.drop_last = batch_size, drop_last
        self.epoch = 0

    def __len__(self) -> int:
        return self.shard.samples(self.n, self.batch_size, self.drop_last)

    def __iter__(self) -> Iterator[int]:
        order = epoch_shard(self.n, self.shuffle, self.seed, self.epoch, self.shard, self.batch_size, self.drop_last)
        self.epoch += 1
        return iter(order.tolist())
