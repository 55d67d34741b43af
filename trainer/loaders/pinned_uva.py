"""`pinned_uva`: a fresh per-sample shuffle every epoch with no host copy at all: the GPU reads
each batch's rows straight out of page-locked host memory.

The dataset is loaded once, chunk by chunk, straight into page-locked memory, in its storage
dtype (uint8 images cross PCIe as bytes and become model input on the device). Each batch is
gathered by one kernel launch (`trainer.loaders.uva_gather`) that reads its rows over PCIe
(unified virtual addressing) into a ring of device buffers, and its labels from a copy of them
on the device. The gathers run on a side stream, `loader.depth` batches ahead of the step, on
`loader.ctas` thread blocks, by default as few as keep the link busy for the dataset's row size,
so the step keeps the other SMs (see `uva_gather.auto_ctas`). Each epoch visits
the samples in `epoch_order`, exactly as `baseline` does: the same batches, in the same order.

The ring holds `loader.depth + 2` slots, each with two events made (and recorded) once: `ready`,
recorded on the side stream after the slot's gather, which the compute stream waits on before
the step reads the slot; and `consumed`, recorded on the compute stream once the step that reads
the slot has been queued, which the side stream waits on before gathering into the slot again.
A batch is a view of its slot, valid until two more batches have been asked for: a loop asks for
the next batch once this one's step is queued, Lightning's fetcher one batch earlier, so a slot
is released when the batch after next is asked for. Gathers run ahead across the end of an
epoch: the next epoch's first batches are gathered while the last ones of this epoch are used.

Without Triton on a CUDA run, each batch is gathered on the host into a page-locked staging
buffer and copied (the run is tagged degraded); on the CPU the batches are `x[idx]`, as
`gpu_resident` yields there. Under torchrun every rank pins the whole dataset and gathers its
own `Shard` of every epoch.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Deque, Iterator

import torch

from trainer.errors import RunFailed, at_least
from trainer.loaders.base import LOADERS, DeviceLoader, LoaderConfig, pinned_empty
from trainer.loaders.order import Shard
from trainer.memory import check_gpu_fits, check_host_fits, chunk_samples_for, host_buffer_bytes

HOLD = 1  # batches a consumer may ask for before the step on a batch is queued (Lightning's fetcher: 1)


@LOADERS.register
class PinnedUvaLoader(DeviceLoader):
    needs_cuda = True

    @dataclass
    class Config(LoaderConfig):
        """Rows gathered by one GPU kernel straight out of page-locked host memory, `depth` batches ahead."""

        name: str = "pinned_uva"
        depth: int = 2  # batches gathered ahead on the side stream (depth + 2 device slots)
        ctas: int = 0  # thread blocks of the gather kernel; 0: from the row size (4 for rows of 32 KiB and more, up to 32 for small rows)

        def __post_init__(self):
            super().__post_init__()
            at_least("loader.depth", self.depth, 1, 2)
            at_least("loader.ctas", self.ctas, 0, "0 (chosen from the row size)")

    def __init__(self, cfg, dataset, device, seed=0, shard=Shard()):
        super().__init__(cfg, dataset, device, seed, shard)
        start = time.perf_counter()
        n, rows = len(dataset), min(cfg.batch_size, len(dataset))
        check_host_fits(dataset.nbytes + n * 8,
                        f"loader=pinned_uva (the whole dataset in {'page-locked ' * self.on_cuda}host memory)",
                        lambda free: f"set a smaller dataset.num_samples, or use loader=pinned_chunk with "
                                     f"dataset.chunk_samples={chunk_samples_for(dataset.sample_bytes + 8, free)}")
        self.x, self.y = _load_pinned(dataset, pin=self.on_cuda)
        self.closed, self.epoch = False, 0
        self.gather, self.fallback = None, None  # the kernel; else why it is not used (a CUDA run only)
        if self.on_cuda:
            self._setup_device(rows)
        self.setup_s = time.perf_counter() - start

    @property
    def degraded(self) -> bool:
        return super().degraded or self.fallback is not None

    def _setup_device(self, rows: int) -> None:
        """The device side: labels, the ring of slots and their events, the side stream, the kernel."""
        ds, slots = self.dataset, self.cfg.depth + 1 + HOLD
        self.num_slots = slots
        self.pinned_bytes = host_buffer_bytes(self.x.nbytes, pinned=True)  # as the host allocator reserves it
        check_gpu_fits(len(ds) * 8 + slots * rows * (ds.sample_bytes + 8), self.device,
                       f"loader=pinned_uva (the labels and {slots} batch slots, loader.depth + 2)",
                       "set a smaller loader.depth or loader.batch_size")
        self.y_dev = self.y.to(self.device)
        self.slots = [(torch.empty((rows, *ds.sample_shape), dtype=ds.storage_dtype, device=self.device),
                       torch.empty((rows,), dtype=torch.int64, device=self.device)) for _ in range(slots)]
        self.stream = torch.cuda.Stream(self.device)  # one per loader, for every pass (timm #2781)
        compute = torch.cuda.current_stream(self.device)
        # A CUDA event is created at its first record: record them all now, not inside the loop.
        self.ready = [torch.cuda.Event() for _ in range(slots)]
        self.consumed = [torch.cuda.Event() for _ in range(slots)]
        for ready, consumed in zip(self.ready, self.consumed):
            ready.record(self.stream)
            consumed.record(compute)
        self.gather, self.fallback = _kernel(self.x, self.y, self.y_dev, self.cfg.ctas, self.slots[0], self.stream)
        if self.gather is not None:
            self.targets = [self.gather.lanes(x) for x, _ in self.slots]  # the views the kernel writes
        else:
            print(f"warning: loader=pinned_uva gathers on the host ({self.fallback}); run tagged degraded=true",
                  file=sys.stderr)
            self.staging = [(pinned_empty((rows, *ds.sample_shape), ds.storage_dtype, True),
                             pinned_empty((rows,), torch.int64, True)) for _ in range(slots)]
            self.pinned_bytes += sum(host_buffer_bytes(x.nbytes, True) + host_buffer_bytes(y.nbytes, True)
                                     for x, y in self.staging)
        self.free: Deque[int] = deque(range(slots))  # slots no gather or batch holds
        self.pending: Deque = deque()  # (epoch, batch, slot, rows) of the gathers issued, in order
        self.held: Deque[int] = deque()  # slots of the batches handed out and not yet released
        self.upcoming: Iterator = iter(())  # the batches to gather next (`_schedule`)
        self.current = None  # the pass that owns the ring (a newer one takes it over)

    # -- the CUDA path ---------------------------------------------------------------------
    def _schedule(self, epoch: int) -> Iterator:
        """`(epoch, batch, rows)` of every batch from `epoch` on, epoch after epoch; the rows on the
        device for the kernel, on the host for the host gather."""
        b, count = self.cfg.batch_size, len(self)
        while count:
            order = self._epoch_rows(epoch)  # this rank's
            if self.gather is not None:
                order = self._upload(order)
            for i in range(count):
                yield epoch, i, order[i * b:(i + 1) * b]
            epoch += 1

    def _upload(self, order: torch.Tensor) -> torch.Tensor:
        """The epoch's order on the device, copied on the side stream (`_fill` runs the schedule)
        from page-locked memory: a pageable copy would wait for the gathers queued before it."""
        return order.pin_memory().to(self.device, non_blocking=True)

    def _fill(self) -> None:
        """Gather the coming batches into every free slot, on the side stream."""
        if not self.free:
            return
        probe, stream = self.copy_probe, self.stream
        with torch.cuda.stream(stream):
            while self.free:
                batch = next(self.upcoming, None)
                if batch is None:  # an empty epoch (drop_last, fewer samples than a batch)
                    return
                epoch, i, rows = batch
                slot, m = self.free.popleft(), len(rows)
                stream.wait_event(self.consumed[slot])  # the step that read this slot last is done
                if probe is not None:
                    probe.copy_begin(stream)
                if self.gather is not None:
                    self.gather(rows, self.targets[slot], self.slots[slot][1])
                else:
                    self._gather_on_host(slot, rows)
                if probe is not None:
                    probe.copy_end(stream, m * (self.dataset.sample_bytes + 8))
                self.ready[slot].record(stream)
                self.pending.append((epoch, i, slot, m))

    def _gather_on_host(self, slot: int, rows: torch.Tensor) -> None:
        """Without the kernel: gather into the slot's page-locked staging buffer, then copy it."""
        (x, y), (stage_x, stage_y), m = self.slots[slot], self.staging[slot], len(rows)
        self.ready[slot].synchronize()  # the copy out of this staging buffer last time has completed
        torch.index_select(self.x, 0, rows, out=stage_x[:m])
        torch.index_select(self.y, 0, rows, out=stage_y[:m])
        x[:m].copy_(stage_x[:m], non_blocking=True)
        y[:m].copy_(stage_y[:m], non_blocking=True)

    def _release_slots(self, compute) -> None:
        """Release the slots of batches whose step is queued by now (all but the last HOLD handed out)."""
        while len(self.held) > HOLD:
            slot = self.held.popleft()
            self.consumed[slot].record(compute)
            self.free.append(slot)

    def _drop_pending(self) -> None:
        """Forget the gathers of an abandoned pass: their slots are free (a later gather into one is
        queued behind them on the side stream, and no step reads them)."""
        self.free.extend(slot for _, _, slot, _ in self.pending)
        self.pending.clear()

    def _device_pass(self, epoch: int) -> Iterator:
        if not (self.pending and self.pending[0][:2] == (epoch, 0)):  # not gathered ahead: first or abandoned pass
            self._drop_pending()
            self.upcoming = self._schedule(epoch)
        token = self.current = object()
        compute = torch.cuda.current_stream(self.device)
        for _ in range(len(self)):
            if self.closed or self.current is not token:
                raise RuntimeError("loader=pinned_uva was closed, or iterated again, during a pass")
            self._release_slots(compute)  # the batch handed out two requests ago has had its step queued
            self._fill()  # the next gather is queued before this batch's step: they overlap
            _, _, slot, m = self.pending.popleft()
            compute.wait_event(self.ready[slot])
            self.held.append(slot)
            x, y = self.slots[slot]
            # uint8 crossed PCIe as uint8; it becomes model input here, on the device.
            yield self.dataset.on_device(x if m == len(x) else x[:m]), (y if m == len(y) else y[:m])

    # -- the CPU path (degraded) -----------------------------------------------------------
    def _host_pass(self, epoch: int) -> Iterator:
        order, b = self._epoch_rows(epoch), self.cfg.batch_size
        for i in range(len(self)):
            if self.closed:
                raise RuntimeError("loader=pinned_uva was closed during a pass")
            idx = order[i * b:(i + 1) * b]
            yield self.dataset.on_device(self.x.index_select(0, idx)), self.y.index_select(0, idx)

    def __iter__(self):
        # A generator: the epoch advances at the first batch, not when an iterator is made (Lightning
        # makes some it never reads).
        if self.closed:
            raise RuntimeError("loader=pinned_uva is closed: build a new one to iterate again")
        epoch, self.epoch = self.epoch, self.epoch + 1
        yield from self._device_pass(epoch) if self.on_cuda else self._host_pass(epoch)

    def _release(self):
        if self.on_cuda and not self.closed:
            self.stream.synchronize()  # no gather still reads the pinned data or writes a slot
            self.slots, self.targets, self.staging, self.pending = [], [], [], deque()
            self.y_dev = self.gather = None
        self.closed = True
        self.x = self.y = None


def _load_pinned(dataset, pin: bool):
    """The whole dataset as one (page-locked when `pin`) host tensor plus int64 labels, loaded chunk by chunk."""
    n = len(dataset)
    x = pinned_empty((n, *dataset.sample_shape), dataset.storage_dtype, pin)
    y = torch.empty((n,), dtype=torch.int64)
    for c in range(dataset.num_chunks):
        lo, hi = dataset.chunk_range(c)
        _, labels = dataset.load_chunk(c, out=x[lo:hi])
        y[lo:hi].copy_(labels)
    return x, y


def _kernel(x: torch.Tensor, y: torch.Tensor, y_dev: torch.Tensor, ctas: int, slot, stream):
    """`(RowGather, None)`, or `(None, why not)` where Triton is missing or cannot build the kernel.
    The kernel is compiled here (setup time, not the first step's) and checked to copy bit for bit."""
    try:
        from trainer.loaders import uva_gather  # imports Triton: only for a CUDA run that uses it
    except ImportError as e:
        return None, f"Triton is not available: {e}"
    gather = uva_gather.RowGather(x, y_dev, ctas or uva_gather.auto_ctas(x[0].nbytes))
    target, target_y = gather.lanes(slot[0]), slot[1]
    m = min(3, len(x), len(target))
    rows = torch.arange(len(x) - 1, len(x) - 1 - m, -1)  # the last rows, reversed
    try:
        with torch.cuda.stream(stream):
            gather(rows.to(target.device), target, target_y)
        stream.synchronize()
    except Exception as e:  # Triton cannot build or launch it here (no C compiler, an unsupported GPU, ...)
        first = next(iter(str(e).strip().splitlines()), "")
        return None, f"Triton cannot run the gather kernel: {type(e).__name__}: {first}"
    if not (torch.equal(target[:m].cpu(), gather.lanes(x[rows])) and torch.equal(target_y[:m].cpu(), y[rows])):
        raise RunFailed("loader=pinned_uva: the gather kernel's rows differ from the dataset's on this GPU: "
                        "use loader=pinned_gather")
    return gather, None
