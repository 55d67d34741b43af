"""The GPU event sampler: which steps (and their batches' copies) are timed with CUDA events, and
the events that time them.

An event record costs the loop's thread about what launching a small kernel does (20-40 us on the
cloud hosts measured), so two per step are 3-4% of an eager step of 50-odd kernels. The GPU side
is therefore timed in samples: runs of `TIMING_RUN` consecutive steps, with two events per step
and two per copy inside a run and none outside it. Every warm-up step is timed (it costs the
timed region nothing); after the warm-up the runs are counted in blocks of `gpu_timing_every`,
and one run of each block, at a seeded pseudo-random place in it, is timed (the first run of the
timed region always). Runs at fixed places would line up with the epochs: with 256 batches per
epoch and one run of 32 in every 8, only positions 0-31 of an epoch (workers restarting, chunks
swapping, prefetch refilling) would ever be timed.

PyTorch creates a CUDA event at its first `record()`, which would put `cudaEventCreate` inside
the timed loop. Every event a planned run may record is made here and recorded once before the
loop; a run longer than planned adds more as it goes.
"""

from __future__ import annotations

from typing import List, Tuple

import numpy as np
import torch

TIMING_RUN = 32  # consecutive steps timed on the GPU, one run in every `gpu_timing_every`
_DRAW = 1024  # blocks whose timed run is drawn at once (a fixed size: the places do not depend on the run's length)
_GROW = 4096  # events added at a time past the planned run


class Schedule:
    """Which steps are timed on the GPU (batch `i`'s copy is timed with step `i`): every warm-up
    step, then one run of `TIMING_RUN` steps in each block of `every` runs, at a place drawn from
    `seed`, the first run after the warm-up always."""

    def __init__(self, warmup_steps: int, every: int, seed: int):
        self.every = max(1, every)
        # A stream of its own: not the one a loader's shuffling draws from the same seed.
        self._rng = np.random.default_rng([seed, TIMING_RUN])
        self.mask = bytearray(b"\x01" * max(0, warmup_steps))  # per step: 1 if timed; grows in place
        self._blocks = 0
        self._places = np.zeros(0, dtype=np.int64)

    def timed(self, i: int) -> bool:
        """Whether step (or batch) `i`, counted from 0, is timed on the GPU."""
        if i >= len(self.mask):
            self.extend(i + 1)
        return bool(self.mask[i])

    def count(self, n: int) -> int:
        """Steps timed among the first `n`."""
        self.extend(n)
        return self.mask.count(1, 0, n)

    def indices(self, n: int) -> np.ndarray:
        """The timed steps among the first `n`, in order."""
        self.extend(n)
        return np.flatnonzero(np.frombuffer(bytes(self.mask[:n]), dtype=np.uint8))

    def extend(self, n: int) -> None:
        """Decide at least the first `n` steps, a block at a time."""
        while len(self.mask) < n:
            b = self._blocks % _DRAW
            if b == 0:
                self._places = self._rng.integers(self.every, size=_DRAW)
            place = 0 if self._blocks == 0 else int(self._places[b])
            block = bytearray(self.every * TIMING_RUN)
            block[place * TIMING_RUN:(place + 1) * TIMING_RUN] = b"\x01" * TIMING_RUN
            self.mask.extend(block)  # in place: the sampler holds this bytearray
            self._blocks += 1


def pool_sizes(schedule: Schedule, steps: int, copies_ahead: int) -> Tuple[int, int]:
    """Event pairs a run of `steps` steps may record: (timed steps, timed copies). Copies run up to
    `copies_ahead` batches ahead of the steps, so batches up to `steps + copies_ahead` count."""
    return schedule.count(steps), schedule.count(steps + copies_ahead)


def _events(n: int) -> List[torch.cuda.Event]:
    return [torch.cuda.Event(enable_timing=True) for _ in range(n)]


class EventSampler:
    """CUDA events around the steps and copies `schedule` times, for a run of `steps` steps whose
    copies run up to `copies_ahead` batches ahead. All of them are created on `device` here."""

    def __init__(self, schedule: Schedule, device: torch.device, steps: int, copies_ahead: int):
        self.schedule, self.device = schedule, device
        self._mask = schedule.mask
        n_steps, n_copies = pool_sizes(schedule, steps, copies_ahead)
        self.starts, self.ends = _events(n_steps), _events(n_steps)  # by timed step, in order
        self.copy_starts, self.copy_ends = _events(n_copies), _events(n_copies)  # by timed copy, in order
        self.copy_bytes = np.zeros(n_copies, dtype=np.int64)
        self.steps_timed = 0  # steps whose two events are recorded
        self.copies = 0  # copies begun and ended, timed or not
        self.copies_timed = 0
        self.batch_bytes = 0  # the largest copy: a full batch (the last one of an epoch may be partial)
        self._timing = self._copy_timing = False
        self._stream = None  # the compute stream, from the first timed step on
        stream = torch.cuda.current_stream(device)
        for e in self.starts + self.ends + self.copy_starts + self.copy_ends:
            e.record(stream)  # creates the CUDA event now, not at its first record in the loop
        self.ref = torch.cuda.Event(enable_timing=True)  # time zero of the events' timestamps
        self.ref.record(stream)
        torch.cuda.synchronize(device)

    # -- the loop: nothing is allocated; a step outside the runs costs a lookup ------------------
    def step_begin(self, i: int) -> None:
        if i >= len(self._mask):
            self.schedule.extend(i + 1)
        self._timing = self._mask[i]
        if self._timing:
            if self._stream is None:  # looked up once: a lookup builds a Stream object
                self._stream = torch.cuda.current_stream(self.device)
            if self.steps_timed == len(self.starts):
                self.starts += _events(_GROW)
                self.ends += _events(_GROW)
            self.starts[self.steps_timed].record(self._stream)

    def step_end(self) -> None:
        if self._timing:
            self.ends[self.steps_timed].record(self._stream)
            self.steps_timed += 1

    def copy_begin(self, stream) -> None:
        c = self.copies
        if c >= len(self._mask):
            self.schedule.extend(c + 1)
        self._copy_timing = self._mask[c]
        if self._copy_timing:
            if self.copies_timed == len(self.copy_starts):
                self.copy_starts += _events(_GROW)
                self.copy_ends += _events(_GROW)
                self.copy_bytes = np.concatenate([self.copy_bytes, np.zeros(_GROW, dtype=np.int64)])
            self.copy_starts[self.copies_timed].record(stream)

    def copy_end(self, stream, nbytes: int) -> None:
        if self._copy_timing:
            k = self.copies_timed
            self.copy_ends[k].record(stream)
            self.copy_bytes[k] = nbytes
            self.copies_timed = k + 1
        self.copies += 1
        if nbytes > self.batch_bytes:
            self.batch_bytes = nbytes

    # -- after the loop (the device must have finished) ------------------------------------------
    def step_times(self, n: int) -> List[tuple]:
        """`(step, compute_ms, (start, end))` of the timed steps among the first `n` that ended;
        start and end in ms from `ref`."""
        out = []
        for k, i in enumerate(self.schedule.indices(n)[:self.steps_timed].tolist()):
            b, e = self.starts[k], self.ends[k]
            out.append((i, b.elapsed_time(e), (self.ref.elapsed_time(b), self.ref.elapsed_time(e))))
        return out

    def copy_times(self) -> List[tuple]:
        """`(batch, h2d_ms, (start, end), bytes)` of every timed copy that ended."""
        out = []
        for k, c in enumerate(self.schedule.indices(self.copies)[:self.copies_timed].tolist()):
            b, e = self.copy_starts[k], self.copy_ends[k]
            out.append((c, b.elapsed_time(e), (self.ref.elapsed_time(b), self.ref.elapsed_time(e)),
                        int(self.copy_bytes[k])))
        return out
