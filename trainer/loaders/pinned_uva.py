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
`gpu_resident` yields there. Under torchrun every rank gathers its own `Shard` of every epoch
from one page-locked copy of the dataset that the ranks of its host share
(`trainer.loaders.host_copy`; `loader.shared_host_copy=false`: a copy per rank).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Deque, Iterator, List, Optional

import torch

from trainer.errors import ConfigError, RunFailed, at_least
from trainer.loaders.base import LOADERS, DeviceLoader, LoaderConfig, pinned_empty
from trainer.loaders.host_copy import holds_copy, shared_figures, whole_dataset
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
        ctas: int = 0  # thread blocks of the gather kernel; 0: from the row size (4 to 32), doubled while the step waits for its gather
        gather_in_graph: bool = False  # with engine.cuda_graph=true: the next batch's gather is captured in the step's graph
        shared_host_copy: bool = True  # under torchrun: one page-locked copy of the dataset per host, not per rank

        def __post_init__(self):
            super().__post_init__()
            at_least("loader.depth", self.depth, 1, 2)
            at_least("loader.ctas", self.ctas, 0, "0 (chosen from the row size and the step)")

    def __init__(self, cfg, dataset, device, seed=0, shard=Shard()):
        super().__init__(cfg, dataset, device, seed, shard)
        start = time.perf_counter()
        n, rows = len(dataset), min(cfg.batch_size, len(dataset))
        check_host_fits(holds_copy(shard.peers, cfg.shared_host_copy) * (dataset.nbytes + n * 8),
                        f"loader=pinned_uva (the whole dataset in {'page-locked ' * self.on_cuda}host memory)",
                        lambda free: f"set a smaller dataset.num_samples, or use loader=pinned_chunk with "
                                     f"dataset.chunk_samples={chunk_samples_for(dataset.sample_bytes + 8, free)}")
        if cfg.gather_in_graph:
            self._check_full_batches()
        self.copy = whole_dataset(dataset, self.on_cuda, shard.peers, cfg.shared_host_copy)
        self.x, self.y = self.copy.x, self.copy.y
        self.shared = shared_figures(self.copy)  # (figures() is asked once the loader has closed)
        self.closed, self.epoch = False, 0
        self.gather, self.fallback = None, None  # the kernel; else why it is not used (a CUDA run only)
        self.tuning: Optional[BlockTuning] = None  # loader.ctas=0 on the ring: the blocks, from the step's waits
        self.blocks = 0  # the gather kernel's thread blocks (0: no kernel)
        if self.on_cuda:
            self._setup_device(rows)
        self.setup_s = time.perf_counter() - start

    @property
    def degraded(self) -> bool:
        return super().degraded or self.fallback is not None

    def figures(self) -> dict:
        """`gather_blocks`: the gather kernel's thread blocks at the end of the run (a CUDA run with
        the kernel); `shared_host_mb`: the host copy this rank made for every rank of its host."""
        out = {"gather_blocks": float(self.blocks)} if self.blocks else {}
        return {**out, **self.shared}

    def _check_full_batches(self) -> None:
        """A graph replays one batch shape: every batch of every epoch must be full."""
        b, rows = self.cfg.batch_size, len(self._epoch_rows(0))
        if rows != len(self) * b:
            raise ConfigError(f"loader.gather_in_graph=true captures the gather of full batches, but an epoch of this "
                              f"{'rank' if self.shard.world_size > 1 else 'run'} ends with a batch of {rows % b or rows} "
                              f"samples, not {b}: set loader.drop_last=true, or loader.gather_in_graph=false")

    def _setup_device(self, rows: int) -> None:
        """The device side: labels, the side stream, the kernel; then the ring of slots and their
        events, or (`loader.gather_in_graph`, with the kernel) the graph feed's buffers."""
        ds, in_graph, slots = self.dataset, self.cfg.gather_in_graph, self.cfg.depth + 1 + HOLD
        # As the host allocator reserves it; a copy shared by the host's ranks, by the rank that made it.
        self.pinned_bytes = host_buffer_bytes(self.x.nbytes, pinned=True) if not self.copy.shared else \
            self.copy.nbytes * self.copy.filled_here
        if in_graph:  # the gathered batch, the step's float32 input, two epochs of order
            what = "the next batch, the step's input and two epochs' order"
            needed = rows * (ds.sample_bytes + 4 * math.prod(ds.sample_shape) + 16) + 2 * len(self) * rows * 8
        else:
            what, needed = f"{slots} batch slots, loader.depth + 2", slots * rows * (ds.sample_bytes + 8)
        check_gpu_fits(len(ds) * 8 + needed, self.device, f"loader=pinned_uva (the labels and {what})",
                       "set a smaller loader.depth or loader.batch_size")
        self.y_dev = self.y.to(self.device)
        self.stream = torch.cuda.Stream(self.device)  # one per loader, for every pass (timm #2781)
        self.gather, self.fallback = _kernel(self.x, self.y, self.y_dev, self.cfg.ctas, self.stream)
        if self.gather is not None:
            self.blocks = self.gather.ctas
            if in_graph:
                self.graph_feed = UvaGraphFeed(self, rows)
                return
        elif in_graph:
            print("warning: loader.gather_in_graph=true needs the gather kernel: the gathers stay outside the graph",
                  file=sys.stderr)
        self._setup_ring(rows, slots)

    def _setup_ring(self, rows: int, slots: int) -> None:
        """The ring of device slots, their events, and the host staging buffers without the kernel."""
        ds = self.dataset
        self.num_slots = slots
        self.slots = [(torch.empty((rows, *ds.sample_shape), dtype=ds.storage_dtype, device=self.device),
                       torch.empty((rows,), dtype=torch.int64, device=self.device)) for _ in range(slots)]
        compute = torch.cuda.current_stream(self.device)
        # A CUDA event is created at its first record: record them all now, not inside the loop.
        self.ready = [torch.cuda.Event() for _ in range(slots)]
        self.consumed = [torch.cuda.Event() for _ in range(slots)]
        for ready, consumed in zip(self.ready, self.consumed):
            ready.record(self.stream)
            consumed.record(compute)
        if self.gather is not None:
            self.targets = [self.gather.lanes(x) for x, _ in self.slots]  # the views the kernel writes
            if self.cfg.ctas == 0:
                self.tuning = BlockTuning(self.gather, self.stream, compute)
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
                if self.tuning is not None:
                    self.tuning.gathered(stream)
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
        if self.tuning is not None:
            self.tuning.realign()

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
            if self.tuning is not None and self.tuning.needed(compute):
                self.tuning = None  # the blocks are chosen
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

    # -- the CUDA path with the gather in the step's graph ----------------------------------------
    def _graph_pass(self, epoch: int) -> Iterator:
        feed, count = self.graph_feed, len(self)
        token = self.current = object()
        if feed.at != (epoch, 0):  # not placed by the last pass's final step: the first pass, or after an abandoned one
            feed.start(epoch)
        feed.upload(epoch + 1)  # this epoch's last step gathers the next one's first batch
        for i in range(count):
            if self.closed or self.current is not token:
                raise RuntimeError("loader=pinned_uva was closed, or iterated again, during a pass")
            if feed.at != (epoch, i):  # no replay placed it (the warm-up before capture, a loop without the graph)
                feed.place()
            yield feed.x, feed.y

    def __iter__(self):
        # A generator: the epoch advances at the first batch, not when an iterator is made (Lightning
        # makes some it never reads).
        if self.closed:
            raise RuntimeError("loader=pinned_uva is closed: build a new one to iterate again")
        epoch, self.epoch = self.epoch, self.epoch + 1
        if not self.on_cuda:
            yield from self._host_pass(epoch)
        elif self.graph_feed is not None:
            yield from self._graph_pass(epoch)
        else:
            yield from self._device_pass(epoch)

    def _release(self):
        if self.gather is not None:
            self.blocks = self.gather.ctas  # as the run ended (`BlockTuning` may have raised them)
        if self.on_cuda and not self.closed:
            self.stream.synchronize()  # no gather still reads the pinned data or writes a slot
            self.slots, self.targets, self.staging, self.pending = [], [], [], deque()
            self.y_dev = self.gather = self.graph_feed = self.tuning = None
        self.closed = True
        self.x = self.y = None
        if self.copy is not None:
            self.copy.close()  # after the stream's gathers (synchronized above)
            self.copy = None


class UvaGraphFeed:
    """`loader.gather_in_graph`: the next batch gathered by work that a CUDA-graphed step captures
    in its own graph (`trainer.loop.steps.GraphedStep`), so that one replay trains on this batch
    and gathers the next beside it: no launch, event or copy of the loader's between replays.

    `x`, `y` are the step's batch (the model input: uint8 made float here, on the device), which
    the loader yields at every step. `raw`, `raw_y` receive the next batch's gathered rows. Two
    epochs' order live on the device, one per half of `order` (epoch e in half e % 2), and `pos`
    on the device is where in them `x`, `y`'s batch is: the work needs nothing from the host.
    One replay runs, on the captured streams:

        side stream:    rows = order[pos + 1]; raw <- gather(rows)      (beside the step)
        compute stream: the step on x, y;  then, after both: x, y <- raw; pos <- pos + 1

    The same work runs eagerly on the compute stream (`place`) where no replay ran: the steps
    before the graph is captured, or a loop without it. `at` is the (epoch, batch) that `x`, `y`
    hold once the work queued so far has run; the loader places a batch when no replay did.
    """

    def __init__(self, loader: PinnedUvaLoader, rows: int):
        ds, device = loader.dataset, loader.device
        self.loader, self.dataset, self.gather = loader, ds, loader.gather
        self.pin = loader.on_cuda  # the order's uploads from page-locked memory (a CUDA run)
        self.count, self.rows = len(loader), rows  # batches per epoch, rows per batch
        self.order = torch.empty((2 * self.count, rows), dtype=torch.int64, device=device)  # epoch e: rows [e % 2 * count:]
        self.held = [None, None]  # the epoch whose order each half holds
        self.pos = torch.zeros(1, dtype=torch.int64, device=device)
        self.next_pos = torch.zeros(1, dtype=torch.int64, device=device)
        self.next_rows = torch.empty((1, rows), dtype=torch.int64, device=device)
        self.raw = torch.empty((rows, *ds.sample_shape), dtype=ds.storage_dtype, device=device)
        self.raw_y = torch.empty((rows,), dtype=torch.int64, device=device)
        self.target = self.gather.lanes(self.raw)  # the view the kernel writes
        self.x = torch.empty_like(ds.on_device(self.raw))  # the step's input, in the dtype the model reads
        self.y = torch.empty_like(self.raw_y)
        self.at = None  # (epoch, batch) in x, y once the queued work has run; None: nothing placed yet

    def _after(self, at: tuple) -> tuple:
        epoch, i = at
        return (epoch, i + 1) if i + 1 < self.count else (epoch + 1, 0)

    def upload(self, epoch: int) -> None:
        """`epoch`'s order into its half, on the current stream: behind every replay queued before,
        which may still read the half's previous epoch."""
        half = epoch % 2
        if self.held[half] != epoch:
            rows = self.loader._epoch_rows(epoch).view(self.count, self.rows)
            # A page-locked source: a pageable copy would wait for the replays queued before it.
            self.order[half * self.count:(half + 1) * self.count].copy_(rows.pin_memory() if self.pin else rows,
                                                                        non_blocking=True)
            self.held[half] = epoch

    def start(self, epoch: int) -> None:
        """Place `epoch`'s first batch (the first pass, or one after an abandoned pass)."""
        self.upload(epoch)
        self.pos.fill_((epoch % 2 * self.count - 1) % (2 * self.count))  # the next position is the epoch's first
        self.at = (epoch, -1)
        self.place()

    def _gather_next(self) -> None:
        """On the current stream: the position after `pos`, its rows, gathered into `raw`."""
        torch.add(self.pos, 1, out=self.next_pos)
        self.next_pos.remainder_(2 * self.count)
        torch.index_select(self.order, 0, self.next_pos, out=self.next_rows)
        self.gather(self.next_rows[0], self.target, self.raw_y)

    def _put_next(self) -> None:
        """On the current stream: the gathered batch becomes the step's, `pos` moves on."""
        self.x.copy_(self.dataset.on_device(self.raw))
        self.y.copy_(self.raw_y)
        self.pos.copy_(self.next_pos)

    def place(self) -> None:
        """Gather the next batch and make it the step's, eagerly, on the current stream."""
        self._gather_next()
        self._put_next()
        self.at = self._after(self.at)

    @contextlib.contextmanager
    def beside(self):
        """For a step's capture: the next batch's gather on the loader's side stream, beside the
        work captured in the block, then placed once both are done. Call `replayed()` after each
        replay of the graph."""
        compute = torch.cuda.current_stream(self.loader.device)
        side = self.loader.stream
        side.wait_stream(compute)  # forks the side stream into the capture
        with torch.cuda.stream(side):
            self._gather_next()
        yield
        compute.wait_stream(side)  # joins it: the step is done reading x, the next batch is gathered
        self._put_next()

    def replayed(self) -> None:
        """A replay of the captured graph placed the next batch."""
        self.at = self._after(self.at)


class BlockTuning:
    """`loader.ctas=0` on the ring: the gather starts on `auto_ctas` blocks (from the row size: as
    few as keep the link busy, leaving the other SMs to the step) and doubles them, up to
    `most`, while the step waits for its batch, which is the sign that the gather, not the step,
    sets the pace (a step that only copies, `model=noop`; a short GPU-bound step). A doubling
    that did not shorten the steps by `GAIN` is taken back, and the blocks are chosen: the link,
    or the step, is the limit there, and more blocks would only hold SMs.

    Over windows of `WINDOW` batches, after the first `SKIP` (the first steps build, capture and
    warm up), two timing events per batch: `ready`, recorded on the side stream after the batch's
    gather, and `needed`, on the compute stream just before it waits for that batch, where the
    previous step's work is done. The step waited `ready - needed` (when positive), and the steps
    came `needed - previous needed` apart. A window's events are read once its last have
    completed (polled with `query()`, never a sync): the loop never waits for them.
    """

    SKIP, WINDOW = 8, 16
    WAITED = 0.1  # the median wait, as a share of the median step, that says the step waits for the gather
    GAIN = 0.03  # a doubling that shortened the median step by less than this is taken back

    def __init__(self, gather, side, compute, most: int = 32):  # most: `uva_gather.AUTO_CTAS`'s
        self.gather, self.most = gather, most
        self.events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                       for _ in range(self.WINDOW)]  # (ready, needed) per batch of the window
        for ready, needed in self.events:  # a CUDA event is created at its first record: now, not in the loop
            ready.record(side)
            needed.record(compute)
        self.gathers = self.handed = 0  # batches gathered, and waited for, so far
        self.start = self.SKIP  # the window's first batch
        self.before: Optional[tuple] = None  # (blocks, median ms between steps) of the window before a doubling

    def realign(self) -> None:
        """The gathers not handed out were dropped (an abandoned pass): the next batch gathered is
        the next one handed out, and a window under way starts again from it."""
        self.handed = self.gathers
        if self.start < self.gathers:
            self.start = self.gathers

    def gathered(self, side) -> None:
        """After a batch's gather, on the side stream."""
        k = self.gathers - self.start
        if 0 <= k < self.WINDOW:
            self.events[k][0].record(side)
        self.gathers += 1

    def needed(self, compute) -> bool:
        """Before the compute stream waits for the next batch. True once the blocks are chosen."""
        if self.gather.ctas >= self.most and self.before is None:
            return True  # the row size already asked for the most
        k = self.handed - self.start
        if 0 <= k < self.WINDOW:
            self.events[k][1].record(compute)
        self.handed += 1
        if k < self.WINDOW - 1 or not all(e.query() for e in self.events[-1]):
            return False
        waits = [max(0.0, needed.elapsed_time(ready)) for ready, needed in self.events]
        gaps = [a[1].elapsed_time(b[1]) for a, b in zip(self.events, self.events[1:])]
        gap = statistics.median(gaps)
        if self.before is not None and gap > (1 - self.GAIN) * self.before[1]:
            self.gather.ctas = self.before[0]  # no faster with twice the blocks
            return True
        blocks = more_blocks(self.gather.ctas, self.most, waits, gaps, self.WAITED)
        if blocks == self.gather.ctas:
            return True
        self.before = (self.gather.ctas, gap)
        self.gather.ctas, self.start = blocks, self.gathers  # the next window: batches not gathered yet
        return False


def more_blocks(blocks: int, most: int, waits_ms: List[float], gaps_ms: List[float], waited: float) -> int:
    """The gather's blocks for the next window: twice `blocks` (at most `most`) when the step's
    median wait for its batch was at least `waited` of the median time between steps."""
    wait = statistics.median(waits_ms)
    if wait > 0 and wait >= waited * statistics.median(gaps_ms):
        return min(most, 2 * blocks)
    return blocks


def _kernel(x: torch.Tensor, y: torch.Tensor, y_dev: torch.Tensor, ctas: int, stream):
    """`(RowGather, None)`, or `(None, why not)` where Triton is missing or cannot build the kernel.
    The kernel is compiled here (setup time, not the first step's, nor inside a graph's capture)
    and checked to copy bit for bit."""
    try:
        from trainer.loaders import uva_gather  # imports Triton: only for a CUDA run that uses it
    except ImportError as e:
        return None, f"Triton is not available: {e}"
    gather = uva_gather.RowGather(x, y_dev, ctas or uva_gather.auto_ctas(x[0].nbytes))
    m = min(3, len(x))
    target = gather.lanes(torch.empty((m, *x.shape[1:]), dtype=x.dtype, device=y_dev.device))
    target_y = torch.empty((m,), dtype=torch.int64, device=y_dev.device)
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
