"""The reference autoencoder's gradient exchange measured alone, by each way this host offers
(CUDA only; two or more GPUs of one host, under torchrun):

    torchrun --standalone --nproc_per_node=2 benchmarks/exchange_alone.py

The flat float32 gradients of the multi_gpu preset's autoencoder (8.45M values, 32.25 MiB), each
rank's slice 1/N of them, exchanged by:
- `nccl_allreduce`: NCCL's all-reduce (AVG) of the whole buffer (`distributed.sync=allreduce`);
- `nccl_rs_ag`: NCCL's reduce-scatter of the gradients, then its all-gather of the weights'
  slices (`distributed.sync=sharded`);
- `symm_two_shot`, `symm_one_shot`: PyTorch's symmetric-memory all-reduces (SM kernels reading the
  peers' memory over NVLink; no multicast);
- `ce_pull`: what `distributed.exchange=copy` does in one bucket: a barrier kernel, this rank's
  slice copied from every peer by the copy engine and added in, a barrier, another barrier, and
  every peer's slice of the weights copied;
- `ce_push`: barriers and this rank's slice of the weights copied into every peer's buffer;
- `ce_ag_only`, `ce_copy_alone`, `barrier_only`: the parts of those alone.
Each is timed with CUDA events over 30 calls, eager (median ms a call), and as 10 calls captured
in one CUDA graph (ms a call). `correct` checks the result of one eager call; `graph-correct`
checks it after a replay of the graph, for the exchanges that give the same result when repeated
(None for the others, which repeat their additions). Prints on rank 0, with its total time.
"""
import os
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist

t0 = time.time()
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(rank)
dev = torch.device("cuda", rank)
dist.init_process_group("nccl", device_id=dev)
import torch.distributed._symmetric_memory as symm_mem

group = dist.group.WORLD
gname = group.group_name
N = 65536 * 64 * 2 + 64 + 65536
N = -(-N // (32 * world)) * 32 * world
half = N // world
lo, hi = rank * half, (rank + 1) * half


def say(*a):
    if rank == 0:
        print(*a, flush=True)


say("torch", torch.__version__, "world", world, "N", N, "MB", N * 4 / 2**20)
say("env", {k: os.environ.get(k) for k in ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "NCCL_NVLS_ENABLE")})
ops = [o for o in dir(torch.ops.symm_mem) if not o.startswith("_")]
say("symm_mem ops:", ops)
for name in ("two_shot_all_reduce_", "one_shot_all_reduce", "one_shot_all_reduce_out", "reduce_scatter_out",
             "two_shot_all_reduce_out", "all_gather_out"):
    try:
        say(" ", getattr(torch.ops.symm_mem, name).default._schema)
    except Exception as e:
        say("  no", name, type(e).__name__)
say("symm_mem api:", [a for a in dir(symm_mem) if not a.startswith("__")])

g = symm_mem.empty(N, dtype=torch.float32, device=dev)
w = symm_mem.empty(N, dtype=torch.float32, device=dev)
hg = symm_mem.rendezvous(g, group)
hw = symm_mem.rendezvous(w, group)
say("handle api:", [a for a in dir(hg) if not a.startswith("__")])
peers = [p for p in range(world) if p != rank]
pg = {p: hg.get_buffer(p, (N,), torch.float32) for p in peers}
pw = {p: hw.get_buffer(p, (N,), torch.float32) for p in peers}
recv = torch.empty(half * (world - 1), device=dev)
out = torch.empty(N, device=dev)
plain = torch.empty(N, device=dev)
plain_w = torch.empty(N, device=dev)


def fill():
    g.fill_(rank + 1.0)
    plain.fill_(rank + 1.0)
    w.fill_(-1.0)
    w[lo:hi].fill_(rank + 10.0)
    plain_w.fill_(-1.0)
    plain_w[lo:hi].fill_(rank + 10.0)


def nccl_allreduce():
    dist.all_reduce(plain, op=dist.ReduceOp.AVG)


def nccl_rs_ag():
    dist.reduce_scatter_tensor(plain[lo:hi], plain, op=dist.ReduceOp.AVG)
    dist.all_gather_into_tensor(plain_w, plain_w[lo:hi])


def symm_two_shot():
    torch.ops.symm_mem.two_shot_all_reduce_(g, "sum", gname)


def symm_one_shot():
    torch.ops.symm_mem.one_shot_all_reduce_out(g, "sum", gname, out)


def ce_pull():
    """barrier; pull my slice of every peer's grads; add; barrier; (update); barrier; pull every peer's slice of weights."""
    hg.barrier(channel=0)
    for i, p in enumerate(peers):
        recv[i * half:(i + 1) * half].copy_(pg[p][lo:hi])
    g[lo:hi].add_(recv.view(world - 1, half).sum(0) if world > 2 else recv)
    hg.barrier(channel=1)
    hw.barrier(channel=2)
    for p in peers:
        w[p * half:(p + 1) * half].copy_(pw[p][p * half:(p + 1) * half])


def ce_push():
    """barrier; barrier; this rank's slice of the weights pushed into every peer's; barrier."""
    hg.barrier(channel=0)
    hg.barrier(channel=1)
    for p in peers:
        pw[p][lo:hi].copy_(w[lo:hi])
    hw.barrier(channel=2)


def ce_ag_only():
    hw.barrier(channel=2)
    for p in peers:
        w[p * half:(p + 1) * half].copy_(pw[p][p * half:(p + 1) * half])


def ce_copy_alone():
    for i, p in enumerate(peers):
        recv[i * half:(i + 1) * half].copy_(pg[p][lo:hi])


def barrier_only():
    hg.barrier(channel=0)


def check(name):
    torch.cuda.synchronize()
    s = sum(range(1, world + 1))
    if name == "nccl_allreduce":
        ok = torch.allclose(plain, torch.full_like(plain, s / world))
    elif name == "nccl_rs_ag":
        ok = torch.allclose(plain[lo:hi], torch.full_like(plain[lo:hi], s / world)) and all(
            torch.allclose(plain_w[p * half:(p + 1) * half], torch.full((half,), p + 10.0, device=dev)) for p in range(world))
    elif name in ("symm_two_shot",):
        ok = torch.allclose(g, torch.full_like(g, float(s)))
    elif name == "symm_one_shot":
        ok = torch.allclose(out, torch.full_like(out, float(s)))
    elif name == "ce_pull":
        ok = torch.allclose(g[lo:hi], torch.full_like(g[lo:hi], float(s))) and all(
            torch.allclose(w[p * half:(p + 1) * half], torch.full((half,), p + 10.0, device=dev)) for p in range(world))
    elif name == "ce_push":
        ok = all(torch.allclose(w[p * half:(p + 1) * half], torch.full((half,), p + 10.0, device=dev)) for p in range(world))
    else:
        ok = None
    return ok


def timed(fn, reps=30):
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        ts.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(x.elapsed_time(y) for x, y in ts)


results = {}
for name, fn in [("nccl_allreduce", nccl_allreduce), ("nccl_rs_ag", nccl_rs_ag), ("symm_two_shot", symm_two_shot),
                 ("symm_one_shot", symm_one_shot), ("ce_pull", ce_pull), ("ce_push", ce_push),
                 ("ce_ag_only", ce_ag_only), ("ce_copy_alone", ce_copy_alone), ("barrier_only", barrier_only)]:
    if time.time() - t0 > 100:  # within one device call, whatever the rest takes
        say("out of time before", name)
        break
    try:
        fill()
        dist.barrier()
        fn()
        ok = check(name)
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        eager = timed(fn)
        # graphed: 10 calls in one graph
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        dist.barrier()
        with torch.cuda.stream(s):
            with torch.cuda.graph(graph, stream=s):
                for _ in range(10):
                    fn()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        dist.barrier()
        fill()
        torch.cuda.synchronize()
        dist.barrier()
        graph.replay()
        ok_graph = check(name) if name not in ("symm_two_shot", "nccl_rs_ag", "ce_pull") else None
        dist.barrier()
        gt = timed(graph.replay, reps=10) / 10
        results[name] = (eager, gt, ok, ok_graph)
        say(f"{name:16s} eager {eager:.4f} ms  graphed {gt:.4f} ms  correct {ok} graph-correct {ok_graph}")
    except Exception as e:
        say(f"{name} FAILED: {type(e).__name__}: {str(e)[:300]}")
        if rank == 0:
            traceback.print_exc(limit=3)
        try:
            torch.cuda.synchronize()
            dist.barrier()
        except Exception:
            break
say(f"total {time.time() - t0:.1f} s")
dist.barrier()
dist.destroy_process_group()
