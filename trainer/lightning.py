"""GPU prefetching for PyTorch Lightning users (what PyTorch Lightning issue #1316 asked for), and
feedbench strategies as Lightning data. Needs `pip install 'feedbench[lightning]'`.

- `lightning_prefetch(dataloader)`: your own DataLoader, its batches copied to the Trainer's GPU on
  a side CUDA stream while the previous step computes (what `loader=prefetch` does):

      trainer.fit(model, datamodule=lightning_prefetch(DataLoader(data, batch_size=64, pin_memory=True)))

- `FeedbenchDataModule(cfg.loader, dataset)`: any feedbench strategy (`prefetch`, `pinned_chunk`,
  `gpu_resident`, ...) over a feedbench dataset, built on the Trainer's device.

Both hand Lightning batches that are already on its device. Lightning still calls
`LightningModule.transfer_batch_to_device` on each one (through the strategy's `batch_to_device`
and `move_data_to_device`), which calls `tensor.to(device, non_blocking=True)`; a tensor already on
that device is returned as it is, so nothing is copied a second time.

Lightning takes a batch from these when its step is next (its fetcher reads one batch ahead only
for data without a length), and the copy of the batch after it is queued just before; nothing in
Lightning's single-device loop waits for the GPU, so that copy runs beside the step's kernels.
It pays off when a step's GPU work outlasts the host's work per batch (workers, pinned data): then
the copy leaves the compute stream and each step is shorter by about one copy
(`benchmarks/lightning_prefetch.py`). A loop bound by the host (a DataLoader collating big batches
in the main thread) leaves the GPU idle between steps: no kernel for the copy to hide behind, and
either way the loop runs at the host's pace.

A single device: these do not shard the data across processes the way Lightning does for a
DataLoader under DDP.
"""

from __future__ import annotations

import warnings
from typing import Callable, Iterator, Optional

import lightning as L
import torch

from trainer.loaders import build_loader
from trainer.loaders.stream import SideStreamCopier, tensors


class EpochPasses:
    """A re-iterable for `Trainer.fit`: every `iter()` starts one pass (`make_pass()`) and first
    closes the one before. Lightning stops calling `next()` once it has had `len()` batches, which
    would leave the previous pass suspended (and its DataLoader workers running) until it happened
    to be garbage-collected; `close()` ends the current one."""

    def __init__(self, make_pass: Callable[[], Iterator], sized):
        self.make_pass, self.sized = make_pass, sized
        self._live: Optional[Iterator] = None

    def __len__(self) -> int:
        return len(self.sized)  # a TypeError (no length) tells Lightning the data is unsized

    def __iter__(self) -> Iterator:
        self.close()
        self._live = self.make_pass()
        return self._live

    def close(self) -> None:
        live, self._live = self._live, None
        if hasattr(live, "close"):
            live.close()


class DevicePrefetcher(EpochPasses):
    """The batches of `dataloader`, copied to `device` on a side CUDA stream `depth` batches ahead
    of the step that uses them: feedbench's `prefetch` strategy around a DataLoader you already
    have. A batch may be a tensor, or tuples, lists and dicts of tensors. Give the DataLoader
    `pin_memory=True`: a copy from pageable memory makes the host wait and cannot overlap.
    On a CPU device the batches pass through unchanged. Lightning reads a DataLoader without a
    length one batch ahead itself: its copies then run `depth` + 1 batches ahead.

    Return one from your own LightningDataModule's `train_dataloader()` (with
    `self.trainer.strategy.root_device`), or let `lightning_prefetch` do that.
    """

    def __init__(self, dataloader, device, depth: int = 1):
        if depth < 1:
            raise ValueError(f"depth must be >= 1 (got {depth}): use depth=1")
        super().__init__(self._pass, dataloader)
        self.dataloader, self.device = dataloader, torch.device(device)
        self.on_cuda = self.device.type == "cuda"
        self.copy_probe = None  # SideStreamCopier's interface: no meter here
        self.copier = SideStreamCopier(self, depth)  # one side stream for the prefetcher's lifetime
        self._checked_pinned = not self.on_cuda

    def _pass(self) -> Iterator:
        return self.copier.run(self._host_batches())

    def _host_batches(self):
        for batch in self.dataloader:  # the DataLoader's iterator starts on the first next(), not at iter()
            yield batch, None

    def _copy(self, batch, non_blocking: bool):
        if not self._checked_pinned:
            self._checked_pinned = True
            if not all(t.is_pinned() for t in tensors(batch)):
                warnings.warn("DevicePrefetcher: the DataLoader's batches are not in pinned memory, so their copies "
                              "cannot overlap the step: create the DataLoader with pin_memory=True", stacklevel=2)
        return _to(batch, self.device, non_blocking)


def _to(batch, device: torch.device, non_blocking: bool):
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return type(batch)((k, _to(v, device, non_blocking)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(_to(v, device, non_blocking) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to(v, device, non_blocking) for v in batch)
    return batch


class _PrefetchDataModule(L.LightningDataModule):
    def __init__(self, dataloader, depth: int):
        super().__init__()
        self.dataloader, self.depth = dataloader, depth
        self.prefetcher: Optional[DevicePrefetcher] = None

    def train_dataloader(self) -> DevicePrefetcher:
        self.teardown("fit")
        self.prefetcher = DevicePrefetcher(self.dataloader, self.trainer.strategy.root_device, self.depth)
        return self.prefetcher

    def teardown(self, stage: str) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()


def lightning_prefetch(dataloader, depth: int = 1) -> L.LightningDataModule:
    """A LightningDataModule whose training batches are `dataloader`'s, copied to the Trainer's
    device on a side CUDA stream `depth` batches ahead: pass it as `trainer.fit(model, datamodule=...)`."""
    if depth < 1:
        raise ValueError(f"depth must be >= 1 (got {depth}): use depth=1")
    return _PrefetchDataModule(dataloader, depth)


class FeedbenchDataModule(L.LightningDataModule):
    """A feedbench loader strategy as Lightning's training data: `loader_cfg` is a composed
    `loader` section (`cfg.loader`, e.g. `loader=pinned_chunk`), `dataset` a feedbench dataset
    (`datasets.build_dataset(cfg.dataset)`). The strategy is built on the Trainer's device when
    the fit starts and closed when it ends."""

    def __init__(self, loader_cfg, dataset, seed: int = 0):
        super().__init__()
        self.loader_cfg, self.dataset, self.seed = loader_cfg, dataset, seed
        self.loader = self.passes = None

    def train_dataloader(self) -> EpochPasses:
        self.teardown("fit")
        self.loader = build_loader(self.loader_cfg, self.dataset, self.trainer.strategy.root_device, seed=self.seed)
        self.passes = EpochPasses(lambda: iter(self.loader), self.loader)
        return self.passes

    def teardown(self, stage: str) -> None:
        if self.passes is not None:
            self.passes.close()
        if self.loader is not None:
            self.loader.close()
        self.loader = self.passes = None
