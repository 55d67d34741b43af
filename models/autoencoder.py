"""The reference autoencoder (hidden 64, bottleneck 3 by default)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from torch import nn
from torch.nn import functional as F

from models.base import MODELS, FeedModel, ModelConfig
from trainer.errors import at_least


@MODELS.register
class Autoencoder(FeedModel):
    """The reference autoencoder: flatten -> hidden -> bottleneck -> hidden -> reconstruction (MSE)."""

    @dataclass
    class Config(ModelConfig):
        """Autoencoder: input -> hidden -> bottleneck -> hidden -> input; input size follows the dataset."""

        name: str = "autoencoder"
        hidden: int = 64
        bottleneck: int = 3

        def __post_init__(self):
            super().__post_init__()
            at_least("model.hidden", self.hidden, 1, 64)
            at_least("model.bottleneck", self.bottleneck, 1, 3)

    def __init__(self, cfg: Config, sample_shape: Sequence[int], num_classes: Optional[int]):
        super().__init__(cfg)
        d = math.prod(sample_shape)
        self.encoder = nn.Sequential(nn.Linear(d, cfg.hidden), nn.ReLU(), nn.Linear(cfg.hidden, cfg.bottleneck))
        self.decoder = nn.Sequential(nn.Linear(cfg.bottleneck, cfg.hidden), nn.ReLU(), nn.Linear(cfg.hidden, d))

    def forward_loss(self, x, y):
        x = x.flatten(1)
        return F.mse_loss(self.decoder(self.encoder(x)), x)
