"""The job's config: the engine, tracking and distributed sections, and the registries through
which every component (dataset, loader strategy, model) adds its own.

Each component class carries a small typed `Config` dataclass beside its code; registering the
class (`@LOADERS.register`) stores that dataclass in Hydra's ConfigStore as its group's option
(`loader=prefetch`), so a typo (`loader.pin_memroy=true`) or a wrong type (`loader.batch_size=abc`)
fails when Hydra composes the config, before anything runs. Range checks live in each dataclass's
`__post_init__`, which runs when the composed config is turned into these objects
(`trainer.validate.validate`); each component then receives only its own object.

This module imports no component: the packages `datasets`, `models` and `trainer.loaders` register
their options when imported (`trainer.components` imports all three).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from trainer.errors import ConfigError, at_least
from trainer.launch import launch_time

PROJECT_ROOT = Path(__file__).resolve().parent.parent  # a checkout's root (site-packages once installed)
# A wheel carries the checkout's conf/ inside the package (pyproject.toml maps it to trainer/conf);
# in a checkout (an editable install) that folder does not exist and conf/ is read where it is.
_PACKAGED_CONF = Path(__file__).resolve().parent / "conf"
INSTALLED = _PACKAGED_CONF.is_dir()
CONF_DIR = _PACKAGED_CONF if INSTALLED else PROJECT_ROOT / "conf"
# Where outputs/ (runs, Hydra's folders) and data/ go: the checkout's root, wherever you launch
# from; for an installed package, the current directory (Hydra >= 1.2 does not change it).
BASE_DIR = Path.cwd() if INSTALLED else PROJECT_ROOT

OPTIMIZERS = ("adam", "adamw", "sgd")
LOOPS = ("feedbench", "lightning")
MAX_EXPERIMENT_NAME_LENGTH = 500  # MLflow's (mlflow.utils.validation): it refuses a longer name


# ----------------------------------------------------------------------------- registries
class Registry(dict):
    """One config group's options, `name -> component class`. Each class carries its `Config`
    dataclass, whose `name` default is the option's name; registering the class also stores that
    dataclass in Hydra's ConfigStore as the group's option, so it composes with no YAML file."""

    def __init__(self, group: str):
        super().__init__()
        self.group = group

    def register(self, cls: type) -> type:
        """Class decorator: `@LOADERS.register` above a strategy makes it `loader=<its Config.name>`."""
        name = cls.Config.name
        cls.Config.__name__ = f"{cls.__name__}.Config"  # Hydra's messages name it (`not in 'PrefetchLoader.Config'`)
        self[name] = cls
        ConfigStore.instance().store(group=self.group, name=name, node=cls.Config)
        return cls

    def config(self, section):
        """`section` as its option's typed Config, checked by the Config's `__post_init__`: from a
        section of a composed config, or of one read from a YAML file; a Config is returned as is."""
        if not isinstance(section, DictConfig):
            return section
        if section.name not in self:
            raise ConfigError(f"{self.group}.name must be one of {', '.join(self)} (got {section.name!r}): "
                              f"set {self.group}=<one of them>")
        # A plain dict first: interpolations resolve against the whole config, and an untyped
        # section (read from a file) is checked against the Config's keys and types.
        values = OmegaConf.to_container(section, resolve=True)
        return OmegaConf.to_object(OmegaConf.merge(self[section.name].Config, values))

    def build(self, section, *args, **kwargs):
        """The component `section` names, made from its typed Config and `args`."""
        cfg = self.config(section)
        return self[cfg.name](cfg, *args, **kwargs)


def import_modules(package: str, path: Iterable[str]) -> None:
    """Import every module of a package (`__name__`, `__path__`): each component file registers
    itself, so a new option is one new file."""
    for module in pkgutil.iter_modules(path):
        importlib.import_module(f"{package}.{module.name}")


# ----------------------------------------------------------------------------- run
@dataclass
class OptimizerConfig:
    name: str = "adam"  # adam | sgd | adamw
    lr: float = 1e-3

    def __post_init__(self):
        if self.name not in OPTIMIZERS:
            raise ConfigError(f"engine.optimizer.name must be one of {', '.join(OPTIMIZERS)} (got {self.name!r}): "
                              f"set engine.optimizer.name=adam")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"engine.optimizer.lr must be a finite number > 0 (got {self.lr}): set engine.optimizer.lr=0.001")


@dataclass
class LightningConfig:
    """Lightning's own features under `engine.loop=lightning`: all off by default, so the two loops
    do the same work; turn one on to see what it costs."""

    logger: bool = False  # CSVLogger, and the loss sent through `self.log` at every step
    log_every_n_steps: int = 50  # how often the logger writes (Trainer's log_every_n_steps)
    checkpointing: bool = False  # ModelCheckpoint at the end of every epoch
    progress_bar: bool = False  # Lightning's progress bar (in place of feedbench's)
    model_summary: bool = False  # the model summary printed when fitting starts


@dataclass
class EngineConfig:
    loop: str = "feedbench"  # feedbench | lightning: the loop that drives the steps (lightning: Lightning's Trainer)
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0  # model init and shuffling
    epochs: int = 3  # passes over the data when max_steps=0
    max_steps: int = 0  # the run's length in steps, over as many epochs as it takes (0: `epochs` passes)
    warmup_steps: int = 5  # excluded from the summaries
    verify: bool = False  # checksum every batch on the device (tag data_checksum)
    progress: bool = True  # tqdm bar on stderr (only on a terminal)
    quiet: bool = False  # no summary on stderr when the run ends (`python -m trainer -q`)
    cuda_graph: bool = False  # capture forward+backward+step once, replay it every step
    profile: bool = False  # torch.profiler trace of the last warm-up steps (and whether its copies overlapped kernels)
    steady_heap: bool = True  # keep freed host buffers in the process (glibc), so no run's batches fault in anew (trainer.tools.heap)
    gpu_timing_every: int = 8  # CUDA events time the steps (and copies) of one run of 32 in every N; 1: all (trainer.loop.meter)
    journal_s: float = 2.0  # seconds between writes of the measured steps to the run's journal (0: none; trainer.tracking.journal)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lightning: LightningConfig = field(default_factory=LightningConfig)  # engine.loop=lightning only

    def __post_init__(self):
        at_least("engine.epochs", self.epochs, 1, "1 (or set engine.max_steps, the run's length in steps)")
        at_least("engine.max_steps", self.max_steps, 0, "0 (run engine.epochs passes)")
        at_least("engine.warmup_steps", self.warmup_steps, 0, 5)
        at_least("engine.gpu_timing_every", self.gpu_timing_every, 1, 8)
        at_least("engine.journal_s", self.journal_s, 0, "2 (or 0: no journal)")
        if self.loop not in LOOPS:
            raise ConfigError(f"engine.loop must be one of {', '.join(LOOPS)} (got {self.loop!r}): set engine.loop=feedbench")
        if self.loop == "lightning":
            self._check_lightning()

    def _check_lightning(self) -> None:
        if importlib.util.find_spec("lightning") is None:
            raise ConfigError("engine.loop=lightning needs the lightning package: pip install 'feedbench[lightning]' "
                              "(or pip install lightning), or set engine.loop=feedbench")
        if self.cuda_graph:
            # Lightning's automatic optimization runs forward, backward and the optimizer step itself, in
            # its closure: there is no single step function to capture.
            raise ConfigError("engine.cuda_graph=true cannot be used with engine.loop=lightning (Lightning runs the step "
                              "itself): set engine.cuda_graph=false, or engine.loop=feedbench")
        at_least("engine.lightning.log_every_n_steps", self.lightning.log_every_n_steps, 1, 50)


@dataclass
class TrackingConfig:
    uri: Optional[str] = None  # MLflow tracking URI (None = sqlite outputs/mlflow.db)
    experiment: str = "feedbench"
    run_name: Optional[str] = None  # None: MLflow's random name, or the swept values in a sweep
    system_metrics: bool = False  # MLflow system metrics (CPU, memory; GPU with nvidia-ml-py); needs psutil
    system_metrics_interval_s: float = 1.0  # seconds between system-metric samples
    parent_run_id: Optional[str] = None  # nest the run under this MLflow run (a sweep sets it per job)
    sweep_name: Optional[str] = None  # name of a multirun's parent run (None = the swept overrides)

    def __post_init__(self):
        if not self.experiment:
            raise ConfigError("tracking.experiment must be a non-empty name (got ''): set tracking.experiment=feedbench")
        if len(self.experiment) > MAX_EXPERIMENT_NAME_LENGTH:
            raise ConfigError(f"tracking.experiment must be at most {MAX_EXPERIMENT_NAME_LENGTH} characters (got "
                              f"{len(self.experiment)}): set tracking.experiment=feedbench")


@dataclass
class DistributedConfig:
    """Runs under torchrun (`torchrun --nproc_per_node=N -m trainer ...`); ignored in one process."""

    timeout_s: float = 300.0  # how long the ranks' own collectives (errors, results after the loop) wait for a rank

    def __post_init__(self):
        if not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            raise ConfigError(f"distributed.timeout_s must be a finite number of seconds > 0 (got {self.timeout_s}): "
                              f"set distributed.timeout_s=300")


@dataclass
class Config:
    """The whole job. `dataset`, `loader` and `model` are their chosen option's own Config
    (`loader=prefetch`: `PrefetchLoader.Config`), stored by the registries."""

    dataset: Any = MISSING
    loader: Any = MISSING
    model: Any = MISSING
    engine: EngineConfig = field(default_factory=EngineConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)


def register() -> None:
    """Store the job's schema (`conf/config.yaml` starts from it) and the resolvers its folders use."""
    ConfigStore.instance().store(name="config_schema", node=Config)
    if not OmegaConf.has_resolver("base_dir"):
        OmegaConf.register_new_resolver("base_dir", lambda: str(BASE_DIR))  # Hydra's folders: under outputs/ there
    if not OmegaConf.has_resolver("launch_time"):
        # `${now:}` as rank 0 read it: under torchrun every rank composes its own config, and
        # Hydra's output folder would otherwise differ from rank to rank. Cached, like `now`.
        OmegaConf.register_new_resolver("launch_time", launch_time, use_cache=True)


register()
