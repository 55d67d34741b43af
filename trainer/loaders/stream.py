"""Copies on a dedicated CUDA stream, `depth` batches ahead of the step that consumes them."""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterable, Iterator, Optional, Sequence

import torch

from trainer.loaders.base import Batch


class SideStreamCopier:
    """Feeds host batches through one side stream created once per loader (timm #2781: a new
    stream per epoch leaks and serialises). Guards:
    - the compute stream waits on each batch's copy event before using it;
    - each device batch is `record_stream`-ed on the compute stream, so the caching allocator
      cannot hand its memory to a later copy while a step still reads it;
    - the host batch is referenced until its copy event is consumed, and `on_copied(tag, event)`
      tells the owner of a reused host buffer when the copy reading it is issued.
    """

    def __init__(self, loader, depth: int, reuses_host_buffers: bool = False):
        self.loader, self.depth = loader, depth
        self.reuses_host_buffers = reuses_host_buffers
        self.stream = torch.cuda.Stream(loader.device) if loader.on_cuda else None

    def run(self, host_batches: Iterable, on_copied: Optional[Callable] = None,
            events: Optional[Sequence[torch.cuda.Event]] = None) -> Iterator[Batch]:
        """`host_batches` yields `(batch, tag)`; returns device batches in the same order.
        `events`, indexed by tag: the event each copy records (one per host buffer, made once);
        without them every copy records a new one."""
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
            with torch.cuda.stream(self.stream):
                dev = loader._copy(batch, non_blocking=True)
                done = torch.cuda.Event() if events is None else events[tag]
                done.record(self.stream)
            if on_copied is not None:
                on_copied(tag, done)
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
