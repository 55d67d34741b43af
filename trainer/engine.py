"""The training loop: fetch a device-ready batch, forward, loss, backward, step – timed by one meter."""

from __future__ import annotations

import sys

import torch
from tqdm import tqdm

from trainer.meter import StepMeter
from trainer.steps import make_step
from trainer.verify import Checksum


def train(model, optimizer, loader, meter: StepMeter, cfg, checksum: Checksum | None = None) -> int:
    """Run `cfg.epochs` passes over `loader` (at most `cfg.max_steps` steps); returns steps done."""
    planned = cfg.epochs * len(loader)
    total = min(planned, cfg.max_steps) if cfg.max_steps else planned
    step_fn = make_step(model, optimizer, cfg)
    bar = tqdm(total=total, file=sys.stderr, mininterval=0.5, unit="step", leave=False,
               disable=not (cfg.progress and sys.stderr.isatty()))
    step = 0
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
                    checksum.update(*batch)
                meter.step_begin(len(batch[0]))
                loss = step_fn(*batch)
                meter.step_end(loss)
                step += 1
                bar.update()  # tqdm redraws at most every `mininterval` seconds
                if step == cfg.warmup_steps:
                    meter.start_timed()
            if checksum is not None:
                checksum.end_epoch()
            if step >= total:
                break
    finally:
        bar.close()
    return step
