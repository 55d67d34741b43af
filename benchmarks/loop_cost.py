"""What the engine's loop costs the host per step, beyond `for x, y in loader: step(x, y)`.

    python benchmarks/loop_cost.py                     # on the GPU if there is one (about 15 s)
    python benchmarks/loop_cost.py --device cpu --steps 2000 --rounds 5

One process, the same batches (a few small tensors already on the device, handed out as a loader
does) and the same step: one kernel and its loss, so the host's work around the step is what is
timed. In alternating blocks, the side that goes first alternating:

- plain: `for x, y in batches: step(x, y)`, synced at both ends of its timed steps;
- engine: `trainer.loop.engine.train` with the meter `python -m trainer` builds (the host clock,
  the CUDA event sampler at `engine.gpu_timing_every`, the loss log and the lagged loss check),
  timed by its own meter over the same number of steps.

It prints each block's µs per step, the medians, and their difference: the engine loop's own cost
per step. `--parts` adds, in the same rounds, the plain loop with the meter's parts added one at
a time (the host clock, the GPU event sampler, the loss log, the loss check), so the cost is
broken down by part. That cost is added to every step of every run whatever the step does, so it bounds what
the loop can add to a real one (a few µs on a 1.5 ms eager step is a fraction of a percent), where
timing real steps in turns cannot resolve a cost below the host's own noise. Not counted here:
the run's journal thread (a write of the new rows every `engine.journal_s`, 2 s by default) and
what runs before and after the timed region.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from trainer.config import EngineConfig
from trainer.loop.engine import train
from trainer.loop.faults import LossWatch
from trainer.loop.meter import StepMeter

# The meter's parts, as the engine's loop calls them per step, added one at a time to the plain loop.
PARTS = ("host clock", "GPU event sampler", "loss log", "loss check")


class Batches:
    """A loader of ready batches: `for x, y in batches` hands out the same few tensors again and again."""

    copy_probe = None  # the engine hands its meter to a loader that copies; these never copy

    def __init__(self, device: torch.device, count: int = 16, batch: int = 64):
        self.items = [(torch.rand(batch, 32, device=device), torch.zeros(batch, dtype=torch.long, device=device))
                      for _ in range(count)]

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self):
        return iter(self.items)


def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One kernel and a loss tensor: next to nothing for the host to issue."""
    return x.sum()


def plain_block(batches: Batches, steps: int, warmup: int, device: torch.device) -> float:
    """µs per step of the plain loop over `steps` steps after `warmup`."""
    done, t0 = 0, None
    while done < steps + warmup:
        for x, y in batches:
            step(x, y)
            done += 1
            if done == warmup:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
            if done == steps + warmup:
                break
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) * 1e6 / steps


def engine_block(batches: Batches, steps: int, warmup: int, device: torch.device) -> float:
    """µs per step of the engine's loop over the same steps, by its own meter."""
    cfg = EngineConfig(max_steps=steps + warmup, warmup_steps=warmup, progress=False)
    meter = StepMeter(device, warmup, capacity=steps + warmup, gpu_timing_every=cfg.gpu_timing_every,
                      seed=cfg.seed, copies_ahead=1)
    train(step, batches, meter, cfg)
    return meter.finish().summary["ms_per_step"] * 1e3


def parts_block(batches: Batches, steps: int, warmup: int, device: torch.device, parts: int) -> float:
    """µs per step of the plain loop with the first `parts` of `PARTS` called as the engine's loop calls them.
    (Its own copy of `plain_block`'s loop: the plain one stays bare, with no test per part in it.)"""
    meter = StepMeter(device, warmup, capacity=steps + warmup, gpu_timing_every=EngineConfig.gpu_timing_every,
                      copies_ahead=1)
    clock, sampler, log = meter.clock, meter.sampler, meter.loss_log
    sampler = sampler if parts >= 2 else None
    watch = LossWatch(meter, 1e-3) if parts >= 4 else None
    done, t0 = 0, None
    while done < steps + warmup:
        for x, y in batches:
            if parts >= 1:
                clock.wait_begin()
                clock.step_begin(done, x.shape[0], 0)
            if sampler is not None:
                sampler.step_begin(done)
            loss = step(x, y)
            if sampler is not None:
                sampler.step_end()
            if parts >= 1:
                clock.step_end(done)
            if parts >= 3:
                log.put(done, loss)
            meter.n = meter.ended = done + 1
            done += 1
            if watch is not None:
                watch.after_step(done)
            if done == warmup:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
            if done == steps + warmup:
                break
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) * 1e6 / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto", help="auto, cuda or cpu")
    p.add_argument("--steps", type=int, default=5000, help="timed steps per block")
    p.add_argument("--warmup", type=int, default=200, help="untimed steps before each block")
    p.add_argument("--rounds", type=int, default=9, help="blocks of each side")
    p.add_argument("--parts", action="store_true", help="also the plain loop with the meter's parts added one at a time")
    args = p.parse_args()
    name = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    device = torch.device(name)
    batches = Batches(device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"the loop's own cost on {where}: {args.rounds} blocks of {args.steps} steps per side")
    blocks = {"engine": engine_block, "plain": plain_block}
    if args.parts:
        have = [p for p in PARTS if device.type == "cuda" or p != "GPU event sampler"]  # no events on the CPU
        blocks.update({f"plain + {' + '.join(have[:k])}": lambda *a, k=PARTS.index(have[k - 1]) + 1: parts_block(*a, parts=k)
                       for k in range(1, len(have) + 1)})
    t0, got = time.perf_counter(), {side: [] for side in blocks}
    for r in range(args.rounds):
        order = list(blocks) if r % 2 == 0 else list(reversed(blocks))
        for side in order:
            got[side].append(blocks[side](batches, args.steps, args.warmup, device))
        print(f"  round {r + 1}: " + ", ".join(f"{side} {got[side][-1]:.2f}" for side in blocks) + " µs/step")
    engine, plain = statistics.median(got["engine"]), statistics.median(got["plain"])
    diffs = sorted(e - q for e, q in zip(got["engine"], got["plain"]))
    print(f"median: engine {engine:.2f} µs/step, plain {plain:.2f}; the engine loop's own cost "
          f"{statistics.median(diffs):+.2f} µs per step (rounds' differences {diffs[0]:+.2f} to {diffs[-1]:+.2f})")
    for side in list(blocks)[2:]:  # each part's cost: its row's rounds against the plain loop's
        diffs = sorted(e - q for e, q in zip(got[side], got["plain"]))
        print(f"  {side}: {statistics.median(got[side]):.2f} µs/step, {statistics.median(diffs):+.2f} over plain")
    print(f"total: {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
