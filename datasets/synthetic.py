"""Synthetic data: a big random chunk 'loaded from disk', batches drawn from it."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Tuple

import numpy as np
import torch

from datasets.base import DATASETS, DatasetConfig, FeedDataset, to_unit_float
from trainer.errors import ConfigError
from trainer.memory import check_host_fits

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "uint8": torch.uint8}


@DATASETS.register
class SyntheticDataset(FeedDataset):
    """`num_samples` random samples of `shape`, generated chunk by chunk from a seeded generator.

    Chunk `i` is always the same data for the same `seed`, however it is read (one sample at a
    time, a chunk at a time, or through the iterable view), so every strategy sees the same bytes.
    """

    @dataclass
    class Config(DatasetConfig):
        """Random samples generated from a seed, 'loaded from disk' one chunk at a time.

        The chunking is set by `chunks` or by `chunk_samples`, not both: `chunk_samples=0` splits
        `num_samples` into `chunks` loads; `chunk_samples=N` loads N samples at a time (and `chunks`
        follows: leave it at 1). The presets of docs/results.md use `num_samples=2000 chunk_samples=1000 batches_per_chunk=4`.
        """

        name: str = "synthetic"
        num_samples: int = 1000  # samples in the whole dataset (all chunks together)
        shape: List[int] = field(default_factory=lambda: [256, 256])  # one sample's shape
        dtype: str = "float32"  # storage dtype: float32 | float16 | bfloat16 | uint8 (model input is float32)
        chunks: int = 1  # the data is 'loaded from disk' in this many chunks
        chunk_samples: int = 0  # samples per chunk (0 = num_samples / chunks, rounded up)
        batches_per_chunk: int = 0  # iterable view: random batches drawn per loaded chunk (0 = one pass)
        load_ms: float = 0.0  # simulated disk-read time per chunk
        num_classes: int = 10  # a fixed random label per sample (for the MLP)

        def __post_init__(self):
            """Fail before generating anything, naming the key and a value that works."""
            if self.dtype not in _DTYPES:
                raise ConfigError(f"dataset.dtype must be one of {sorted(_DTYPES)} (got {self.dtype!r}): set dataset.dtype=float32")
            checks = [
                (self.num_samples >= 1, f"dataset.num_samples must be >= 1 (got {self.num_samples}): set dataset.num_samples=1000"),
                (self.chunks >= 1, f"dataset.chunks must be >= 1 (got {self.chunks}): set dataset.chunks=1"),
                (self.chunk_samples >= 0, f"dataset.chunk_samples must be >= 0 (got {self.chunk_samples}): set dataset.chunk_samples=0 (num_samples / chunks)"),
                (self.chunk_samples <= self.num_samples, f"dataset.chunk_samples={self.chunk_samples} is more than dataset.num_samples={self.num_samples}: set dataset.num_samples={self.chunk_samples}"),
                (self.chunks <= self.num_samples, f"dataset.chunks={self.chunks} is more than dataset.num_samples={self.num_samples}: set dataset.chunks=1"),
                (len(self.shape) >= 1 and all(s >= 1 for s in self.shape), f"dataset.shape must be sizes >= 1 (got {list(self.shape)}): set dataset.shape=[256,256]"),
                # numpy (1.x) handles at most 32 dimensions, and a batch adds one.
                (len(self.shape) <= 31, f"dataset.shape must have at most 31 sizes (got {len(self.shape)}): set dataset.shape=[256,256]"),
                (self.batches_per_chunk >= 0, f"dataset.batches_per_chunk must be >= 0 (got {self.batches_per_chunk}): set dataset.batches_per_chunk=0 (one pass)"),
                (self.load_ms >= 0, f"dataset.load_ms must be >= 0 (got {self.load_ms}): set dataset.load_ms=0"),
                (self.num_classes >= 1, f"dataset.num_classes must be >= 1 (got {self.num_classes}): set dataset.num_classes=10"),
            ]
            for ok, message in checks:
                if not ok:
                    raise ConfigError(message)
            n, size = self.num_samples, chunk_size(self)
            made = math.ceil(n / size)
            if not self.chunk_samples and made != self.chunks:  # e.g. 10 samples in 6 chunks: chunks of 2 make 5
                raise ConfigError(f"dataset.num_samples={n} does not split into dataset.chunks={self.chunks} chunks "
                                  f"(chunks of {size} make {made}): set dataset.chunks={made}")
            if self.chunk_samples and self.chunks not in (1, made):
                raise ConfigError(f"dataset.chunks={self.chunks} with dataset.chunk_samples={size} needs "
                                  f"dataset.num_samples={self.chunks * size} (got {n}): set that, or leave "
                                  f"dataset.chunks at 1 (it follows from num_samples / chunk_samples)")

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.sample_shape = tuple(int(s) for s in cfg.shape)
        self.storage_dtype = _DTYPES[cfg.dtype]
        self.num_classes = int(cfg.num_classes)
        n = self.num_samples = int(cfg.num_samples)  # read once: len() is asked at every epoch
        self.chunk_samples = chunk_size(cfg)
        # One fixed random class per sample, independent of how the data is chunked: the one
        # allocation the dataset makes for all samples at once, before any strategy checks its own.
        check_host_fits(n * 8, f"dataset.num_samples={n} (one int64 label per sample)",
                        "set a smaller dataset.num_samples")
        self.labels = torch.from_numpy(np.random.default_rng([cfg.seed, 0x1ABE1]).integers(0, self.num_classes, n))
        self._all: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return self.num_samples

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
        # Narrow storage crosses PCIe as is and becomes float32 model input only here.
        if x.dtype == torch.uint8:
            return to_unit_float(x)
        return x if x.dtype == torch.float32 else x.float()

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
        """The iterable_chunks loader's IterableDataset (batches of random rows from each loaded chunk)."""
        return SeedIterable(self, batch_size)


def chunk_size(cfg) -> int:
    """Samples per chunk: `chunk_samples`, or `num_samples / chunks` rounded up when it is 0."""
    return int(cfg.chunk_samples) or math.ceil(int(cfg.num_samples) / int(cfg.chunks))


class _SyntheticSamples(torch.utils.data.Dataset):
    """The map-style view: item `i` is sample `i` of the materialised chunks, as model input."""

    def __init__(self, source: SyntheticDataset):
        self.source = source
        self.x = source.materialize()

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int):
        return self.source.on_device(self.x[i]), self.source.labels[i]


class SeedIterable(torch.utils.data.IterableDataset):
    """For each chunk: load it (paying `load_ms`), then yield `batches_per_chunk` batches of
    rows drawn at random (with replacement, as `rng.choice` did in the seed).

    Yields whole batches: wrap it as `DataLoader(it, batch_size=None)`. With DataLoader
    workers, each worker loads and serves its own share of the chunks. The rows drawn depend
    only on (seed, epoch, chunk), so they are the same with or without workers.
    """

    def __init__(self, source: SyntheticDataset, batch_size: int):
        if batch_size < 1:
            raise ConfigError(f"loader.batch_size must be >= 1 (got {batch_size}): set loader.batch_size=64")
        self.source, self.batch_size = source, batch_size
        self.epoch = 0  # advanced by each pass in this process (workers start from it)
        self.rank, self.world_size = 0, 1  # several processes (torchrun): each loads every world_size-th chunk

    def chunks(self) -> range:
        """The chunks this process loads (all of them in a world of one)."""
        return range(self.source.num_chunks)[self.rank::self.world_size]

    def _batches_in(self, chunk: int) -> int:
        start, stop = self.source.chunk_range(chunk)
        return self.source.cfg.batches_per_chunk or math.ceil((stop - start) / self.batch_size)

    def __len__(self) -> int:
        return sum(self._batches_in(i) for i in self.chunks())

    def rows(self, epoch: int, chunk: int) -> Iterator[torch.Tensor]:
        """Row indices within `chunk` of each batch drawn from it in `epoch`."""
        start, stop = self.source.chunk_range(chunk)
        g = np.random.default_rng([self.source.cfg.seed, 0xD4A3, epoch, chunk])
        for _ in range(self._batches_in(chunk)):
            yield torch.from_numpy(g.integers(0, stop - start, self.batch_size))

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        epoch, self.epoch = self.epoch, self.epoch + 1
        worker = torch.utils.data.get_worker_info()
        chunks = self.chunks()
        if worker is not None:
            chunks = chunks[worker.id::worker.num_workers]
        for i in chunks:
            x, y = self.source.load_chunk(i)  # the 'disk read': one big chunk into memory
            for idx in self.rows(epoch, i):
                yield self.source.on_device(x[idx]), y[idx]
