"""What every dataset offers the loader strategies, the config keys common to all of them, and
the registry each dataset file adds its datasets to.

Two paths to the same samples:
- `per_sample()`: a map-style `torch.utils.data.Dataset` whose items are model-ready
  (float, normalised) – what DataLoader-based strategies iterate, as the seeds did;
- the tensor path: `load_chunk(i)` returns chunk `i` as one host tensor in its storage
  dtype (uint8 for images) plus labels, and `on_device(x)` turns a copied batch into the
  model input *after* the host->device copy (4x fewer bytes over PCIe for uint8 images).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
from omegaconf import MISSING

from trainer.config import Registry

DATASETS = Registry("dataset")  # `dataset=<name>`: every dataset of datasets/, registered by its own file


@dataclass
class DatasetConfig:
    """Common to every dataset; a dataset's own `Config` extends it."""

    name: str = MISSING  # the dataset (`dataset=synthetic`), set by its Config
    seed: int = 0  # seeds data generation (synthetic) and fixed labels


class FeedDataset:
    """Base class: subclasses set `sample_shape`, `storage_dtype`, `num_classes` and the loaders."""

    sample_shape: Tuple[int, ...]
    storage_dtype: torch.dtype
    num_classes: Optional[int]
    chunk_samples: int  # samples in every chunk but possibly the last

    def __len__(self) -> int:
        raise NotImplementedError

    # -- per-sample path -----------------------------------------------------------------
    def per_sample(self) -> torch.utils.data.Dataset:
        """Map-style dataset of model-ready `(x, y)` items."""
        raise NotImplementedError

    # -- tensor path ---------------------------------------------------------------------
    @property
    def num_chunks(self) -> int:
        return math.ceil(len(self) / self.chunk_samples)

    def chunk_range(self, i: int) -> Tuple[int, int]:
        start = i * self.chunk_samples
        return start, min(start + self.chunk_samples, len(self))

    def load_chunk(self, i: int, out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Chunk `i` as `(x, y)` host tensors; `x` is written into `out[:n]` when given
        (so a caller can load straight into page-locked memory it allocated once)."""
        raise NotImplementedError

    def on_device(self, x: torch.Tensor) -> torch.Tensor:
        """Turn a batch of the tensor path into the model input, where it now lives."""
        return x

    def check_block(self, what: str) -> None:
        """Before `what` (a strategy) holds the whole dataset in one block of its storage dtype:
        refuse in one line if this dataset says it must not (an image folder past its
        `max_host_mb`). The strategies check the host's free memory themselves."""

    @property
    def per_sample_finish(self) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
        """What turns a copied batch of the per-sample path into the model input, for a dataset
        whose per-sample items cross the link in their storage dtype (an image folder with
        `dataset.batch_dtype=uint8`); None: they are the model input already."""
        return None

    @property
    def sample_bytes(self) -> int:
        return math.prod(self.sample_shape) * torch.empty((), dtype=self.storage_dtype).element_size()

    @property
    def nbytes(self) -> int:
        """Bytes of the whole dataset in its storage dtype (what a resident copy needs)."""
        return len(self) * self.sample_bytes

    @property
    def per_sample_bytes(self) -> int:
        """Host memory `per_sample()` allocates for its samples: the whole dataset here (the
        synthetic data is materialised); none for a dataset that reads each sample when asked."""
        return self.nbytes

    def example(self, device: torch.device) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """One model input as a batch of one on `device`, and its label (None: the samples have
        none): what a model is checked on before the run."""
        x = torch.zeros((1, *self.sample_shape), dtype=self.storage_dtype, device=device)
        return self.on_device(x), torch.zeros(1, dtype=torch.int64, device=device)


def to_unit_float(x: torch.Tensor) -> torch.Tensor:
    """uint8 -> float32 in [0, 1], bit-identical on CPU and GPU. `x.float().div(255)` is not: CUDA
    turns division by a Python scalar into multiplication by its reciprocal, which rounds
    differently for about half of the 256 values; dividing by a tensor on the device does not."""
    return x.float().div_(torch.full((), 255.0, device=x.device))
