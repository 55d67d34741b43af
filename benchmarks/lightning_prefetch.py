"""Does `lightning_prefetch` hide the host->device copy inside Lightning? (CUDA only.)

    python benchmarks/lightning_prefetch.py [--steps 300] [--warmup 30] [--busy-ms 20]

One process, one GPU, a step where a copy can hide: 16 MiB batches (64 x 256 x 256 float32, the
size PyTorch Lightning issue #1316 quotes) already in pinned memory, so the host's work per batch
is small, and the reference autoencoder with `model.busy_ms` of device work per step, so the
GPU's step outlasts the host's. It must: Lightning's loop adds host work to every step. With 2 ms
of device work both variants ran at 3.5-3.6 ms/step on an H100, more than the device's own work
(2 ms, a graphed autoencoder step's 0.71 ms, one 16.8 MB copy at 48.5 GB/s: 0.35 ms, each
measured there): the device waited for the host, and no copy ran beside a kernel in either
trace, prefetched or not.

Two ways to feed the same LightningModule from the same pin_memory DataLoader:

- `lightning_default`: `trainer.fit(module, train_dataloaders=loader)`; Lightning copies each
  batch (`transfer_batch_to_device`, `non_blocking=True`) on the compute stream, in line with the
  steps;
- `lightning_prefetch`: `trainer.fit(module, datamodule=lightning_prefetch(loader))`; the copies
  run on a side stream, one batch ahead.

Each runs twice, in the order default, prefetch, prefetch, default (drift in the machine's speed
hits both alike). A fit is `--warmup` steps then `--steps` timed ones: wall clock from the end of
the warm-up to the end of the last step, the device synced at both ends and nowhere between.
The first fit of each variant also traces 10 of its warm-up steps with torch.profiler
(`trainer.loop.profiling`): `trace_h2d_overlap_fraction` is the share of the host->device copy
time during which a kernel ran (0: in line with the steps, 1: hidden behind them), and
`trace_kernel_busy_fraction` the share of the traced time during which a kernel ran (well below 1:
the device waited for the host, and the run says nothing about hiding copies).

Prints one JSON line per variant: each fit's ms per step, their median, samples/s, `vs_default`
(Lightning's default ms/step over this variant's: above 1 is faster), the trace's figures, and
`copy_ms`, one batch's copy timed alone: with the copy hidden, the default should be slower by
about that much per step.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.fabric.utilities.warnings import PossibleUserWarning
from torch.utils.data import DataLoader, Dataset

from models import build_model
from trainer import lightning_prefetch
from trainer.tools.overhead import compose_config
from trainer.loop.profiling import StepProfiler, copy_overlap

BATCH, SHAPE, DISTINCT = 64, (256, 256), 8  # 8 distinct pinned batches, cycled
VARIANTS = ("lightning_default", "lightning_prefetch")
TRACED = 10  # warm-up steps in the trace


class PinnedBatches(Dataset):
    """`length` batches, cycling through a few already in pinned memory (no collation, nothing to pin)."""

    def __init__(self, length: int):
        self.length = length
        self.batches = [(torch.randn(BATCH, *SHAPE).pin_memory(), torch.zeros(BATCH).pin_memory())
                        for _ in range(DISTINCT)]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i):
        return self.batches[i % DISTINCT]


class Autoencoder(L.LightningModule):
    """The module a user writes around the reference autoencoder (built by the project's `build_model`)."""

    def __init__(self, model_cfg):
        super().__init__()
        self.model = build_model(model_cfg, SHAPE, None)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.model.loss(x, y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class Clock(L.Callback):
    """Times steps `warmup`+1 .. `warmup`+`steps` (a device sync at both ends); with a profiler,
    traces the last warm-up steps first."""

    def __init__(self, warmup: int, steps: int, profiler=None):
        self.warmup, self.steps, self.profiler = warmup, steps, profiler
        self.done, self.t0, self.seconds, self.trace = 0, None, None, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.done += 1
        if self.profiler is not None:
            self.profiler.step()
        if self.done == self.warmup:
            if self.profiler is not None:
                self.trace, self.profiler = self.profiler.close(), None  # the timed steps run unprofiled
            torch.cuda.synchronize()
            self.t0 = time.perf_counter()
        elif self.done == self.warmup + self.steps:
            torch.cuda.synchronize()
            self.seconds = time.perf_counter() - self.t0


def fit(variant: str, loader: DataLoader, model_cfg, args, out_dir: Path, traced: bool) -> dict:
    """One Lightning fit fed the `variant` way: its timed ms/step, and the trace's figures when `traced`."""
    torch.manual_seed(0)
    module = Autoencoder(model_cfg)
    profiler = None
    if traced:
        (out_dir / variant).mkdir()
        profiler = StepProfiler(True, out_dir / variant, skip=args.warmup, active=TRACED)
    clock = Clock(args.warmup, args.steps, profiler)
    trainer = L.Trainer(accelerator="gpu", devices=1, precision="32-true", max_epochs=-1,
                        max_steps=args.warmup + args.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, default_root_dir=str(out_dir), callbacks=[clock])
    data = {"train_dataloaders": loader} if variant == "lightning_default" else {"datamodule": lightning_prefetch(loader)}
    trainer.fit(module, **data)
    result = {"ms_per_step": clock.seconds * 1e3 / args.steps}
    if clock.trace is not None:
        result.update(copy_overlap(clock.trace))
    return result


def copy_ms(batch: torch.Tensor, repeats: int = 20) -> float:
    """Median time of one pinned batch's copy to the GPU, alone on a side stream (CUDA events)."""
    stream = torch.cuda.Stream()
    times = []
    with torch.cuda.stream(stream):
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            batch.to("cuda", non_blocking=True)
            end.record()
            end.synchronize()  # outside any timed fit
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="timed steps per fit")
    p.add_argument("--warmup", type=int, default=30, help=f"untimed steps first (more than {TRACED + 1}: the trace's)")
    p.add_argument("--busy-ms", type=float, default=20.0, help="device work added to each step (model.busy_ms)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("error: benchmarks/lightning_prefetch.py needs a CUDA GPU (none found)")
    if args.steps < 1 or args.warmup <= TRACED + 1:
        raise SystemExit(f"error: needs --steps >= 1 and --warmup > {TRACED + 1} (got {args.steps}, {args.warmup})")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # which devices Lightning found, its tips
    warnings.filterwarnings("ignore", category=PossibleUserWarning)  # "the DataLoader has few workers": none needed
    # the DataLoader is longer than a fit: every step in steady state, the prefetcher one copy ahead to the end
    loader = DataLoader(PinnedBatches(args.warmup + args.steps + 8), batch_size=None, pin_memory=True)
    model_cfg = compose_config(["model=autoencoder", f"model.busy_ms={args.busy_ms}"]).model
    figures = {v: {"ms": []} for v in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for i, variant in enumerate(VARIANTS + VARIANTS[::-1]):
            result = fit(variant, loader, model_cfg, args, Path(tmp), traced=i < len(VARIANTS))
            figures[variant]["ms"].append(result.pop("ms_per_step"))
            figures[variant].update(result)
    common = {"gpu": torch.cuda.get_device_name(), "batch_mb": BATCH * SHAPE[0] * SHAPE[1] * 4 / 1e6,
              "busy_ms": args.busy_ms, "copy_ms": round(copy_ms(loader.dataset.batches[0][0]), 4),
              "timed_steps": args.steps}
    default_ms = statistics.median(figures["lightning_default"]["ms"])
    for variant in VARIANTS:
        ms = figures[variant].pop("ms")
        median = statistics.median(ms)
        print(json.dumps({"variant": variant, "ms_per_step": [round(m, 4) for m in ms], "median_ms_per_step": round(median, 4),
                          "samples_per_s": round(BATCH * 1e3 / median, 1), "vs_default": round(default_ms / median, 4),
                          **{k: round(v, 4) for k, v in figures[variant].items()}, **common}), flush=True)


if __name__ == "__main__":
    main()
