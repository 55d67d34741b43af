"""Several processes under torchrun: one rank per process, one MLflow run per experiment.

`torchrun --nproc_per_node=N -m trainer ...` starts N copies of the entry point, the *ranks*.
Each one:

- joins one process group (`launch`, called by the entry point before Hydra composes the
  config): gloo for CPU tensors, NCCL for CUDA ones. The ranks agree there on one launch time,
  so `${launch_time:}` in Hydra's output folders names one folder for all of them, and on the
  host threads each rank uses;
- takes its own device, `cuda:LOCAL_RANK`, made current before anything touches CUDA (a
  DataLoader's pin-memory thread adopts the device current when its iterator starts: without
  this, every rank would leave a context on GPU 0), and its own `Shard` of every epoch;
- trains a DistributedDataParallel model; only rank 0 opens the MLflow run;
- after the loop, never inside it, sends its meter's summary to rank 0 (`Ranks.combine`) over
  a gloo group of their own, whose collectives time out after `distributed.timeout_s`.

Errors end every rank, printed once:
- a bad value, or anything raised while the parts are built, ends the block on every rank
  (`Ranks.agree`: the ranks exchange their verdicts), and rank 0 prints it;
- a rank that fails later (an exception, a NaN loss) or is interrupted writes why into the
  process group's store (first writer wins) and exits; torchrun then stops the others. Each of
  them, whatever it was doing (blocked in a collective that lost a peer, or stopped by
  torchrun's SIGTERM), reads the store (`Ranks.guard`): rank 0 closes the run FAILED with the
  failing rank's message (KILLED after Ctrl-C) and keeps what it measured. No collective runs
  after a failure, so no rank waits for one that has left.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import signal
import socket
import sys
import threading
import time
from datetime import datetime, timedelta
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainer.errors import ConfigError, Interrupted, RunFailed
from trainer.launch import LAUNCH_TIME_ENV
from trainer.validate import available_cores
from trainer.loaders.host_copy import HostPeers
from trainer.loaders.order import Shard
from trainer.loop.engine import planned_steps
from trainer.loop.environment import gpu_links, gpu_numa_node
from trainer.loop.verify import combine_ranks
from trainer.loop.limits import allreduce_ms, h2d_burst, shared_rate

GROUP_TIMEOUT_S = 600  # backstop of the default group (DDP's all-reduce); faults normally end it sooner
FLAT_SYNCS = ("allreduce", "sharded")  # distributed.sync values whose exchange a CUDA graph can hold
PER_RANK = ("throughput_samples_per_s", "data_wait_fraction", "h2d_GBps", "compute_stream_span_fraction",
            "median_step_ms", "timed_wall_s", "host_rss_mb", "host_pss_mb", "run_host_pss_mb")
PACE_STEPS = 4  # distributed.exchange=copy: how many steps the host may queue ahead of the GPU (`PeerCopyShards.pace`)
PACE_POLL_S = 1e-4  # how often it looks while it waits: the GPU still has the steps between to run
STOPPED_KEY = "feedbench/stopped"  # set once any rank failed or was interrupted
DONE_KEY = "feedbench/done"  # set by rank 0 when it has finished everything
ARRIVED_KEY = "feedbench/finishing"  # how many ranks have reached `finish`
_launched_store = None  # the store, kept past the process group's end
_groups: Dict[float, object] = {}  # the ranks' own gloo groups, by timeout
_runs = 0  # runs this process has started: the store keys of each run are its own


def adopt_submitit_tasks() -> None:
    """In a job of Hydra's submitit launcher with several tasks (`hydra.launcher.tasks_per_node=N`,
    e.g. N GPUs of a Slurm node), the tasks are the ranks: set torchrun's variables (RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) from submitit's, and the rest runs as under torchrun."""
    if "WORLD_SIZE" in os.environ or not os.environ.get("SUBMITIT_EXECUTOR"):
        return
    import submitit

    if submitit.JobEnvironment().num_tasks > 1:
        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


def world() -> Tuple[int, int, int, int]:
    """(rank, world size, local rank, ranks on this host), as torchrun sets them; (0, 1, 0, 1) alone."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    return (int(os.environ.get("RANK", "0")), size, int(os.environ.get("LOCAL_RANK", "0")),
            int(os.environ.get("LOCAL_WORLD_SIZE", str(size))))


def is_main_process() -> bool:
    """Rank 0, or the only process: the one that records runs and prints errors."""
    return world()[0] == 0


def launch() -> None:
    """Under torchrun (WORLD_SIZE > 1): set this rank's host threads, join the process group and
    take rank 0's launch time. Does nothing in a single process, or when already done."""
    rank, size, _, local_size = world()
    if size <= 1 or dist.is_initialized():
        return
    set_threads(local_size)
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    global _launched_store
    store = _launched_store = _store()
    if rank == 0:
        store.set("feedbench/launch_time", datetime.now().isoformat())
        atexit.register(_main_done)  # registered first, so it runs last: after a sweep's own exit hooks
    os.environ[LAUNCH_TIME_ENV] = store.get("feedbench/launch_time").decode()  # waits for rank 0


def finish(failed: bool = False) -> None:
    """At the end of the process (the entry point's last step). After a failure or interrupt
    anywhere (recorded in the store), leave at once. Otherwise every rank waits here for all the
    others, then each leaves the process group, all at once: NCCL's shutdown may wait for its
    peers (`ncclCommAbort` is a collective call in some NCCL versions), so a rank that left it
    while another was still busy would wait for that one forever. Then the other ranks wait for
    rank 0 to be done, to its very exit (it may still close a sweep's parent run then): a rank
    that exits first, even with an error every rank shares, makes torchrun stop rank 0 half-way.
    The store, hosted by torchrun's agent, outlives the process group. `failed`: this process ends
    with an error the others may not share: it says so in the store and leaves at once (torchrun
    stops the others), instead of waiting for ranks that may be waiting for it."""
    store = _launched_store
    if store is None or not dist.is_initialized():
        return
    size = world()[1]
    try:
        if failed:
            store.set(STOPPED_KEY, "1")
        store.add(ARRIVED_KEY, 1)
        while store.add(ARRIVED_KEY, 0) < size and not store.check([STOPPED_KEY]):
            time.sleep(0.05)
        if store.check([STOPPED_KEY]):
            # torchrun's SIGTERM is on its way: it must not cut short what is left (a sweep's
            # parent run is closed at exit), and this process is ending anyway.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            return
    except Exception:  # the store went with torchrun's agent: nothing left to wait for
        return
    try:
        dist.destroy_process_group()
    except Exception as e:  # the others go on waiting for rank 0 to be done, not for this
        print(f"warning: leaving the process group failed: {' '.join(str(e).split())[:200]}", file=sys.stderr)
    try:
        while not is_main_process() and not store.check([DONE_KEY]) and not store.check([STOPPED_KEY]):
            time.sleep(0.1)
    except Exception:
        pass


def _main_done() -> None:
    try:
        _launched_store.set(DONE_KEY, "1")
    except Exception:
        pass


def quiet_other_ranks() -> None:
    """Under torchrun only rank 0 speaks: the other ranks' Python output (Hydra's log lines, its
    report of a failed job, a progress bar) would repeat rank 0's. Their errors reach rank 0
    through the store. HYDRA_FULL_ERROR=1 keeps every rank's output, with full traces."""
    if world()[1] > 1 and not is_main_process() and os.environ.get("HYDRA_FULL_ERROR") != "1":
        sys.stdout = sys.stderr = open(os.devnull, "w")


def set_threads(ranks_on_host: int) -> None:
    """torchrun sets OMP_NUM_THREADS=1 for its workers unless it was set already. One intra-op
    thread starves a rank that trains or collates on the CPU, so when torchrun chose it, each
    rank gets its share of the cores this host gives the job; a value you set is kept."""
    if "OMP_NUM_THREADS" not in _parent_environment():
        cores = available_cores()
        torch.set_num_threads(max(1, cores // max(1, ranks_on_host)))


def _parent_environment() -> Dict[str, str]:
    """The launching torchrun's environment (Linux); unreadable: assume the value was set by hand."""
    try:
        raw = open(f"/proc/{os.getppid()}/environ", "rb").read()
    except OSError:
        return {"OMP_NUM_THREADS": "?"}
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw.split(b"\0") if item)


def _describe(error: BaseException) -> str:
    """An error on one line; feedbench's own errors need no type name (their message says it all)."""
    text = " ".join(str(error).split())
    return text if isinstance(error, (ConfigError, RunFailed)) else f"{type(error).__name__}: {text}"


def _store():
    # The process group's key-value store, hosted by torchrun's agent: it outlives any rank.
    return dist.distributed_c10d._get_default_store()


def device_id(device: torch.device) -> str:
    """What two jobs share when they run on the same device: host and GPU (by UUID, whatever
    CUDA_VISIBLE_DEVICES numbers it), or host and `cpu`."""
    host = socket.gethostname()
    if device.type != "cuda":
        return f"{host}:cpu"
    props = torch.cuda.get_device_properties(device)
    return f"{host}:GPU-{getattr(props, 'uuid', device.index)}"


class PeerStopped(RunFailed):
    """Another rank failed: this one stops too (the message names the rank and its error)."""


class _LossForward(nn.Module):
    """The model's `loss(x, y)` as `forward`: DDP averages gradients only for what runs through it."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x, y):
        return self.model.loss(x, y)


ALIGN_BYTES = 128  # where each parameter starts in a flat buffer: a multiple of this many bytes


def flat_layout(numels: List[int], element_size: int, pad_to: int = 1) -> Tuple[List[int], int]:
    """Where each of these tensors starts in one flat buffer, and the buffer's length: each start
    aligned to `ALIGN_BYTES`, the length a multiple of `pad_to` aligned slices (`pad_to`: the
    ranks, each updating one slice). PyTorch's vectorised kernels load 16 bytes at a time only from
    aligned addresses, and NCCL likewise: with the views packed end to end, the graphed sharded
    step of the reference autoencoder took 0.80 ms on two H200s (Adam's update 0.14 of it, the
    all-gather 0.12), aligned 0.75 (0.12 and 0.08)."""
    step = max(1, ALIGN_BYTES // element_size)
    offsets, at = [], 0
    for n in numels:
        offsets.append(at)
        at += -(-n // step) * step
    return offsets, -(-at // (step * pad_to)) * step * pad_to


def _broadcast_initial(model: nn.Module) -> None:
    """Rank 0's weights and buffers to every rank, as DDP does when it wraps a model."""
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t, src=0)


class FlatGradients:
    """`distributed.sync=allreduce`: every gradient a view of one flat buffer (one per dtype),
    zeroed before backward, and one all-reduce of it after backward averages all of them.

    DDP hooks every parameter, copies each gradient into a bucket as backward produces it and
    all-reduces each bucket while backward still runs: on a large model that overlap pays. On a
    small, launch-bound step its hooks, copies and Python forward are host work at every step.
    Here the host issues one zeroing kernel before backward (which then adds into the views) and
    one collective after it, and a CUDA graph can hold both (`engine.cuda_graph=true`).

    What differs from DDP: no overlap with backward; an unused parameter's gradient is zero, never
    None (an optimizer updates it as such); buffers (BatchNorm's statistics) stay each rank's own,
    as DDP's with `broadcast_buffers=False`. The weights start equal: rank 0's, broadcast here, as
    DDP does when it wraps a model.

    The step calls `zero()` before backward, `average()` after it, the optimizer's step over
    `updated()`, then `share()` (nothing here: every rank updated every weight)."""

    sync = "allreduce"

    def __init__(self, model: nn.Module, world_size: int, pad_to: int = 1):
        """`pad_to`: each flat buffer cut in this many equal aligned slices (`flat_layout`; the gaps
        between the views and the tail are zeros that no view reads)."""
        self.world_size = world_size
        _broadcast_initial(model)
        by_dtype: Dict[torch.dtype, List[nn.Parameter]] = {}
        for p in model.parameters():
            if p.requires_grad:
                by_dtype.setdefault(p.dtype, []).append(p)
        self.groups: List[List[nn.Parameter]] = list(by_dtype.values())  # the parameters of each flat buffer, in order
        self.offsets: List[List[int]] = []  # where each parameter starts in its flat buffer
        self.flats: List[torch.Tensor] = []
        self.views: List[Tuple[nn.Parameter, torch.Tensor]] = []
        for params in self.groups:
            offsets, numel = flat_layout([p.numel() for p in params], params[0].element_size(), pad_to)
            flat = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
            for p, at in zip(params, offsets):
                p.grad = flat[at:at + p.numel()].view_as(p)
                self.views.append((p, p.grad))
            self.offsets.append(offsets)
            self.flats.append(flat)
        # NCCL averages in the collective; gloo has no AVG: a sum, then a division
        self.in_collective = all(f.is_cuda for f in self.flats)
        self.checked = False

    def zero(self) -> None:
        """Before backward, in place of `optimizer.zero_grad()` (which would drop the views)."""
        for flat in self.flats:
            flat.zero_()

    def updated(self) -> List[torch.Tensor]:
        """What this rank's optimizer updates: every parameter."""
        return [p for params in self.groups for p in params]

    def check_views(self) -> None:
        """Every gradient still a view of its flat buffer: one that was replaced (`optimizer.zero_grad()`
        sets it to None, and backward makes a new one) is this rank's own, averaged with no other."""
        if any(p.grad is not view for p, view in self.views):
            raise RuntimeError(f"a gradient was replaced after distributed.sync={self.sync} made it a view of its flat "
                               "buffer (optimizer.zero_grad() sets it to None): zero it with FlatGradients.zero()")

    def _check_once(self) -> None:
        if not self.checked:  # at the first step, and after the loop (`Ranks.exchange`): not a cost per step
            self.check_views()
            self.checked = True

    def average(self) -> None:
        """After backward: the mean of every rank's gradients, in place."""
        self._check_once()
        for flat in self.flats:
            if self.in_collective:
                dist.all_reduce(flat, op=dist.ReduceOp.AVG)
            else:
                dist.all_reduce(flat)
                flat.div_(self.world_size)

    def share(self) -> None:
        """After the optimizer's step: every rank holds every updated weight already."""

    def settle(self) -> None:
        """After the last step: nothing left in flight."""

    def buckets(self) -> List[int]:
        """The bytes each step exchanges, per flat buffer (an all-reduce's, or a reduce-scatter's
        and an all-gather's: the same bytes on the wire as a ring all-reduce of them)."""
        return [f.numel() * f.element_size() for f in self.flats]


# A flat tensor's reduce-scatter and all-gather: torch >= 2.14 names them `*_single` and warns at the old names.
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ShardedGradients(FlatGradients):
    """`distributed.sync=sharded`: the flat gradients of `allreduce`, the weights likewise views of
    one flat buffer, and each rank updates only its 1/N slice of both.

    After backward a reduce-scatter leaves each rank the mean of its slice of the gradients; its
    optimizer updates that slice of the weights (and holds the optimizer's state for it alone);
    an all-gather then gives every rank all the updated weights. The wire carries what one
    all-reduce carries (a ring all-reduce is a reduce-scatter then an all-gather), but each rank's
    optimizer does 1/N of the update and keeps 1/N of its state: the first stage of ZeRO
    (Rajbhandari et al., 2020), over flat slices where PyTorch's ZeroRedundancyOptimizer deals
    whole parameters to the ranks. Adam, AdamW and SGD update each element on its own, so the
    weights are those of `allreduce`. A slice may cut a parameter in two: each part is then
    updated by its own rank."""

    sync = "sharded"

    def __init__(self, model: nn.Module, world_size: int, rank: int):
        super().__init__(model, world_size, pad_to=world_size)
        self.weights: List[torch.Tensor] = []  # the flat weights, one per flat gradient buffer
        self.shards: List[torch.Tensor] = []  # this rank's slice of each: what its optimizer updates
        self.addresses: List[Tuple[nn.Parameter, int]] = []
        with torch.no_grad():
            for params, offsets, flat in zip(self.groups, self.offsets, self.flats):
                weights = torch.zeros_like(flat)
                for p, at in zip(params, offsets):
                    weights[at:at + p.numel()].copy_(p.reshape(-1))
                    # the parameter stays the module's (hooks, the optimizer, a graph keep it), its storage the flat buffer's
                    p.data = weights[at:at + p.numel()].view_as(p)
                    self.addresses.append((p, p.data_ptr()))
                size = flat.numel() // world_size
                shard = weights[rank * size:(rank + 1) * size]
                shard.grad = flat[rank * size:(rank + 1) * size]
                self.weights.append(weights)
                self.shards.append(shard)
        self.shard_grads = [shard.grad for shard in self.shards]

    def updated(self) -> List[torch.Tensor]:
        """This rank's slice of each flat buffer of weights (its `.grad` the slice of the gradients)."""
        return self.shards

    def check_views(self) -> None:
        super().check_views()
        if any(shard.grad is not grad for shard, grad in zip(self.shards, self.shard_grads)):
            # the optimizer would skip a slice without a gradient, and the all-gather keep the ranks equal: no error, no training
            raise RuntimeError("the gradient of this rank's slice was replaced after distributed.sync=sharded made it a view "
                               "of its flat buffer (optimizer.zero_grad() sets it to None): zero it with FlatGradients.zero()")
        if any(p.data_ptr() != address for p, address in self.addresses):
            raise RuntimeError("a parameter's storage was replaced after distributed.sync=sharded made it a view of its "
                               "flat buffer (an assignment to `.data`): its updates would not reach the other ranks")

    def average(self) -> None:
        """After backward: the mean of every rank's gradients in this rank's slice (the rest of the
        buffer keeps this rank's own sums, which nothing reads)."""
        self._check_once()
        for flat, shard in zip(self.flats, self.shards):
            # in place: NCCL's output at input + rank x count, its documented in-place form
            if self.in_collective:
                reduce_scatter_flat(shard.grad, flat, op=dist.ReduceOp.AVG)
            else:
                reduce_scatter_flat(shard.grad, flat)
                shard.grad.div_(self.world_size)

    def share(self) -> None:
        """After the optimizer's step: every rank's updated slice to every rank (in place)."""
        for weights, shard in zip(self.weights, self.shards):
            all_gather_flat(weights, shard)


def bucket_waits(model: nn.Module, bucket_of: Dict[int, int], fired: Optional[set] = None) -> Tuple[Dict[int, List[int]], List[int]]:
    """Which module waits, before its forward, for which buckets of weights (`PeerCopyShards`): id(module)
    -> bucket numbers, and the buckets waited for at the start of each step instead. `bucket_of`:
    id(parameter) -> its bucket. Without `fired`, each module waits for the buckets of its own
    parameters. With `fired` (the ids of the modules whose forward ran in a step), a module whose
    forward did not run hands its buckets to the nearest enclosing module whose forward did (some
    modules read parameters of modules that never run: nn.MultiheadAttention its out_proj's,
    torchvision's Swin its qkv's and proj's); with none (parameters read in `loss` itself), they
    are waited for at the start of each step."""
    parents: Dict[int, Optional[nn.Module]] = {id(model): None}
    waits: Dict[int, set] = {}
    at_start: set = set()
    for module in model.modules():
        for child in module.children():
            parents.setdefault(id(child), module)
    for module in model.modules():
        mine = {bucket_of[id(p)] for p in module._parameters.values() if p is not None and id(p) in bucket_of}
        if not mine:
            continue
        waiter: Optional[nn.Module] = module
        while fired is not None and waiter is not None and id(waiter) not in fired:
            waiter = parents.get(id(waiter))
        if waiter is None:
            at_start |= mine
        else:
            waits.setdefault(id(waiter), set()).update(mine)
    return {k: sorted(v) for k, v in waits.items()}, sorted(at_start)


class PeerCopyShards:
    """`distributed.sync=sharded` with `distributed.exchange=copy`: the same slices, updates and
    results as `ShardedGradients`, the bytes moved by the GPUs' copy engines instead of NCCL's
    kernels, and both exchanges run beside the step's own work.

    The flat gradients and weights live in symmetric memory (PyTorch's `symm_mem`): every rank
    maps every other rank's buffers into its own address space (one host: NVLink or PCIe peer
    access). In backward's order the parameters fill buckets (DDP's rule: a bucket closes once it
    holds `bucket_cap_mb`), each cut in N aligned slices, one a rank. A side stream does all the
    exchanging, its steps met by the ranks at device-side barriers (kernels, which a CUDA graph
    holds):
    - once backward has added a bucket's last gradient (a hook) and every earlier bucket has
      started (the ranks meet at the buckets in one order), the side stream meets the other
      ranks, copies this rank's slice of that bucket from every peer and averages it into its
      own, while backward goes on with the layers before;
    - after backward the optimizer updates this rank's slices;
    - at the start of the next step (`zero`), the side stream meets the ranks again and copies
      every peer's updated slices, bucket after bucket in the order the forward pass needs them,
      while the step zeroes its gradients and runs the first layers' forward: each module's
      forward first waits for the buckets holding its parameters (a forward pre-hook). The last
      step's update reaches every rank with `settle()`, after the loop.
    A copy engine moves bytes without the SMs that NCCL's kernels hold, so what runs beside the
    step takes little from it (NCCL's reduce-scatter and all-gather run beside the step made the
    reference step slower, `docs/benchmark.md`).

    Who touches what, when: a peer reads this rank's slice of a bucket's gradients between their
    meeting at that bucket and their next meeting at the start of a step, and this rank zeroes its
    gradients only after that meeting. A peer's updated slice is read after that meeting, and the
    peer changes it only in its next update, after the next step's bucket meetings, which this
    rank reaches after its copies. A module whose forward never runs has its parameters waited
    for by the nearest enclosing module whose forward does (`bucket_waits`); a parameter read in
    the forward of a module that neither holds nor encloses it, before any that does has run its
    forward in that step, would read its previous value (no model here does that). Between steps
    the peers' slices are one update behind until the next step's start, or `settle()`."""

    sync = "sharded"

    def __init__(self, model: nn.Module, world_size: int, rank: int, group, bucket_cap_mb: float, timeout_s: float):
        import torch.distributed._symmetric_memory as symm_mem

        _broadcast_initial(model)
        self.world_size, self.rank = world_size, rank
        self.timeout_ms = int(timeout_s * 1000)
        device = next(model.parameters()).device
        self.side = torch.cuda.Stream(device)  # the exchanges, beside the step's own work
        params = [p for p in model.parameters() if p.requires_grad]
        by_dtype: Dict[torch.dtype, List[nn.Parameter]] = {}
        for p in reversed(params):  # backward's order, about: the last layers' gradients come first
            by_dtype.setdefault(p.dtype, []).append(p)
        self.views: List[Tuple[nn.Parameter, torch.Tensor]] = []
        self.addresses: List[Tuple[nn.Parameter, int]] = []
        self.flats: List[torch.Tensor] = []  # gradients, one per dtype (what `zero` clears)
        self.bucket_list: List[dict] = []
        self.handles = []
        self.grad_hooks = []  # removed by `settle()`, as the forward pre-hooks
        self.releasing: Optional[threading.Thread] = None  # `release_barriers`, once a rank has failed
        self.paces = [torch.cuda.Event() for _ in range(PACE_STEPS)]  # `pace`: one a step, in turn
        self.pace_at = 0
        cap = bucket_cap_mb * 2**20
        for dtype, group_params in by_dtype.items():
            size = torch.empty((), dtype=dtype).element_size()
            step = max(1, ALIGN_BYTES // size)
            plan, bucket, nbytes = [], [], 0
            # A bucket is closed once it holds `cap` bytes (DDP's rule). It is ready when backward has
            # reached all its parameters, in practice its last (the closest to the input): a bucket
            # that ran on into the first layer's bias would wait for the first layer's backward.
            for p in group_params:
                bucket.append(p)
                nbytes += p.numel() * size
                if nbytes >= cap:
                    plan.append(bucket)
                    bucket, nbytes = [], 0
            plan += [bucket] if bucket else []
            layouts, total = [], 0
            for bucket in plan:
                offsets, numel = flat_layout([p.numel() for p in bucket], size, world_size)
                layouts.append((total, offsets, numel))
                total += numel
            grads = symm_mem.empty(total, dtype=dtype, device=device).zero_()
            weights = symm_mem.empty(total, dtype=dtype, device=device).zero_()
            grads_handle, weights_handle = symm_mem.rendezvous(grads, group), symm_mem.rendezvous(weights, group)
            self.handles += [grads_handle, weights_handle]
            peers = [r for r in range(world_size) if r != rank]
            peer_grads = {r: grads_handle.get_buffer(r, (total,), dtype) for r in peers}
            peer_weights = {r: weights_handle.get_buffer(r, (total,), dtype) for r in peers}
            with torch.no_grad():
                for bucket, (start, offsets, numel) in zip(plan, layouts):
                    for p, at in zip(bucket, offsets):
                        at += start
                        weights[at:at + p.numel()].copy_(p.reshape(-1))
                        p.data = weights[at:at + p.numel()].view_as(p)
                        p.grad = grads[at:at + p.numel()].view_as(p)
                        self.views.append((p, p.grad))
                        self.addresses.append((p, p.data_ptr()))
                    cut = numel // world_size
                    mine = slice(start + rank * cut, start + (rank + 1) * cut)
                    shard = weights[mine]
                    shard.grad = grads[mine]
                    b = {"params": bucket, "shard": shard, "grad": shard.grad, "handle": grads_handle,
                         "theirs": [peer_grads[r][mine] for r in peers],
                         "recv": torch.empty((len(peers), cut), dtype=dtype, device=device),
                         "gather": [(weights[start + r * cut:start + (r + 1) * cut],
                                     peer_weights[r][start + r * cut:start + (r + 1) * cut]) for r in peers],
                         "ready": torch.cuda.Event(), "done": torch.cuda.Event(), "gathered": torch.cuda.Event(),
                         "pending": len(bucket), "seen": set()}
                    self.bucket_list.append(b)
                    self.grad_hooks += [p.register_post_accumulate_grad_hook(lambda p, b=b: self._added(p, b))
                                        for p in bucket]
            self.flats.append(grads)
        self.weights_handle = self.handles[1]
        self.shards = [b["shard"] for b in self.bucket_list]
        self.checked = False
        self.updated_event, self.met = torch.cuda.Event(), torch.cuda.Event()
        self.next_bucket = 0  # the first bucket not started yet this step
        # Each module that holds parameters waits, before its forward, for the buckets holding them
        # (a shared parameter: every module holding it); after the first step, where its forward
        # did not run, its nearest enclosing module that ran waits instead (`bucket_waits`). Every
        # module is hooked for that first step, to see whose forward runs.
        self.model, self.bucket_of = model, {id(p): n for n, b in enumerate(self.bucket_list) for p in b["params"]}
        self.waits, _ = bucket_waits(model, self.bucket_of)  # id(module) -> the buckets it waits for before its forward
        self.fired: set = set()  # the modules whose forward ran in the first step
        self.hooks = {id(m): m.register_forward_pre_hook(self._before_forward) for m in model.modules()}
        self.waited_at_start: List[int] = []
        # the forward pass needs the first layers first: gathered in the reverse of backward's order
        self.gather_order = list(reversed(self.bucket_list))

    def _added(self, p: nn.Parameter, b: dict) -> None:
        if id(p) in b["seen"]:
            # DDP refuses it too ("marked ready twice"): the bucket would be read before its sum is whole
            raise RuntimeError("a parameter's gradient was accumulated twice in one backward (a checkpointed block that "
                               "also uses it outside?), and distributed.exchange=copy exchanges each bucket once its "
                               "gradients are complete: set distributed.exchange=nccl")
        b["seen"].add(id(p))
        b["pending"] -= 1
        if b["pending"] == 0:
            b["ready"].record()  # on the stream that added its last gradient
            self._start_ready()

    def _start_ready(self) -> None:
        """Start the buckets whose gradients are complete, in bucket order, never one before an
        earlier one: the ranks meet at each bucket's barrier in the order they start them, so a
        rank whose backward finished its buckets in another order (a parameter unused on one rank
        only) would otherwise read a peer's bucket at another bucket's meeting, before it is ready."""
        while self.next_bucket < len(self.bucket_list) and self.bucket_list[self.next_bucket]["pending"] == 0:
            self._reduce(self.bucket_list[self.next_bucket])
            self.next_bucket += 1

    def _reduce(self, b: dict) -> None:
        """This rank's slice of bucket `b`, averaged over the ranks, on the side stream (after `ready`)."""
        self.side.wait_event(b["ready"])
        with torch.cuda.stream(self.side):
            # channel 1: the buckets' barriers follow each other on this one stream; channel 0 is the weights'
            b["handle"].barrier(channel=1, timeout_ms=self.timeout_ms)
            for recv, theirs in zip(b["recv"], b["theirs"]):
                recv.copy_(theirs)  # a copy engine reads the peer's memory
            b["grad"].add_(b["recv"].sum(0) if len(b["recv"]) > 1 else b["recv"][0]).div_(self.world_size)
            b["done"].record()

    def _gather(self) -> None:
        """On the side stream, after this rank's last update: meet the ranks, then copy every
        peer's updated slices, bucket by bucket (`gathered` each)."""
        self.updated_event.record()
        self.side.wait_event(self.updated_event)
        with torch.cuda.stream(self.side):
            self.weights_handle.barrier(channel=0, timeout_ms=self.timeout_ms)
            self.met.record()
            for b in self.gather_order:
                for mine, theirs in b["gather"]:
                    mine.copy_(theirs)  # a copy engine reads the peer's memory
                b["gathered"].record()

    def _before_forward(self, module: nn.Module, _args) -> None:
        if not self.checked:
            self.fired.add(id(module))
        mine = self.waits.get(id(module))
        if mine:
            self._wait(mine)

    def _plan_waits(self) -> None:
        """After the first step's forward: who waits for which bucket from now on (`bucket_waits`);
        hooks that wait for nothing go."""
        self.waits, self.waited_at_start = bucket_waits(self.model, self.bucket_of, self.fired)
        for module_id, hook in self.hooks.items():
            if not self.waits.get(module_id):
                hook.remove()

    def _wait(self, buckets: List[int]) -> None:
        stream = torch.cuda.current_stream()
        for n in buckets:
            stream.wait_event(self.bucket_list[n]["gathered"])

    def pace(self) -> None:
        """Once a step (from `zero` when eager; after each replay of a graphed step): the host
        waits until the GPU has finished the step `PACE_STEPS` back. A step of this exchange waits
        on the GPU for the peers (its barriers): were a peer to die, the host would otherwise run
        on until the GPU's queue is full, and `release_barriers` would have all of that to drain
        before the run can close. Polling an event with short sleeps lets a signal handler run
        between polls (inside a blocking CUDA call it waits for the call's end), and leaves the CPU
        free (a blocking wait on the event spins a core, which the run's host CPU time would
        count). A step bound by the host never waits here: the GPU is behind it by less than a
        step."""
        event = self.paces[self.pace_at]
        while not event.query():  # True until first recorded
            time.sleep(PACE_POLL_S)
        event.record()
        self.pace_at = (self.pace_at + 1) % PACE_STEPS

    def zero(self) -> None:
        """At the start of a step: the peers' updated slices of the weights on their way (the
        side stream), and the gradients zeroed once every peer has met here, having finished
        reading this rank's gradients of the last step."""
        if not torch.cuda.is_current_stream_capturing():
            self.pace()  # a graphed step paces after each replay instead
        self._gather()
        stream = torch.cuda.current_stream()
        stream.wait_event(self.met)
        for flat in self.flats:
            flat.zero_()
        for n in self.waited_at_start:
            stream.wait_event(self.bucket_list[n]["gathered"])
        for b in self.bucket_list:
            b["pending"] = len(b["params"])
            b["seen"].clear()
        self.next_bucket = 0

    def updated(self) -> List[torch.Tensor]:
        """This rank's slice of each bucket of weights (its `.grad` the slice of the gradients)."""
        return self.shards

    def check_views(self) -> None:
        if any(p.grad is not view for p, view in self.views) or any(b["shard"].grad is not b["grad"] for b in self.bucket_list):
            raise RuntimeError("a gradient was replaced after distributed.sync=sharded made it a view of its flat "
                               "buffer (optimizer.zero_grad() sets it to None): zero it with the ranks' zero()")
        if any(p.data_ptr() != address for p, address in self.addresses):
            raise RuntimeError("a parameter's storage was replaced after distributed.sync=sharded made it a view of its "
                               "flat buffer (an assignment to `.data`): its updates would not reach the other ranks")

    def average(self) -> None:
        """After backward: every bucket's reduce-scatter started (one whose parameters backward did
        not reach, now), and the step's stream waits for all of them."""
        if not self.checked:  # the first step (eager: a graph is captured later)
            self.check_views()
            self.checked = True
            self._plan_waits()
            self._wait(self.waited_at_start)
        for b in self.bucket_list[self.next_bucket:]:
            if b["pending"] != 0:  # not reached by backward on this rank: started now, in order
                b["pending"] = 0
                b["ready"].record()
        self._start_ready()
        stream = torch.cuda.current_stream()
        for b in self.bucket_list:
            stream.wait_event(b["done"])

    def share(self) -> None:
        """After the optimizer's step: nothing yet (the next step's `zero` gathers the update)."""

    def settle(self) -> None:
        """After the last step: every peer's last update copied here, as the step's stream goes on,
        and the model the user's again (`unhook`)."""
        self._gather()
        self._wait(list(range(len(self.bucket_list))))
        self.unhook()

    def release_barriers(self, for_s: float) -> None:
        """Once a rank has failed (this one, or another: then from the peer watch's thread), in a
        thread of its own (once): every barrier this rank waits in, or will reach, passes."""
        if self.releasing is None:
            self.releasing = threading.Thread(target=self._release, args=(for_s,), daemon=True,
                                              name="feedbench-copy-release")
            self.releasing.start()

    def _release(self, for_s: float) -> None:
        """`release_barriers`' loop. A barrier kernel spins on the GPU until each peer has marked
        this rank's signal pad, and neither aborting the process group nor a signal reaches it:
        the queued work would stay stuck behind it, and the main thread with it (in a launch, or
        a read of the GPU; the failed rank's too, reading its timings, when its peers stopped
        short of its last barrier), until the barrier's own timeout traps the kernel. So the
        peers' marks are written here, and this rank's own marks on their pads cleared, again and
        again for `for_s` seconds, by the GPU's front end (a stream write, no kernel), on a stream
        of its own. The copies after each barrier then read whatever the peer left: the run is
        ending FAILED, and nothing from those steps is kept as a result."""
        from torch._C._distributed_c10d import _SymmetricMemory

        peers = [r for r in range(self.world_size) if r != self.rank]
        n, deadline = self.world_size, time.monotonic() + for_s
        try:
            with torch.cuda.device(self.side.device):
                stream = torch.cuda.Stream()  # the step's streams are stuck behind the barriers
                pads = [(h.get_signal_pad(self.rank, dtype=torch.uint32),
                         {p: h.get_signal_pad(p, dtype=torch.uint32) for p in peers}) for h in self.handles]
                with torch.cuda.stream(stream):
                    while time.monotonic() < deadline:
                        for mine, theirs in pads:
                            for channel in (0, 1):  # the weights' barriers, and the buckets'
                                for p in peers:
                                    _SymmetricMemory.stream_write_value32(mine, channel * n + p, 1)  # p arrived
                                    _SymmetricMemory.stream_write_value32(theirs[p], channel * n + self.rank, 0)  # room for ours
                        stream.synchronize()
                        time.sleep(0.002)
        except Exception as e:  # the barriers' own timeout (distributed.timeout_s) ends the wait instead
            print(f"warning: could not release the copy exchange's barriers: {' '.join(str(e).split())[:200]}",
                  file=sys.stderr)

    def unhook(self) -> None:
        """Our hooks off the model: a backward after the run (the user's own fine-tuning, an
        evaluation with gradients) would otherwise start a bucket's barrier that no peer meets."""
        for hook in [*self.hooks.values(), *self.grad_hooks]:
            hook.remove()
        self.hooks, self.grad_hooks = {}, []

    def buckets(self) -> List[int]:
        """The bytes each step exchanges, per dtype (as `FlatGradients.buckets`)."""
        return [f.numel() * f.element_size() for f in self.flats]


class DistributedModel(DistributedDataParallel):
    """A DDP-wrapped model with the `loss(x, y)` the step calls."""

    def loss(self, x, y):
        return self(x, y)


def steps_per_rank(batches_per_rank: List[int], engine) -> List[int]:
    """The steps each rank's loop will take (`planned_steps`), from its batches per epoch; a rank
    without a batch stops at once."""
    return [planned_steps(engine, range(b)) if b else 0 for b in batches_per_rank]


def ddp_buckets(model: DistributedDataParallel) -> List[int]:
    """The bytes of each bucket DDP all-reduces a step: the buckets it rebuilt after its first
    step in the order backward produced the gradients (`rebuilt_bucket_sizes` of its own record;
    until then, and on a rank that never ran a forward, its first single bucket)."""
    try:
        info = model._get_ddp_logging_data()
        sizes = str(info.get("rebuilt_bucket_sizes") or info.get("bucket_sizes") or "")
        buckets = [int(b) for b in sizes.replace(" ", "").split(",") if b]
    except Exception:  # a private record: its absence costs only the split
        buckets = []
    return buckets or [sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)]


class Ranks:
    """This process's place among the ranks of one run; a world of one without torchrun, where
    every method does what a single process needs (nothing, mostly)."""

    def __init__(self, cfg):
        """`cfg`: the `distributed` config section."""
        adopt_submitit_tasks()
        self.rank, self.world_size, self.local_rank, self.local_world_size = world()
        self.shard = Shard(self.rank, self.world_size)
        self.ddp = {"bucket_cap_mb": cfg.bucket_cap_mb, "gradient_as_bucket_view": cfg.gradient_as_bucket_view}
        self.sync = cfg.sync
        self.exchange_with = cfg.exchange  # distributed.exchange: nccl, or copy (sharded's slices by the copy engines)
        self.timeout_s = cfg.timeout_s
        self.grads: Optional[FlatGradients] = None  # distributed.sync=allreduce or sharded: what the step zeroes and averages
        self.backend = "none"
        self.device_: Optional[torch.device] = None
        self.group = self.store = self._watch = None
        self.joined = False  # trained under DDP's join() (`uneven`)
        if not self.enabled:
            return
        launch()
        global _runs
        _runs += 1
        self.key = f"feedbench/run{_runs}/stop"
        self.store = _store()
        peers = HostPeers(self.local_rank, self.local_world_size, self.store,
                          f"feedbench/run{_runs}/{os.environ.get('GROUP_RANK', '0')}-{socket.gethostname()}", cfg.timeout_s)
        self.shard = Shard(self.rank, self.world_size, peers)
        if cfg.timeout_s not in _groups:  # created by every rank alike, once per timeout
            _groups[cfg.timeout_s] = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.timeout_s))
        self.group = _groups[cfg.timeout_s]

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # -- before the run ------------------------------------------------------------------------
    def device(self, device: torch.device) -> torch.device:
        """This rank's device: `cuda:LOCAL_RANK`, made current now, before any loader exists."""
        if self.enabled and device.type == "cuda":
            count = torch.cuda.device_count()
            if self.local_rank >= count:
                raise ConfigError(f"torchrun started {self.local_world_size} processes on this host but it has {count} "
                                  f"GPU(s): set --nproc_per_node={count} (or engine.device=cpu)")
            device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(device)
        if self.enabled:
            self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.device_ = device
        return device

    def validate(self, cfg) -> None:
        if not self.enabled:
            return
        if cfg.engine.cuda_graph and self.sync not in FLAT_SYNCS:
            # DDP's per-parameter hooks and bucket bookkeeping run on the host at every step; one
            # collective of a flat buffer is a kernel a graph can hold.
            raise ConfigError(f"engine.cuda_graph=true with several ranks (got {self.world_size}) needs the gradients averaged "
                              f"inside the graph: set distributed.sync=allreduce (or engine.cuda_graph=false)")
        if self.sync in FLAT_SYNCS and cfg.engine.loop != "feedbench":
            raise ConfigError(f"distributed.sync={self.sync} is the feedbench loop's (engine.loop={cfg.engine.loop} averages "
                              f"the gradients its own way): set distributed.sync=ddp, or engine.loop=feedbench")
        if self.exchange_with == "copy":
            if self.sync != "sharded":
                raise ConfigError(f"distributed.exchange=copy moves the slices of distributed.sync=sharded (got "
                                  f"distributed.sync={self.sync}): set distributed.sync=sharded, or distributed.exchange=nccl")
            if self.device_ is None or self.device_.type != "cuda":
                raise ConfigError("distributed.exchange=copy maps each GPU's buffers into the other ranks' (CUDA peer "
                                  "access): set engine.device=cuda, or distributed.exchange=nccl")
            if cfg.engine.compile != "off":
                # its pre-forward and gradient hooks order the step against the exchange's stream; a
                # compiled module's graph has not been checked to keep them
                raise ConfigError(f"distributed.exchange=copy cannot be used with engine.compile={cfg.engine.compile}: "
                                  "set engine.compile=off, or distributed.exchange=nccl")
            if self.local_world_size != self.world_size:
                raise ConfigError(f"distributed.exchange=copy needs every rank on one host (got {self.world_size} ranks, "
                                  f"{self.local_world_size} on this host): set distributed.exchange=nccl")
        if self.sync == "sharded" and cfg.engine.precision == "fp16":
            # The gradient scaler looks for an overflow in the gradients its optimizer holds: here
            # one rank's slice, so the ranks would disagree on skipping a step and on the scale.
            raise ConfigError("distributed.sync=sharded cannot be used with engine.precision=fp16 (each rank's gradient "
                              "scaler would see only its own slice of the gradients): set engine.precision=bf16, or "
                              "distributed.sync=allreduce")

    def check_plan(self, batches_per_rank: List[int], engine, graphed: bool, short_batches: bool) -> None:
        """`distributed.sync=allreduce` or `sharded` (after `wrap`, with gradients to average) has no stand-in for
        a rank that has finished (DDP's `join()`): every rank must take the same number of steps,
        or the others would wait in their all-reduce for it. Graphed, every batch must be full: a
        short one runs eagerly on its rank alone, and NCCL needs every rank's collective captured
        alike (a replayed all-reduce against an eager one is not promised to meet)."""
        if not self.enabled or self.grads is None:
            return
        steps = steps_per_rank(batches_per_rank, engine)
        if len(set(steps)) > 1:
            raise ConfigError(f"distributed.sync={self.sync} needs every rank to take the same number of steps (these shards "
                              f"give {', '.join(map(str, steps))}): set engine.max_steps, loader.drop_last=true, or "
                              f"distributed.sync=ddp (its join() stands in for a rank that has finished)")
        if graphed and short_batches:
            raise ConfigError(f"engine.cuda_graph=true with distributed.sync={self.sync} needs every batch full (a short one runs "
                              "eagerly on its rank alone, its all-reduce outside the graph the other ranks replay): set "
                              "loader.drop_last=true")

    def tags(self) -> Dict[str, str]:
        tags = {"world_size": str(self.world_size), "backend": self.backend, "torch_threads": str(torch.get_num_threads())}
        if self.device_ is not None:
            tags["device_ids"] = device_id(self.device_)
        return tags

    @contextlib.contextmanager
    def agree(self):
        """Run a block on every rank and compare verdicts: an exception on any rank ends the block
        on all of them, each raising it (the rank that raised it its own, the others its
        message, prefixed by the rank). Marked `agreed`: every rank knows, so a sweep may go on."""
        if not self.enabled:
            yield
            return
        error: Optional[Exception] = None
        try:
            yield
        except Exception as e:  # a KeyboardInterrupt is not exchanged: it ends the process
            error = e
            self.shard.peers.give_up(_describe(e))  # ranks of this host waiting for its copy of the dataset
        verdict = None if error is None else (_describe(error), isinstance(error, ConfigError))
        failed = [(r, v) for r, v in enumerate(self._all_gather(verdict)) if v is not None]
        if not failed:
            return
        if error is None:
            r, (text, config) = failed[0]
            error = (ConfigError if config else PeerStopped)(f"rank {r}: {text}")
        error.agreed = True
        raise error

    def tracker(self, make: Callable[[], object]):
        """The run's tracker: `make()` on rank 0, a tracker that records nothing elsewhere."""
        from trainer.tracking.runs import NoTracker

        with self.agree():
            return make() if self.is_main else NoTracker()

    def wrap(self, model: nn.Module) -> nn.Module:
        """DistributedDataParallel around the model (`distributed.sync=ddp`), or the model itself
        with its gradients in one flat buffer (`allreduce`: `self.grads`, which the step zeroes and
        averages; `sharded`: its weights too, each rank updating a slice); unchanged alone, or when
        it has no parameters (nothing to average)."""
        if not self.enabled or not any(p.requires_grad for p in model.parameters()):
            return model
        if self.sync == "allreduce":
            self.grads = FlatGradients(model, self.world_size)
            return model
        if self.sync == "sharded" and self.exchange_with == "copy":
            self.grads = PeerCopyShards(model, self.world_size, self.rank, dist.group.WORLD, self.ddp["bucket_cap_mb"],
                                        self.timeout_s)
            return model
        if self.sync == "sharded":
            self.grads = ShardedGradients(model, self.world_size, self.rank)
            return model
        ids = [self.device_.index] if self.device_.type == "cuda" else None
        return DistributedModel(_LossForward(model), device_ids=ids, bucket_cap_mb=self.ddp["bucket_cap_mb"],
                                gradient_as_bucket_view=self.ddp["gradient_as_bucket_view"])

    def uneven(self, model: nn.Module, batches_per_rank: List[int], engine) -> contextlib.AbstractContextManager:
        """Ranks whose shards give them different numbers of steps would leave DDP's all-reduce
        waiting for a rank that has finished: then train under DDP's `join()`, which stands in
        for finished ranks (at the cost of one more small all-reduce per step). Each rank's steps
        are the loop's own plan (`planned_steps`): with `engine.max_steps` set, every rank that has
        a batch takes exactly that many, over as many epochs of its shard as it takes."""
        self.joined = len(set(steps_per_rank(batches_per_rank, engine))) > 1 and isinstance(model, DistributedModel)
        return model.join() if self.joined else contextlib.nullcontext()

    # -- faults --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def guard(self):
        """Around the open run. A failure or interrupt of this rank is written to the store (first
        writer wins) before it propagates; one caused by another rank's failure (a collective
        that lost its peer, torchrun's SIGTERM) becomes that rank's error, so the run closes
        FAILED with its message (or KILLED when that rank was interrupted)."""
        if not self.enabled:
            yield
            return
        if self.backend == "nccl":
            self._watch = _PeerWatch(self)
        try:
            yield
        except BaseException as e:
            if getattr(e, "agreed", False) or isinstance(e, (SystemExit, GeneratorExit)):
                raise
            release = getattr(self.grads, "release_barriers", None)
            if release is not None:  # distributed.exchange=copy: the peers may stop short of this rank's barriers
                release(self.timeout_s)
            settled = self._settle(e)
            if settled is e:
                raise
            raise settled from e
        finally:
            if self._watch is not None:
                self._watch.stop()

    def _settle(self, error: BaseException) -> BaseException:
        if isinstance(error, KeyboardInterrupt):
            mine = f"interrupted|{self.rank}|{getattr(error, 'signum', signal.SIGINT)}"
        else:
            mine = f"failed|{self.rank}|{_describe(error)}"
        try:
            first = self.store.compare_set(self.key, "", mine).decode()
            self.store.set(STOPPED_KEY, "1")
        except Exception:  # the store is gone (torchrun is exiting): this rank's own error stands
            return error
        kind, rank, what = first.split("|", 2)
        if int(rank) == self.rank:
            return error
        if kind == "interrupted":
            return Interrupted(int(what))
        return PeerStopped(f"rank {rank} failed: {what}")

    def stopped_elsewhere(self) -> Optional[str]:
        """The record of another rank's failure or interrupt, if there is one (never blocks)."""
        try:
            if not self.store.check([self.key]):
                return None
            first = self.store.get(self.key).decode()
        except Exception:
            return None
        return first if int(first.split("|", 2)[1]) != self.rank else None

    # -- after the loop (every rank finished it) -----------------------------------------------
    def ceilings(self, alone: Callable[[], dict], nbytes: int) -> dict:
        """The copy ceilings: `alone()` (rank 0 by itself while the others wait: the single-GPU
        figure), then every rank copying `nbytes` batches at once for ~4 GiB, added up over the
        time all of them were copying, on each host (`shared_rate`): `aggregate_h2d_peak_pinned_GBps`."""
        if not self.enabled:
            return alone()
        out = alone() if self.is_main else {}
        self._barrier()
        if self.device_.type != "cuda" or not nbytes:
            return out
        burst = h2d_burst(nbytes, self.device_, line_up=self._barrier)
        bursts = self._gather((socket.gethostname(), burst))
        if self.is_main:
            hosts: Dict[str, list] = {}
            for host, b in bursts:
                hosts.setdefault(host, []).append(b)
            out["aggregate_h2d_peak_pinned_GBps"] = sum(shared_rate(b) for b in hosts.values())
        return out

    def exchange(self, model: nn.Module) -> dict:
        """The gradient exchange, measured alone after the loop (several ranks, a model with
        parameters):
        - `grad_mb`: the gradients every step all-reduces (in DDP's own buckets, or the one flat
          buffer of `distributed.sync=allreduce`; `sharded` reduce-scatters it and all-gathers the
          weights: the same bytes on the wire);
        - `grad_allreduce_ms`: the time to all-reduce them with nothing to overlap: what a step
          can lose to the exchange at most (DDP starts each bucket while backward still runs);
        - `allreduce_bus_GBps`: that as bus bandwidth (bytes x 2(n-1)/n over the time, as NCCL's
          own tests count it: comparable across GPU counts).
        A step slower on N GPUs than on one by about `grad_allreduce_ms` is bound by the
        exchange, not by its feed."""
        if not self.enabled or not (isinstance(model, DistributedModel) or self.grads is not None):
            return {}
        if self.grads is not None:
            self.grads.settle()  # the last update on every rank
            self.grads.check_views()  # still the flat buffer's: else each rank trained on its own gradients
        # One list of buckets on every rank, the most split (a rank that joined with no batch
        # never rebuilt its own): ranks all-reducing different sizes would wait for each other
        # until the group's timeout. Likewise all measure, or none: a rank with no room left for
        # one more bucket says so first.
        mine = self.grads.buckets() if self.grads is not None else ddp_buckets(model)
        buckets = max(self._all_gather(mine), key=len)
        try:
            buffer = torch.empty(max(1, max(buckets) // 4), dtype=torch.float32, device=self.device_)
        except torch.OutOfMemoryError:
            buffer = None
        out = {"grad_mb": sum(buckets) / 2**20}
        if not all(self._all_gather(buffer is not None)):
            return out  # not measured: no room for one bucket more on some rank's device
        timed = []
        self._collective(lambda: timed.append(allreduce_ms(buckets, buffer.fill_(1.0))))
        n, ms = self.world_size, timed[0]
        return {**out, "grad_allreduce_ms": ms,
                "allreduce_bus_GBps": sum(buckets) * 2 * (n - 1) / n / (ms * 1e6) if ms > 0 else math.nan}

    def combine(self, summary: dict, rows: List[dict], verified: Optional[dict], tracker) -> Tuple[dict, Optional[dict]]:
        """Every rank's summary (and checksums, and steps) to rank 0, which records the run's:
        see `combine_summaries`; `verified` becomes the ranks' combined checksums. Alone:
        unchanged."""
        if not self.enabled:
            return summary, verified
        mine = {"summary": summary, "verified": verified, "device": device_id(self.device_),
                "gpu": (socket.gethostname(), self.device_.index, gpu_numa_node(self.device_)),
                "rows": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]}
        everyone = self._gather(mine)
        if not self.is_main:
            return summary, verified
        tracker.set_tags({"device_ids": ",".join(dict.fromkeys(e["device"] for e in everyone)),
                          "steps_per_rank": ",".join(str(len(e["rows"])) for e in everyone),
                          "ddp_join": str(self.joined).lower()})  # join's extra all-reduce is in every step's time
        if self.device_.type == "cuda":  # where each rank's GPU sits: its NUMA node, and how rank 0's host links them
            here = [index for host, index, _ in (e["gpu"] for e in everyone) if host == socket.gethostname()]
            tracker.set_tags({"gpu_numa_nodes": ",".join(e["gpu"][2] for e in everyone), "gpu_links": gpu_links(here) or "none"})
        for r, e in enumerate(everyone[1:], start=1):
            tracker.log_rows(e["rows"], f"steps_rank{r}.csv")
        if verified is not None:
            verified = combine_ranks([e["verified"] for e in everyone])
        return combine_summaries([e["summary"] for e in everyone]), verified

    # -- collectives on the ranks' own gloo group ----------------------------------------------
    def _all_gather(self, obj) -> list:
        out = [None] * self.world_size
        self._collective(lambda: dist.all_gather_object(out, obj, group=self.group))
        return out

    def _gather(self, obj) -> list:
        out = [None] * self.world_size if self.is_main else None
        self._collective(lambda: dist.gather_object(obj, out, dst=0, group=self.group))
        return out

    def line_up(self) -> None:
        """Wait until every rank is here (a world of one: at once)."""
        if self.enabled:
            self._barrier()

    def _barrier(self) -> None:
        self._collective(lambda: dist.barrier(group=self.group))

    def _collective(self, fn: Callable[[], None]) -> None:
        """A collective that fails (a rank left, or it timed out) raises the reason the store
        gives: that rank's failure or interrupt."""
        try:
            fn()
        except Exception as e:
            settled = self._settle(e)
            if settled is e:
                raise RunFailed(f"lost contact with the other ranks: {' '.join(str(e).split())[:500]}") from e
            raise settled from e


class _PeerWatch:
    """NCCL only: a rank blocked in a collective whose peer has died waits in a GPU kernel, where
    neither a Python signal handler nor torchrun's SIGTERM reaches it before its SIGKILL. This
    thread polls the store and, when another rank has failed, aborts the process group, which
    ends the wait with an error: the run then closes as FAILED with what it measured. With
    distributed.exchange=copy the wait is in the exchange's barrier kernels instead: it releases
    them (`PeerCopyShards.release_barriers`), leaves NCCL unaborted (its abort would wait behind
    those barriers) and signals its own process (SIGTERM), whose handler
    raises in the main thread once that is free; the run closes FAILED with the other rank's
    error all the same."""

    def __init__(self, ranks: Ranks, every_s: float = 0.5):
        self.ranks, self.every_s = ranks, every_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="feedbench-peer-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(self.every_s):
            if self.ranks.stopped_elsewhere():
                release = getattr(self.ranks.grads, "release_barriers", None)
                if release is not None:
                    # distributed.exchange=copy: the loop makes no NCCL call, so NCCL is left as it is.
                    # Its abort waits as long as the barriers hold the GPU (seen on two H200s: this
                    # thread stayed in `_abort_process_group` until torchrun's SIGKILL), so that
                    # it would never reach the release.
                    release(self.ranks.timeout_s)
                    # The main thread learns of it as from torchrun's SIGTERM, which it may not
                    # send (another launcher), or only once the failed rank has exited: the
                    # handler raises where the run can still save what it measured.
                    os.kill(os.getpid(), signal.SIGTERM)
                    return
                abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
                if abort is not None:
                    try:
                        abort()
                    except Exception as e:  # the collective will still time out
                        print(f"warning: could not abort the process group: {e}", file=sys.stderr)
                return

    def stop(self) -> None:
        self._done.set()


def combine_summaries(summaries: List[Dict[str, float]]) -> Dict[str, float]:
    """The run's summary from every rank's, in rank order.

    - `throughput_samples_per_s`: every rank's timed samples over the longest timed region;
    - `aggregate_h2d_GBps`: the ranks' copy bandwidths added (each is bytes over the time its
      own copies took): what the host delivered while they all copied;
    - `total_samples`, `pinned_host_mb`, `shared_host_mb` (counted by the rank that made it): added;
      `host_rss_mb`, `host_pss_mb`, `run_host_pss_mb`: the means (memory per rank), and
      `ranks_host_pss_mb` the ranks' `host_pss_mb` added (what they hold together, a shared copy once); `total_steps`, `peak_gpu_mem_mb`, `setup_s`,
      `timed_wall_s`: the largest; the timed region: from the first start to the last end;
    - `final_loss` and the copy ceilings: rank 0's; every other figure: the mean over ranks;
    - `rank<r>/<figure>` for each rank: throughput, data wait, copy GB/s, stream span, median step,
      timed wall time and host memory (`PER_RANK`).
    """
    out: Dict[str, float] = {}
    keys = [k for k in summaries[0] if all(k in s for s in summaries)]
    for k in keys:
        values = [float(s[k]) for s in summaries]
        out[k] = sum(values) / len(values)
    walls = [s.get("timed_wall_s", 0.0) for s in summaries]
    if "throughput_samples_per_s" not in out:
        pass  # warm-up covered every step: nothing was timed
    elif max(walls) > 0:
        out["throughput_samples_per_s"] = sum(s["throughput_samples_per_s"] * w for s, w in zip(summaries, walls)) / max(walls)
    else:
        out["throughput_samples_per_s"] = sum(s["throughput_samples_per_s"] for s in summaries)
    out["aggregate_h2d_GBps"] = sum(s.get("h2d_GBps", 0.0) for s in summaries)
    if "host_pss_mb" in out:
        out["ranks_host_pss_mb"] = sum(s["host_pss_mb"] for s in summaries)
    for k, how in (("total_samples", sum), ("pinned_host_mb", sum), ("shared_host_mb", sum), ("total_steps", max), ("peak_gpu_mem_mb", max),
                   ("setup_s", max), ("timed_wall_s", max), ("timed_start_unix_s", min), ("timed_end_unix_s", max)):
        if k in out:
            out[k] = how(s[k] for s in summaries)
    for k, v in summaries[0].items():
        if k == "final_loss" or k.startswith(("h2d_peak_", "aggregate_h2d_peak_")):  # rank 0 measures them
            out[k] = v
    for r, s in enumerate(summaries):
        out.update({f"rank{r}/{k}": s[k] for k in PER_RANK if k in s})
    return out
