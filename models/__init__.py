"""feedbench's models, one registry keyed by the names of `conf/model/*.yaml`.

Every model takes its input size from the dataset (`sample_shape`, `num_classes`), never from
a number kept by hand in its config, and exposes `loss(x, y)` for the engine's step.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn import functional as F

from models.busy import DeviceBusy


class FeedModel(nn.Module):
    """Base: `loss(x, y)` runs the forward pass (plus `busy_ms` of emulated device work)."""

    def __init__(self, cfg):
        super().__init__()
        if cfg.busy_ms < 0:
            raise ValueError(f"model.busy_ms must be >= 0 (got {cfg.busy_ms}): set model.busy_ms=0")
        self.busy = DeviceBusy(cfg.busy_ms)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.busy(x.device)
        return self.forward_loss(x, y)

    def forward_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Autoencoder(FeedModel):
    """Seed 000's autoencoder: flatten -> hidden -> bottleneck -> hidden -> reconstruction (MSE)."""

    def __init__(self, cfg, sample_shape: Sequence[int], num_classes: Optional[int]):
        super().__init__(cfg)
        d = math.prod(sample_shape)
        self.encoder = nn.Sequential(nn.Linear(d, cfg.hidden), nn.ReLU(), nn.Linear(cfg.hidden, cfg.bottleneck))
        self.decoder = nn.Sequential(nn.Linear(cfg.bottleneck, cfg.hidden), nn.ReLU(), nn.Linear(cfg.hidden, d))

    def forward_loss(self, x, y):
        x = x.flatten(1)
        return F.mse_loss(self.decoder(self.encoder(x)), x)


class Mlp(FeedModel):
    """Seed 003's classifier: flatten -> hidden -> classes (cross-entropy)."""

    needs_labels = True

    def __init__(self, cfg, sample_shape: Sequence[int], num_classes: Optional[int]):
        super().__init__(cfg)
        if not num_classes:
            raise ValueError("model=mlp needs a dataset with labels (dataset.num_classes >= 2): use model=autoencoder or model=noop")
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(sample_shape), cfg.hidden), nn.ReLU(), nn.Linear(cfg.hidden, num_classes))

    def forward_loss(self, x, y):
        return F.cross_entropy(self.net(x), y)


class Noop(FeedModel):
    """No parameters, no work: the step costs only the data feed (and `busy_ms`)."""

    def __init__(self, cfg, sample_shape: Sequence[int], num_classes: Optional[int]):
        super().__init__(cfg)

    def forward_loss(self, x, y):
        return x.new_zeros((), dtype=torch.float32)


MODELS = {"autoencoder": Autoencoder, "mlp": Mlp, "noop": Noop}


def build_model(cfg, sample_shape: Sequence[int], num_classes: Optional[int]) -> FeedModel:
    """Build the model named by `cfg.name`, sized for the dataset."""
    return MODELS[cfg.name](cfg, sample_shape, num_classes)


def layer_sizes(cfg, sample_shape: Sequence[int], num_classes: Optional[int]) -> Tuple[int, int]:
    """(parameters, the layers' output widths added up) of the model `cfg.name` names, counted on
    the meta device: nothing is allocated, however large the model."""
    with torch.device("meta"):
        model = build_model(cfg, sample_shape, num_classes)
    params = sum(p.numel() for p in model.parameters())
    return params, sum(m.out_features for m in model.modules() if isinstance(m, nn.Linear))
