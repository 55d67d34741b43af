"""feedbench's models; each file registers its own in `MODELS` under the name of its `Config`
(`model=mlp`), so adding a model is adding its file. Each exposes `loss(x, y)` for the engine's step."""

from __future__ import annotations

import copy
import itertools
import math
from typing import Callable, Optional, Sequence, Tuple

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


class BuiltOnce:
    """One model's initial weights for many short runs of one process (the advisor's rungs): built
    once from its config section, then copied for each run straight onto the run's device. Every
    run it serves starts from the same weights, those the run's seed (`engine.seed`) gives the
    model built from a freshly seeded CPU generator, and the process's generators are left as they
    were: what a run's loader drew from them before (strategies differ) changes neither. Building
    the compute-bound preset's 537M parameters takes the host 2-3 s a run (`kaiming_uniform_` on
    one core); the copy, a tenth of that. Built anew when the section, the data's shape or the
    seed differ; a model without weights (`model=noop`, the advisor's feed-alone rungs) is built
    for its run and leaves the kept one alone. Built for each run instead: a model larger than
    `keep_at_most()` bytes (the advisor: a quarter of the host's free memory), or one a copy
    could not reproduce (a parameter of a subclass of `nn.Parameter` or with attributes of its
    own; `deepcopy` refusing). Hooks registered on the kept model are deep-copied with it: one
    that holds the module it was registered on in a closure would keep pointing at the kept one."""

    def __init__(self, keep_at_most: Optional[Callable[[], float]] = None):
        self.keep_at_most = keep_at_most or (lambda: math.inf)
        self.key, self.model = None, None

    def __call__(self, cfg, sample_shape: Sequence[int], num_classes: Optional[int], device) -> FeedModel:
        from omegaconf import OmegaConf

        seed = torch.initial_seed()  # the run's engine.seed: the run seeds the generator first
        key = (OmegaConf.to_yaml(cfg, resolve=True), tuple(sample_shape), num_classes, seed)
        if key != self.key:
            with torch.random.fork_rng(devices=[]):
                torch.default_generator.manual_seed(seed)  # (torch.manual_seed would reseed the GPUs' too)
                model = build_model(cfg, sample_shape, num_classes)
            nbytes = sum(t.nbytes for t in itertools.chain(model.parameters(), model.buffers()))
            if nbytes == 0 or nbytes > self.keep_at_most() or not _copyable(model):
                return model.to(device)
            self.key, self.model = key, model
        try:
            return self._copy(device)
        except Exception:  # deepcopy refused (a lock, an open file): this one goes to the run as it is
            model, self.key, self.model = self.model, None, None
            return model.to(device)

    def _copy(self, device) -> FeedModel:
        # deepcopy takes each tensor from `memo` where it finds it there: the parameters and
        # buffers are copied once, straight to the device, and shared ones stay shared.
        memo = {id(p): nn.Parameter(p.detach().to(device, copy=True), requires_grad=p.requires_grad)
                for p in self.model.parameters()}
        memo.update({id(b): b.detach().to(device, copy=True) for b in self.model.buffers()})
        return copy.deepcopy(self.model, memo)


def _copyable(model: nn.Module) -> bool:
    """Whether `BuiltOnce._copy` reproduces the model's parameters: plain `nn.Parameter`s, with no
    attributes of their own (a copy makes plain ones)."""
    return all(type(p) is nn.Parameter and not p.__dict__ for p in model.parameters())
