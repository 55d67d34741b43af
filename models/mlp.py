"""A small MLP classifier (the mnist_mlp preset's 784-512-10)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Optional, Sequence

from torch import nn
from torch.nn import functional as F

from models.base import MODELS, FeedModel, ModelConfig
from trainer.errors import at_least


@MODELS.register
class Mlp(FeedModel):
    """A small classifier: flatten -> hidden -> classes (cross-entropy)."""

    @dataclass
    class Config(ModelConfig):
        """MLP classifier: flatten -> hidden -> classes; input size and classes follow the dataset."""

        min_classes: ClassVar[int] = 2
        name: str = "mlp"
        hidden: int = 512

        def __post_init__(self):
            super().__post_init__()
            at_least("model.hidden", self.hidden, 1, 512)

    def __init__(self, cfg: Config, sample_shape: Sequence[int], num_classes: Optional[int]):
        super().__init__(cfg)
        if not num_classes:
            raise ValueError("model=mlp needs a dataset with labels (dataset.num_classes >= 2): use model=autoencoder or model=noop")
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(sample_shape), cfg.hidden), nn.ReLU(), nn.Linear(cfg.hidden, num_classes))

    def forward_loss(self, x, y):
        return F.cross_entropy(self.net(x), y)
