"""How much the engine's bookkeeping costs: the engine loop versus a bare loop doing the same work.

    python -m trainer.overhead [--steps 2000] [--repeats 5] [hydra overrides...]

Runs the same steps over the same loader (default: a small MLP on 28x28 synthetic data on the
CPU, where per-step overhead shows most) alternately through `trainer.loop.engine.train` (meter,
copy probe, loss watch, progress bar) and through a bare `for x, y in loader: step(x, y)` loop,
and prints the median wall time per step of each and the difference.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from datasets import build_dataset
from models import build_model
from trainer.config import PROJECT_ROOT
from trainer.loop.engine import train
from trainer.loaders import build_loader
from trainer.loop.meter import StepMeter
from trainer.loop.steps import build_optimizer, make_step

DEFAULTS = ["model=mlp", "model.hidden=128", "dataset.shape=[28,28]", "dataset.num_samples=4096",
            "loader.batch_size=64", "engine.device=cpu", "engine.progress=false", "engine.warmup_steps=0"]


def bare_loop(step_fn, loader, steps: int) -> None:
    """The same work with no bookkeeping at all."""
    done = 0
    while done < steps:
        for x, y in loader:
            step_fn(x, y)
            done += 1
            if done == steps:
                return


def measure(cfg, steps: int, repeats: int) -> dict:
    device = torch.device(cfg.engine.device if cfg.engine.device != "auto" else "cpu")
    dataset = build_dataset(cfg.dataset)
    model = build_model(cfg.model, dataset.sample_shape, dataset.num_classes).to(device)
    step_fn = make_step(model, build_optimizer(cfg.engine.optimizer, model), graphed=False)
    engine = OmegaConf.merge(cfg.engine, {"epochs": 10**6, "max_steps": steps})
    times = {"engine": [], "bare": []}
    for _ in range(repeats):
        for name in times:  # alternate, so drift in machine speed hits both alike
            loader = build_loader(cfg.loader, dataset, device, seed=cfg.engine.seed)
            start = time.perf_counter()
            if name == "engine":
                meter = StepMeter(device, 0)
                loader.copy_probe = meter
                train(step_fn, loader, meter, engine)
                meter.finish()  # reading the events is part of the meter's cost
            else:
                bare_loop(step_fn, loader, steps)
            times[name].append((time.perf_counter() - start) * 1e3 / steps)
    med = {k: statistics.median(v) for k, v in times.items()}
    med["overhead_pct"] = 100 * (med["engine"] / med["bare"] - 1)
    return med


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=autoencoder")
    args = p.parse_args()
    import trainer.config  # noqa: F401
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=DEFAULTS + args.overrides)
    r = measure(cfg, args.steps, args.repeats)
    print(f"engine loop {r['engine']:.4f} ms/step\nbare loop   {r['bare']:.4f} ms/step\n"
          f"overhead    {r['overhead_pct']:+.2f} %")


if __name__ == "__main__":
    main()
