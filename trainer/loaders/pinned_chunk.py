"""`pinned_chunk`: seed 000's idea done properly.

The data is loaded chunk by chunk straight into page-locked buffers allocated once (no
`.pin_memory()` copy of a pageable tensor). Batches are contiguous slices of the chunk, so they
stay pinned (a fancy-indexed gather would not), and are copied on a side stream like `prefetch`.
Shuffling permutes the order of the slices each epoch (and, with `shuffle_rows`, the rows of a
chunk once when it is loaded). With several chunks, two buffers alternate: the next chunk loads
in a background thread while the current one is being copied to the device.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from trainer.loaders.base import DeviceLoader, pinned_empty
from trainer.loaders.order import epoch_order
from trainer.loaders.stream import SideStreamCopier


class PinnedChunkLoader(DeviceLoader):
    needs_cuda = True

    def __init__(self, cfg, dataset, device, seed=0):
        super().__init__(cfg, dataset, device, seed)
        if cfg.depth < 1:
            raise ValueError(f"loader.depth must be >= 1 (got {cfg.depth}): set loader.depth=1")
        start = time.perf_counter()
        self.copier = SideStreamCopier(self, cfg.depth)
        n_buffers = 1 if dataset.num_chunks == 1 else 2
        rows = dataset.chunk_samples
        self.buffers = [
            (pinned_empty((rows, *dataset.sample_shape), dataset.storage_dtype, self.on_cuda),
             pinned_empty((rows,), torch.int64, self.on_cuda))
            for _ in range(n_buffers)
        ]
        self.pinned_bytes = sum(x.nbytes + y.nbytes for x, y in self.buffers) if self.on_cuda else 0
        self.last_copy = [None] * n_buffers  # latest copy event reading each buffer
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="chunk-load") if n_buffers > 1 else None
        self.ready = self._load(0, 0)  # (chunk, buffer, x, y) or a Future of it
        self.setup_s = time.perf_counter() - start
        self.epoch = 0

    def _load(self, chunk: int, buffer: int):
        """Load `chunk` into `buffer` once no copy still reads that buffer."""
        if self.last_copy[buffer] is not None:
            self.last_copy[buffer].synchronize()  # host waits here, in the loader thread
        x_buf, y_buf = self.buffers[buffer]
        x, y = self.dataset.load_chunk(chunk, out=x_buf)
        n = len(x)
        y_buf[:n].copy_(y)
        x, y = x_buf[:n], y_buf[:n]
        if self.cfg.shuffle_rows:
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 7919 + chunk))
            x.copy_(x[perm])
            y.copy_(y[perm])
        return chunk, buffer, x, y

    def _take(self, chunk: int):
        ready = self.ready.result() if hasattr(self.ready, "result") else self.ready
        if ready[0] != chunk:  # an earlier pass stopped early: load what this one needs
            ready = self._load(chunk, ready[1])
        return ready

    def _host_slices(self, epoch: int):
        ds, b = self.dataset, self.cfg.batch_size
        for c in range(ds.num_chunks):
            self.ready = ready = self._take(c)
            _, buffer, x, y = ready
            if self.pool is not None:  # overlap the next chunk's load with this chunk's copies
                self.ready = self.pool.submit(self._load, (c + 1) % ds.num_chunks, 1 - buffer)
            n_slices = math.ceil(len(x) / b)
            for s in epoch_order(n_slices, self.cfg.shuffle, self.seed, epoch * ds.num_chunks + c).tolist():
                xs, ys = x[s * b:(s + 1) * b], y[s * b:(s + 1) * b]
                if self.cfg.drop_last and len(xs) < b:
                    continue
                # A contiguous slice of a page-locked buffer is page-locked too.
                assert xs.is_pinned() or not self.on_cuda
                yield (xs, ys), buffer

    def _copied(self, buffer: int, event) -> None:
        self.last_copy[buffer] = event

    def __len__(self) -> int:
        ds, b = self.dataset, self.cfg.batch_size
        sizes = [stop - start for start, stop in map(ds.chunk_range, range(ds.num_chunks))]
        return sum(n // b if self.cfg.drop_last else math.ceil(n / b) for n in sizes)

    def __iter__(self):
        epoch, self.epoch = self.epoch, self.epoch + 1
        for x, y in self.copier.run(self._host_slices(epoch), on_copied=self._copied):
            yield self.dataset.on_device(x), y

    def close(self):
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        self.buffers, self.ready = [], None
