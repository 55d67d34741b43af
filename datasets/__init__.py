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
    tool's rounds): built from its config section, handed again while the section is the same."""

    def __init__(self):
        self.key, self.dataset = None, None

    def __call__(self, cfg) -> FeedDataset:
        from omegaconf import OmegaConf
        key = OmegaConf.to_yaml(cfg)
        if key != self.key:
            self.key, self.dataset = None, None  # the last one's memory goes before the next is built
            self.dataset, self.key = build_dataset(cfg), key
        return self.dataset
