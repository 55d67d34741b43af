"""`model=torchvision model.arch=resnet18`: any classification model of `torchvision.models`, by the
name `torchvision.models.get_model` knows, untrained (`weights=None`: nothing is downloaded). Its
first convolution takes the dataset's channels and its classifier the dataset's classes; it is
trained with cross-entropy.

torchvision (a second of imports) is imported when this model is chosen, not when it registers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, Optional, Sequence

from torch import nn

from models.base import MODELS, ModelConfig
from models.custom import ModuleModel
from trainer.errors import ConfigError


@MODELS.register
class TorchvisionModel(ModuleModel):
    @dataclass
    class Config(ModelConfig):
        """A classification model of torchvision.models by name, untrained; input channels and classes follow the dataset."""

        min_classes: ClassVar[int] = 2
        name: str = "torchvision"
        arch: str = "resnet18"  # a name of torchvision.models.list_models(module=torchvision.models)
        kwargs: Dict[str, Any] = field(default_factory=dict)  # more keyword arguments of get_model (`+model.dropout=0.2`)

        def __post_init__(self):
            super().__post_init__()
            import torchvision

            known = torchvision.models.list_models(module=torchvision.models)
            if self.arch not in known:
                raise ConfigError(f"model.arch must be a classification model of torchvision.models (got {self.arch!r}): "
                                  f"set model.arch=resnet18 (all {len(known)}: python -c \"import torchvision; "
                                  f"print(torchvision.models.list_models(module=torchvision.models))\")")

    def __init__(self, cfg: Config, sample_shape: Sequence[int], num_classes: Optional[int]):
        from torchvision import models

        if len(sample_shape) != 3:
            raise ConfigError(f"model=torchvision takes images, samples of channels x height x width (got samples of "
                              f"shape {list(sample_shape)}): use a dataset of images, e.g. dataset.shape=[3,32,32]")
        if not num_classes:
            raise ConfigError("model=torchvision sizes its classifier by the dataset's classes, and the dataset does not "
                              "say how many: set dataset.num_classes=<N>")
        try:
            module = models.get_model(cfg.arch, weights=None, num_classes=num_classes, **cfg.kwargs)
        except Exception as e:
            raise ConfigError(f"model.arch={cfg.arch}: torchvision.models.get_model failed ({type(e).__name__}: {e}): "
                              f"fix the +model.* keys (its keyword arguments)") from e
        _take_channels(module, sample_shape[0])
        super().__init__(cfg, module, "cross_entropy", num_classes, f"model=torchvision model.arch={cfg.arch}")

    def outputs(self, x):
        out = self.module(x)
        # googlenet and inception_v3 return (logits, auxiliary logits) while training
        return out[0] if isinstance(out, tuple) else out


def _take_channels(module: nn.Module, channels: int) -> None:
    """Make the model's first convolution take `channels` input channels (torchvision's take 3)."""
    name, conv = next(((n, m) for n, m in module.named_modules() if isinstance(m, nn.Conv2d)), (None, None))
    if conv is None or conv.in_channels == channels:
        return
    parent, _, attr = name.rpartition(".")
    setattr(module.get_submodule(parent), attr,
            nn.Conv2d(channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding, conv.dilation,
                      conv.groups, conv.bias is not None, conv.padding_mode))
