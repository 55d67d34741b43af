"""The training step: eager, as a plain PyTorch loop writes it, or captured once in a CUDA graph and replayed.

`engine.precision` bf16 or fp16 runs forward+loss under autocast (the weights, their gradients and the
optimizer stay float32); fp16 adds a gradient scaler, as PyTorch's AMP recipe does. A graphed step
captures the autocast region inside its graph; fp16 it refuses (see `GraphedStep`).

Both kinds count what they ran, for the run's record: `graph_replays` (steps that replayed the
graph) and `eager_steps` (steps that ran eagerly: every step of an `EagerStep`; in a
`GraphedStep`, batches of another shape than the one it captured).
"""

from __future__ import annotations

import contextlib

import torch

from trainer.config import FP16_GRAPH_REFUSED
from trainer.errors import ConfigError

# A graphed step's losses are written into a device ring this long, one slot per replay: a
# returned loss stays its step's for this many replays, more than the meter holds one
# (`trainer.loop.meter.LOSS_BATCH`, 32 steps).
LOSS_SLOTS = 64
AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # engine.precision -> autocast's dtype


def make_step(model, optimizer, graphed: bool, precision: str = "fp32", feed=None):
    """Return `step(x, y) -> loss` for the engine loop. `feed`: the loader's `graph_feed`, whose
    next batch a graphed step fetches inside its graph (`loader.gather_in_graph`)."""
    if graphed:
        return GraphedStep(model, optimizer, precision=precision, feed=feed)
    return EagerStep(model, optimizer, precision)


class EagerStep:
    """zero_grad, forward+loss, backward, optimizer step: the four lines of a plain PyTorch loop;
    under bf16 or fp16, forward+loss in autocast, and for fp16 the loss scaled by a `GradScaler`."""

    graph_replays = 0  # an eager step never replays a graph

    def __init__(self, model, optimizer, precision: str = "fp32"):
        self.model, self.optimizer = model, optimizer
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
        # PyTorch's default (set_to_none=True): backward writes fresh gradients instead of zeroing
        # the old ones and adding into them, which costs a kernel per parameter and its memory traffic.
        self.optimizer.zero_grad()
        loss = self.forward(x, y)
        if self.scaler is None:
            loss.backward()
            self.optimizer.step()
        else:
            self.scaler.scale(loss).backward()
            # Skips the update when a gradient overflowed: it reads that flag from the device (a sync
            # per step, as in any fp16 loop with a GradScaler), then adapts the scale.
            self.scaler.step(self.optimizer)
            self.scaler.update()
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

    def __init__(self, model, optimizer, warmup_iters: int = 3, precision: str = "fp32", feed=None):
        if precision == "fp16":
            raise ConfigError(FP16_GRAPH_REFUSED)
        self.model, self.optimizer, self.warmup_iters = model, optimizer, warmup_iters
        self.feed = feed
        self.eager = EagerStep(model, optimizer, precision)  # the warm-up before capture, and batches of another shape
        self.graph = None
        self.graph_replays = 0
        self.eager_steps = 0

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
        self._losses = torch.zeros(LOSS_SLOTS, dtype=loss.dtype, device=device)
        self._slot = torch.zeros(1, dtype=torch.long, device=device)  # where the next replay writes its loss
        self._loss_views = self._losses.unbind()  # made once: a step hands one out, it makes no tensor
        if self.optimizer is not None:
            # No gradient at capture: backward then allocates each one in the graph's pool and every
            # replay writes it afresh. A graph captured over kept gradients (set_to_none=False) would
            # zero them and add into them at every replay: kernels and memory traffic per parameter.
            self.optimizer.zero_grad(set_to_none=True)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: loader threads (DataLoader pinning, chunk loading) may touch CUDA meanwhile.
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"), \
                (self.feed.beside() if fed else contextlib.nullcontext()):
            loss = self.eager.forward(self.static_x, self.static_y, cache=False)
            if self.optimizer is not None:
                loss.backward()
                self.optimizer.step()
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
        if fed:
            self.feed.replayed()
        return self._loss_views[slot]


def build_optimizer(cfg, model, capturable: bool = False):
    """Optimizer named by `engine.optimizer.name` (None for a model without parameters).
    `capturable` keeps Adam's step counter on the device so the step can live in a CUDA graph."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return None
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr)
    classes = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
    if cfg.name not in classes:
        raise ValueError(f"engine.optimizer.name must be one of adam, adamw, sgd (got {cfg.name!r}): set engine.optimizer.name=adam")
    return classes[cfg.name](params, lr=cfg.lr, capturable=capturable)
