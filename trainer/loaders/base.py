"""What every loader strategy shares: a plain iterable of device-ready `(x, y)` batches, the
config keys common to all of them, and the registry each strategy file adds itself to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Iterator, Optional, Tuple

import torch
from omegaconf import MISSING

from datasets.base import FeedDataset
from trainer.config import Registry
from trainer.errors import at_least
from trainer.loaders.order import EpochSampler, Shard, epoch_shard
from trainer.memory import check_host_fits, chunk_samples_for, release_pinned_cache

Batch = Tuple[torch.Tensor, torch.Tensor]
LOADERS = Registry("loader")  # `loader=<name>`: every strategy of trainer/loaders/, registered by its own file


@dataclass
class LoaderConfig:
    """Common to every loader strategy; a strategy's own `Config` extends it."""

    name: str = MISSING  # the strategy (`loader=prefetch`), set by its Config
    batch_size: int = 64
    shuffle: bool = True
    drop_last: bool = False
    num_workers: int = 0  # DataLoader worker processes (DataLoader-based strategies)
    prefetch_factor: Optional[int] = None  # batches each worker loads ahead (None = torch default)
    persistent_workers: bool = False  # keep workers alive between epochs
    uses_dataloader: ClassVar[bool] = False  # whether the three keys above mean anything to the strategy

    def unused_dataloader_keys(self) -> list:
        """The DataLoader keys set away from their defaults for a strategy that has no DataLoader."""
        if self.uses_dataloader:
            return []
        found = {"num_workers": self.num_workers != 0, "prefetch_factor": self.prefetch_factor is not None,
                 "persistent_workers": self.persistent_workers}
        return [f"loader.{k}={getattr(self, k)}" for k, v in found.items() if v]

    def __post_init__(self):
        at_least("loader.batch_size", self.batch_size, 1, 64)
        at_least("loader.num_workers", self.num_workers, 0, 0)
        if self.prefetch_factor is not None:
            at_least("loader.prefetch_factor", self.prefetch_factor, 1, 2)


class DeviceLoader:
    """Base class. Iterating yields `(x, y)` already on `device`, ready for the model.

    Works in any training loop (`for x, y in loader: ...`). Strategies know nothing about
    timing: a meter may set `copy_probe`, which is told where each host->device copy starts
    and ends (one copy per batch, in the order the batches are yielded).

    Under torchrun each rank builds its own loader with its `shard` of every epoch
    (`trainer.loaders.order.Shard`): it yields only that rank's batches.
    """

    needs_cuda = False  # True: on CPU it runs a degraded path (tagged `degraded=true`)
    reads_files = False  # True: it decodes an image folder's files itself (`gpu_decode`), for no other dataset
    per_sample = False  # True: it feeds the dataset's per-sample path (a DataLoader) and holds no block of it
    copier = None  # a strategy that copies on a side stream: its `SideStreamCopier`
    # A strategy whose next batch a CUDA-graphed step can fetch inside its own graph: an object with
    # `x`, `y` (the batch it yields), `beside()` (a context manager the step's capture wraps its work
    # in) and `replayed()` (told after each replay). See `trainer.loaders.pinned_uva.UvaGraphFeed`.
    graph_feed = None

    def __init__(self, cfg: LoaderConfig, dataset: FeedDataset, device: torch.device, seed: int = 0, shard: Shard = Shard()):
        self.cfg, self.dataset, self.device, self.seed = cfg, dataset, torch.device(device), seed
        self.shard = shard
        self.on_cuda = self.device.type == "cuda"
        self.setup_s = 0.0  # one-time cost paid before the first batch (pinning, uploading)
        self.pinned_bytes = 0  # page-locked host memory this loader holds
        self.copy_probe = None
        # A per-sample batch that crosses the link in its storage dtype is made the model input
        # after its copy (DataLoader strategies; None: it is the model input already).
        self.finish = dataset.per_sample_finish

    @property
    def degraded(self) -> bool:
        return self.needs_cuda and not self.on_cuda

    def figures(self) -> dict:
        """The strategy's own figures for the run's summary (e.g. `pinned_uva`'s `gather_blocks`)."""
        return {}

    def __len__(self) -> int:
        """Batches per epoch (this rank's, under torchrun)."""
        return self.shard.batches(len(self.dataset), self.cfg.batch_size, self.cfg.drop_last)

    def batches_per_rank(self) -> list:
        """Batches per epoch of every rank, in rank order (`[len(self)]` in a world of one)."""
        n, b, drop = len(self.dataset), self.cfg.batch_size, self.cfg.drop_last
        return [self.shard.batches(n, b, drop, rank=r) for r in range(self.shard.world_size)]

    def has_short_batches(self) -> bool:
        """Whether some rank's epoch has a batch shorter than `loader.batch_size`: the epoch's last,
        unless `loader.drop_last` drops it (every strategy cuts the same grid of batches)."""
        return not self.cfg.drop_last and len(self.dataset) % self.cfg.batch_size != 0

    def __iter__(self) -> Iterator[Batch]:
        raise NotImplementedError

    def host_batches(self) -> Optional[Iterator[Batch]]:
        """One pass of this strategy's batches *before* their copy, for a loop that copies batches
        itself (Lightning's `transfer_batch_to_device`), or None when the strategy must make its own
        copies: only a strategy whose copy is a plain `.to(device, non_blocking=True)` on the compute
        stream after a DataLoader returns them (none of the side-stream or resident strategies), of
        batches that are the model input once copied (not `self.finish`'s)."""
        return None

    def _finished(self, batch: Batch) -> Batch:
        """A copied per-sample batch as the model takes it (`self.finish`, when there is one)."""
        return batch if self.finish is None else (self.finish(batch[0]), *batch[1:])

    def close(self) -> None:
        """Release workers, threads and buffers (also called on interrupt; safe to call twice)."""
        self._stop_workers()
        self._release()
        if self.on_cuda:  # the page-locked blocks the buffers held, which PyTorch would keep cached
            release_pinned_cache(after=self.copier.stream if self.copier is not None else None)

    def _release(self) -> None:
        """Drop this strategy's buffers (by default its DataLoader), so their memory can be freed."""
        self.dataloader = None

    def _epoch_rows(self, epoch: int) -> torch.Tensor:
        """This rank's samples of `epoch`, batch after batch: its batch i is rows i*B .. i*B+B-1."""
        cfg = self.cfg
        return epoch_shard(len(self.dataset), cfg.shuffle, self.seed, epoch, self.shard, cfg.batch_size, cfg.drop_last)

    def _thread_device(self) -> Optional[int]:
        """The CUDA device a strategy's own threads select before they touch CUDA (else each would
        make a context on GPU 0, whatever the rank's device); None on the CPU."""
        if not self.on_cuda:
            return None
        return self.device.index if self.device.index is not None else torch.cuda.current_device()

    def _batches(self) -> Iterator[Batch]:
        """Iterate the DataLoader, remembering the live iterator so its workers can be stopped
        the moment the pass ends or fails, not whenever the iterator is garbage-collected (a
        traceback can keep it alive, and a dead worker's SIGCHLD error with it).

        The pass keeps its own DataLoader and iterator: a pass left suspended may be closed (or
        garbage-collected) after the strategy's `close()` dropped `self.dataloader`, or while a
        later pass runs, and must then stop only its own workers."""
        dataloader = self.dataloader
        live = self._live = iter(dataloader)
        try:
            yield from live
        finally:
            if not dataloader.persistent_workers:  # persistent ones serve the next pass; close() stops them
                self._stop_workers(live)

    def _stop_workers(self, live=None) -> None:
        """Stop the workers of `live` (by default: of the latest pass)."""
        if live is None or live is getattr(self, "_live", None):
            live, self._live = getattr(self, "_live", None), None
        shutdown = getattr(live, "_shutdown_workers", None)  # multi-process iterators only
        if shutdown is not None:
            shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- helpers for subclasses --------------------------------------------------------------
    def _copy(self, batch: Batch, non_blocking: bool) -> Batch:
        """Copy a host batch to the device on the current stream, reporting it to the probe."""
        stream = torch.cuda.current_stream(self.device) if self.on_cuda else None
        probe = self.copy_probe if stream is not None else None
        if probe is not None:
            probe.copy_begin(stream)
        out = tuple(t.to(self.device, non_blocking=non_blocking) for t in batch)
        if probe is not None:
            probe.copy_end(stream, sum(t.nbytes for t in batch))
        return out

    def _dataloader(self, pin_memory: bool) -> torch.utils.data.DataLoader:
        """The per-sample DataLoader the DataLoader-based strategies wrap."""
        cfg, workers = self.cfg, self.cfg.num_workers
        check_host_fits(self.dataset.per_sample_bytes, f"loader={cfg.name} (the whole dataset in host memory)",
                        lambda free: f"use loader=pinned_chunk with dataset.chunk_samples="
                                     f"{chunk_samples_for(self.dataset.sample_bytes, free)}, or a smaller dataset.num_samples")
        return torch.utils.data.DataLoader(
            self.dataset.per_sample(),
            batch_size=cfg.batch_size,
            sampler=EpochSampler(len(self.dataset), cfg.shuffle, self.seed, self.shard, cfg.batch_size, cfg.drop_last),
            drop_last=False,  # the sampler has dropped the epoch's partial batch, once for all ranks
            num_workers=workers,
            pin_memory=pin_memory and self.on_cuda,
            prefetch_factor=cfg.prefetch_factor if workers > 0 else None,
            persistent_workers=cfg.persistent_workers and workers > 0,
        )


def pinned_empty(shape, dtype, pin: bool) -> torch.Tensor:
    """Allocate directly in page-locked memory (no pageable copy first, unlike `.pin_memory()`)."""
    return torch.empty(shape, dtype=dtype, pin_memory=pin)
