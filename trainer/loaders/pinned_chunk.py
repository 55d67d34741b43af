"""`pinned_chunk`: a big chunk pinned once, batches copied as contiguous slices of it.

The data is loaded chunk by chunk straight into page-locked buffers allocated once (no
`.pin_memory()` copy of a pageable tensor). Batches are contiguous slices of the chunk, so they
stay pinned (a fancy-indexed gather would not), and are copied on a side stream like `prefetch`.
Shuffling permutes the order of the batches within each chunk every epoch (and, with
`shuffle_rows`, the rows of a chunk once when it is loaded); `drop_last` drops the grid's short
last batch, the same rows every epoch (a per-sample shuffle drops other samples each epoch).
With several chunks, two buffers alternate: the next chunk loads in a background thread while
the current one is being copied.

Under torchrun every rank loads every chunk and is dealt every `world_size`-th batch of the
epoch's sequence of batches, as with every strategy (`trainer.loaders.order`). A dataset of one
chunk is loaded once per host, into a page-locked copy the ranks of the host share
(`trainer.loaders.host_copy`; `loader.shared_host_copy=false`: a copy per rank). Unshuffled, each
rank gets exactly `baseline`'s batches. Shuffled, the ranks are dealt this strategy's own sequence
(batches permuted within each chunk): the same split of a different order, so a rank's batches
differ from `baseline`'s, and without `drop_last` the epoch's short batch may fall to any rank
(it is still one batch: every rank has as many batches as under any other strategy).

The load thread selects the run's GPU before it touches CUDA (it waits on copy events), and waits
on blocking events: it sleeps while a copy still reads the buffer it is to refill.

Batches follow the same grid as every other strategy (batch j holds samples j*B .. j*B+B-1), so
without shuffling they are byte-identical to `baseline`'s. A batch that straddles two chunks is
assembled in a small page-locked staging buffer from the tail of one chunk and the head of the next.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from trainer.errors import ConfigError, at_least
from trainer.loaders.base import LOADERS, DeviceLoader, LoaderConfig, pinned_empty
from trainer.loaders.host_copy import HostCopy, holds_copy, shared_figures
from trainer.loaders.order import Shard, epoch_order
from trainer.loaders.stream import SideStreamCopier, made_events
from trainer.memory import check_host_fits, chunk_samples_for, host_buffer_bytes

_STAGES = 2  # staging buffers for straddling batches, used alternately


@LOADERS.register
class PinnedChunkLoader(DeviceLoader):
    needs_cuda = True

    @dataclass
    class Config(LoaderConfig):
        """Data loaded once into page-locked chunks; contiguous slices copied on a side stream."""

        name: str = "pinned_chunk"
        depth: int = 1  # slices copied ahead on the side stream
        shuffle_rows: bool = False  # also permute the rows of each chunk once, when it is loaded
        shared_host_copy: bool = True  # under torchrun, a dataset of one chunk: one page-locked copy per host, not per rank

        def __post_init__(self):
            super().__post_init__()
            at_least("loader.depth", self.depth, 1, 1)

    def __init__(self, cfg, dataset, device, seed=0, shard=Shard()):
        super().__init__(cfg, dataset, device, seed, shard)
        if dataset.num_chunks > 1 and dataset.chunk_samples < cfg.batch_size:
            raise ConfigError(f"loader=pinned_chunk needs chunks of at least loader.batch_size={cfg.batch_size} samples "
                              f"(got {dataset.chunk_samples}): lower dataset.chunks or loader.batch_size")
        start = time.perf_counter()
        self.copier = SideStreamCopier(self, cfg.depth, reuses_host_buffers=True)
        n_chunk_buffers = 1 if dataset.num_chunks == 1 else 2
        sizes = [dataset.chunk_samples] * n_chunk_buffers + [cfg.batch_size] * _STAGES * (n_chunk_buffers > 1)
        pin, shape = self.on_cuda, dataset.sample_shape
        # One chunk, loaded once: under torchrun the ranks of a host may share it (`HostCopy`).
        self.copy = None
        one = n_chunk_buffers == 1 and cfg.shared_host_copy and not shard.peers.alone
        held = sum(host_buffer_bytes(rows * dataset.sample_bytes, pin) + host_buffer_bytes(rows * 8, pin)  # + int64 labels
                   for rows in sizes) * (not one or holds_copy(shard.peers, True))
        check_host_fits(held, f"loader=pinned_chunk ({n_chunk_buffers} page-locked buffer(s) of "
                              f"dataset.chunk_samples={dataset.chunk_samples})",
                        lambda free: f"set dataset.chunk_samples={chunk_samples_for(dataset.sample_bytes + 8, free)} "
                                     f"or a smaller dataset.num_samples")
        if one:
            self.copy = HostCopy(len(dataset), shape, dataset.storage_dtype, self._fill, pin, shard.peers)
            self.buffers = [(self.copy.x, self.copy.y)]
            held = self.copy.nbytes * self.copy.filled_here
        else:
            self.buffers = [(pinned_empty((rows, *shape), dataset.storage_dtype, pin), pinned_empty((rows,), torch.int64, pin))
                            for rows in sizes]
        self.pinned_bytes = held if pin else 0
        self.shared = shared_figures(self.copy)  # (figures() is asked once the loader has closed)
        # Per buffer, an event recorded after every copy that reads it (`_copied`): the buffer is
        # free once its latest record has completed (copies run in order on the side stream).
        self.buffer_events = made_events(len(self.buffers), self.copier.stream, blocking=True) if pin else None
        self.load_device = self._thread_device()  # the load thread selects it before any CUDA call
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="chunk-load") if n_chunk_buffers > 1 else None
        # (chunk, buffer, x, y), or a Future of it; a shared chunk is loaded (by the host's first rank) already
        self.ready = (0, 0, *self.buffers[0]) if self.copy is not None else self._load(0, 0)
        self.setup_s = time.perf_counter() - start
        self.epoch = 0

    def figures(self) -> dict:
        """`shared_host_mb`: the host copy this rank made for every rank of its host."""
        return self.shared

    def _fill(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """The one chunk into a copy shared by the host's ranks, as `_load` loads it into a buffer."""
        _, labels = self.dataset.load_chunk(0, out=x)
        y.copy_(labels)
        self._shuffle_rows(x, y, 0)

    def _shuffle_rows(self, x: torch.Tensor, y: torch.Tensor, chunk: int) -> None:
        if self.cfg.shuffle_rows:
            perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(self.seed * 7919 + chunk))
            x.copy_(x[perm])
            y.copy_(y[perm])

    def _wait_free(self, buffer: int) -> None:
        """Block (asleep) until no issued copy still reads `buffer`."""
        if self.buffer_events is not None:
            self.buffer_events[buffer].synchronize()

    def _load(self, chunk: int, buffer: int):
        """Load `chunk` into `buffer` once no copy still reads it (runs in the loader thread)."""
        self._wait_free(buffer)
        x_buf, y_buf = self.buffers[buffer]
        x, y = self.dataset.load_chunk(chunk, out=x_buf)
        n = len(x)
        y_buf[:n].copy_(y)
        x, y = x_buf[:n], y_buf[:n]
        self._shuffle_rows(x, y, chunk)
        return chunk, buffer, x, y

    def _load_in_background(self, chunk: int, buffer: int):
        """`_load` on the load thread, on the run's GPU: without selecting it, the thread's first
        CUDA call (the wait on a copy event) would make a context on GPU 0, whatever the rank's."""
        if self.load_device is not None:
            torch.cuda.set_device(self.load_device)
        return self._load(chunk, buffer)

    def _take(self, chunk: int):
        ready = self.ready.result() if isinstance(self.ready, Future) else self.ready
        if ready[0] != chunk:  # an earlier pass stopped early: load what this one needs
            ready = self._load(chunk, ready[1])
        return ready

    def _host_slices(self, epoch: int):
        """Yield `((x, y), buffer)` host batches: slices of the loaded chunk, in shuffled order."""
        ds, b = self.dataset, self.cfg.batch_size
        tail = None  # (stage buffer, rows filled) carried from the previous chunk
        position = 0  # of the batch in the epoch's sequence, over all chunks: the ranks split it
        for c in range(ds.num_chunks):
            _, buffer, x, y = self.ready = self._take(c)
            lo, hi = ds.chunk_range(c)
            head = min((-lo) % b, hi - lo)  # rows that complete the batch begun in the previous chunk
            items = []
            if tail is not None:
                stage, filled = tail
                sx, sy = self.buffers[stage]
                sx[filled:filled + head].copy_(x[:head])
                sy[filled:filled + head].copy_(y[:head])
                items.append((sx[:filled + head], sy[:filled + head], stage))
            starts = range(head, hi - lo, b)
            items += [(x[s:s + b], y[s:s + b], buffer) for s in starts]
            tail = None
            if c + 1 < ds.num_chunks and len(items[-1][0]) < b:  # this chunk's last rows start a batch
                items.pop()
                s = starts[-1]
                stage = len(self.buffers) - _STAGES + c % _STAGES
                self._wait_free(stage)
                sx, sy = self.buffers[stage]
                sx[:hi - lo - s].copy_(x[s:])
                sy[:hi - lo - s].copy_(y[s:])
                tail = (stage, hi - lo - s)
            if self.pool is not None:  # overlap the next chunk's load with this chunk's copies
                self.ready = self.pool.submit(self._load_in_background, (c + 1) % ds.num_chunks, 1 - buffer)
            for i in epoch_order(len(items), self.cfg.shuffle, self.seed, epoch * ds.num_chunks + c).tolist():
                xs, ys, source = items[i]
                if self.cfg.drop_last and len(xs) < b:
                    continue
                position, mine = position + 1, self.shard.owns(position)
                if not mine:  # under torchrun: another rank's batch (every world_size-th is this rank's)
                    continue
                # A contiguous slice of a page-locked buffer is page-locked too.
                assert xs.is_pinned() or not self.on_cuda
                yield (xs, ys), source

    def _copied(self, buffer: int) -> None:
        self.buffer_events[buffer].record(self.copier.stream)

    def __iter__(self):
        epoch, self.epoch = self.epoch, self.epoch + 1
        for x, y in self.copier.run(self._host_slices(epoch), on_copied=self._copied):
            yield self.dataset.on_device(x), y

    def _release(self):
        if self.pool is not None:  # first: the load thread may be writing a buffer
            self.pool.shutdown(wait=True, cancel_futures=True)
        self.buffers, self.ready = [], None
        if self.copy is not None:
            self.copy.close(after=self.copier.stream if self.on_cuda else None)  # once no copy reads it
            self.copy = None
