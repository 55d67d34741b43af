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

import dataclasses
import importlib
import importlib.util
import math
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from trainer.errors import ConfigError, at_least, one_of
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
# engine.optimizer.impl: torch's three implementations of an optimizer's update (`default`: torch
# picks, foreach on a GPU and the for-loop on the CPU).
OPTIMIZER_IMPLS = ("default", "for-loop", "foreach", "fused")
# engine.compile: off, or torch.compile's mode (`torch._inductor.list_mode_options()`); the modes
# that record CUDA graphs are COMPILE_GRAPH_MODES.
COMPILE_MODES = ("off", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
COMPILE_GRAPH_MODES = ("reduce-overhead", "max-autotune")
PRECISIONS = ("fp32", "bf16", "fp16")
GRAD_SYNCS = ("ddp", "allreduce", "sharded")  # distributed.sync: how several ranks average their gradients
EXCHANGES = ("nccl", "copy")  # distributed.exchange: what moves sharded's slices between the ranks
# GradScaler.step reads from the device whether a gradient overflowed (`.item()`) before it steps
# the optimizer: a host-side branch that a captured CUDA graph cannot hold.
FP16_GRAPH_REFUSED = ("engine.precision=fp16 cannot be used with engine.cuda_graph=true (the gradient scaler decides on "
                      "the host, after a sync, whether to skip each step): set engine.precision=bf16 (no scaler), or "
                      "engine.cuda_graph=false")
LOOPS = ("feedbench", "lightning")
# What `python -m trainer` returns to Hydra (a sweeper optimises it), and in which direction it is better.
OBJECTIVES = {"throughput_samples_per_s": "maximize", "ms_per_step": "minimize", "median_step_ms": "minimize",
              "data_wait_fraction": "minimize", "gpu_kernel_busy_fraction": "maximize"}
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
        kind = self[section.name].Config
        if takes_kwargs(kind):
            values = fold_kwargs(kind, values)
        return OmegaConf.to_object(OmegaConf.merge(kind, values))

    def build(self, section, *args, **kwargs):
        """The component `section` names, made from its typed Config and `args`."""
        cfg = self.config(section)
        return self[cfg.name](cfg, *args, **kwargs)


def import_modules(package: str, path: Iterable[str]) -> None:
    """Import every module of a package (`__name__`, `__path__`): each component file registers
    itself, so a new option is one new file."""
    for module in pkgutil.iter_modules(path):
        importlib.import_module(f"{package}.{module.name}")


# ----------------------------------------------------------------------------- _target_
KWARGS = "kwargs"  # the Config field that holds a `_target_`'s keyword arguments


def takes_kwargs(kind) -> bool:
    """True for a Config with a `kwargs` field: keys its section adds (`+dataset.root=/data`) are
    its `_target_`'s keyword arguments, not typos."""
    return dataclasses.is_dataclass(kind) and KWARGS in {f.name for f in dataclasses.fields(kind)}


def fold_kwargs(kind, values: dict) -> dict:
    """`values` of a section whose Config `takes_kwargs`, with the keys the Config lacks moved into `kwargs`."""
    known = {f.name for f in dataclasses.fields(kind)}
    extra = {k: v for k, v in values.items() if k not in known}
    return {**{k: v for k, v in values.items() if k in known}, KWARGS: {**(values.get(KWARGS) or {}), **extra}}


def locate(key: str, path: str):
    """The object the import path `path` names (`package.module.name`), its module imported from
    `sys.path` (PYTHONPATH); one that cannot be found is a `ConfigError` naming `key`."""
    parts = path.split(".")
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        raise ConfigError(f"{key}={path!r} is not an import path: set {key}=<module>.<name> (e.g. my_data.make_dataset), "
                          f"with the module's folder on PYTHONPATH")
    for i in range(len(parts) - 1, 0, -1):  # the longest prefix that is a module; the rest are its attributes
        module = ".".join(parts[:i])
        try:
            found = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and (module == e.name or module.startswith(e.name + ".")):
                continue  # this prefix is no module: try a shorter one
            raise ConfigError(f"{key}={path}: importing {module} failed ({type(e).__name__}: {e}): install what it "
                              f"imports, or fix that module") from e
        except Exception as e:  # the user's module itself fails to import (a syntax error, an error at import time)
            raise ConfigError(f"{key}={path}: importing {module} failed ({type(e).__name__}: {_first_line(e)}): "
                              f"fix that module") from e
        try:
            for name in parts[i:]:
                found = getattr(found, name)
        except AttributeError:
            raise ConfigError(f"{key}={path}: module {module} has no {'.'.join(parts[i:])}: fix the name after "
                              f"{module}.") from None
        return found
    raise ConfigError(f"{key}={path}: no module {parts[0]} can be imported: put the folder that holds {parts[0]}.py "
                      f"on PYTHONPATH (PYTHONPATH=/that/folder python -m trainer ...), or fix the path") from None


def call_target(key: str, path: str, kwargs: dict):
    """Call the callable `path` names with `kwargs` (Hydra's `_target_` convention); a failure
    is one `ConfigError` line naming `key` (the user's traceback stays its cause: HYDRA_FULL_ERROR=1)."""
    if not path:
        raise ConfigError(f"{key} is not set: set {key}=<module>.<callable> (its module's folder on PYTHONPATH)")
    target = locate(key, path)
    if not callable(target):
        raise ConfigError(f"{key}={path} is a {type(target).__name__}, not a callable: name a function or class "
                          f"that makes it")
    try:
        return target(**kwargs)
    except Exception as e:
        given = ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) or "no arguments"
        raise ConfigError(f"{key}={path} raised {type(e).__name__} when called with {given}: {_first_line(e)}: "
                          f"fix its keyword arguments (+{key.split('.')[0]}.<name>=<value>) or the callable") from e


def _first_line(error: BaseException) -> str:
    return next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)


# ----------------------------------------------------------------------------- run
@dataclass
class OptimizerConfig:
    name: str = "adam"  # adam | sgd | adamw
    lr: float = 1e-3
    impl: str = "default"  # default | for-loop | foreach | fused: the update's implementation (default: torch's choice)

    def __post_init__(self):
        one_of("engine.optimizer.name", self.name, OPTIMIZERS, "adam")
        one_of("engine.optimizer.impl", self.impl, OPTIMIZER_IMPLS, "fused")
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
    compile: str = "off"  # off, or torch.compile's mode for forward+loss (COMPILE_MODES): default | reduce-overhead | ...
    precision: str = "fp32"  # fp32 | bf16 | fp16: autocast around forward+loss (fp16 adds a gradient scaler)
    profile: bool = False  # torch.profiler trace of the last warm-up steps (and whether its copies overlapped kernels)
    steady_heap: bool = True  # keep freed host buffers in the process (glibc), so no run's batches fault in anew (trainer.loop.heap)
    gpu_timing_every: int = 8  # CUDA events time the steps (and copies) of one run of 32 in every N; 1: all (trainer.loop.meter)
    journal_s: float = 2.0  # seconds between writes of the measured steps to the run's journal (0: none; trainer.tracking.journal)
    kernel_window_steps: int = 20  # steps traced after the timed region for the kernels' own figures (0: none; trainer.loop.profiling)
    gpu_memory_fraction: float = 1.0  # share of the GPU's memory the run may use, as on a smaller card (e.g. a dataset larger than it)
    objective: str = "throughput_samples_per_s"  # the summary figure returned to Hydra, for a sweeper to optimise (OBJECTIVES)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lightning: LightningConfig = field(default_factory=LightningConfig)  # engine.loop=lightning only

    def __post_init__(self):
        at_least("engine.epochs", self.epochs, 1, "1 (or set engine.max_steps, the run's length in steps)")
        at_least("engine.max_steps", self.max_steps, 0, "0 (run engine.epochs passes)")
        at_least("engine.warmup_steps", self.warmup_steps, 0, 5)
        at_least("engine.gpu_timing_every", self.gpu_timing_every, 1, 8)
        at_least("engine.journal_s", self.journal_s, 0, "2 (or 0: no journal)")
        at_least("engine.kernel_window_steps", self.kernel_window_steps, 0, "20 (or 0: no kernel window)")
        if not 0 < self.gpu_memory_fraction <= 1:
            raise ConfigError(f"engine.gpu_memory_fraction must be above 0 and at most 1 (got {self.gpu_memory_fraction:g}): "
                              f"set engine.gpu_memory_fraction=1.0 (the whole GPU) or a share such as 0.25")
        one_of("engine.objective", self.objective, OBJECTIVES, "throughput_samples_per_s")
        # seeds torch's generators, directly and as `seed * 1_000_003 + epoch` (the loaders' shuffles):
        # within 32 bits both fit torch's 64-bit seeds
        if not 0 <= self.seed < 2**32:
            raise ConfigError(f"engine.seed must be from 0 to {2**32 - 1} (got {self.seed}): set engine.seed=0")
        one_of("engine.loop", self.loop, LOOPS, "feedbench")
        one_of("engine.precision", self.precision, PRECISIONS, "fp32")
        if self.precision == "fp16" and self.cuda_graph:
            raise ConfigError(FP16_GRAPH_REFUSED)
        one_of("engine.compile", self.compile, COMPILE_MODES,
               "default (torch.compile's default mode), or engine.compile=off")
        if self.compile != "off" and self.cuda_graph:
            # Capturing a compiled step by hand is fragile (its code is compiled and autotuned at the first
            # calls, which a capture must not run), and torch.compile records CUDA graphs itself.
            raise ConfigError(f"engine.compile={self.compile} cannot be used with engine.cuda_graph=true (torch.compile "
                              f"records its own CUDA graphs in mode reduce-overhead): set engine.compile=reduce-overhead "
                              f"engine.cuda_graph=false, or engine.compile=off")
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
        if self.compile != "off":
            # The compiled step is the feedbench loop's; under Lightning it would be the LightningModule's to compile.
            raise ConfigError(f"engine.compile={self.compile} cannot be used with engine.loop=lightning (Lightning runs "
                              f"the step itself): set engine.compile=off, or engine.loop=feedbench")
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
    plots: bool = True  # timeline.png beside steps.csv (a few tenths of a second at the run's close)

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
    # How the ranks average their gradients each step (GRAD_SYNCS): ddp, DistributedDataParallel as a
    # user writes it; allreduce, every gradient a view of one flat buffer and one all-reduce of it after
    # backward (no per-parameter hooks; a CUDA graph with several ranks can hold it); sharded, as allreduce
    # but a reduce-scatter, each rank's optimizer updating its 1/N slice of the weights, and an all-gather
    # of them (ZeRO's first stage: the same bytes exchanged, 1/N of the optimizer's work and state a rank).
    sync: str = "ddp"
    # What moves sharded's slices (EXCHANGES): nccl, its reduce-scatter and all-gather after backward;
    # copy, the GPUs' copy engines between buffers the ranks of one host map from each other, each
    # bucket's reduce-scatter started while backward runs (CUDA only).
    exchange: str = "nccl"
    # Gradient buckets, in backward's order: DDP all-reduces each once its gradients are ready
    # (PyTorch's default size), exchange=copy reduce-scatters each likewise.
    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = False  # DDP: gradients are views of the buckets (no copy into them; PyTorch's default: false)

    def __post_init__(self):
        if not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            raise ConfigError(f"distributed.timeout_s must be a finite number of seconds > 0 (got {self.timeout_s}): "
                              f"set distributed.timeout_s=300")
        one_of("distributed.sync", self.sync, GRAD_SYNCS, "ddp")
        one_of("distributed.exchange", self.exchange, EXCHANGES, "nccl")
        if not (self.bucket_cap_mb > 0 and math.isfinite(self.bucket_cap_mb)):
            raise ConfigError(f"distributed.bucket_cap_mb must be a finite number of MiB > 0 (got {self.bucket_cap_mb}): "
                              f"set distributed.bucket_cap_mb=25")


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
    if not OmegaConf.has_resolver("objective_direction"):
        # A sweeper's direction from the objective's (`hydra.sweeper.direction: ${objective_direction:${engine.objective}}`).
        OmegaConf.register_new_resolver("objective_direction", lambda name: OBJECTIVES.get(name, "maximize"))
    if not OmegaConf.has_resolver("launch_time"):
        # `${now:}` as rank 0 read it: under torchrun every rank composes its own config, and
        # Hydra's output folder would otherwise differ from rank to rank. Cached, like `now`.
        OmegaConf.register_new_resolver("launch_time", launch_time, use_cache=True)


register()
