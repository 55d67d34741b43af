"""Every component's config group: importing this module imports the dataset, loader and model
packages, whose files register their options (`loader=prefetch`) with Hydra's ConfigStore. Import
it before composing a config (`python -m trainer` does, through `trainer.loop.run`)."""

from datasets import DATASETS
from models import MODELS
from trainer.loaders import LOADERS

REGISTRIES = {"dataset": DATASETS, "loader": LOADERS, "model": MODELS}  # config group -> its registry
