"""The training step: eager, or captured once in a CUDA graph and replayed."""

from __future__ import annotations

import torch


def make_step(model, optimizer, graphed: bool):
    """Return `step(x, y) -> loss` for the engine loop."""
    return GraphedStep(model, optimizer) if graphed else EagerStep(model, optimizer)


class EagerStep:
    """zero_grad, forward+loss, backward, optimizer step – one kernel launch at a time."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def __call__(self, x, y):
        if self.optimizer is None:  # a model without parameters (noop): forward only
            return self.model.loss(x, y)
        # Keep gradient tensors (set_to_none=False): a graph captured over them must find them.
        self.optimizer.zero_grad(set_to_none=False)
        loss = self.model.loss(x, y)
        loss.backward()
        self.optimizer.step()
        return loss


class GraphedStep:
    """Forward+backward+optimizer step captured once in a CUDA graph, then replayed every step.

    A small model is launch-bound: replaying one graph replaces hundreds of kernel launches from
    Python. Batches are copied (device to device, on the compute stream) into the graph's static
    input buffers; a batch of another shape (a last partial batch) runs eagerly instead.
    """

    def __init__(self, model, optimizer, warmup_iters: int = 3):
        self.model, self.optimizer, self.warmup_iters = model, optimizer, warmup_iters
        self.eager = EagerStep(model, optimizer)
        self.graph = None
        self.eager_steps = 0  # steps that could not replay (shape differed from the capture)

    def _capture(self, x, y):
        self.static_x, self.static_y = x.clone(), y.clone()
        initial = [p.detach().clone() for p in self.model.parameters()]
        # Warm up on a side stream (lazy init, cuBLAS workspaces, optimizer state), as capture requires.
        side = torch.cuda.Stream(x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup_iters):
                self.eager(self.static_x, self.static_y)
        torch.cuda.current_stream(x.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: loader threads (DataLoader pinning, chunk loading) may touch CUDA meanwhile.
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.static_loss = self.eager(self.static_x, self.static_y)
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
        if x.shape != self.static_x.shape or y.shape != self.static_y.shape:
            self.eager_steps += 1
            return self.eager(x, y)
        self.static_x.copy_(x)
        self.static_y.copy_(y)
        self.graph.replay()
        # The next replay overwrites `static_loss`: return a copy, so the loss belongs to this step.
        return self.static_loss.clone()


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
