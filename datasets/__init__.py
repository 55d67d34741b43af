"""feedbench's datasets; each file registers its own in `DATASETS` under the name of its `Config`
(`dataset=mnist`), so adding a dataset is adding its file.

This package is `datasets` at the top level of the project. Hugging Face's `datasets`
distribution uses the same import name; `trainer` checks at import time that this one is
the package it got (see `trainer/__init__.py`).
"""

from datasets.base import DATASETS, FeedDataset
from trainer.config import import_modules

FEEDBENCH = True  # marks this package as feedbench's own, not Hugging Face's

import_modules(__name__, __path__)


def build_dataset(cfg) -> FeedDataset:
    """Build the dataset `cfg` names (its typed Config, or its section of a composed config)."""
    return DATASETS.build(cfg)


class BuiltOnce:
    """One dataset at a time for many short runs of one process (the advisor's rungs, the overhead
    tool's rounds): built from its config section, handed again while the section is the same.
    A dataset of more than a quarter of the host's free memory is built for each run instead: kept
    between runs (with what a run caches in it, such as the samples a DataLoader reads), it would
    compete with the next run's own buffers (a page-locked copy of it, say) for the host's memory."""

    def __init__(self):
        self.key, self.dataset = None, None

    def __call__(self, cfg) -> FeedDataset:
        from omegaconf import OmegaConf

        from trainer.memory import host_available_bytes
        key = OmegaConf.to_yaml(cfg, resolve=True)  # (an interpolated size: the value it has now)
        if key != self.key:
            self.key, self.dataset = None, None  # the last one's memory goes before the next is built
            dataset = build_dataset(cfg)
            if dataset.nbytes > host_available_bytes() / 4:
                return dataset
            self.dataset, self.key = dataset, key
        return self.dataset
