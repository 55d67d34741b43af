"""`run(cfg)`: build the parts from their own config sections, train, and record the run."""

from __future__ import annotations

import sys
import warnings

import torch

from datasets import build_dataset
from models import build_model
from trainer.engine import train
from trainer.environment import describe
from trainer.errors import ConfigError
from trainer.loaders import build_loader
from trainer.meter import StepMeter
from trainer.steps import build_optimizer
from trainer.tracking import Tracker
from trainer.verify import Checksum


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
    """One experiment: returns the summary metrics (also logged to MLflow)."""
    device = select_device(cfg.engine.device)
    torch.manual_seed(cfg.engine.seed)
    tags = {"strategy": cfg.loader.name, "dataset": cfg.dataset.name, "model": cfg.model.name,
            "device": device.type, "torch_version": torch.__version__,
            "cuda_version": str(torch.version.cuda),
            "gpu_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "none"}
    with Tracker(cfg, tags) as tracker:
        tracker.log_environment(describe(device))
        dataset = build_dataset(cfg.dataset)
        loader = build_loader(cfg.loader, dataset, device, seed=cfg.engine.seed)
        tracker.set_tags({"degraded": str(loader.degraded).lower()})
        if loader.degraded:
            print(f"warning: loader={cfg.loader.name} needs CUDA; running its CPU path (run tagged degraded=true)", file=sys.stderr)
        model = build_model(cfg.model, dataset.sample_shape, dataset.num_classes).to(device)
        optimizer = build_optimizer(cfg.engine.optimizer, model)
        meter = StepMeter(device, cfg.engine.warmup_steps)
        meter.setup_s = loader.setup_s
        loader.copy_probe = meter
        checksum = Checksum(device) if cfg.engine.verify else None
        try:
            with loader:
                train(model, optimizer, loader, meter, cfg.engine, checksum)
        finally:
            # Whatever happened, what was measured is recorded before the run is closed.
            result = meter.finish()
            tracker.log_steps(result.rows)
            summary = dict(result.summary, pinned_host_mb=loader.pinned_bytes / 2**20)
            tracker.log_summary(summary)
            if checksum is not None:
                tracker.set_tags(checksum.result())
    return summary
