"""`dataset=custom`: your own data, made by the callable `dataset._target_` names, with the
section's other keys as its keyword arguments (Hydra's `_target_` convention):

    PYTHONPATH=/my/code python -m trainer dataset=custom dataset._target_=my_data.make +dataset.root=/data/x

The callable returns a map-style `torch.utils.data.Dataset` of `x` or `(x, y)` samples, or a pair
of tensors `(x, y)` (N samples each). Every strategy runs on it (`datasets.samples`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch

from datasets.base import DATASETS, DatasetConfig
from datasets.samples import SampleDataset
from trainer.config import call_target
from trainer.errors import ConfigError, at_least

KEY = "dataset._target_"


@DATASETS.register
class CustomDataset(SampleDataset):
    @dataclass
    class Config(DatasetConfig):
        """Your own dataset: `_target_` names a callable (its module on PYTHONPATH) returning a map-style
        Dataset of `x` or `(x, y)` samples, or a pair of tensors; the keys you add (`+dataset.root=/data`)
        are its keyword arguments."""

        name: str = "custom"
        _target_: str = ""  # import path of the callable, e.g. my_data.make_dataset
        num_classes: Optional[int] = None  # classes of y (None: the dataset's `classes`, or a tensor y's max + 1)
        read_workers: int = 0  # processes reading the samples into a one-block strategy's block (0: this one)
        kwargs: Dict[str, Any] = field(default_factory=dict)  # the callable's keyword arguments: `+dataset.<name>=<value>`

        def __post_init__(self):
            at_least("dataset.read_workers", self.read_workers, 0, 0)
            if self.num_classes is not None:
                at_least("dataset.num_classes", self.num_classes, 1, "null (read from the dataset)")

    def __init__(self, cfg: Config):
        self.cfg = cfg
        what = f"{KEY}={cfg._target_}"
        made = call_target(KEY, cfg._target_, dict(cfg.kwargs))
        samples, block = _samples(made, what)
        super().__init__(samples, what, _classes(cfg, made, block), cfg.read_workers, block)


def _samples(made, what: str) -> Tuple[Any, Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]]]:
    """`(samples, block)`: the map-style dataset `made` is, and its tensors when it is tensors."""
    arrays = (torch.Tensor, np.ndarray)
    if isinstance(made, arrays):
        x = torch.as_tensor(made)
        return torch.utils.data.TensorDataset(x), (x, None)
    if isinstance(made, (tuple, list)) and len(made) == 2 and all(isinstance(t, arrays) for t in made):
        x, y = (torch.as_tensor(t) for t in made)
        if len(x) != len(y):
            raise ConfigError(f"{what} returned {len(x)} samples of x but {len(y)} of y: return N samples of each")
        return torch.utils.data.TensorDataset(x, y), (x, y)
    if isinstance(made, torch.utils.data.IterableDataset):
        raise ConfigError(f"{what} returned an IterableDataset, whose samples cannot be asked for by index: return a "
                          f"map-style torch.utils.data.Dataset (with __getitem__ and __len__)")
    if not (hasattr(made, "__getitem__") and hasattr(made, "__len__")):
        raise ConfigError(f"{what} returned a {type(made).__module__}.{type(made).__name__}, not a dataset: return a "
                          f"map-style torch.utils.data.Dataset of (x, y) samples, or a pair of tensors (x, y)")
    return made, None


def _classes(cfg, made, block) -> Optional[int]:
    """`dataset.num_classes`, else what the dataset says (`classes`, as torchvision's have), else the
    largest class number + 1 of a tensor pair; None when unknown."""
    if cfg.num_classes is not None:
        return cfg.num_classes
    classes = getattr(made, "classes", None)
    if isinstance(classes, (list, tuple)) and classes:
        return len(classes)
    y = block[1] if block is not None else None
    if y is not None and len(y) and not (y.is_floating_point() or y.is_complex()):
        return int(y.max()) + 1
    return None
