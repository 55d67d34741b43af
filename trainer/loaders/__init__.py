"""Loader strategies, one file each in this folder; each registers itself in `LOADERS` under the
name of its `Config` (`loader=prefetch`), so adding a strategy is adding its file.

Each strategy wraps a dataset and yields device-ready `(x, y)` batches; any training loop can
iterate one directly:

    loader = build_loader(cfg.loader, dataset, torch.device("cuda"))
    for x, y in loader: ...
"""

from __future__ import annotations

import torch

from trainer.config import import_modules
from trainer.loaders.base import LOADERS, DeviceLoader
from trainer.loaders.order import Shard

import_modules(__name__, __path__)


def build_loader(cfg, dataset, device: torch.device, seed: int = 0, shard: Shard = Shard()) -> DeviceLoader:
    """Build the strategy `cfg` names (its typed Config, or its section of a composed config);
    under torchrun, over this rank's `shard` of every epoch."""
    name = cfg.name if hasattr(cfg, "name") else cfg["name"]
    if name in LOADERS and not LOADERS[name].per_sample:  # it will hold the dataset in one block: may it?
        dataset.check_block(f"loader={name}")
    return LOADERS.build(cfg, dataset, device, seed, shard)


def for_any_dataset() -> list:
    """The strategies that feed every dataset: all but those that decode an image folder's files
    themselves (`gpu_decode`)."""
    return [name for name, cls in LOADERS.items() if not cls.reads_files]
