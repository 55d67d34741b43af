"""`pinned_gather`: a fresh per-sample shuffle every epoch, fed from page-locked memory.

The dataset is held once in host memory, in its storage dtype (uint8 images stay uint8); under
torchrun, once per host for all its ranks (`trainer.loaders.host_copy`; `loader.shared_host_copy=false`:
a copy per rank). Each
epoch visits the samples in `epoch_order`, exactly as `baseline` does, so the batches are the
same, in the same order. `loader.threads` worker threads gather the rows of the coming batches
straight into a ring of page-locked slots allocated once; each filled slot is copied on the
side stream (`SideStreamCopier`, as `prefetch`), and a slot is gathered into again only after
the event of the copy that read it has completed. The loop's thread only hands out indices and
issues copies, so the gathers run in parallel with the step and with the copies of other slots,
and across the end of an epoch: the next epoch's first batches are gathered (its order is known
in advance) while the last ones of this epoch are copied.

The ring holds `loader.depth + loader.threads + 1` slots: `depth` batches being copied ahead,
one the step is about to use, and one per thread to gather into meanwhile.

`close()` stops and joins every thread before it marks the loader closed and drops the slots; an
interrupt meanwhile (Ctrl-C) is raised only once no thread is left running.

The threads are fed through lean C-level queues rather than an executor's futures: a gather is
one `put` on the loop's thread and one `get` when its batch is due, and in between a worker takes
the GIL only to start the gather and to report it. An eager step is bound by the loop's thread
launching kernels; every extra GIL handoff and lock between it and the workers slows it down.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Deque, Iterator, List, Optional, Tuple

import numpy as np
import torch

from trainer.errors import RunFailed, at_least
from trainer.loaders.base import LOADERS, DeviceLoader, LoaderConfig, pinned_empty
from trainer.loaders.host_copy import holds_copy, shared_figures, whole_dataset
from trainer.loaders.order import Shard
from trainer.loaders.stream import SideStreamCopier, made_events
from trainer.memory import check_host_fits, chunk_samples_for, host_buffer_bytes

THREAD_PREFIX = "pinned-gather"  # the worker threads' names start with this


@LOADERS.register
class PinnedGatherLoader(DeviceLoader):
    needs_cuda = True

    @dataclass
    class Config(LoaderConfig):
        """Per-sample shuffle at PCIe speed: threads gather each batch's rows into page-locked slots, copied on a side stream."""

        name: str = "pinned_gather"
        depth: int = 1  # batches copied ahead on the side stream
        threads: int = 4  # threads gathering rows into the page-locked slots (depth + threads + 1 slots)
        shared_host_copy: bool = True  # under torchrun: one copy of the dataset per host, not per rank

        def __post_init__(self):
            super().__post_init__()
            at_least("loader.depth", self.depth, 1, 1)
            at_least("loader.threads", self.threads, 1, 4)

    def __init__(self, cfg, dataset, device, seed=0, shard=Shard()):
        super().__init__(cfg, dataset, device, seed, shard)
        start = time.perf_counter()
        n, rows = len(dataset), min(cfg.batch_size, len(dataset))
        self.num_slots = cfg.depth + cfg.threads + 1
        source_bytes = holds_copy(shard.peers, cfg.shared_host_copy) * (dataset.nbytes + n * 8)  # samples + labels
        slot_rows, pin = self.num_slots * rows, self.on_cuda  # the slots' samples and int64 labels
        slot_bytes = host_buffer_bytes(slot_rows * dataset.sample_bytes, pin) + host_buffer_bytes(slot_rows * 8, pin)
        check_host_fits(source_bytes + slot_bytes,
                        f"loader=pinned_gather (the whole dataset in host memory and {self.num_slots} page-locked "
                        f"batch slots, loader.depth + loader.threads + 1)",
                        lambda free: f"set a smaller dataset.num_samples, or use loader=pinned_chunk with "
                                     f"dataset.chunk_samples={chunk_samples_for(dataset.sample_bytes + 8, free)} "
                                     f"(it holds two chunks, not the whole dataset)")
        # The rows are read on the host (by the threads), so the copy need not be page-locked.
        self.copy = whole_dataset(dataset, False, shard.peers, cfg.shared_host_copy)
        self.x, self.y = self.copy.x, self.copy.y
        self.shared = shared_figures(self.copy)  # (figures() is asked once the loader has closed)
        shape = dataset.sample_shape
        self.slots_x = pinned_empty((self.num_slots, rows, *shape), dataset.storage_dtype, pin)
        self.slots_y = pinned_empty((self.num_slots, rows), torch.int64, pin)
        self.pinned_bytes = slot_bytes if pin else 0
        # The gather works on raw bytes: one row per sample, whatever the dtype (numpy has no bfloat16).
        self._src_x, self._src_y = _row_bytes(self.x), self.y.numpy()
        self._dst_x = [_row_bytes(s) for s in self.slots_x]
        self._dst_y = [s.numpy() for s in self.slots_y]
        self.copier = SideStreamCopier(self, cfg.depth, reuses_host_buffers=True)  # one stream per loader
        # One event per slot, made once and recorded by each copy that reads the slot. A gather
        # thread waits on it before refilling the slot; with a step queued ahead of the GPU that
        # wait lasts milliseconds, so the event blocks (the thread sleeps) instead of spinning a
        # core on the driver beside the loop's thread. Re-recording is safe: a slot is copied
        # again only after its gather, which began after the wait on the previous record ended.
        # Before its first copy a slot's event holds the record that made it (`made_events`), on
        # the idle side stream: waiting on it returns at once.
        self.slot_events = made_events(self.num_slots, self.copier.stream, blocking=True) if self.on_cuda else None
        self.pending: Deque = deque()  # (epoch, batch, slot) of the queued gathers, in order
        self.upcoming: Iterator = iter(())  # the batches to queue next (`_schedule`)
        self.queued = 0  # gathers queued so far: the next one fills slot `queued % num_slots`
        # Views of each slot, made once: the loop's thread hands out one per batch.
        self._views = [(self.slots_x[s], self.slots_y[s]) for s in range(self.num_slots)]
        # The gather threads: `todo` carries (slot, rows, event) to them, `done[slot]` brings back
        # the outcome of the gather into that slot (at most one is queued per slot at a time).
        self.todo: queue.SimpleQueue = queue.SimpleQueue()
        self.done = [queue.SimpleQueue() for _ in range(self.num_slots)]
        self.threads: List[threading.Thread] = []  # started with the first batch, stopped by close()
        # A loader dropped without close() stops its threads when it is collected (they hold it
        # only weakly, between gathers).
        weakref.finalize(self, _stop, self.todo, self.threads)
        self.closed = False
        self.setup_s = time.perf_counter() - start
        self.epoch = 0

    def _gather(self, slot: int, rows: np.ndarray, after) -> int:
        """Gather `rows` into `slot` (runs in a worker thread); returns the number of rows."""
        if after is not None and not after.query():
            # FFCV's rule: the slot is not rewritten until the copy that reads it has completed
            # (a host-side wait on this thread, never on the loop's; skipped when it already has).
            after.synchronize()
        m = len(rows)
        # np.take releases the GIL and copies row by row on this thread alone; torch.index_select
        # would split each large row over the intra-op thread pool from every worker at once.
        # mode="clip" writes straight into `out` ("raise" would gather into a temporary first);
        # the rows come from a permutation, so nothing is ever clipped.
        np.take(self._src_x, rows, axis=0, out=self._dst_x[slot][:m], mode="clip")
        np.take(self._src_y, rows, axis=0, out=self._dst_y[slot][:m], mode="clip")
        return m

    def _start_threads(self) -> None:
        if self.threads:
            return
        index = self._thread_device()
        for k in range(self.cfg.threads):
            t = threading.Thread(target=_work, args=(self.todo, self.done, weakref.ref(self), index),
                                 name=f"{THREAD_PREFIX}_{k}", daemon=True)
            t.start()
            self.threads.append(t)

    def _schedule(self, epoch: int) -> Iterator[Tuple[int, int, np.ndarray]]:
        """`(epoch, batch, rows)` of every batch from `epoch` on, epoch after epoch."""
        b, count = self.cfg.batch_size, len(self)
        while count:
            order = self._epoch_rows(epoch).numpy()  # this rank's batches, end to end
            for i in range(count):
                yield epoch, i, order[i * b:(i + 1) * b]
            epoch += 1

    def _queue_gathers(self) -> None:
        """Queue gathers until every slot but the one handed out last is taken (called only once
        that one has been consumed: its copy issued, or on the CPU its clone made)."""
        while len(self.pending) < self.num_slots:
            batch = next(self.upcoming, None)
            if batch is None:  # an empty epoch (drop_last, fewer samples than a batch)
                return
            epoch, i, rows = batch
            slot = self.queued % self.num_slots
            self.queued += 1
            self.todo.put((slot, rows, self.slot_events[slot] if self.slot_events else None))
            self.pending.append((epoch, i, slot))

    def _drop_gathers(self) -> None:
        """Cancel the queued gathers and wait for those already running: no slot is written after this."""
        while True:  # the gathers no thread has taken yet: never started
            try:
                self.todo.get_nowait()
            except queue.Empty:
                break
        alive = sum(t.is_alive() for t in self.threads)
        if alive:
            # A fence: every thread meets the loop's thread at a barrier once it has finished
            # what it took, so no gather is running after this, whichever ones had reported.
            # Only live threads are counted: one that has exited would never arrive.
            fence = threading.Barrier(alive + 1)
            for _ in range(alive):
                self.todo.put(fence)
            try:
                fence.wait()
            finally:
                fence.abort()  # interrupted here: no thread stays stuck at the barrier
        for done in self.done:  # the outcomes nobody will ask for
            while True:
                try:
                    done.get_nowait()
                except queue.Empty:
                    break
        self.pending.clear()

    def _host_batches(self, epoch: int) -> Iterator:
        """Yield `((x, y), slot)`: views of the filled slots, in `epoch_order`.

        The gathers run ahead of the loop by up to one ring of slots, across the end of the epoch:
        the first batches of the next epoch are gathered while the last ones of this epoch are
        copied, so a new epoch starts without waiting for a gather.
        """
        if self.closed:
            raise RuntimeError("loader=pinned_gather is closed: build a new one to iterate again")
        self._start_threads()
        if not (self.pending and self.pending[0][:2] == (epoch, 0)):  # not gathered ahead: first or abandoned pass
            self._drop_gathers()
            self.upcoming = self._schedule(epoch)
        rows = len(self._views[0][1])
        finished = False
        try:
            for i in range(len(self)):
                if self.closed:
                    raise RuntimeError("loader=pinned_gather was closed during a pass")
                self._queue_gathers()  # the batch handed out before this one has been consumed
                slot = self.pending[0][2]
                m = _result(self.done[slot].get())  # an interrupt before `popleft` is fine: the fence waits for every thread
                self.pending.popleft()
                x, y = self._views[slot]
                yield ((x, y) if m == rows else (x[:m], y[:m])), slot
            self._queue_gathers()  # the last batch is consumed: start on the next epoch's
            finished = True
        finally:
            if not finished:  # abandoned or failed: no gather may write a slot after this
                self._drop_gathers()
                if self.copier.stream is not None:
                    # A copy issued just before an interrupt may not have reported its event: wait
                    # for every copy on the side stream, so no slot is refilled while the DMA reads it.
                    self.copier.stream.synchronize()

    def __iter__(self):
        epoch, self.epoch = self.epoch, self.epoch + 1
        host = self._host_batches(epoch)
        copies = self.copier.run(host, events=self.slot_events)
        try:
            for x, y in copies:
                # uint8 crossed PCIe as uint8; it becomes model input here, on the device.
                yield self.dataset.on_device(x), y
        finally:
            # Close both now (not whenever they are collected): the gathers of this pass stop here.
            copies.close()
            host.close()

    def close(self):
        try:
            self._drop_gathers()
        finally:
            try:
                _stop_and_join(self.todo, self.threads)  # an interrupt meanwhile is raised after the last join
            finally:
                self.threads.clear()
                self.closed = True  # only now: no thread can write a slot any more
                super().close()  # drops the slots (`_release`), then their page-locked blocks

    def figures(self) -> dict:
        """`shared_host_mb`: the host copy this rank made for every rank of its host."""
        return self.shared

    def _release(self):
        self.pending.clear()
        if self.copy is not None:
            self.copy.close()
        self.copy = self.x = self.y = self.slots_x = self.slots_y = None
        self._src_x = self._src_y = None
        self._dst_x, self._dst_y, self._views, self.slot_events = [], [], [], None


class _Failed:
    """What a gather that raised reports instead of its number of rows."""

    def __init__(self, error: BaseException):
        self.error = error


def _work(todo: queue.SimpleQueue, done: list, loader_ref, device_index: Optional[int]) -> None:
    """A gather thread: take (slot, rows, event) from `todo`, gather, report on `done[slot]`;
    meet the loop's thread at a fence (`_drop_gathers`); exit on None or once the loader is gone."""
    unusable = None
    if device_index is not None:
        try:
            torch.cuda.set_device(device_index)
        except BaseException as e:
            # Stay alive and report it for every gather taken: a thread that died here would leave
            # the loop waiting for its gathers, and the fence waiting for it, for ever.
            unusable = e
    while True:
        item = todo.get()  # blocks without the GIL
        if item is None:
            return
        if isinstance(item, threading.Barrier):
            try:
                item.wait()
            except threading.BrokenBarrierError:
                pass
            continue
        loader = loader_ref()
        if loader is None:
            return
        slot, rows, after = item
        try:
            outcome = _Failed(unusable) if unusable is not None else loader._gather(slot, rows, after)
        except BaseException as e:  # reported to the loop's thread, which fails the run
            outcome = _Failed(e)
        del loader
        done[slot].put(outcome)


def _stop(todo: queue.SimpleQueue, threads: list) -> None:
    for _ in threads:
        todo.put(None)


def _stop_and_join(todo: queue.SimpleQueue, threads: list) -> None:
    """Stop every thread of `threads` and wait until each has exited. An interrupt meanwhile (a
    signal handler raising) does not cut this short: it is raised once no thread is left running."""
    interrupt, stops = None, 0
    while any(t.is_alive() for t in threads):
        try:
            while stops < len(threads):
                todo.put(None)  # each thread takes one stop and exits (a spare one is never taken)
                stops += 1
            for t in threads:
                t.join()
        except BaseException as e:  # Ctrl-C or a stop signal: join the rest first
            interrupt = interrupt or e
    if interrupt is not None:
        raise interrupt


def _result(outcome) -> int:
    """A gather's number of rows; a failed gather becomes a one-line `RunFailed`."""
    if isinstance(outcome, _Failed):
        e = outcome.error
        raise RunFailed(f"a loader=pinned_gather gather thread failed: {type(e).__name__}: {e}") from e
    return outcome


def _row_bytes(t: torch.Tensor) -> np.ndarray:
    """`t` (contiguous, samples along dim 0) as a numpy uint8 array of one row per sample, sharing memory."""
    return t.reshape(len(t), -1).view(torch.uint8).numpy()
