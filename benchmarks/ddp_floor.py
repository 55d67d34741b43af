"""The multi_gpu preset's step written by hand with DDP, as a user writes it: how fast several GPUs
train the reference autoencoder when nothing feeds them (CUDA only; run under torchrun).

    torchrun --standalone --nproc_per_node=2 benchmarks/ddp_floor.py [--steps 20] [--blocks 15]
        [--bind] [--threads N] [--bucket-mb 25] [--impl default|fused]

Each rank holds 1000/N samples of 256x256 float32 on its GPU (the preset's dataset split over the
ranks; here random, the same on every rank), shuffles them every epoch on the device, and runs
`optimizer.zero_grad(); loss.backward(); optimizer.step()` on batches of 64 (Adam, lr 1e-3,
torch's default implementation, as the preset), the model wrapped in DistributedDataParallel
(`bucket_cap_mb` as the preset) on several ranks, left bare on one (as a user with one GPU runs
it). It drops each epoch's partial batch; compare its ms/step with the runs' `median_step_ms`
(the partial batch is a minority of steps). After 30 warm-up steps, `--blocks` blocks of
`--steps` steps, each timed with CUDA events at its ends (the device synchronised between
blocks, never inside one). `--bind` pins each rank to its own share of the host's cores (its
local rank's slice of the cores this process may use); `--threads` sets torch's intra-op threads
(torchrun sets 1 per rank on several). Rank 0 prints one JSON line: the world size, each rank's
median ms/step over the blocks and their range, samples/s of all ranks at those medians, the
GPU, torch's version and the date.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel


def bind(local_rank: int, local_size: int) -> list:
    """This rank's slice of the cores the process may use, as the process's affinity."""
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // local_size
    mine = cores[local_rank * share:(local_rank + 1) * share] or cores
    os.sched_setaffinity(0, mine)
    return mine


def main(argv=None) -> None:
    """Train and time; rank 0 prints the JSON line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20, help="steps per timed block")
    p.add_argument("--blocks", type=int, default=15, help="timed blocks")
    p.add_argument("--bind", action="store_true", help="pin each rank to its share of the cores")
    p.add_argument("--threads", type=int, default=0, help="torch's intra-op threads (0: as launched)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP's bucket_cap_mb")
    p.add_argument("--impl", choices=("default", "fused"), default="default", help="Adam's implementation")
    args = p.parse_args(argv)
    start = time.perf_counter()
    rank, size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank, local_size = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    cores = bind(local_rank, local_size) if args.bind else sorted(os.sched_getaffinity(0))
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    if size > 1:
        dist.init_process_group("nccl", device_id=device)
    torch.manual_seed(0)
    data = torch.randn(1000 // size, 256 * 256, device=device)
    d, hidden = 256 * 256, 64
    model = nn.Sequential(nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, 3),
                          nn.Linear(3, hidden), nn.ReLU(), nn.Linear(hidden, d)).to(device)
    if size > 1:
        model = DistributedDataParallel(model, device_ids=[local_rank], bucket_cap_mb=args.bucket_mb)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, **({"fused": True} if args.impl == "fused" else {}))
    generator = torch.Generator(device=device).manual_seed(0)
    batch = 64

    def batches():
        while True:
            order = torch.randperm(len(data), device=device, generator=generator)
            for i in range(len(data) // batch):
                yield data[order[i * batch:(i + 1) * batch]]

    feed = batches()

    def step():
        x = next(feed)
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), x)
        loss.backward()
        optimizer.step()

    for _ in range(30):
        step()
    torch.cuda.synchronize()
    blocks = []
    for _ in range(args.blocks):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(args.steps):
            step()
        end.record()
        end.synchronize()
        blocks.append(begin.elapsed_time(end) / args.steps)
    mine = torch.tensor([statistics.median(blocks), min(blocks), max(blocks)], device=device)
    every = [torch.zeros_like(mine) for _ in range(size)]
    if size > 1:
        dist.all_gather(every, mine)
    else:
        every = [mine]
    if rank == 0:
        medians = [round(float(t[0]), 3) for t in every]
        print(json.dumps({"world_size": size, "bind": args.bind, "cores_per_rank": len(cores),
                          "threads": torch.get_num_threads(), "bucket_mb": args.bucket_mb, "impl": args.impl,
                          "ms_per_step": medians,
                          "range": [[round(float(t[1]), 3), round(float(t[2]), 3)] for t in every],
                          "samples_per_s": round(sum(batch * 1000 / m for m in medians)),
                          "gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
                          "date": time.strftime("%Y-%m-%d %H:%M"), "total_s": round(time.perf_counter() - start, 1)}))
    if size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
