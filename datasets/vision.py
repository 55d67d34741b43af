"""MNIST and CIFAR-10 through torchvision's own dataset classes."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torchvision
from torchvision import transforms

from datasets.base import FeedDataset


class _Vision(FeedDataset):
    tv_class: type
    mean: Tuple[float, ...]
    std: Tuple[float, ...]

    def __init__(self, cfg):
        self.cfg = cfg
        self.tv = self.tv_class(root=cfg.root, train=cfg.train, download=cfg.download)
        x = torch.as_tensor(self.tv.data)
        x = x.unsqueeze(1) if x.ndim == 3 else x.permute(0, 3, 1, 2)  # N x C x H x W
        n = cfg.num_samples or len(x)
        self.x = x[:n].contiguous()
        self.y = torch.as_tensor(self.tv.targets)[:n].long()
        self.sample_shape = tuple(self.x.shape[1:])
        self.storage_dtype = torch.uint8
        self.num_classes = 10
        self.chunk_samples = len(self.x)

    def __len__(self) -> int:
        return len(self.x)

    def per_sample(self):
        self.tv.transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize(self.mean, self.std)])
        return torch.utils.data.Subset(self.tv, range(len(self)))

    def load_chunk(self, i: int, out: Optional[torch.Tensor] = None):
        start, stop = self.chunk_range(i)
        x = self.x[start:stop]
        if out is not None:
            out[: len(x)].copy_(x)
            x = out[: len(x)]
        return x, self.y[start:stop]

    def on_device(self, x: torch.Tensor) -> torch.Tensor:
        # Same ops, same order as ToTensor + Normalize, so both paths give identical values.
        mean = torch.tensor(self.mean, device=x.device).view(-1, 1, 1)
        std = torch.tensor(self.std, device=x.device).view(-1, 1, 1)
        return x.float().div(255).sub_(mean).div_(std)


class Mnist(_Vision):
    tv_class = torchvision.datasets.MNIST
    mean, std = (0.1307,), (0.3081,)


class Cifar10(_Vision):
    tv_class = torchvision.datasets.CIFAR10
    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
