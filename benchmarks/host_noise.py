"""How steady this host is: the same eager step timed again and again, in one process.

    python benchmarks/host_noise.py                                  # eager gpu_resident, 10 runs of 150 steps (about 20 s)
    python benchmarks/host_noise.py --loader pinned_chunk --runs 20 --cpus 2-5

A host-bound step (an eager step of small kernels, or one fed by a DataLoader) runs as fast as
the host's thread, so what two runs of it can tell apart is bounded by how much the same run
moves from one try to the next on this machine. This times the plain loop over the reference
workload's batches (`trainer.tools.plain_loop.measure`, the engine's step in a plain loop) `--runs`
times in a row, each `--steps` timed steps after 20 of warm-up, and prints each run's ms/step, the
spread of its blocks of 50 steps, the spread over runs (max/min and coefficient of variation) and
the share of CPU time the hypervisor took ("steal", from /proc/stat). `--cpus` repeats the runs
bound to those cores (`os.sched_setaffinity`), to see whether placement on the cores is the noise.
docs/benchmark.md ("What the engine adds") quotes it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from datasets import build_dataset
from trainer.tools.compose import compose_config
from trainer.tools.plain_loop import measure


def steal() -> tuple:
    """(steal ticks, all ticks) of the whole machine so far."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    return ticks[7] if len(ticks) > 7 else 0, sum(ticks)


def runs(cfg, dataset, count: int, tag: str, tmp: Path) -> list:
    """`count` runs of the plain loop; prints each, then their spread."""
    got, before = [], steal()
    for i in range(count):
        clock = tmp / f"clock_{i}.npy"
        figures = measure(cfg, clock_file=str(clock), dataset=dataset)
        steps_ms = np.diff(np.load(clock)) * 1e3
        blocks = [float(steps_ms[j:j + 50].mean()) for j in range(0, len(steps_ms) - 49, 50)]
        got.append(figures["plain_ms_per_step"])
        print(f"  {tag}, run {i + 1}: {got[-1]:.3f} ms/step (blocks of 50 steps {min(blocks):.3f} to {max(blocks):.3f}), "
              f"host CPU {figures['plain_host_cpu_ms_per_step']:.3f} ms/step", flush=True)
    after = steal()
    print(f"{tag}: median {statistics.median(got):.3f} ms/step, max/min {max(got) / min(got):.3f}, "
          f"coefficient of variation {statistics.stdev(got) / statistics.mean(got):.3f}, "
          f"steal {(after[0] - before[0]) / max(1, after[1] - before[1]):.4f} of the machine's CPU time", flush=True)
    return got


def cpu_list(text: str) -> list:
    """`2-5,8` as [2, 3, 4, 5, 8]."""
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--loader", default="gpu_resident", help="the strategy (default gpu_resident: no copy at all)")
    p.add_argument("--runs", type=int, default=10, help="runs per CPU set")
    p.add_argument("--steps", type=int, default=150, help="timed steps per run")
    p.add_argument("--cpus", action="append", default=[], help="a CPU list to bind the runs to, e.g. 2-5 (repeatable)")
    p.add_argument("overrides", nargs="*", help="more Hydra overrides (default: the reference workload, eager)")
    args = p.parse_args()
    t0 = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = compose_config(["experiment=bench_strategies", f"engine.device={device}", f"loader={args.loader}",
                          "engine.warmup_steps=20", f"engine.max_steps={20 + args.steps}", *args.overrides])
    dataset = build_dataset(cfg.dataset)
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"loader={args.loader}, {args.runs} runs of {args.steps} steps, on {where}")
    measure(cfg, dataset=dataset)  # a first run, untimed: kernels and libraries load
    everything = sorted(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        for cpus in [everything] + [cpu_list(c) for c in args.cpus]:
            os.sched_setaffinity(0, cpus)
            torch.set_num_threads(len(cpus))
            runs(cfg, dataset, args.runs, f"{len(cpus)} cores ({cpus[0]}-{cpus[-1]})", Path(tmp))
    os.sched_setaffinity(0, everything)
    print(f"total: {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
