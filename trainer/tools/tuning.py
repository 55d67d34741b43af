"""The tuner's search space: each trial's strategy knobs, suggested only where they mean something.

`experiment=tune_dataloader` runs Hydra's Optuna sweeper over `loader` (its `params`) and hands
each trial to `loader_knobs` (its `custom_search_space`), which suggests the knobs of the strategy
that trial chose: a knob a strategy does not have (`loader.depth` for `baseline`) would fail the
trial at composition, and one it ignores (`loader.prefetch_factor` without workers) would only
spread the sampler's effort over values that change nothing.
"""

from __future__ import annotations

import dataclasses
import os

import trainer.components  # noqa: F401  (registers every loader strategy)
from trainer.loaders import LOADERS

# The strategies whose batches a torch DataLoader makes: the ones its knobs apply to.
DATALOADER_STRATEGIES = ("baseline", "pinned", "prefetch")
MAX_DEPTH = 4  # batches copied ahead: past a few, only memory grows
MAX_THREADS = 8  # pinned_gather's gather threads


def max_workers() -> int:
    """DataLoader workers worth trying on this host: up to its cores, at most 8."""
    return min(8, os.cpu_count() or 1)


def loader_knobs(cfg, trial) -> None:
    """Hydra's Optuna sweeper calls this for each trial after sampling `params`: suggest the knobs
    of the strategy the trial chose (`loader`, swept or fixed). A knob already in `params` (swept
    or fixed on the command line) is left as it is."""
    name = trial.params.get("loader") or trial.user_attrs.get("loader") or cfg.loader.name
    fields = {f.name for f in dataclasses.fields(LOADERS[name].Config)}
    taken = set(trial.params) | set(trial.user_attrs)

    def suggest(key, how, *args):
        if f"loader.{key}" in taken or key not in fields:
            return None
        return getattr(trial, how)(f"loader.{key}", *args)

    if name in DATALOADER_STRATEGIES:
        workers = suggest("num_workers", "suggest_int", 0, max_workers())
        if workers is None:
            workers = int(trial.params.get("loader.num_workers", trial.user_attrs.get("loader.num_workers", 0)))
        if workers > 0:  # the DataLoader ignores both without workers
            suggest("prefetch_factor", "suggest_int", 1, 8)
            suggest("persistent_workers", "suggest_categorical", [True, False])
    suggest("non_blocking", "suggest_categorical", [True, False])
    suggest("depth", "suggest_int", 1, MAX_DEPTH)
    suggest("threads", "suggest_int", 1, MAX_THREADS)
