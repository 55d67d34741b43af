"""`gpu_resident`: the whole dataset moved to GPU memory once; batches gathered there by index.

Nothing crosses PCIe after setup. uint8 images stay uint8 in GPU memory (4x less than float)
and become model input only after the gather, on the device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from trainer.loaders.base import LOADERS, DeviceLoader, LoaderConfig
from trainer.loaders.order import Shard
from trainer.memory import check_gpu_fits, check_host_fits


@LOADERS.register
class GpuResidentLoader(DeviceLoader):
    needs_cuda = True

    @dataclass
    class Config(LoaderConfig):
        """The whole dataset moved to GPU memory once; batches gathered there by index."""

        name: str = "gpu_resident"

    def __init__(self, cfg, dataset, device, seed=0, shard=Shard()):
        super().__init__(cfg, dataset, device, seed, shard)
        start = time.perf_counter()
        n = len(dataset)
        chunk = dataset.chunk_samples * dataset.sample_bytes  # each chunk passes through host memory
        if self.on_cuda:
            check_fits(dataset.nbytes + n * 8, self.device)
        check_host_fits(chunk + (0 if self.on_cuda else dataset.nbytes + n * 8),
                        f"loader=gpu_resident{'' if self.on_cuda else ' on the CPU (the whole dataset in host memory)'}",
                        "set a smaller dataset.num_samples (or more dataset.chunks)")
        self.x = torch.empty((n, *dataset.sample_shape), dtype=dataset.storage_dtype, device=self.device)
        self.y = torch.empty((n,), dtype=torch.int64, device=self.device)
        for c in range(dataset.num_chunks):
            lo, hi = dataset.chunk_range(c)
            x, y = dataset.load_chunk(c)
            self.x[lo:hi].copy_(x)
            self.y[lo:hi].copy_(y)
        if self.on_cuda:
            torch.cuda.synchronize(self.device)  # setup cost is paid in full before training
        self.setup_s = time.perf_counter() - start
        self.epoch = 0

    def __iter__(self):
        epoch, self.epoch = self.epoch, self.epoch + 1
        b = self.cfg.batch_size
        gather = self.cfg.shuffle or not self.shard.whole  # else batches are plain slices
        if gather:
            order = self._epoch_rows(epoch)
            if self.on_cuda:  # from pinned memory: a pageable copy would wait for every queued step
                order = order.pin_memory().to(self.device, non_blocking=True)
        for i in range(len(self)):
            if gather:
                idx = order[i * b:(i + 1) * b]
                x, y = self.x.index_select(0, idx), self.y.index_select(0, idx)
            else:
                x, y = self.x[i * b:(i + 1) * b], self.y[i * b:(i + 1) * b]
            yield self.dataset.on_device(x), y

    def _release(self):
        self.x = self.y = None


def check_fits(needed: int, device: torch.device) -> None:
    """Fail before allocating when the data cannot fit, saying how much is needed and free."""
    check_gpu_fits(needed, device, "loader=gpu_resident", "use loader=pinned_chunk or a smaller dataset.num_samples")
