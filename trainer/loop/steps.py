"""The training step: eager, as a plain PyTorch loop writes it, captured once in a CUDA graph and
replayed, or with forward+loss through `torch.compile` (`engine.compile`).

`engine.precision` bf16 or fp16 runs forward+loss under autocast (the weights, their gradients and the
optimizer stay float32); fp16 adds a gradient scaler, as PyTorch's AMP recipe does. A graphed step
captures the autocast region inside its graph; fp16 it refuses (see `GraphedStep`).

Both kinds count what they ran, for the run's record: `graph_replays` (steps that replayed the
graph) and `eager_steps` (steps that ran eagerly: every step of an `EagerStep`; in a
`GraphedStep`, batches of another shape than the one it captured). A `CompiledStep` counts
neither: it reports `compile_s` and `compile_recompiles` instead.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from typing import Optional

import torch

from trainer.config import COMPILE_GRAPH_MODES, FP16_GRAPH_REFUSED
from trainer.errors import ConfigError

# A graphed step's losses are written into a device ring this long, one slot per replay: a
# returned loss stays its step's for this many replays, more than the meter holds one
# (`trainer.loop.meter.LOSS_BATCH`, 32 steps).
LOSS_SLOTS = 64
STEP_COUNTS = ("graph_replays", "eager_steps", "compile_s", "compile_recompiles")  # what steps count, for the run's record
AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # engine.precision -> autocast's dtype


def make_step(model, optimizer, graphed: bool, precision: str = "fp32", compile: str = "off", feed=None, grads=None):
    """Return `step(x, y) -> loss` for the engine loop. `compile`: `engine.compile`'s mode. `feed`:
    the loader's `graph_feed`, whose next batch a graphed step fetches inside its graph
    (`loader.gather_in_graph`). `grads`: several ranks with `distributed.sync=allreduce`, the
    ranks' `FlatGradients` (or `ShardedGradients`), which the step zeroes before backward, averages
    after it and shares after the optimizer's step."""
    if compile != "off":
        return CompiledStep(model, optimizer, precision, mode=compile, grads=grads)
    if graphed:
        return GraphedStep(model, optimizer, precision=precision, feed=feed, grads=grads)
    return EagerStep(model, optimizer, precision, grads=grads)


class EagerStep:
    """zero_grad, forward+loss, backward, optimizer step: the four lines of a plain PyTorch loop;
    under bf16 or fp16, forward+loss in autocast, and for fp16 the loss scaled by a `GradScaler`.
    With `grads` (`distributed.sync=allreduce` or `sharded`) the gradients are zeroed in their flat
    buffer and averaged over the ranks between backward and the optimizer's step, and after the
    step each rank's updated slice of the weights goes to every rank (`sharded`)."""

    graph_replays = 0  # an eager step never replays a graph

    def __init__(self, model, optimizer, precision: str = "fp32", grads=None):
        self.model, self.optimizer, self.grads = model, optimizer, grads
        self.eager_steps = 0
        self.dtype = AUTOCAST[precision]
        self.scaler = None
        if precision == "fp16" and optimizer is not None:
            self.scaler = torch.amp.GradScaler(next(model.parameters()).device.type)

    def forward(self, x, y, cache: bool = True):
        """`model.loss(x, y)`, in autocast unless fp32. `cache=False`: autocast keeps no cast weights
        between calls, as a CUDA graph's capture needs (its casts then run in every replay)."""
        if self.dtype is None:
            return self.model.loss(x, y)
        with torch.autocast(x.device.type, dtype=self.dtype, cache_enabled=cache):
            return self.model.loss(x, y)

    def __call__(self, x, y):
        self.eager_steps += 1
        if self.optimizer is None:  # a model without parameters (noop): forward only
            return self.forward(x, y)
        grads = self.grads  # several ranks with distributed.sync=allreduce; else None (one attribute read a step)
        if grads is None:
            # PyTorch's default (set_to_none=True): backward writes fresh gradients instead of zeroing the
            # old ones and adding into them, which costs a kernel per parameter and its memory traffic.
            self.optimizer.zero_grad()
        else:
            grads.zero()  # one kernel; the gradients stay views of the flat buffer the ranks average
        loss = self.forward(x, y)
        if self.scaler is None:
            loss.backward()
            if grads is not None:
                grads.average()
            self.optimizer.step()
            if grads is not None:
                grads.share()  # distributed.sync=sharded: each rank's updated slice of the weights to all
        else:
            self.scaler.scale(loss).backward()
            if grads is not None:
                grads.average()  # before the scaler looks for an overflow: every rank then sees the same one
            # Skips the update when a gradient overflowed: it reads that flag from the device (a sync
            # per step, as in any fp16 loop with a GradScaler), then adapts the scale.
            self.scaler.step(self.optimizer)
            self.scaler.update()
            if grads is not None:
                grads.share()
        return loss


class GraphedStep:
    """Forward+backward+optimizer step captured once in a CUDA graph, then replayed every step.

    A small model is launch-bound: replaying one graph replaces hundreds of kernel launches from
    Python. Batches are copied (device to device, on the compute stream) into the graph's static
    input buffers; a batch of another shape (a last partial batch) runs eagerly instead and is
    counted in `eager_steps`. The graph is captured as PyTorch's CUDA-graph recipe does it, and
    writes each step's loss into a slot of a small device ring (`LOSS_SLOTS`), so that per step
    the host issues the input copies and the replay, and nothing else.

    Under bf16 the autocast region is captured inside the graph, with autocast's weight cache off
    (PyTorch's rule for capture). fp16 is refused: its GradScaler decides on the host, after reading
    the device, whether each step is skipped, a branch a replayed graph cannot take.

    With a loader's `feed` (`loader.gather_in_graph`) the graph's inputs are the feed's own
    batch (`feed.x`, `feed.y`, which the loader yields): no copy into static inputs, and the
    capture wraps the step in `feed.beside()`, so each replay also fetches the next batch.
    """

    def __init__(self, model, optimizer, warmup_iters: int = 3, precision: str = "fp32", feed=None, grads=None):
        if precision == "fp16":
            raise ConfigError(FP16_GRAPH_REFUSED)
        self.model, self.optimizer, self.warmup_iters = model, optimizer, warmup_iters
        self.feed = feed
        self.eager = EagerStep(model, optimizer, precision, grads=grads)  # the warm-up before capture, and batches of another shape
        self.graph = None
        self.graph_replays = 0
        self.eager_steps = 0
        self.pace = getattr(grads, "pace", None)  # distributed.exchange=copy: the host kept a few steps ahead

    def _fed(self, x) -> bool:
        """Whether `x` is the feed's batch, which the graph reads where it is and fetches itself."""
        return self.feed is not None and x is self.feed.x

    def _capture(self, x, y):
        device = x.device
        fed = self._fed(x)
        self.static_x, self.static_y = (x, y) if fed else (x.clone(), y.clone())
        initial = [p.detach().clone() for p in self.model.parameters()]
        # Warm up on a side stream (lazy init, cuBLAS workspaces, optimizer state), as capture requires.
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup_iters):
                loss = self.eager(self.static_x, self.static_y)
        torch.cuda.current_stream(device).wait_stream(side)
        dtype = loss.dtype
        # The last warm-up's loss keeps its autograd graph alive, and with it each parameter's
        # AccumulateGrad node of the side stream: backward at capture would then make the capture's
        # stream wait on that stream (PyTorch warns of the mismatch). Dropped, capture makes its own.
        del loss
        self._losses = torch.zeros(LOSS_SLOTS, dtype=dtype, device=device)
        self._slot = torch.zeros(1, dtype=torch.long, device=device)  # where the next replay writes its loss
        self._loss_views = self._losses.unbind()  # made once: a step hands one out, it makes no tensor
        grads = self.eager.grads
        if self.optimizer is not None and grads is None:
            # No gradient at capture: backward then allocates each one in the graph's pool and every
            # replay writes it afresh. A graph captured over kept gradients (set_to_none=False) would
            # zero them and add into them at every replay: kernels and memory traffic per parameter.
            # (Several ranks' flat gradients are zeroed in the graph instead: one kernel, and one
            # all-reduce of them, which NCCL replays with the graph.)
            self.optimizer.zero_grad(set_to_none=True)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: loader threads (DataLoader pinning, chunk loading) may touch CUDA meanwhile.
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"), \
                (self.feed.beside() if fed else contextlib.nullcontext()):
            if self.optimizer is not None and grads is not None:
                grads.zero()
            loss = self.eager.forward(self.static_x, self.static_y, cache=False)
            if self.optimizer is not None:
                loss.backward()
                if grads is not None:
                    grads.average()
                self.optimizer.step()
                if grads is not None:
                    grads.share()
            # The loss into its slot of the ring, inside the graph: the meter holds the returned
            # slot for up to 32 steps, and the next replays write the next slots.
            self._losses.index_copy_(0, self._slot, loss.detach().reshape(1))
            self._slot.add_(1)
        # Undo the warm-up updates in place (the graph holds these addresses), so a graphed run
        # trains exactly like an eager one from the same initial weights.
        with torch.no_grad():
            for p, p0 in zip(self.model.parameters(), initial):
                p.copy_(p0)
            if self.optimizer is not None:
                for state in self.optimizer.state.values():
                    for v in state.values():
                        if torch.is_tensor(v):
                            v.zero_()

    def __call__(self, x, y):
        if self.graph is None:
            self._capture(x, y)
        fed = x is self.static_x  # the feed's batch: the graph reads it in place and fetches the next
        if not fed:
            if x.shape != self.static_x.shape or y.shape != self.static_y.shape:
                self.eager_steps += 1
                return self.eager(x, y)
            self.static_x.copy_(x)
            self.static_y.copy_(y)
        slot = self.graph_replays % LOSS_SLOTS
        if slot == 0:
            self._slot.zero_()  # back to the ring's start: one tiny kernel every LOSS_SLOTS steps
        self.graph.replay()
        self.graph_replays += 1
        if self.pace is not None:
            self.pace()
        if fed:
            self.feed.replayed()
        return self._loss_views[slot]


class CompiledStep:
    """The eager step with forward+loss through `torch.compile(mode=...)`: zero_grad, backward and
    the optimizer's update run as `EagerStep` runs them.

    What is compiled is what users compile, the model's forward and its loss (with the autocast
    region under bf16 or fp16); its backward comes compiled with it (torch traces the backward of
    the compiled region). The optimizer's update stays out: compiling it is a compile of its own,
    long for many parameters, and `engine.optimizer.impl=fused` already makes it a few kernels, so
    each lever is measured alone. fp16's gradient scaler stays out too, so fp16 works in every
    mode: its decision to skip a step is a host branch after the compiled region, not in a graph.

    Compiling is timed apart from the steps, by torch's compile callbacks: `compile_s` is the
    seconds spent compiling (the first step's compile, a backward compiled at its first call, the
    CUDA graphs recorded by reduce-overhead, and every recompile); `compile_recompiles` counts
    the compiles after the first step, and `recompile_warning()` says what caused the first one.
    """

    graph_replays = 0  # the engine's own graph (engine.cuda_graph); reduce-overhead's graphs are torch's
    eager_steps = 0  # every step runs the compiled code

    def __init__(self, model, optimizer, precision: str = "fp32", mode: str = "default", grads=None):
        import torch._dynamo  # here, not at the top: an eager run never imports the compiler
        # A process that runs several runs (a sweep) would otherwise reuse the last run's compiled code,
        # guarded on the last run's model: a recompile charged to this run, and after torch's
        # `recompile_limit` (8) of them the step falls back to eager. (It clears the compile callbacks too.)
        torch._dynamo.reset()
        self.mode = mode
        self.eager = EagerStep(model, optimizer, precision, grads=grads)
        # dynamic=False: a batch of another shape (a partial last batch) gets code of its own. With
        # torch's default the second shape makes the batch dimension dynamic, and every later full
        # batch runs that dynamic-shape code: another step than the one timed before it.
        self.eager.forward = torch.compile(self.eager.forward, mode=mode, dynamic=False)
        # The modes that record CUDA graphs return a loss in the graph's memory, which the next
        # replay overwrites; the meter holds a step's loss for up to 32 steps (`LOSS_BATCH`).
        self.graphs = mode in COMPILE_GRAPH_MODES
        self.steps = 0
        self.compile_s = 0.0
        self.compile_recompiles = 0
        self._first_batch: Optional[tuple] = None  # (shape, dtype) of the first step's x
        self._cause = ""  # what the first recompile was for
        _time_compiles(weakref.ref(self))

    def __call__(self, x, y):
        if self._first_batch is None:
            self._first_batch = (tuple(x.shape), x.dtype)
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()  # a new step: the last one's graph outputs may be overwritten
        recompiles = self.compile_recompiles
        loss = self.eager(x, y)
        self.steps += 1
        if self.compile_recompiles != recompiles and not self._cause:
            self._cause = self._recompiled_for(x)
        return loss.detach().clone() if self.graphs else loss

    def _recompiled_for(self, x) -> str:
        """What made torch compile the step again for this batch, and the fix where there is one."""
        shape, dtype = self._first_batch
        if x.dtype != dtype:
            return f"a batch of dtype {x.dtype}, not {dtype} as at the first step"
        if tuple(x.shape[1:]) == shape[1:] and len(x) < shape[0]:
            return f"a batch of {len(x)} samples, not {shape[0]} (a partial last batch): set loader.drop_last=true"
        if tuple(x.shape) != shape:
            return f"a batch of shape {list(x.shape)}, not {list(shape)} as at the first step"
        failures = [reason for reasons in torch._dynamo.utils.guard_failures.values() for reason in reasons]
        return f"torch's guard failed: {failures[-1]}" if failures else "run with TORCH_LOGS=recompiles to see why"

    def recompile_warning(self) -> str:
        """One line on the step's recompiles ("" when there were none)."""
        if not self.compile_recompiles:
            return ""
        return (f"warning: engine.compile={self.mode} compiled the step {self.compile_recompiles} more time(s) after its "
                f"first step (compile_recompiles={self.compile_recompiles}, within compile_s={self.compile_s:.1f}), first "
                f"for {self._cause}")


def _time_compiles(step: weakref.ref) -> None:
    """Book torch.compile's work to `step` (weakly held: a finished run's step is not kept alive):
    dynamo's callbacks bracket each compile of a frame, of a backward at its first call and each
    CUDA graph's recording; a frame compiled after the step's first call is a recompile."""
    from torch._dynamo.callback import callback_handler
    began = [0.0]

    def start(args=None):  # (an older torch passes no args: every compile then counts as a frame's)
        began[0] = time.perf_counter()
        owner = step()
        trigger = getattr(getattr(args, "callback_trigger", None), "name", "DYNAMO")
        if owner is not None and owner.steps and trigger == "DYNAMO":
            owner.compile_recompiles += 1

    def end(args=None):
        owner = step()
        if owner is not None:
            owner.compile_s += time.perf_counter() - began[0]

    callback_handler.register_start_callback(start)
    callback_handler.register_end_callback(end)


# engine.optimizer.impl -> the keywords that pick it (torch's optimizers take both foreach and fused)
IMPL_KWARGS = {"default": {}, "for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
# Where torch (>= 2.4) has fused Adam, AdamW and SGD kernels, among the devices the engine runs on.
FUSED_DEVICES = ("cpu", "cuda")


def build_optimizer(cfg, model, capturable: bool = False, params=None):
    """Optimizer named by `engine.optimizer.name` (None for a model without parameters), in the
    implementation `engine.optimizer.impl` names, over the model's trainable parameters or
    `params` (with `distributed.sync=sharded`: this rank's slices of the flat weights). `capturable`
    keeps Adam's step counter on the device so the step can live in a CUDA graph (the fused
    kernels keep it there anyway)."""
    if params is None:
        params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return None
    name = getattr(cfg, "impl", "default")  # (configs saved before engine.optimizer.impl existed: torch's default)
    impl = IMPL_KWARGS[name]
    if name == "fused":
        check_fused(params)
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, **impl)
    classes = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
    if cfg.name not in classes:
        raise ValueError(f"engine.optimizer.name must be one of adam, adamw, sgd (got {cfg.name!r}): set engine.optimizer.name=adam")
    return classes[cfg.name](params, lr=cfg.lr, capturable=capturable, **impl)


def check_fused(params) -> None:
    """Torch checks a fused optimizer's parameters only at its first step, mid-run: checked here,
    before the run, in one line."""
    for p in params:
        if p.device.type not in FUSED_DEVICES or not torch.is_floating_point(p):
            raise ConfigError(f"engine.optimizer.impl=fused needs floating-point parameters on {' or '.join(FUSED_DEVICES)} "
                              f"(a parameter is {p.dtype} on {p.device.type}): set engine.optimizer.impl=foreach")
