"""Seed 000's synthetic data: a big random chunk 'loaded from disk', batches drawn from it."""

from __future__ import annotations

import time
from typing import Iterator, Optional, Tuple

import numpy as np
import torch

from datasets.base import FeedDataset

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "uint8": torch.uint8}


class SyntheticDataset(FeedDataset):
    """`num_samples` random samples of `shape`, generated chunk by chunk from a seeded generator.

    Chunk `i` is always the same data for the same `seed`, however it is read (one sample at a
    time, a chunk at a time, or through the iterable view), so every strategy sees the same bytes.
    """

    def __init__(self, cfg):
        if cfg.dtype not in _DTYPES:
            raise ValueError(f"dataset.dtype must be one of {sorted(_DTYPES)} (got {cfg.dtype!r}): set dataset.dtype=float32")
        self.cfg = cfg
        self.sample_shape = tuple(int(s) for s in cfg.shape)
        self.storage_dtype = _DTYPES[cfg.dtype]
        self.num_classes = int(cfg.num_classes)
        self.chunk_samples = -(-int(cfg.num_samples) // int(cfg.chunks))
        # One fixed random class per sample, independent of how the data is chunked.
        self.labels = torch.from_numpy(
            np.random.default_rng([cfg.seed, 0x1ABE1]).integers(0, self.num_classes, int(cfg.num_samples))
        )
        self._all: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return int(self.cfg.num_samples)

    def load_chunk(self, i: int, out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        start, stop = self.chunk_range(i)
        n = stop - start
        x = out[:n] if out is not None else torch.empty((n, *self.sample_shape), dtype=self.storage_dtype)
        rng = np.random.default_rng([self.cfg.seed, i])
        if self.storage_dtype == torch.float32:
            rng.random(out=x.numpy(), dtype=np.float32)  # straight into `x`, pinned or not
        elif self.storage_dtype == torch.uint8:
            x.numpy()[...] = rng.integers(0, 256, size=x.shape, dtype=np.uint8)
        else:  # float16 / bfloat16: numpy cannot generate them directly
            x.copy_(torch.from_numpy(rng.random(x.shape, dtype=np.float32)))
        if self.cfg.load_ms > 0:
            time.sleep(self.cfg.load_ms / 1000)  # simulated disk read
        return x, self.labels[start:stop]

    def on_device(self, x: torch.Tensor) -> torch.Tensor:
        return x.float().div_(255) if x.dtype == torch.uint8 else x

    def materialize(self) -> torch.Tensor:
        """All chunks in one host tensor (loaded once, then shared by DataLoader workers)."""
        if self._all is None:
            all_x = torch.empty((len(self), *self.sample_shape), dtype=self.storage_dtype)
            for i in range(self.num_chunks):
                start, stop = self.chunk_range(i)
                self.load_chunk(i, out=all_x[start:stop])
            self._all = all_x
        return self._all

    def per_sample(self) -> torch.utils.data.Dataset:
        return _SyntheticSamples(self)

    def iterable(self, batch_size: int) -> "SeedIterable":
        """Seed 000's IterableDataset semantics (batches of random rows from each loaded chunk)."""
        return SeedIterable(self, batch_size)


class _SyntheticSamples(torch.utils.data.Dataset):
    def __init__(self, source: SyntheticDataset):
        self.source = source
        self.x = source.materialize()

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int):
        return self.source.on_device(self.x[i]), self.source.labels[i]


class SeedIterable(torch.utils.data.IterableDataset):
    """For each chunk: load it (paying `load_ms`), then yield `batches_per_chunk` batches of
    rows drawn at random (with replacement, as `rng.choice` did in the seed)."""

    def __init__(self, source: SyntheticDataset, batch_size: int):
        self.source, self.batch_size = source, batch_size
        self.epoch = 0

    def __len__(self) -> int:
        per_chunk = self.source.cfg.batches_per_chunk
        return sum(per_chunk or -(-(b - a) // self.batch_size) for a, b in map(self.source.chunk_range, range(self.source.num_chunks)))

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        g = np.random.default_rng([self.source.cfg.seed, 0xD4A3, self.epoch])
        self.epoch += 1
        for i in range(self.source.num_chunks):
            x, y = self.source.load_chunk(i)
            per_chunk = self.source.cfg.batches_per_chunk or -(-len(x) // self.batch_size)
            for _ in range(per_chunk):
                idx = torch.from_numpy(g.integers(0, len(x), self.batch_size))
                yield self.source.on_device(x[idx]), y[idx]
