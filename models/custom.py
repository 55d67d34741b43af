"""`model=custom`: your own `nn.Module`, made by the callable `model._target_` names (its module on
PYTHONPATH, the keys you add, `+model.hidden=256`, as its keyword arguments), and the loss its
output meets, `model.loss`:

- `cross_entropy`: `F.cross_entropy(module(x), y)`, class scores against the labels;
- `mse`: `F.mse_loss(module(x), x)`, a reconstruction against the input;
- `none`: `module(x, y)` returns the loss itself;
- an import path, `my_losses.focal`: `focal(module(x), y)` (a class, `torch.nn.SmoothL1Loss`, is
  made once with no arguments, then called).

The module goes through its loss on one sample of the dataset before the run (`check`): an output
that does not fit is one line naming `model.loss` or the module, not a shape error at step 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from models.base import MODELS, FeedModel, ModelConfig
from trainer.config import call_target, locate
from trainer.errors import ConfigError

LOSSES = ("cross_entropy", "mse", "none")  # and any import path of a loss(output, y)


class ModuleModel(FeedModel):
    """A module feedbench did not write, trained with the loss `loss` names (see the module's docstring)."""

    def __init__(self, cfg: ModelConfig, module: nn.Module, loss: str, num_classes: Optional[int], what: str):
        super().__init__(cfg)
        self.module, self.loss_name, self.num_classes, self.what = module, loss, num_classes, what
        self.reconstructs = loss == "mse"  # the target is the input, not the label
        self.criterion = None if loss == "none" else _criterion(loss)

    def outputs(self, x: torch.Tensor):
        """The module's output for `x`, as the loss takes it."""
        return self.module(x)

    def forward_loss(self, x, y):
        if self.criterion is None:
            return self.module(x, y)
        return self.criterion(self.outputs(x), x if self.reconstructs else y)

    def check(self, x, y):
        if y is None and self.loss_name == "cross_entropy":
            raise ConfigError(f"model.loss={self.loss_name} needs labels, and the dataset's samples have none: set "
                              f"model.loss=mse (a reconstruction of x), or none (the module returns its loss)")
        y = torch.zeros(len(x), dtype=torch.int64, device=x.device) if y is None else y
        training = self.training
        self.eval()  # the check leaves no trace: no BatchNorm statistics, no dropout draw
        try:
            with torch.no_grad():
                if self.criterion is None:
                    loss = self.module(x, y)
                else:
                    out = self.outputs(x)
                    self._check_output(out, x, y)
                    loss = self.criterion(out, x if self.reconstructs else y)
        except ConfigError:
            raise
        except Exception as e:
            first = next((line for line in str(e).splitlines() if line.strip()), "")
            raise ConfigError(f"{self.what} with model.loss={self.loss_name} fails on one sample of the dataset "
                              f"(x {_shape(x)}): {type(e).__name__}: {first.strip()}: make the module take the "
                              f"dataset's samples, or set model.loss to what its output is") from e
        finally:
            self.train(training)
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()):
            found = _shape(loss) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ConfigError(f"{self.what} with model.loss={self.loss_name} gives a loss of {found}, not one number: "
                              f"return a scalar loss")

    def _check_output(self, out, x: torch.Tensor, y: torch.Tensor) -> None:
        """The output against what `model.loss` takes (a built-in loss; a loss of the user's checks itself)."""
        if not isinstance(out, torch.Tensor):
            raise ConfigError(f"{self.what} returns a {type(out).__name__}, not a tensor: return one tensor from "
                              f"forward(x), or set model.loss=none and return the loss from forward(x, y)")
        if self.reconstructs and out.shape != x.shape:
            raise ConfigError(f"model.loss=mse compares the output with the input x {_shape(x)}, and {self.what} returns "
                              f"{_shape(out)}: return an output shaped like x, or set model.loss=cross_entropy")
        if self.loss_name != "cross_entropy":
            return
        if out.ndim != 2 or len(out) != len(x):
            raise ConfigError(f"model.loss=cross_entropy takes class scores [batch, classes], and {self.what} returns "
                              f"{_shape(out)} for a batch of {len(x)}: return [batch, classes] scores, or set "
                              f"model.loss=mse (a reconstruction of x)")
        labels = int(y.max()) + 1 if y.ndim == 1 and not y.is_floating_point() else 0
        classes = max(self.num_classes or 0, labels)
        if out.shape[1] < classes:
            raise ConfigError(f"{self.what} returns {out.shape[1]} class scores, and the dataset has {classes} classes: "
                              f"return at least {classes} scores per sample")


def _criterion(loss: str):
    """The loss function `model.loss` names, called as `criterion(output, target)`."""
    if loss == "cross_entropy":
        return F.cross_entropy
    if loss == "mse":
        return F.mse_loss
    found = locate("model.loss", loss) if "." in loss else None
    if isinstance(found, type):
        try:
            found = found()  # a loss class (`torch.nn.SmoothL1Loss`): made once
        except Exception as e:
            raise ConfigError(f"model.loss={loss} cannot be made with no arguments ({type(e).__name__}: {e}): name a "
                              f"loss function, or a function that returns the loss module you want") from e
    if not callable(found):
        raise ConfigError(f"model.loss must be one of {', '.join(LOSSES)} or the import path of a loss(output, y) "
                          f"(got {loss!r}): set model.loss=cross_entropy")
    return found


def _shape(t: torch.Tensor) -> str:
    return str(list(t.shape))


@MODELS.register
class CustomModel(ModuleModel):
    @dataclass
    class Config(ModelConfig):
        """Your own nn.Module: `_target_` names a callable (its module on PYTHONPATH) that returns it; the keys
        you add (`+model.hidden=256`) are its keyword arguments; `loss` is what its output meets."""

        name: str = "custom"
        _target_: str = ""  # import path of a class or function returning an nn.Module, e.g. my_model.Net
        # cross_entropy (scores vs y) | mse (output vs x) | none (forward(x, y) returns it) | import path of loss(output, y)
        loss: str = "cross_entropy"
        kwargs: Dict[str, Any] = field(default_factory=dict)  # the callable's keyword arguments: `+model.<name>=<value>`

    def __init__(self, cfg: Config, sample_shape: Sequence[int], num_classes: Optional[int]):
        what = f"model._target_={cfg._target_}"
        module = call_target("model._target_", cfg._target_, dict(cfg.kwargs))
        if not isinstance(module, nn.Module):
            raise ConfigError(f"{what} returned a {type(module).__module__}.{type(module).__name__}, not a "
                              f"torch.nn.Module: return the module (an nn.Module class, or a function that builds one)")
        super().__init__(cfg, module, cfg.loss, num_classes, what)
