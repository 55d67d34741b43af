"""feedbench's models; each file registers its own in `MODELS` under the name of its `Config`
(`model=mlp`), so adding a model is adding its file. Each exposes `loss(x, y)` for the engine's step."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from torch import nn

from models.base import MODELS, FeedModel
from trainer.config import import_modules

import_modules(__name__, __path__)


def build_model(cfg, sample_shape: Sequence[int], num_classes: Optional[int]) -> FeedModel:
    """Build the model `cfg` names (its typed Config, or its section of a composed config), sized for the dataset."""
    return MODELS.build(cfg, sample_shape, num_classes)


def layer_sizes(cfg, sample_shape: Sequence[int], num_classes: Optional[int]) -> Tuple[int, int]:
    """(parameters, the layers' output widths added up) of the model `cfg.name` names, counted on
    the meta device: nothing is allocated, however large the model."""
    with torch.device("meta"):
        model = build_model(cfg, sample_shape, num_classes)
    params = sum(p.numel() for p in model.parameters())
    return params, sum(m.out_features for m in model.modules() if isinstance(m, nn.Linear))
