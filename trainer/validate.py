"""From the composed config to the typed objects the components receive, checked on the way.

Hydra rejects unknown keys and wrong types when it composes the config (each section's schema is
its component's `Config` dataclass). `validate` then resolves the config and builds those
dataclasses: each one's `__post_init__` checks its own values, and the few checks that need two
sections run after. Each failure is one `ConfigError` naming the key, the value, what is allowed
and a value that works, e.g. `loader.batch_size must be >= 1 (got 0): set loader.batch_size=64`.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import warnings

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from trainer.config import KWARGS, Config, takes_kwargs
from trainer.errors import ConfigError


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


def _fold_kwargs(cfg: DictConfig) -> None:
    """In each section whose Config takes keyword arguments for its `_target_` (`dataset=custom`),
    move the keys it added (`+dataset.root=/data`) into its `kwargs`."""
    for key in cfg:
        node = cfg._get_node(key)
        kind = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
        if not takes_kwargs(kind):
            continue
        known = {f.name for f in dataclasses.fields(kind)}
        with open_dict(node):
            for extra in [k for k in node if k not in known]:
                node[KWARGS][extra] = node[extra]
                del node[extra]


def _check_keys(node: DictConfig, prefix: str) -> None:
    """Refuse a key that its section's dataclass does not have: Hydra lets `+loader.batchsize=1`
    add one (only a plain override of an unknown key fails at compose time), and the dataclass
    would carry it along unread."""
    kind = OmegaConf.get_type(node)
    if dataclasses.is_dataclass(kind):
        known = [f.name for f in dataclasses.fields(kind)]
        for key in node:
            if key not in known:
                raise ConfigError(f"{prefix}{key} is not a key of {prefix[:-1] or 'the config'} ({kind.__name__}): "
                                  f"{_instead(prefix, key, node[key], known)}; its keys are {', '.join(known)}")
    for key in node:
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            _check_keys(child, f"{prefix}{key}.")


def _instead(prefix: str, key: str, value, known: list) -> str:
    """The fix for an unknown key: the nearest real key when one is close (`batchsize` -> `batch_size`)."""
    near = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if not near:
        return f"remove +{prefix}{key}"
    if isinstance(value, (bool, int, float, str)):
        shown = str(value).lower() if isinstance(value, bool) else value
        return f"did you mean {prefix}{near[0]}? set {prefix}{near[0]}={shown} instead of +{prefix}{key}={shown}"
    return f"did you mean {prefix}{near[0]}? remove +{prefix}{key}"


def validate(cfg) -> Config:
    """Resolve the composed config and return it as typed objects (`trainer.config.Config`, whose
    `dataset`, `loader` and `model` are their options' own Config); raise `ConfigError` for the
    first value that cannot run."""
    resolve(cfg)
    _fold_kwargs(cfg)
    _check_keys(cfg, "")
    job = OmegaConf.to_object(cfg)  # runs every section's __post_init__ checks
    _check_sections(job)
    unused = job.loader.unused_dataloader_keys()
    if unused:
        print(f"warning: loader={job.loader.name} has no DataLoader: {', '.join(unused)} "
              f"{'changes' if len(unused) == 1 else 'change'} nothing in "
              f"this run (DataLoader keys apply to loader=baseline, pinned, prefetch and iterable_chunks)", file=sys.stderr)
    else:
        warn_workers_beyond_cores(job.loader.num_workers)
    return job


def _check_sections(job: Config) -> None:
    """Checks that need two sections."""
    classes = getattr(job.dataset, "num_classes", 10)  # the vision datasets have 10; None: known once it is built
    if classes is not None and classes < job.model.min_classes:
        raise ConfigError(f"model={job.model.name} needs labels of at least {job.model.min_classes} classes (got "
                          f"dataset.num_classes={classes}): set dataset.num_classes=10, or use model=autoencoder or model=noop")
    if getattr(job.loader, "gather_in_graph", False) and not job.engine.cuda_graph:
        raise ConfigError(f"loader.gather_in_graph=true captures the next batch's gather in the step's CUDA graph, and "
                          f"this step has none: set engine.cuda_graph=true, or loader.gather_in_graph=false")


def available_cores() -> int:
    """The CPU cores this process may run on: its affinity, which a container or `taskset` narrows."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def warn_workers_beyond_cores(workers: int) -> None:
    """More DataLoader workers than CPU cores take turns on them: a run slows down many times
    over. Said in one line (PyTorch's own warning, which says the same, is silenced)."""
    cores = available_cores()
    if workers > cores:
        print(f"warning: loader.num_workers={workers} but this machine gives the run {cores} CPU cores: the workers "
              f"take turns on them and the run slows down; set loader.num_workers={cores} or fewer", file=sys.stderr)
        warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)


def check_against_dataset(cfg, dataset) -> None:
    """Checks that need the built dataset: a batch larger than the dataset would silently shrink to it."""
    n, b = len(dataset), cfg.loader.batch_size
    if b > n:
        raise ConfigError(f"loader.batch_size must be <= {n}, the samples in dataset={cfg.dataset.name} (got {b}): "
                          f"set loader.batch_size={min(64, n)} or dataset.num_samples>={b}")
