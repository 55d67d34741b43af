"""Range checks on the composed config, run before anything is built or recorded.

The schemas (`trainer/config.py`) reject unknown keys and wrong types when Hydra composes the
config; these checks catch values of the right type that cannot run. Each failure is one
`ConfigError` naming the key, the value, what is allowed and a value that works, e.g.
`loader.batch_size must be >= 1 (got 0): set loader.batch_size=64`.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import warnings

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer.errors import ConfigError

OPTIMIZERS = ("adam", "adamw", "sgd")
LOOPS = ("feedbench", "lightning")
MAX_EXPERIMENT_NAME_LENGTH = 500  # MLflow's (mlflow.utils.validation): it refuses a longer name


def at_least(key: str, value, low, fix) -> None:
    """`key` must be >= `low`; `fix` is a value that works."""
    if value < low:
        raise ConfigError(f"{key} must be >= {low} (got {value}): set {key}={fix}")


def resolve(cfg) -> None:
    """Replace every interpolation (`dataset.num_samples=${loader.batch_size}`) by its value, once.
    Unresolved, each read of such a key parses the interpolation again, about 0.2 ms, and the
    loaders read some keys at the start of every epoch: a run of one-step epochs measured its
    step several times longer than a plain loop over the same, resolved config."""
    _check_interpolations(cfg, "")
    OmegaConf.resolve(cfg)


def _check_interpolations(node, prefix: str) -> None:
    """Read every interpolated key once, so that one that cannot resolve is named."""
    for key in node.keys() if OmegaConf.is_dict(node) else range(len(node)):
        name = f"{prefix}{key}" if OmegaConf.is_dict(node) else f"{prefix[:-1]}[{key}]"
        if OmegaConf.is_interpolation(node, key):
            try:
                node[key]
            except OmegaConfBaseException as e:
                reason = str(e).splitlines()[0]
                raise ConfigError(f"{name}: its interpolation cannot be resolved ({reason}): set {name} to a value, "
                                  f"or to ${{...}} of a key that exists") from None
        else:
            child = node._get_node(key)
            if OmegaConf.is_config(child):
                _check_interpolations(child, f"{name}.")


def validate(cfg) -> None:
    """Resolve the config, then check it; raise `ConfigError` for the first value that cannot run."""
    resolve(cfg)
    loader, engine, model = cfg.loader, cfg.engine, cfg.model
    at_least("loader.batch_size", loader.batch_size, 1, 64)
    at_least("loader.num_workers", loader.num_workers, 0, 0)
    warn_workers_beyond_cores(loader.num_workers)
    if loader.prefetch_factor is not None:
        at_least("loader.prefetch_factor", loader.prefetch_factor, 1, 2)
    if "depth" in loader:
        at_least("loader.depth", loader.depth, 1, 1)
    if "threads" in loader:
        at_least("loader.threads", loader.threads, 1, 4)
    at_least("engine.epochs", engine.epochs, 1, "1 (or set engine.max_steps, the run's length in steps)")
    at_least("engine.max_steps", engine.max_steps, 0, "0 (run engine.epochs passes)")
    at_least("engine.warmup_steps", engine.warmup_steps, 0, 5)
    at_least("engine.gpu_timing_every", engine.gpu_timing_every, 1, 8)
    check_seed(engine.seed)
    _validate_loop(engine)
    if engine.optimizer.name not in OPTIMIZERS:
        raise ConfigError(f"engine.optimizer.name must be one of {', '.join(OPTIMIZERS)} (got {engine.optimizer.name!r}): "
                          f"set engine.optimizer.name=adam")
    if not (engine.optimizer.lr > 0 and math.isfinite(engine.optimizer.lr)):
        raise ConfigError(f"engine.optimizer.lr must be a finite number > 0 (got {engine.optimizer.lr}): set engine.optimizer.lr=0.001")
    at_least("model.busy_ms", model.busy_ms, 0, 0)
    for key, fix in (("hidden", 64), ("bottleneck", 3)):
        if key in model:
            at_least(f"model.{key}", model[key], 1, fix)
    _validate_dataset(cfg.dataset)
    classes = cfg.dataset.get("num_classes", 10)  # the vision datasets have 10
    if model.name == "mlp" and classes < 2:
        raise ConfigError(f"model=mlp needs labels of at least 2 classes (got dataset.num_classes={classes}): "
                          f"set dataset.num_classes=10, or use model=autoencoder or model=noop")
    if not (cfg.distributed.timeout_s > 0 and math.isfinite(cfg.distributed.timeout_s)):
        raise ConfigError(f"distributed.timeout_s must be a finite number of seconds > 0 (got {cfg.distributed.timeout_s}): "
                          f"set distributed.timeout_s=300")
    if not cfg.tracking.experiment:
        raise ConfigError("tracking.experiment must be a non-empty name (got ''): set tracking.experiment=feedbench")
    if len(cfg.tracking.experiment) > MAX_EXPERIMENT_NAME_LENGTH:
        raise ConfigError(f"tracking.experiment must be at most {MAX_EXPERIMENT_NAME_LENGTH} characters (got "
                          f"{len(cfg.tracking.experiment)}): set tracking.experiment=feedbench")


def warn_workers_beyond_cores(workers: int) -> None:
    """More DataLoader workers than CPU cores take turns on them: a run slows down many times
    over. Said in one line (PyTorch's own warning, which says the same, is silenced)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if workers > cores:
        print(f"warning: loader.num_workers={workers} but this machine gives the run {cores} CPU cores: the workers "
              f"take turns on them and the run slows down; set loader.num_workers={cores} or fewer", file=sys.stderr)
        warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)


def check_seed(seed: int) -> None:
    """`engine.seed` seeds torch's generators, directly and as `seed * 1_000_003 + epoch` (the
    loaders' shuffles): within 32 bits both fit torch's 64-bit seeds."""
    if not 0 <= seed < 2**32:
        raise ConfigError(f"engine.seed must be from 0 to {2**32 - 1} (got {seed}): set engine.seed=0")


def _validate_loop(engine) -> None:
    if engine.loop not in LOOPS:
        raise ConfigError(f"engine.loop must be one of {', '.join(LOOPS)} (got {engine.loop!r}): set engine.loop=feedbench")
    if engine.loop != "lightning":
        return
    if importlib.util.find_spec("lightning") is None:
        raise ConfigError("engine.loop=lightning needs the lightning package: pip install 'feedbench[lightning]' "
                          "(or pip install lightning), or set engine.loop=feedbench")
    if engine.cuda_graph:
        # Lightning's automatic optimization runs forward, backward and the optimizer step itself, in
        # its closure: there is no single step function to capture.
        raise ConfigError("engine.cuda_graph=true cannot be used with engine.loop=lightning (Lightning runs the step "
                          "itself): set engine.cuda_graph=false, or engine.loop=feedbench")
    at_least("engine.lightning.log_every_n_steps", engine.lightning.log_every_n_steps, 1, 50)


def _validate_dataset(cfg) -> None:
    if cfg.name == "synthetic":
        from datasets.synthetic import _validate  # the synthetic dataset's own checks, run before the run opens

        _validate(cfg)
    elif "num_samples" in cfg:
        at_least("dataset.num_samples", cfg.num_samples, 0, "0 (the whole split)")


def check_against_dataset(cfg, dataset) -> None:
    """Checks that need the built dataset: a batch larger than the dataset would silently shrink to it."""
    n, b = len(dataset), cfg.loader.batch_size
    if b > n:
        raise ConfigError(f"loader.batch_size must be <= {n}, the samples in dataset={cfg.dataset.name} (got {b}): "
                          f"set loader.batch_size={min(64, n)} or dataset.num_samples>={b}")
