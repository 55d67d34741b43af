"""Copies on a dedicated CUDA stream, `depth` batches ahead of the step that consumes them."""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterable, Iterator, List, Optional, Sequence

import torch

from trainer.loaders.base import Batch


def made_events(count: int, stream: torch.cuda.Stream, blocking: bool = False) -> List[torch.cuda.Event]:
    """`count` CUDA events, each recorded once on `stream` now: PyTorch creates the CUDA event at
    its first `record()`, which would otherwise fall inside the timed loop. `blocking`: a host
    waiting on one sleeps instead of spinning a core."""
    events = [torch.cuda.Event(blocking=blocking) for _ in range(count)]
    for event in events:
        event.record(stream)
    return events


class SideStreamCopier:
    """Feeds host batches through one side stream created once per loader (timm #2781: a new
    stream per epoch leaks and serialises). Guards:
    - the compute stream waits on each batch's copy event before using it;
    - each device batch is `record_stream`-ed on the compute stream, so the caching allocator
      cannot hand its memory to a later copy while a step still reads it;
    - the host batch is referenced until its copy event is consumed, and `on_copied(tag)` tells
      the owner of a reused host buffer when a copy reading it has been issued on `stream`.
    """

    def __init__(self, loader, depth: int, reuses_host_buffers: bool = False):
        self.loader, self.depth = loader, depth
        self.reuses_host_buffers = reuses_host_buffers
        self.stream = torch.cuda.Stream(loader.device) if loader.on_cuda else None
        # The copy events, made once and recorded in turn. A copy is issued right after the compute
        # stream was told to wait on the batch dequeued before it, so the batches whose waits are
        # still to come are the depth - 1 others in flight: of depth + 1 slots, the one recorded
        # next belongs to a batch waited on one dequeue earlier (a wait captures the record it
        # waits for, so even the slot just waited on could be recorded again). Were a slot recorded
        # again before its wait, that wait would only last longer (a later copy on the same
        # stream), never too short: an abandoned pass's slots are safe to reuse too.
        self.ring = made_events(depth + 1, self.stream) if self.stream is not None else []
        self.turn = 0  # the ring's slot the next copy records

    def run(self, host_batches: Iterable, on_copied: Optional[Callable] = None,
            events: Optional[Sequence[torch.cuda.Event]] = None) -> Iterator[Batch]:
        """`host_batches` yields `(batch, tag)`; returns device batches in the same order.
        `events`, indexed by tag: the event each copy records (one per host buffer, made once),
        when no tag is ever in flight twice; without them the copies take turns in `ring`."""
        loader = self.loader
        if self.stream is None:  # CPU: nothing to overlap
            for batch, _ in host_batches:
                # A view of a buffer that will be refilled must not escape to the caller.
                yield tuple(t.clone() for t in batch) if self.reuses_host_buffers else batch
            return
        compute = torch.cuda.current_stream(loader.device)
        source, in_flight = iter(host_batches), deque()

        def issue() -> None:
            item = next(source, None)
            if item is None:
                return
            batch, tag = item
            if events is None:
                done, self.turn = self.ring[self.turn], (self.turn + 1) % len(self.ring)
            else:
                done = events[tag]
            with torch.cuda.stream(self.stream):
                dev = loader._copy(batch, non_blocking=True)
                done.record(self.stream)
            if on_copied is not None:
                on_copied(tag)
            in_flight.append((dev, done, batch))

        for _ in range(self.depth):
            issue()
        while in_flight:
            dev, done, _host = in_flight.popleft()
            compute.wait_event(done)
            for t in tensors(dev):
                t.record_stream(compute)
            issue()  # the next copy is queued before the step on `dev` is launched: they overlap
            yield dev


def tensors(batch) -> list:
    """Every tensor in a batch: a tensor, or tuples, lists and dicts of them (other values are skipped)."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (tuple, list)):
        return [t for item in batch for t in tensors(item)]
    return []
