"""The reference every engine figure is read against: a plain loop over the same loader.

    python -m trainer.tools.plain_loop [--step engine|hand] [hydra overrides...]   # or: --config composed.yaml

A plain script, in a process of its own: it builds the same dataset, loader strategy and model
as `python -m trainer` would for the same overrides, then runs one of two loops over the loader,
with nothing else in it (a host timestamp per step, kept in an array made beforehand): no meter,
no events, no loss kept, no MLflow.

- `--step engine` (the default): the engine's own step (`trainer.loop.steps.make_step`), eager,
  CUDA-graphed or compiled as `engine.cuda_graph` and `engine.compile` say:

      for x, y in loader:
          step(x, y)

- `--step hand`: the step as a user writes it, inline in the loop:

      for x, y in loader:
          optimizer.zero_grad()
          loss = model.loss(x, y)
          loss.backward()
          optimizer.step()

  and with `engine.cuda_graph=true` a graph captured by hand as PyTorch's CUDA-graph docs show
  (`capture_by_hand`), replayed after `static_x.copy_(x); static_y.copy_(y)`.

Either loop takes the same number of steps as the engine (`engine.max_steps`, or `engine.epochs`
passes), syncs the device after the first `engine.warmup_steps` and at the end, and prints one
JSON line: the wall time per timed step and the process's minor page faults and CPU time per
timed step over the same region.

`python -m trainer.report --plain` runs it (the engine's step) for every finished job of a sweep,
from the job's own `config.yaml`, and logs `plain_ms_per_step` and `engine_vs_plain` on the job's run
(`trainer.tracking.plain`).
"""

from __future__ import annotations

import argparse
import json
import time

from typing import Optional

import numpy as np
import torch
from omegaconf import OmegaConf

from datasets import build_dataset
from models import build_model
from trainer.errors import ConfigError, RunFailed
from trainer.loaders import build_loader
from trainer.loop.engine import planned_steps
from trainer.loop.clock import host_usage  # the engine's own count of faults and CPU time
from trainer.loop.steps import build_optimizer, make_step
from trainer.loop.heap import keep_freed
from trainer.memory import limit_gpu_memory
from trainer.tools.turns import pause_if_asked
from trainer.validate import resolve

STEPS = ("engine", "hand")  # --step: the engine's step, or the one a user writes


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Clock:
    """The loops' bookkeeping, one `tick()` after each step: steps done, when each ended (host
    monotonic clock), and the start of the timed region after the warm-up (a device sync)."""

    def __init__(self, total: int, warmup: int, device):
        self.total, self.warmup, self.device = total, warmup, device
        self.done, self.t0, self.usage0 = 0, None, None
        self.ends = np.zeros(total + 1)  # ends[k]: when step k ended, for `trainer.tools.turns`

    def start_timed(self) -> None:
        """Open the timed region: after the warm-up's steps, or before the first with no warm-up."""
        _sync(self.device)
        pause_if_asked()  # under `trainer.tools.turns`: wait here for the process it is compared with
        self.t0, self.usage0 = time.perf_counter(), host_usage()
        self.ends[self.done] = self.t0

    def tick(self) -> bool:
        """A step was issued; True when it was the last."""
        self.done += 1
        self.ends[self.done] = time.perf_counter()
        if self.done == self.warmup:
            self.start_timed()
        return self.done == self.total


def engine_loop(loader, step, clock: _Clock) -> None:
    """The engine's step in a plain loop."""
    while clock.done < clock.total:
        for x, y in loader:
            step(x, y)
            if clock.tick():
                break


def hand_loop(loader, model, optimizer, clock: _Clock) -> None:
    """The loop as a user writes it."""
    while clock.done < clock.total:
        for x, y in loader:
            optimizer.zero_grad()
            loss = model.loss(x, y)
            loss.backward()
            optimizer.step()
            if clock.tick():
                break


def capture_by_hand(model, optimizer, x, y, warmup_iters: int = 3):
    """One training step captured in a CUDA graph as PyTorch's docs show it ("whole-network
    capture"): static inputs, a warm-up on a side stream, gradients set to None, capture.
    Returns (graph, static_x, static_y, static_loss)."""
    static_x, static_y = x.clone(), y.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup_iters):
            optimizer.zero_grad(set_to_none=True)
            loss = model.loss(static_x, static_y)
            loss.backward()
            optimizer.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)
    # thread_local (the docs use the default): a loader's own threads may touch CUDA meanwhile.
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        static_loss = model.loss(static_x, static_y)
        static_loss.backward()
        optimizer.step()
    return graph, static_x, static_y, static_loss


def hand_graph_loop(loader, model, optimizer, clock: _Clock) -> None:
    """The loop as a user writes it around a graph captured by hand."""
    graph = None
    while clock.done < clock.total:
        for x, y in loader:
            if graph is None:
                graph, static_x, static_y, _ = capture_by_hand(model, optimizer, x, y)
            if x.shape != static_x.shape:
                raise ConfigError(f"a graph captured by hand replays batches of one shape (step {clock.done + 1} "
                                  f"has {len(x)} samples, the graph {len(static_x)}): set loader.drop_last=true")
            static_x.copy_(x)
            static_y.copy_(y)
            graph.replay()
            if clock.tick():
                break


def measure(cfg, clock_file: Optional[str] = None, step: str = "engine", dataset=None) -> dict:
    """Run the plain loop for `cfg` (a composed config) with the engine's step or the hand-written
    one (`step`: engine | hand) and return its figures; `clock_file`: also save when each timed
    step began and ended (`.npy`, host monotonic clock: one more entry than steps); `dataset`: one
    built from `cfg.dataset` already (else built here)."""
    resolve(cfg)  # as run() does: no interpolation is parsed again inside the loop
    precision = cfg.engine.get("precision", "fp32")  # configs saved before engine.precision existed are fp32
    if step == "hand" and precision != "fp32":
        raise ConfigError(f"the hand-written step runs in fp32 (got engine.precision={precision}): use the engine's "
                          f"step (--step engine), which runs in the run's precision")
    compiled = cfg.engine.get("compile", "off")  # (configs saved before engine.compile existed ran eagerly)
    if step == "hand" and compiled != "off":
        raise ConfigError(f"the hand-written step runs eagerly (got engine.compile={compiled}): use the engine's step "
                          f"(--step engine), which compiles as the run did")
    name = cfg.engine.device
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)
    if device.type == "cuda":  # as `python -m trainer` does: the same share of the GPU's memory
        limit_gpu_memory(cfg.engine.get("gpu_memory_fraction", 1.0), device)
    if cfg.engine.get("steady_heap", True):
        keep_freed()  # as `python -m trainer` does (trainer.loop.heap)
    torch.manual_seed(cfg.engine.seed)
    dataset = build_dataset(cfg.dataset) if dataset is None else dataset
    loader = build_loader(cfg.loader, dataset, device, seed=cfg.engine.seed)
    graphed = bool(cfg.engine.cuda_graph) and device.type == "cuda"
    model = build_model(cfg.model, dataset.sample_shape, dataset.num_classes).to(device)
    optimizer = build_optimizer(cfg.engine.optimizer, model, capturable=graphed)
    if step == "hand" and optimizer is None:
        raise ConfigError(f"the hand-written step trains a model with parameters (got model={cfg.model.name}): "
                          "use the engine's step (--step engine)")
    total, warmup = planned_steps(cfg.engine, loader), cfg.engine.warmup_steps  # the engine's own length
    clock = _Clock(total, warmup, device)
    with loader:
        if warmup == 0:
            clock.start_timed()
        if step == "engine":
            engine_loop(loader, make_step(model, optimizer, graphed, precision, compile=compiled, feed=loader.graph_feed),
                        clock)
        elif graphed:
            hand_graph_loop(loader, model, optimizer, clock)
        else:
            hand_loop(loader, model, optimizer, clock)
        _sync(device)
        t1, usage1 = time.perf_counter(), host_usage()  # the steps alone, as the engine times them: not closing the loader
    timed = clock.done - warmup
    if clock.t0 is None or timed <= 0:
        return {"plain_timed_steps": 0}
    if clock_file:
        np.save(clock_file, clock.ends[warmup:clock.done + 1])  # the timed steps' bounds
    return {"plain_ms_per_step": (t1 - clock.t0) * 1e3 / timed,
            "plain_host_page_faults_per_step": (usage1[0] - clock.usage0[0]) / timed,
            "plain_host_cpu_ms_per_step": (usage1[1] - clock.usage0[1]) * 1e3 / timed,
            "plain_timed_steps": timed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", help="a composed config (YAML), instead of overrides")
    p.add_argument("--clock", help="save the timed steps' bounds on the host clock to this .npy file")
    p.add_argument("--step", choices=STEPS, default="engine",
                   help="engine: the engine's step (make_step); hand: the step as a user writes it, inline")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for python -m trainer")
    args = p.parse_args()
    if args.config:
        cfg = OmegaConf.load(args.config)
    else:
        from trainer.tools.compose import compose_config
        cfg = compose_config(args.overrides)
    try:
        figures = measure(cfg, args.clock, args.step)
    except (ConfigError, RunFailed) as e:  # what `python -m trainer` reports in one line, this does too
        raise SystemExit(f"error: {e}") from None
    print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
