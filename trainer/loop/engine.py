"""The training loop: fetch a device-ready batch, forward, loss, backward, step – timed by one meter."""

from __future__ import annotations

import sys

from tqdm import tqdm

from trainer.loop.faults import LossWatch
from trainer.loop.meter import StepMeter


def train(step_fn, loader, meter: StepMeter, cfg, checksum=None, profiler=None) -> int:
    """Run `cfg.epochs` passes over `loader` (at most `cfg.max_steps` steps); returns steps done."""
    planned = cfg.epochs * len(loader)
    total = min(planned, cfg.max_steps) if cfg.max_steps else planned
    bar = tqdm(total=total, file=sys.stderr, mininterval=0.5, unit="step", leave=False,
               disable=not (cfg.progress and sys.stderr.isatty()))
    watch = LossWatch(meter, cfg.optimizer.lr)  # NaN/inf loss: checked lagged, never with a sync
    step, batches = 0, None
    try:
        for epoch in range(cfg.epochs):
            meter.epoch = epoch
            batches = iter(loader)
            while step < total:
                meter.wait_begin()
                batch = next(batches, None)  # data_wait: the host blocks here until a batch is ready
                if batch is None:
                    break
                if checksum is not None:
                    checksum.update(*batch)  # device-side hash, read after the loop
                meter.step_begin(len(batch[0]))
                loss = step_fn(*batch)
                meter.step_end(loss)
                step += 1
                bar.update()  # tqdm redraws at most every `mininterval` seconds
                watch.after_step(step)
                if profiler is not None:
                    profiler.step()
                if step == cfg.warmup_steps:
                    meter.start_timed()
            if checksum is not None:
                checksum.end_epoch()
            if step >= total:
                break
        watch.final()
    finally:
        bar.close()
        if hasattr(batches, "close"):  # stop this pass's DataLoader workers and copies now, even on error
            batches.close()
    return step
