"""Loader strategies, one registry keyed by the names of `conf/loader/*.yaml`.

Each strategy wraps a dataset and yields device-ready `(x, y)` batches; any training loop can
iterate one directly:

    loader = build_loader(cfg.loader, dataset, torch.device("cuda"))
    for x, y in loader: ...
"""

from __future__ import annotations

import torch

from trainer.loaders.base import DeviceLoader
from trainer.loaders.baseline import BaselineLoader
from trainer.loaders.gpu_resident import GpuResidentLoader
from trainer.loaders.order import Shard
from trainer.loaders.pinned import PinnedLoader
from trainer.loaders.pinned_chunk import PinnedChunkLoader
from trainer.loaders.pinned_gather import PinnedGatherLoader
from trainer.loaders.pinned_uva import PinnedUvaLoader
from trainer.loaders.prefetch import PrefetchLoader
from trainer.loaders.seed_iterable import SeedIterableLoader

LOADERS = {
    "baseline": BaselineLoader,
    "pinned": PinnedLoader,
    "prefetch": PrefetchLoader,
    "pinned_chunk": PinnedChunkLoader,
    "pinned_gather": PinnedGatherLoader,
    "pinned_uva": PinnedUvaLoader,
    "gpu_resident": GpuResidentLoader,
    "seed_iterable": SeedIterableLoader,
}


def build_loader(cfg, dataset, device: torch.device, seed: int = 0, shard: Shard = Shard()) -> DeviceLoader:
    """Build the strategy named by `cfg.name` from its own config section; under torchrun,
    over this rank's `shard` of every epoch."""
    return LOADERS[cfg.name](cfg, dataset, device, seed, shard)
