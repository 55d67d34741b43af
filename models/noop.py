"""A model that does nothing: the step costs only the data feed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from models.base import MODELS, FeedModel, ModelConfig


@MODELS.register
class Noop(FeedModel):
    """No parameters, no work: the step costs only the data feed (and `busy_ms`)."""

    @dataclass
    class Config(ModelConfig):
        """Forward and backward do nothing: only the data feed is measured (plus model.busy_ms of device work)."""

        name: str = "noop"

    def __init__(self, cfg: Config, sample_shape: Sequence[int], num_classes: Optional[int]):
        super().__init__(cfg)

    def forward_loss(self, x, y):
        return x.new_zeros((), dtype=torch.float32)
