"""The multi_gpu preset's step written by hand, as a user writes it, with each way of averaging the
gradients over the ranks: how fast several GPUs train the reference autoencoder when nothing
feeds them, and where a step's time goes (CUDA only; run under torchrun).

    torchrun --standalone --nproc_per_node=2 benchmarks/ddp_floor.py [--sync ddp|allreduce|sharded|zero|none|ddp-nocomm]
        [--graph] [--steps 20] [--blocks 15] [--bind] [--threads N] [--bucket-mb 25]
        [--impl default|fused] [--turns R] [--profile] [--no-pace]

Each rank holds 1000/N samples of 256x256 float32 on its GPU (the preset's dataset split over the
ranks; here random, the same on every rank), shuffles them every epoch on the device, and runs
`optimizer.zero_grad(); loss.backward(); optimizer.step()` on batches of 64 (Adam, lr 1e-3,
torch's default implementation, as the preset). How the gradients are averaged (`--sync`):
- `ddp`: the model wrapped in DistributedDataParallel (`bucket_cap_mb` as the preset), as a
  user with several GPUs writes it; one GPU runs the bare model;
- `allreduce`: no DDP: every gradient is a view of one flat buffer, zeroed before backward, and
  after backward one `all_reduce(flat, AVG)` averages them all (what DDP does, in one bucket,
  without its per-parameter hooks, its bucket copies and its Python forward);
- `sharded`: as `allreduce`, the weights also views of one flat buffer; after backward a
  `reduce_scatter_tensor` leaves each rank the mean of its 1/N slice of the gradients, Adam
  updates that slice of the weights alone, and an `all_gather_into_tensor` hands every rank all of
  them (ZeRO's first stage, on flat slices: the engine's `distributed.sync=sharded`);
- `sharded-overlap`: sharded in buckets of `--bucket-mb` in backward's order, each bucket's
  reduce-scatter started by a hook while backward goes on, and each bucket's update (an
  optimizer per bucket) and all-gather as soon as its reduce-scatter is done;
- `sharded-copy`: sharded, the slices moved by the copy engines between buffers the ranks map
  from each other, each bucket's reduce-scatter started while backward goes on (the engine's
  `distributed.exchange=copy`, its `PeerCopyShards` driven by this loop, the host kept a few
  steps ahead of the GPU as the engine keeps it, unless `--no-pace`; CUDA only);
- `zero`: DDP, with PyTorch's `ZeroRedundancyOptimizer` around Adam (each rank updates the whole
  parameters dealt to it, then broadcasts them), as a user with several GPUs writes ZeRO; eager;
- `none`: each rank trains alone, nothing exchanged: what several processes cost each other on
  this host (cores, memory, the driver) without any collective;
- `ddp-nocomm`: DDP with a communication hook that returns the bucket as it is: DDP's own work on
  the host, without the exchange or the wait for the other ranks.
`--graph` captures the step (forward, backward, the exchange, the optimizer's update) in one CUDA
graph after 11 eager warm-up steps (DDP's bucket rebuild happens in the first ones), then replays
it; the batch is copied into the graph's input first, as the engine's graphed step does.

It drops each epoch's partial batch; compare its ms/step with the runs' `median_step_ms` (the
partial batch is a minority of steps). After 30 warm-up steps, `--blocks` blocks of `--steps`
steps, each timed with CUDA events at its ends (the device synchronised between blocks, never
inside one), and on the host: `host_ms_per_step` is the time the host took to issue a block's
steps, so a step whose GPU time equals it was set by the host. `--bind` pins each rank to its
own share of the host's cores (its local rank's slice of the cores this process may use);
`--threads` sets torch's intra-op threads (torchrun sets 1 per rank on several). `--turns R`
(several GPUs) times, R times in turns, rank 0 training a model of its own alone (the others
waiting in a gloo barrier) and then every rank with the exchange: `efficiency_in_turns` is the
median of alone ÷ all (the slowest rank), a scaling figure that the host's drift between two
launches does not move. `--profile`
adds, from torch's profiler over 20 more steps of rank 0, the host operators that took the most
of its time and the host's waits on the device, and what its GPU ran: the longest kernels, the
device's busy time and NCCL's kernels apart (ms per step). Rank 0 prints one JSON line: the world size,
each rank's median ms/step over the blocks and their range, samples/s of all ranks at those
medians, the GPU, torch's version and the date.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from trainer.loop.distributed import PeerCopyShards, all_gather_flat, flat_layout, reduce_scatter_flat
from trainer.loop.profiling import busy_time

SYNCS = ("ddp", "allreduce", "sharded", "sharded-overlap", "sharded-copy", "zero", "none", "ddp-nocomm")
WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaStreamQuery")


def bind(local_rank: int, local_size: int) -> list:
    """This rank's slice of the cores the process may use, as the process's affinity."""
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // local_size
    mine = cores[local_rank * share:(local_rank + 1) * share] or cores
    os.sched_setaffinity(0, mine)
    return mine


def _no_exchange(state, bucket):
    """A DDP communication hook that averages nothing: the bucket as it is, as a finished future."""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


class FlatGrads:
    """Every gradient a view of one flat buffer: zeroed before backward (one kernel), averaged over
    the ranks after it (one all-reduce). Backward adds into the views in place."""

    def __init__(self, params, world_size: int, pad_to: int = 1):
        self.params, self.world_size = list(params), world_size
        # each view at an aligned address, as the engine lays them out (`flat_layout`)
        self.offsets, numel = flat_layout([p.numel() for p in self.params], 4, pad_to)
        self.flat = torch.zeros(numel, device=self.params[0].device)
        for p, at in zip(self.params, self.offsets):
            p.grad = self.flat[at:at + p.numel()].view_as(p)
        self.updated = self.params  # what the optimizer updates

    def zero(self):
        self.flat.zero_()

    def share(self):
        """After the optimizer's step: every rank updated every weight."""

    def average(self):
        if self.world_size == 1:
            return
        if self.flat.is_cuda:
            dist.all_reduce(self.flat, op=dist.ReduceOp.AVG)
        else:  # gloo has no AVG
            dist.all_reduce(self.flat)
            self.flat.div_(self.world_size)


class FlatShards(FlatGrads):
    """The weights too in one flat buffer (padded to N equal slices); this rank's optimizer updates
    its slice, whose gradients a reduce-scatter averaged, and an all-gather shares the result."""

    def __init__(self, params, world_size: int, rank: int):
        super().__init__(params, world_size, pad_to=world_size)
        self.weights = torch.zeros_like(self.flat)
        with torch.no_grad():
            for p, at in zip(self.params, self.offsets):
                self.weights[at:at + p.numel()].copy_(p.reshape(-1))
                p.data = self.weights[at:at + p.numel()].view_as(p)
        size = self.flat.numel() // world_size
        self.shard = self.weights[rank * size:(rank + 1) * size]
        self.shard.grad = self.flat[rank * size:(rank + 1) * size]
        self.updated = [self.shard]

    def average(self):
        if self.flat.is_cuda:  # in place: the output at input + rank x count, NCCL's own form
            reduce_scatter_flat(self.shard.grad, self.flat, op=dist.ReduceOp.AVG)
        else:  # gloo has no AVG
            reduce_scatter_flat(self.shard.grad, self.flat)
            self.shard.grad.div_(self.world_size)

    def share(self):
        all_gather_flat(self.weights, self.shard)


class OverlappedShards:
    """`--sync sharded-overlap`: sharded in buckets, in the order backward produces the gradients
    (the parameters in reverse, a bucket closed once it holds `--bucket-mb`), each laid out as
    `FlatShards` lays out the whole. A bucket's reduce-scatter starts from a hook as soon as
    backward has added its last gradient, while backward goes on; after backward each bucket's
    slice is updated by an optimizer of its own once its reduce-scatter is done, and its
    all-gather runs while the next bucket's update does (NCCL's stream beside the compute one)."""

    def __init__(self, params, world_size: int, rank: int, cap_bytes: float):
        self.world_size, self.buckets = world_size, []
        bucket, nbytes, order = [], 0, []
        for p in reversed(list(params)):
            bucket.append(p)
            nbytes += p.numel() * p.element_size()
            if nbytes >= cap_bytes:
                order.append(bucket)
                bucket, nbytes = [], 0
        order += [bucket] if bucket else []
        for params in order:
            offsets, numel = flat_layout([p.numel() for p in params], 4, world_size)
            grads = torch.zeros(numel, device=params[0].device)
            weights = torch.zeros_like(grads)
            with torch.no_grad():
                for p, at in zip(params, offsets):
                    weights[at:at + p.numel()].copy_(p.reshape(-1))
                    p.data = weights[at:at + p.numel()].view_as(p)
                    p.grad = grads[at:at + p.numel()].view_as(p)
            size = numel // world_size
            shard = weights[rank * size:(rank + 1) * size]
            shard.grad = grads[rank * size:(rank + 1) * size]
            b = {"params": params, "grads": grads, "weights": weights, "shard": shard, "pending": len(params), "work": None}
            self.buckets.append(b)
            for p in params:
                p.register_post_accumulate_grad_hook(lambda _, b=b: self._added(b))
        self.updated = [b["shard"] for b in self.buckets]
        self.op = dist.ReduceOp.AVG if weights.is_cuda else dist.ReduceOp.SUM  # gloo has no AVG

    def _added(self, b):
        b["pending"] -= 1
        if b["pending"] == 0:
            b["work"] = reduce_scatter_flat(b["shard"].grad, b["grads"], op=self.op, async_op=True)

    def zero(self):
        for b in self.buckets:
            b["grads"].zero_()
            b["pending"], b["work"] = len(b["params"]), None

    def step(self, optimizers):
        gathers = []
        for b, optimizer in zip(self.buckets, optimizers):
            if b["work"] is None:  # a bucket with a parameter backward did not reach
                b["work"] = reduce_scatter_flat(b["shard"].grad, b["grads"], op=self.op, async_op=True)
            b["work"].wait()
            if self.op == dist.ReduceOp.SUM:
                b["shard"].grad.div_(self.world_size)
            optimizer.step()
            gathers.append(all_gather_flat(b["weights"], b["shard"], async_op=True))
        for g in gathers:
            g.wait()


def profile_summary(step, rank: int, steps: int = 20) -> dict:
    """Rank 0's host operators over `steps` steps, which every rank runs (their collectives wait for
    each other): the ten with most self time, and the host's waits on the device, in ms per step."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    if rank != 0:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        return {}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        kernels = kernel_summary(json.loads(Path(f"{tmp}/trace.json").read_text()), steps)
    events = prof.key_averages()
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
    waits = {e.key: round(e.self_cpu_time_total / 1000 / steps, 4) for e in events if e.key in WAITS}
    return {"top_host_ops_ms_per_step": {e.key: round(e.self_cpu_time_total / 1000 / steps, 4) for e in top},
            "host_waits_ms_per_step": waits,
            "launches_per_step": round(sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cudaLaunchKernelExC",
                                                                               "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")) / steps, 1),
            **kernels}


def kernel_summary(trace: dict, steps: int) -> dict:
    """What rank 0's GPU ran in a profiler trace of `steps` steps, in ms per step: each kernel's
    time, the eight longest by name (a graph's replayed kernels included), the union of all of
    them (the device busy), and NCCL's kernels apart: the exchange on the device, a wait for the
    other ranks included."""
    spans = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in trace.get("traceEvents", [])
             if e.get("cat") == "kernel" and "dur" in e]
    # copies (a copy engine's, beside the kernels) and one step's kernels and copies in order: the
    # middle one of the steps, by count (a replayed graph runs the same ones every step)
    copies = [(e["ts"], e["ts"] + e["dur"], e["name"], e.get("tid")) for e in trace.get("traceEvents", [])
              if e.get("cat") == "gpu_memcpy" and "dur" in e]
    timeline = sorted([(b, e, n, None) for b, e, n in spans] + copies)
    per = len(timeline) // steps if steps else 0
    one = timeline[per * (steps // 2):per * (steps // 2 + 1)]
    step_timeline = [[round(b - one[0][0], 1), round(e - b, 1), n[:48]] for b, e, n, _ in one] if one else []
    by_name: dict = {}
    for begin, end, name in spans:
        by_name[name[:80]] = by_name.get(name[:80], 0.0) + (end - begin)
    busy = busy_time([(begin, end) for begin, end, _ in spans])
    per_step = lambda us: round(us / 1000 / steps, 4)  # noqa: E731 (trace times are in µs)
    top = sorted(by_name.items(), key=lambda kv: kv[1], reverse=True)[:8]
    return {"kernels_ms_per_step": {name: per_step(us) for name, us in top},
            "kernel_count_per_step": round(len(spans) / steps, 1),
            "gpu_busy_ms_per_step": per_step(busy),
            "nccl_kernel_ms_per_step": per_step(sum(us for name, us in by_name.items() if "nccl" in name.lower())),
            "copy_ms_per_step": per_step(sum(end - begin for begin, end, _, _ in copies)),
            "one_step_us": step_timeline}


def make_step(model: nn.Module, how: str, args, size: int, feed, device: torch.device):
    """One training step of `model` over `feed`, its gradients averaged as `how` says (`SYNCS`, or
    `none`), eager or captured as a CUDA graph (`args.graph`): returns `step()`."""
    params = list(model.parameters())
    flat = None
    cuda = device.type == "cuda"
    # A graph's warm-up and capture run on a side stream; DDP made on it too, as PyTorch's
    # CUDA-graph notes ask for DDP.
    side = torch.cuda.Stream(device) if args.graph else None
    with torch.cuda.stream(side) if args.graph else contextlib.nullcontext():
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(device))
        if how in ("ddp", "ddp-nocomm"):
            model = DistributedDataParallel(model, device_ids=[device.index] if cuda else None, bucket_cap_mb=args.bucket_mb)
            if how == "ddp-nocomm":
                model.register_comm_hook(None, _no_exchange)
        elif how == "allreduce":
            flat = FlatGrads(params, size)
        elif how == "sharded":
            flat = FlatShards(params, size, dist.get_rank())
        elif how == "zero":
            model = DistributedDataParallel(model, device_ids=[device.index] if cuda else None, bucket_cap_mb=args.bucket_mb)
        elif how == "sharded-overlap":
            flat = OverlappedShards(params, size, dist.get_rank(), args.bucket_mb * 2**20)
        elif how == "sharded-copy":  # the engine's own exchange (distributed.exchange=copy), in this loop
            flat = PeerCopyShards(model, size, dist.get_rank(), dist.group.WORLD, args.bucket_mb, timeout_s=300)
            flat.updated = flat.updated()
            if args.no_pace:  # the host runs ahead as far as the GPU's queue lets it
                flat.pace = lambda: None
    if side is not None:
        torch.cuda.current_stream(device).wait_stream(side)
    kwargs = {"fused": True} if args.impl == "fused" else {}
    if how == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        optimizer = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.Adam, lr=1e-3, **kwargs)
    elif how == "sharded-overlap":  # an optimizer per bucket
        optimizers = [torch.optim.Adam([shard], lr=1e-3, capturable=args.graph, **kwargs) for shard in flat.updated]
    else:
        optimizer = torch.optim.Adam(flat.updated if flat is not None else params, lr=1e-3, capturable=args.graph, **kwargs)

    def train(x, captured=False):
        if flat is not None:
            flat.zero()
        elif not captured:  # a graph's gradients are None at capture: backward writes them afresh
            optimizer.zero_grad()
        loss = F.mse_loss(model(x), x)
        loss.backward()
        if how == "sharded-overlap":
            flat.step(optimizers)
            return
        if flat is not None:
            flat.average()
        optimizer.step()
        if flat is not None:
            flat.share()

    if not args.graph:
        return lambda: train(next(feed))
    static_x = next(feed).clone()
    with torch.cuda.stream(side):
        for _ in range(11):
            train(static_x)
    torch.cuda.current_stream(device).wait_stream(side)
    if flat is None:
        optimizer.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        train(static_x, captured=True)

    def replay():
        static_x.copy_(next(feed))
        graph.replay()
        if how == "sharded-copy":
            flat.pace()  # as the engine's graphed step, after each replay (eager: inside `zero`)
    return replay


def timed(step, blocks: int, steps: int, cuda: bool, each: bool = False):
    """`blocks` blocks of `steps` steps, each timed with CUDA events at its ends (the host's clock
    without a GPU): (median ms/step, fastest, slowest, median host ms/step to issue a block), or
    with `each` the blocks' ms/step and the host's."""
    out, host = [], []
    for _ in range(blocks):
        t0 = time.perf_counter()
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        for _ in range(steps):
            step()
        host.append((time.perf_counter() - t0) * 1000 / steps)
        if cuda:
            end.record()
            end.synchronize()
            out.append(begin.elapsed_time(end) / steps)
        else:
            out.append(host[-1])
    if each:
        return out, host
    return statistics.median(out), min(out), max(out), statistics.median(host)


def main(argv=None) -> None:
    """Train and time; rank 0 prints the JSON line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sync", choices=SYNCS, default="ddp", help="how the ranks average the gradients")
    p.add_argument("--graph", action="store_true", help="capture the step in a CUDA graph and replay it")
    p.add_argument("--steps", type=int, default=20, help="steps per timed block")
    p.add_argument("--blocks", type=int, default=15, help="timed blocks")
    p.add_argument("--bind", action="store_true", help="pin each rank to its share of the cores")
    p.add_argument("--threads", type=int, default=0, help="torch's intra-op threads (0: as launched)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP's bucket_cap_mb")
    p.add_argument("--impl", choices=("default", "fused"), default="default", help="Adam's implementation")
    p.add_argument("--profile", action="store_true", help="rank 0's host operators and waits, from torch's profiler")
    p.add_argument("--turns", type=int, default=0, help="rounds of rank 0 alone, then every rank, in turns")
    p.add_argument("--no-pace", action="store_true",
                   help="--sync sharded-copy: let the host run ahead of the GPU (the engine keeps it a few steps ahead)")
    args = p.parse_args(argv)
    if args.sync == "sharded-copy" and not torch.cuda.is_available():
        p.error("--sync sharded-copy maps GPU memory across the ranks: it needs CUDA")
    if args.graph and args.sync == "zero":
        p.error("--sync zero is eager: ZeroRedundancyOptimizer's broadcasts and its bookkeeping run on the host")
    if args.graph and args.sync in ("none", "sharded", "sharded-overlap", "sharded-copy") and args.turns:
        # rank 0's two graphs (its own model's alone, and this one) replayed with an illegal address
        # (torch 2.11, H100 and H200); with --sync allreduce they replay as they should
        p.error(f"--graph with --sync {args.sync} and --turns is not supported: time --sync {args.sync} --graph without --turns")
    start = time.perf_counter()
    rank, size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank, local_size = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    cores = bind(local_rank, local_size) if args.bind else sorted(os.sched_getaffinity(0))
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()  # without a GPU (a check of this script), gloo on the CPU, host clocks
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    elif args.graph or args.profile:
        raise SystemExit("--graph and --profile need a GPU")
    if size > 1:
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    torch.manual_seed(0)
    data = torch.randn(1000 // size, 256 * 256, device=device)
    d, hidden = 256 * 256, 64
    bare = nn.Sequential(nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, 3),
                         nn.Linear(3, hidden), nn.ReLU(), nn.Linear(hidden, d)).to(device)
    solo = copy.deepcopy(bare) if args.turns and size > 1 else None  # --turns: rank 0's step alone, with a model of its own
    generator = torch.Generator(device=device).manual_seed(0)
    batch = 64

    def batches():
        while True:
            order = torch.randperm(len(data), device=device, generator=generator)
            for i in range(len(data) // batch):
                yield data[order[i * batch:(i + 1) * batch]]

    feed = batches()
    step = make_step(bare, args.sync if size > 1 else "none", args, size, feed, device)
    alone = make_step(solo, "none", args, size, feed, device) if solo is not None and rank == 0 else None
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(30):
        step()
        if alone is not None:
            alone()
    sync()
    turns = []
    if args.turns and size > 1:
        # In turns, so that both figures share the host's state of the moment: rank 0 alone while the
        # others wait in a gloo barrier (blocked on a socket, not spinning), then every rank.
        idle = dist.new_group(backend="gloo")
        for _ in range(args.turns):
            one = timed(alone, 5, args.steps, cuda) if rank == 0 else None
            dist.barrier(group=idle)
            every = timed(step, 5, args.steps, cuda)
            slowest = [0.0] * size
            dist.all_gather_object(slowest, every[0], group=idle)
            if rank == 0:
                turns.append((one[0], max(slowest)))
    blocks, host = timed(step, args.blocks, args.steps, cuda, each=True)
    profiled = profile_summary(step, rank) if args.profile else {}
    mine = torch.tensor([statistics.median(blocks), min(blocks), max(blocks), statistics.median(host)], device=device)
    in_turns = {}
    if turns:
        in_turns = {"turns_ms_alone_then_all": [[round(a, 3), round(b, 3)] for a, b in turns],
                    "efficiency_in_turns": round(statistics.median(a / b for a, b in turns), 3)}
    every = [torch.zeros_like(mine) for _ in range(size)]
    if size > 1:
        dist.all_gather(every, mine)
    else:
        every = [mine]
    if rank == 0:
        medians = [round(float(t[0]), 3) for t in every]
        print(json.dumps({"world_size": size, "sync": args.sync if size > 1 else "alone", "graph": args.graph,
                          "bind": args.bind, "cores_per_rank": len(cores),
                          "threads": torch.get_num_threads(), "bucket_mb": args.bucket_mb, "impl": args.impl,
                          **({"paced": not args.no_pace} if args.sync == "sharded-copy" else {}),
                          "ms_per_step": medians,
                          "range": [[round(float(t[1]), 3), round(float(t[2]), 3)] for t in every],
                          "host_ms_per_step": [round(float(t[3]), 3) for t in every],
                          "samples_per_s": round(sum(batch * 1000 / m for m in medians)),
                          **in_turns, **profiled,
                          "gpu": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
                          "date": time.strftime("%Y-%m-%d %H:%M"), "total_s": round(time.perf_counter() - start, 1)}),
              flush=True)
    if size > 1:
        # Every rank has printed what it measured; then each leaves without tearing NCCL down: after
        # a graph that replays its all-reduce, destroy_process_group() outlasted the launch's 55 s
        # limit on torch 2.11 (4 x H100), where the process's exit releases the same resources.
        sys.stdout.flush()
        dist.barrier(group=dist.new_group(backend="gloo"))
        os._exit(0)


if __name__ == "__main__":
    main()
