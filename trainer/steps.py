"""The training step: eager, or captured once in a CUDA graph and replayed."""

from __future__ import annotations

import torch


def make_step(model, optimizer, cfg):
    """Return `step(x, y) -> loss` for the engine loop."""
    if optimizer is None:  # a model without parameters (noop): forward only
        return lambda x, y: model.loss(x, y)

    def eager_step(x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = model.loss(x, y)
        loss.backward()
        optimizer.step()
        return loss

    return eager_step


def build_optimizer(cfg, model):
    """Optimizer named by `engine.optimizer.name` (None for a model without parameters)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return None
    classes = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}
    if cfg.name not in classes:
        raise ValueError(f"engine.optimizer.name must be one of {sorted(classes)} (got {cfg.name!r}): set engine.optimizer.name=adam")
    return classes[cfg.name](params, lr=cfg.lr)
