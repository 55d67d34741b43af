"""`run(cfg)`: build the parts from their own config sections, train, and record the run."""

from __future__ import annotations

import gc
import sys
import tempfile
from pathlib import Path

import torch

from datasets import build_dataset
from models import build_model
from trainer.loop.engine import planned_steps, train
from trainer.tools.environment import describe
from trainer.tools.heap import keep_freed
from trainer.errors import ConfigError
from trainer.loop.distributed import Ranks
from trainer.loop.faults import StopSignals, explain_faults
from trainer.loaders import build_loader
from trainer.loop.meter import StepMeter
from trainer.tools.limits import h2d_bandwidth
from trainer.tools.profiling import StepProfiler, copy_overlap
from trainer.loop.steps import build_optimizer, make_step
from trainer.tracking.runs import Tracker
from trainer.tracking.store import check_tracking_uri
from trainer.validate import check_against_dataset, validate
from trainer.loop.verify import Checksum
from trainer.memory import check_model_fits


def select_device(name: str) -> torch.device:
    """`auto` picks CUDA when present; asking for CUDA without it is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("engine.device=cuda but no CUDA device is available: use engine.device=auto or engine.device=cpu")
    if name not in ("cpu", "cuda"):
        raise ConfigError(f"engine.device must be auto, cpu or cuda (got {name!r}): set engine.device=auto")
    return torch.device(name)


def run(cfg) -> dict:
    """One experiment: returns the summary metrics (also logged to MLflow). Under torchrun, one
    rank's part of it (`trainer.loop.distributed`): rank 0 records the run for all of them."""
    ranks = Ranks(cfg.distributed)  # a world of one unless started by torchrun
    with ranks.agree():  # several ranks: a bad value on any of them stops them all, printed once
        job = validate(cfg)  # the typed sections each part is built from
        device = ranks.device(select_device(cfg.engine.device))  # this rank's GPU, current from here on
        ranks.validate(cfg)
        check_tracking_uri(cfg.tracking.uri)
    torch.manual_seed(cfg.engine.seed)
    # Before anything is allocated for the run: whether batch buffers are reused or faulted in
    # anew every step must not depend on what this process did before (trainer.tools.heap).
    heap = ("true" if keep_freed() else "unavailable") if cfg.engine.steady_heap else "false"
    mem_base = gpu_memory_baseline(device)
    tags = {"strategy": cfg.loader.name, "dataset": cfg.dataset.name, "model": cfg.model.name,
            "device": device.type, "loop": cfg.engine.loop, "torch_version": torch.__version__,
            "cuda_version": str(torch.version.cuda),
            "gpu_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "none", "steady_heap": heap,
            **ranks.tags()}
    with StopSignals() as stop, ranks.tracker(lambda: Tracker(cfg, tags)) as tracker, ranks.guard(), explain_faults(cfg):
        stop.arm()  # SIGINT/SIGTERM now stop the run (KILLED); while it opens or saves, they wait
        tracker.log_environment(describe(device))
        with ranks.agree():
            dataset = build_dataset(job.dataset)
            check_against_dataset(job, dataset)
            check_model_fits(cfg, dataset, device)  # before its weights exist, and before the loader's buffers
            loader = build_loader(job.loader, dataset, device, seed=cfg.engine.seed, shard=ranks.shard)
        graphed = cfg.engine.cuda_graph and device.type == "cuda"
        degraded = [f"loader={cfg.loader.name}"] * loader.degraded + ["engine.cuda_graph=true"] * (cfg.engine.cuda_graph and not graphed)
        tracker.set_tags({"degraded": str(bool(degraded)).lower(), "cuda_graph": str(graphed).lower()})
        if degraded:
            print(f"warning: no CUDA for {' and '.join(degraded)}; running the CPU path (run tagged degraded=true)", file=sys.stderr)
        model = ranks.wrap(build_model(job.model, dataset.sample_shape, dataset.num_classes).to(device))  # DDP
        optimizer = build_optimizer(cfg.engine.optimizer, model, capturable=graphed)
        planned = planned_steps(cfg.engine, loader)
        warn_untimed(planned, cfg.engine.warmup_steps)
        lightning = cfg.engine.loop == "lightning"
        if lightning:  # Lightning is an optional extra: imported only when asked for
            from trainer.loop import lightning as lightning_loop
        meter = (lightning_loop.LightningMeter if lightning else StepMeter)(
            device, cfg.engine.warmup_steps, capacity=planned, gpu_timing_every=cfg.engine.gpu_timing_every)
        meter.setup_s = loader.setup_s
        loader.copy_probe = meter
        checksum = Checksum(device) if cfg.engine.verify else None
        tmp = Path(tempfile.mkdtemp(prefix="feedbench-"))
        profiler = StepProfiler(cfg.engine.profile, tmp, skip=cfg.engine.warmup_steps)
        completed = False
        try:
            with loader, ranks.uneven(model, loader.batches_per_rank(), cfg.engine):
                if lightning:  # the same parts, driven by Lightning's Trainer
                    lightning_loop.fit(model, optimizer, loader, meter, cfg.engine, checksum, profiler, tmp)
                else:
                    train(make_step(model, optimizer, graphed), loader, meter, cfg.engine, checksum, profiler)
            completed = True
        finally:
            # Whatever happened, what was measured is recorded before the run is closed.
            stop.hold()
            trace = profiler.close()
            result = meter.finish()
            tracker.log_steps(result.rows)
            summary = dict(result.summary, pinned_host_mb=loader.pinned_bytes / 2**20,
                           peak_gpu_mem_mb=peak_gpu_mb(device, mem_base))
            verified = checksum.result() if checksum is not None else None
            try:
                if completed:  # after a failure: save, don't probe, and no collective with the other ranks
                    summary.update(ranks.ceilings(lambda: ceilings(meter, device), meter.copy_bytes))
                    summary, verified = ranks.combine(summary, result.rows, verified, tracker)  # several ranks: on rank 0
            finally:
                tracker.log_summary(summary)
                if verified is not None:
                    tracker.set_tags(verified)
                if trace is not None:
                    tracker.log_artifact(trace)
                    overlap = copy_overlap(trace)  # did the copies run while kernels ran?
                    tracker.log_summary(overlap)
                    summary.update(overlap)
    return summary


def warn_untimed(planned: int, warmup: int) -> None:
    """A run whose warm-up covers all of its steps times nothing: say so (it records timed_steps=0)."""
    if planned <= warmup:
        print(f"warning: engine.warmup_steps={warmup} covers all {planned} steps of this run, so none is timed "
              f"(timed_steps=0): set engine.max_steps above {warmup} or engine.warmup_steps below {planned}",
              file=sys.stderr)


def gpu_memory_baseline(device: torch.device) -> int:
    """Several runs may share one process (a multirun): free what earlier ones left and measure
    this run's peak from here."""
    if device.type != "cuda":
        return 0
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def peak_gpu_mb(device: torch.device, base: int) -> float:
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20 if device.type == "cuda" else 0.0


def ceilings(meter: StepMeter, device: torch.device) -> dict:
    """After the loop: this machine's pinned and pageable copy bandwidth for the run's batch size,
    so `h2d_GBps` can be read against what the link can do."""
    if device.type != "cuda" or not meter.copy_bytes:
        return {}
    nbytes = meter.copy_bytes
    return {"h2d_peak_pinned_GBps": h2d_bandwidth(nbytes, pinned=True, device=device),
            "h2d_peak_pageable_GBps": h2d_bandwidth(nbytes, pinned=False, device=device)}

