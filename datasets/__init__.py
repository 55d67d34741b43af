"""feedbench's datasets, one registry keyed by the names of `conf/dataset/*.yaml`.

This package is `datasets` at the top level of the project. Hugging Face's `datasets`
distribution uses the same import name; `trainer` checks at import time that this one is
the package it got (see `trainer/__init__.py`).
"""

from datasets.base import FeedDataset

FEEDBENCH = True  # marks this package as feedbench's own, not Hugging Face's


def build_dataset(cfg) -> FeedDataset:
    """Build the dataset named by `cfg.name` from its own config section."""
    if cfg.name == "synthetic":  # torchvision (a second of imports) only for the datasets that need it
        from datasets.synthetic import SyntheticDataset
        return SyntheticDataset(cfg)
    from datasets.vision import Cifar10, Mnist

    return {"mnist": Mnist, "cifar10": Cifar10}[cfg.name](cfg)
