"""`iterable_chunks`: a DataLoader over an IterableDataset of random chunks, in four variants.

The loader of a public notebook that timed a 4 GB pinned copy and then this loader (the presets
`copy_4gb`, `iterable_chunk_loaders`, `lightning_vs_loop`). A DataLoader (`batch_size=None`) over
its IterableDataset (`SyntheticDataset.iterable`): every pass loads each chunk again – the
notebook's 'disk read', here generating it (plus `dataset.load_ms`) – and draws
`dataset.batches_per_chunk` batches of random rows from it (`rng.choice`, with replacement).
`loader.variant` is what the notebook compared:

- `no_pinning`: pageable batches, blocking `.to(device)` after the DataLoader;
- `copy_in_loader`: the DataLoader's collate_fn copies each batch to the device (the notebook's
  `torch.tensor(x, device='cuda')`): the same blocking pageable copy, made inside the loader;
- `pin_batches`: `DataLoader(pin_memory=True)` pins each batch, then `.to(device, non_blocking=True)`;
- `pin_chunk`: each loaded chunk is pinned with `.pin_memory()` and the batches are its first
  contiguous slices (a slice of pinned memory is pinned, a random gather is not), copied with
  `non_blocking=True`.

The rows are the notebook's random draws, so unlike every other strategy this one does not deliver
the same samples as `baseline` (and `loader.shuffle`/`drop_last` do not apply): it reproduces
that notebook, it is not a strategy to compare on equal data. Under torchrun each rank loads every
`world_size`-th chunk (as DataLoader workers share them), so the ranks together draw exactly the
rows one process draws; their numbers of batches differ when the chunks do not split evenly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trainer.errors import ConfigError, one_of
from trainer.loaders.base import LOADERS, DeviceLoader, LoaderConfig
from trainer.loaders.order import Shard
from trainer.memory import check_host_fits, host_buffer_bytes

VARIANTS = ("no_pinning", "copy_in_loader", "pin_batches", "pin_chunk")
IN_PROCESS = ("copy_in_loader", "pin_chunk")  # touch CUDA while loading: DataLoader workers cannot


@LOADERS.register
class IterableChunksLoader(DeviceLoader):
    @dataclass
    class Config(LoaderConfig):
        """A DataLoader over an IterableDataset that reloads random chunks every pass (dataset=synthetic only)."""

        name: str = "iterable_chunks"
        uses_dataloader = True
        variant: str = "pin_batches"  # no_pinning | copy_in_loader | pin_batches | pin_chunk: how batches are pinned and copied

        def __post_init__(self):
            super().__post_init__()
            one_of("loader.variant", self.variant, VARIANTS, "pin_batches")

    def __init__(self, cfg, dataset, device, seed=0, shard=Shard()):
        super().__init__(cfg, dataset, device, seed, shard)
        variant = cfg.variant
        if not hasattr(dataset, "iterable"):
            raise ConfigError(f"loader=iterable_chunks draws from the synthetic dataset's chunks (got dataset={dataset.cfg.name}): "
                              "set dataset=synthetic")
        if variant in IN_PROCESS and cfg.num_workers > 0:
            raise ConfigError(f"loader.variant={variant} touches CUDA while loading, which loader worker processes cannot "
                              f"do (got loader.num_workers={cfg.num_workers}): set loader.num_workers=0")
        self.needs_cuda = variant != "no_pinning"
        check_chunks_fit(cfg, dataset, pinned_copy=variant == "pin_chunk" and self.on_cuda)
        self.iterable = dataset.iterable(cfg.batch_size)
        self.iterable.rank, self.iterable.world_size = shard.rank, shard.world_size  # under torchrun: its chunks
        self.epoch = 0
        if variant == "pin_chunk":
            per_chunk = dataset.cfg.batches_per_chunk * cfg.batch_size
            smallest = min(hi - lo for lo, hi in map(dataset.chunk_range, range(dataset.num_chunks)))
            if per_chunk > smallest:
                raise ConfigError(f"loader.variant=pin_chunk slices dataset.batches_per_chunk={dataset.cfg.batches_per_chunk} "
                                  f"batches of {cfg.batch_size} rows off each chunk, but a chunk has {smallest}: "
                                  "set dataset.batches_per_chunk=0 (one pass) or a smaller loader.batch_size")
            if self.on_cuda:  # a chunk and its int64 labels, pinned at each load
                rows = dataset.chunk_samples
                self.pinned_bytes = host_buffer_bytes(rows * dataset.sample_bytes, True) + host_buffer_bytes(rows * 8, True)
            self.dataloader = None
            return
        workers = cfg.num_workers
        self.dataloader = torch.utils.data.DataLoader(
            self.iterable,
            batch_size=None,  # the iterable yields whole batches
            num_workers=workers,
            pin_memory=variant == "pin_batches" and self.on_cuda,
            collate_fn=self._to_device if variant == "copy_in_loader" else None,
            prefetch_factor=cfg.prefetch_factor if workers > 0 else None,
            persistent_workers=cfg.persistent_workers and workers > 0,
        )

    def __len__(self) -> int:
        return len(self.iterable)

    def has_short_batches(self) -> bool:
        """Random draws are whole batches; `pin_chunk` slices each chunk, whose last slice is short
        unless the chunk's rows are a multiple of the batch (`loader.drop_last` does not apply)."""
        ds, b = self.dataset, self.cfg.batch_size
        if self.cfg.variant != "pin_chunk" or ds.cfg.batches_per_chunk:
            return False
        return any((hi - lo) % b for lo, hi in map(ds.chunk_range, range(ds.num_chunks)))

    def batches_per_rank(self) -> list:
        it = self.iterable
        return [sum(it._batches_in(c) for c in range(it.source.num_chunks)[r::it.world_size]) for r in range(it.world_size)]

    def _to_device(self, batch):
        return self._copy(batch, non_blocking=False)

    def _pinned_slices(self):
        ds, b = self.dataset, self.cfg.batch_size
        for c in self.iterable.chunks():
            x, y = ds.load_chunk(c)
            if self.on_cuda:  # the notebook's `torch.tensor(data).pin_memory()`: a page-locked copy per load
                x, y = x.pin_memory(), y.pin_memory()
            for j in range(ds.cfg.batches_per_chunk or math.ceil(len(x) / b)):
                yield x[j * b:(j + 1) * b], y[j * b:(j + 1) * b]

    def _start_pass(self) -> None:
        # Non-persistent DataLoader workers start each pass from a copy of the iterable: tell it the epoch.
        self.iterable.epoch, self.epoch = self.epoch, self.epoch + 1

    def __iter__(self):
        self._start_pass()
        variant = self.cfg.variant
        if variant == "pin_chunk":
            for batch in self._pinned_slices():
                yield self._copy(batch, non_blocking=True)
        elif variant == "copy_in_loader":
            yield from self._batches()  # collate_fn has copied them
        else:
            for batch in self._batches():
                yield self._copy(batch, non_blocking=variant == "pin_batches")

    def host_batches(self):
        # The notebook's own Lightning run: DataLoader(pin_memory=True) batches, copied by Lightning.
        return self._host_pass() if self.cfg.variant in ("no_pinning", "pin_batches") else None

    def _host_pass(self):
        self._start_pass()
        yield from self._batches()


def check_chunks_fit(cfg, dataset, pinned_copy: bool) -> None:
    """Every loading process (the main one, or each DataLoader worker) holds one whole chunk while
    it serves batches from it; `pin_chunk` adds its page-locked copy."""
    copies = max(1, cfg.num_workers) * (1 + pinned_copy)
    what = (f"loader=iterable_chunks (one chunk of dataset.chunk_samples={dataset.chunk_samples} in each of "
            f"{max(1, cfg.num_workers)} loading process(es){', and its pinned copy' * pinned_copy})")
    check_host_fits(copies * dataset.chunk_samples * dataset.sample_bytes, what,
                    lambda free: f"set dataset.chunk_samples={max(1, free // (2 * copies * dataset.sample_bytes))} "
                                 f"(chunks within half of what is available) or a smaller dataset.num_samples")
