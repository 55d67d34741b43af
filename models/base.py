"""What every model shares: `loss(x, y)` for the engine's step, the config keys common to all of
them, and the registry each model file adds itself to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
from omegaconf import MISSING
from torch import nn

from models.busy import DeviceBusy
from trainer.config import Registry
from trainer.errors import at_least

MODELS = Registry("model")  # `model=<name>`: every model of models/, registered by its own file


@dataclass
class ModelConfig:
    """Common to every model; a model's own `Config` extends it."""

    min_classes: ClassVar[int] = 0  # labels of at least this many classes (checked against the dataset's)
    name: str = MISSING  # the model (`model=autoencoder`), set by its Config
    busy_ms: float = 0.0  # extra fixed device-side work per step (compute emulation)

    def __post_init__(self):
        at_least("model.busy_ms", self.busy_ms, 0, 0)


class FeedModel(nn.Module):
    """Base: `loss(x, y)` runs the forward pass (plus `busy_ms` of emulated device work). Every
    model takes its input size from the dataset (`sample_shape`, `num_classes`), never from a
    number kept by hand in its config."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.busy = DeviceBusy(cfg.busy_ms)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.busy(x.device)
        return self.forward_loss(x, y)

    def forward_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def check(self, x: torch.Tensor, y: Optional[torch.Tensor]) -> None:
        """Before the run: raise a one-line `ConfigError` when one batch `(x, y)` of the dataset (`y`
        None: its samples have no label) cannot go through `loss`. feedbench's own models are sized
        by the dataset and always fit; a module of the user's may not (`models.custom`)."""
