"""How far feedbench's steps are from the same step written by hand, on the reference workload (CUDA only).

    python benchmarks/graph_floor.py [--steps 200] [--blocks 15] [--warmup 50]

The reference workload (synthetic 1000x256x256 float32, autoencoder hidden 64, Adam, batch 64) fed
by `gpu_resident` with `drop_last`, built with the project's own builders, runs through each of
these steps, each with a model and an optimizer of its own:

    hand_graph            a graph captured as PyTorch's CUDA-graph docs show
                          (`trainer.tools.plain_loop.capture_by_hand`), then per step
                          `static_x.copy_(x); graph.replay()` (the autoencoder does not read y)
    graphed_step_before   GraphedStep as it was before gradients were set to None at capture:
                          zero_grad(set_to_none=False) captured in the graph, the loss cloned per step
    graphed_step          GraphedStep (`trainer.loop.steps`)
    graphed_step_events   GraphedStep with two CUDA events recorded around each step, as the
                          meter does in the steps it times on the GPU
    eager_step            EagerStep (`trainer.loop.steps`)
    hand_eager            optimizer.zero_grad(); loss = model.loss(x, y); loss.backward(); optimizer.step()

After `--warmup` steps each (the graphs are captured there), the variants take turns in blocks
of `--steps` steps, in a rotating order, `--blocks` times; a block is timed with CUDA events
recorded at its ends (the device is synchronised between blocks, never inside one). It prints
one JSON line per variant: the median ms/step over its blocks, the range, and the ratio to the
hand-written step of its kind (graphed variants to hand_graph, eager ones to hand_eager).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics

import torch

from datasets import build_dataset
from models import build_model
from trainer.loaders import build_loader
from trainer.loop.steps import EagerStep, GraphedStep, build_optimizer
from trainer.tools.overhead import compose_config
from trainer.tools.plain_loop import capture_by_hand
from trainer.validate import resolve

WORKLOAD = ["experiment=bench_strategies", "loader=gpu_resident", "loader.drop_last=true", "engine.device=cuda"]


class GraphedStepBefore:
    """GraphedStep before gradients were set to None at capture: the step it captured zeroed the
    kept gradients in place (zero_grad(set_to_none=False)) and backward added into them; the loss
    was cloned per step. (Its weight restore and eager fallback do not change its speed: left out.)"""

    def __init__(self, model, optimizer):
        self.model, self.optimizer, self.graph = model, optimizer, None

    def _eager(self, x, y):
        self.optimizer.zero_grad(set_to_none=False)
        loss = self.model.loss(x, y)
        loss.backward()
        self.optimizer.step()
        return loss

    def __call__(self, x, y):
        if self.graph is None:
            self.static_x, self.static_y = x.clone(), y.clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    self._eager(self.static_x, self.static_y)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self.static_loss = self._eager(self.static_x, self.static_y)
        self.static_x.copy_(x)
        self.static_y.copy_(y)
        self.graph.replay()
        return self.static_loss.clone()


def hand_graph(model, optimizer):
    """The hand-written graph's step; captured at its first batch."""
    graph = static_x = None

    def step(x, y):
        nonlocal graph, static_x
        if graph is None:
            graph, static_x, _, _ = capture_by_hand(model, optimizer, x, y)
        static_x.copy_(x)
        graph.replay()
    return step


def hand_eager(model, optimizer):
    def step(x, y):
        optimizer.zero_grad()
        loss = model.loss(x, y)
        loss.backward()
        optimizer.step()
    return step


def with_events(step, pairs: int = 64):
    """`step` with a begin and an end event recorded around it, from a pool made beforehand."""
    pool = itertools.cycle([(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                            for _ in range(pairs)])

    def timed(x, y):
        begin, end = next(pool)
        begin.record()
        step(x, y)
        end.record()
    return timed


# name -> (make(model, optimizer) -> step, capturable optimizer, the hand-written step it is read against)
VARIANTS = {
    "hand_graph": (hand_graph, True, "hand_graph"),
    "graphed_step_before": (GraphedStepBefore, True, "hand_graph"),
    "graphed_step": (GraphedStep, True, "hand_graph"),
    "graphed_step_events": (lambda model, optimizer: with_events(GraphedStep(model, optimizer)), True, "hand_graph"),
    "eager_step": (EagerStep, False, "hand_eager"),
    "hand_eager": (hand_eager, False, "hand_eager"),
}


def endless(loader):
    """The loader's batches, epoch after epoch."""
    while True:
        yield from loader


def run_block(step, batches, n: int) -> None:
    for _ in range(n):
        x, y = next(batches)
        step(x, y)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200, help="steps per timed block")
    p.add_argument("--blocks", type=int, default=15, help="timed blocks per variant (taken in turns)")
    p.add_argument("--warmup", type=int, default=50, help="untimed steps per variant first (graphs are captured there)")
    args = p.parse_args(argv)
    if min(args.steps, args.blocks, args.warmup) < 1:
        raise SystemExit("error: --steps, --blocks and --warmup must be >= 1: use --steps 200 --blocks 15 --warmup 50")
    if not torch.cuda.is_available():
        raise SystemExit("error: graph_floor.py times CUDA graphs and needs a CUDA device")
    cfg = compose_config(WORKLOAD)
    resolve(cfg)
    device = torch.device("cuda")
    dataset = build_dataset(cfg.dataset)
    loader = build_loader(cfg.loader, dataset, device, seed=cfg.engine.seed)
    steps = {}
    for name, (make, capturable, _) in VARIANTS.items():
        torch.manual_seed(cfg.engine.seed)  # the same initial weights for every variant
        model = build_model(cfg.model, dataset.sample_shape, dataset.num_classes).to(device)
        optimizer = build_optimizer(cfg.engine.optimizer, model, capturable=capturable)
        steps[name] = make(model, optimizer)
    gpu = torch.cuda.get_device_name(device)
    ms = {name: [] for name in steps}
    with loader:
        batches = endless(loader)
        for step in steps.values():
            run_block(step, batches, args.warmup)
        torch.cuda.synchronize()
        names = list(steps)
        for b in range(args.blocks):
            order = names[b % len(names):] + names[:b % len(names)]  # each variant in every position in turn
            for name in order:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                run_block(steps[name], batches, args.steps)
                end.record()
                torch.cuda.synchronize()  # between blocks only: a variant's queue does not spill into the next
                ms[name].append(begin.elapsed_time(end) / args.steps)
    medians = {name: statistics.median(values) for name, values in ms.items()}
    for name, (_, _, reference) in VARIANTS.items():
        print(json.dumps({"variant": name, "median_ms_per_step": round(medians[name], 4),
                          "min_ms_per_step": round(min(ms[name]), 4), "max_ms_per_step": round(max(ms[name]), 4),
                          f"vs_{reference}": round(medians[name] / medians[reference], 4),
                          "blocks": args.blocks, "steps_per_block": args.steps, "gpu": gpu,
                          "torch": torch.__version__}), flush=True)


if __name__ == "__main__":
    main()
