"""`python -m trainer.advise [--verify] [--allow precision] [--steps N] [overrides...]`: what bounds
this run, the best configuration within reach, and what to change, each with the ms/step it should give.

For the composed config it measures, in this process on this device, a short ladder of runs
(`trainer.loop.run.run`, each a child of the advice's MLflow run):

    configured        the run as configured
    ceiling           the same model, batch and dtype fed from data already on the device
                      (loader=gpu_resident, no shuffle): the step alone, eager and CUDA-graphed,
                      then with each of the step's other levers (STEP_TRIALS: the optimizer's
                      fused implementation, torch.compile, bf16 with --allow precision) on top
                      of the fastest step so far, where the engine has their keys
    feed              the configured loader with no model (model=noop): how fast batches come (and
                      how much of that is the loop thread's own work), and the same for each
                      feed-side change (another strategy, more or fewer workers)
    again             the eager ceiling, the feed alone and the configured run once more, last:
                      the host's drift over the ladder (each rung the pair's mean)
    copy              this batch's bytes at the pinned peak and at the pageable rate (after the
                      configured run), against the copy it achieved
    kernels           the configured run and the eager ceiling again, for their kernel windows
                      (last: nothing timed runs after CUPTI was attached; not with --no-kernels)

and from them decides what bounds the run (`judge`: input, copy, launch or compute, by which
removal the measured ceilings say would save the most), searches every configuration the rungs
predict, each measured feed against each measured step by one overlap model (`reachable`), and
gives the fastest (`best`, with the bounds it goes through: input → launch → compute) and the best
single changes (`recommend`), as exact overrides. With `--verify` each is run and its measured
ms/step printed beside the prediction. docs/advisor.md explains the rules and the model.
"""
from __future__ import annotations

import argparse
import copy
import math
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from hydra import compose, initialize_config_dir
from mlflow.entities import Metric, RunStatus
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf, open_dict

from datasets import DATASETS
from models import MODELS
from trainer.__main__ import _terminate, hydra_error_line  # the CLI's SIGTERM, and its one line for a bad override
from trainer.config import CONF_DIR
from trainer.errors import ConfigError, DoesNotFit, RunFailed
from trainer.loaders import LOADERS
from trainer.loaders.base import LoaderConfig
from trainer.tools.tuning import DATALOADER_STRATEGIES, max_workers
from trainer.validate import available_cores
from trainer.tracking.journal import owner_tags
from trainer.tracking.store import check_tracking_uri, default_uri, experiment_id, store_errors

BOUNDS = ("input", "copy", "launch", "compute", "none")  # none: the rungs contradict each other, no verdict
IN_LINE = ("baseline", "pinned")  # strategies that copy on the compute stream: the copy and the step take turns there
MIN_TOLERANCE, MAX_TOLERANCE = 0.03, 0.20  # "within a few percent": the ceiling's own jitter, kept in these bounds
# A verified configuration runs at least this long in its timed steps (at most MOST_TIMES_STEPS times the
# rungs' steps): 100 steps of a 0.12 ms graphed step are 12 ms of a host whose speed moves, and two
# such runs measured 22% apart on an H200.
MIN_TIMED_MS, MOST_TIMES_STEPS = 250.0, 10
# The configured run is measured again, last, where its timed steps took less than this: a longer
# run has seen the host's drift already (64 workers on 16 cores: 9 s for 50 steps).
AGAIN_UNDER_MS = 5000.0
# The loader keys every strategy has: carried over when a rung or a change swaps the strategy.
COMMON_LOADER_KEYS = tuple(f for f in LoaderConfig.__dataclass_fields__ if f != "name")
DATALOADER_KEYS = ("num_workers", "prefetch_factor", "persistent_workers")  # mean nothing to a strategy without one

# The levers the advisor moves, each by one override key: a renamed key is one edit here. A lever
# whose key the composed config lacks (an older engine) is neither measured nor proposed.
LEVERS = {
    "strategy": "loader",  # the loader strategy (a config group)
    "workers": "loader.num_workers",  # DataLoader worker processes
    "graph": "engine.cuda_graph",  # the step captured once as a CUDA graph, replayed
    "compile": "engine.compile",  # torch.compile of the step (off | default | reduce-overhead | max-autotune)
    "optimizer": "engine.optimizer.impl",  # the optimizer's implementation (default | for-loop | foreach | fused)
    "precision": "engine.precision",  # autocast dtype: changes the training
}
FEED_LEVERS = ("strategy", "workers")  # how batches arrive: measured by a feed alone (model=noop)
# The step's own levers past the graph: (off, tried). Where the job has one off, it is measured
# once on top of the fastest step so far, at the tried value: `default` compile (reduce-overhead
# captures CUDA graphs, as the graph lever does; max-autotune compiles for minutes, too long for
# a ladder), bf16 (fp16 cannot be graphed).
STEP_TRIALS = {"optimizer": ("default", "fused"), "compile": ("off", "default"), "precision": ("fp32", "bf16")}
CUDA_ONLY = ("compile", "optimizer")  # a CPU ladder does not measure them (no kernels to fuse or launch)
GRAPH_EXCLUSIVE = ("compile",)  # the engine refuses engine.compile with engine.cuda_graph=true
CHANGES_TRAINING = ("precision",)  # proposed only with `--allow <lever>`, and said to change the training
# The lever values of a feed alone: no model to graph or compile.
FEED_ALONE = {"graph": False, "compile": STEP_TRIALS["compile"][0]}
# The dataset as the ceiling reads it, where the job's differs: the step alone reads batches of the
# same shape, and augmenting each sample afresh is the feed's work (a block decoded once cannot).
CEILING_DATASET = {"dataset.augment": "none"}
# Which levers remove which bound (the chain of bounds a configuration goes through).
REMOVES = {"input": FEED_LEVERS, "copy": FEED_LEVERS, "launch": ("graph",), "compute": ("compile", "optimizer", "precision")}

# Changes to the job, lever by lever: ((lever, value), ...) in LEVERS' order; () is the job itself.
Setting = Tuple[Tuple[str, object], ...]


def setting(**changes) -> Setting:
    """The changes as a Setting, in LEVERS' order (`setting(strategy="gpu_resident", graph=True)`)."""
    return tuple((lever, changes[lever]) for lever in LEVERS if lever in changes)


def merged(*settings: Setting) -> Setting:
    """The settings' changes together (a later one wins a lever both change)."""
    return setting(**{k: v for s in settings for k, v in s})


def overrides_of(changes: Setting) -> List[str]:
    """The overrides that make `changes` (`loader=gpu_resident`, `engine.cuda_graph=true`)."""
    return [f"{LEVERS[lever]}={str(value).lower() if isinstance(value, bool) else value}" for lever, value in changes]


def setting_of(overrides: Sequence[str]) -> Setting:
    """The Setting that `overrides` make (`overrides_of`'s inverse): `["loader=gpu_resident",
    "engine.cuda_graph=true"]` -> strategy gpu_resident, graph True. A key no lever has: ValueError."""
    lever_of = {key: lever for lever, key in LEVERS.items()}
    changes = {}
    for override in overrides:
        key, _, text = override.partition("=")
        if key not in lever_of:
            raise ValueError(f"{override}: not a lever the advisor moves (keys: {', '.join(LEVERS.values())})")
        value: object = {"true": True, "false": False}.get(text, text)
        changes[lever_of[key]] = int(text) if lever_of[key] == "workers" else value
    return setting(**changes)


def has_lever(cfg, lever: str) -> bool:
    """Whether the composed config has the lever's key (an engine before it: no)."""
    return OmegaConf.select(cfg, LEVERS[lever], default=_ABSENT) is not _ABSENT


_ABSENT = object()


def _nan() -> float:
    return math.nan


@dataclass
class Ladder:
    """The measured rungs, ms per step (nan: not measured, `missing` says why)."""

    configured: float
    graphed: bool  # the configured step is CUDA-graphed
    strategy: str  # the configured loader
    ceiling_eager: float = field(default_factory=_nan)
    ceiling_graphed: float = field(default_factory=_nan)
    # The loop thread's time in one graphed step (the graphed ceiling's `median_host_step_ms`:
    # replaying the graph) and in one step of the feed alone (the no-op model's; `feeds_host_step`
    # for the feed-side changes): what a graphed step adds to a feed's own work on that thread is
    # the difference (`graph_launch_ms`).
    graphed_host_step: float = field(default_factory=_nan)
    feed_host_step: float = field(default_factory=_nan)
    feed: float = field(default_factory=_nan)
    # The feed alone's work on the loop's own thread (its `loop_thread_cpu_ms_per_step`): the part
    # of `feed` that an eager step's launches take turns with; the rest (DataLoader workers) runs beside.
    feed_loop: float = field(default_factory=_nan)
    configured_wait: float = field(default_factory=_nan)  # the configured run's wait for batches, ms/step
    configured_spread: float = 0.0  # the configured run's own 95% interval, half its width over its ms/step
    configured_drift: float = 0.0  # the configured run measured first and last: how far apart, over the faster
    copy_achieved: float = field(default_factory=_nan)  # the configured run's copies (median, CUDA events)
    copy_pinned: float = field(default_factory=_nan)  # one batch at the pinned peak
    copy_pageable: float = field(default_factory=_nan)  # one batch at the pageable rate
    batch_mb: float = field(default_factory=_nan)
    tolerance: float = MIN_TOLERANCE
    drift: float = 0.0  # the eager ceiling measured first and last: how far apart, over the faster
    feed_drift: float = 0.0  # the same for the feed alone
    workers: int = 0  # the configured DataLoader workers
    shuffles: bool = False  # the configured loader shuffles: on the device its batches are gathered, not views
    cores: int = 0  # the CPU cores the configured run was given (its `host_cores`)
    kernels: Dict[str, Dict[str, float]] = field(default_factory=dict)  # rung -> its kernel window's figures
    feeds: Dict[Setting, float] = field(default_factory=dict)  # a feed-side change -> its feed alone
    feeds_loop: Dict[Setting, float] = field(default_factory=dict)  # the same, its work on the loop's thread
    feeds_host_step: Dict[Setting, float] = field(default_factory=dict)  # the same, its no-op step's host time
    steps: Dict[Setting, float] = field(default_factory=dict)  # a step-side change past the graph -> its ceiling
    decodes_files: bool = False  # the dataset is image files that loader=gpu_decode can decode on this GPU
    # The job's dataset can be held decoded in one block (the one-block strategies): False where the
    # ceiling had to be measured on a part of it, or without its per-sample augmentation.
    holds_block: bool = True
    missing: Dict[str, str] = field(default_factory=dict)  # rung -> why it was not measured

    @property
    def ceiling(self) -> float:
        """The configured step kind's own ceiling (graphed or eager), feeding free."""
        return self.ceiling_graphed if self.graphed else self.ceiling_eager

    def step_rungs(self) -> Dict[Setting, float]:
        """Every measured step fed from the device, by its changes to the job's step (graph included)."""
        eager, graphed = self.flip((), False), self.flip((), True)
        found = {eager: self.ceiling_eager, graphed: self.ceiling_graphed, **self.steps}
        return {s: ms for s, ms in found.items() if math.isfinite(ms)}

    def flip(self, changes: Setting, graph: bool) -> Setting:
        """`changes` with the step graphed or not (no graph change where the job's step is that kind)."""
        values = dict(changes)
        values.pop("graph", None)
        if graph != self.graphed:
            values["graph"] = graph
        return setting(**values)

    def is_graphed(self, changes: Setting) -> bool:
        return bool(dict(changes).get("graph", self.graphed))


@dataclass
class Verdict:
    bound: str  # one of BOUNDS
    reason: str  # one line: the figures that decided it
    feeding_costs_ms: float  # T - ceiling: what feeding adds per step
    launch_costs_ms: float  # what the eager step's launches add per step (0: graphed, or not measured)


@dataclass
class Change:
    """A reachable configuration: the job with `changes` made, its ms/step predicted from measured rungs."""

    changes: Setting
    predicted_ms: float
    why: str
    measured_ms: float = math.nan  # --verify: the mean of its runs
    measured_runs: int = 0  # how many runs measured it (two in turns on a host whose speed moved)
    measured_apart: float = 0.0  # how far apart those runs were, over the faster
    chain: List[str] = field(default_factory=list)  # the best configuration's bounds, first to last

    @property
    def overrides(self) -> List[str]:
        return overrides_of(self.changes)

    @property
    def changes_training(self) -> List[str]:
        """Its overrides that change what is trained (a precision), not only how fast."""
        return overrides_of(tuple((k, v) for k, v in self.changes if k in CHANGES_TRAINING))


# ----------------------------------------------------------------------------- the model
def predict(step_ms: float, feed_ms: float, serial: float, loop_ms: float = math.nan, in_line_ms: float = 0.0,
            launch_ms: float = 0.0) -> float:
    """ms/step of a loop whose step alone takes `step_ms` and whose feed alone takes `feed_ms`,
    `loop_ms` of it on the loop's own thread (nan: all of it): a share `serial` (0..1) of the
    feed's work on the loop's thread (or of the step, if shorter) does not overlap the longer one.
    Work of DataLoader workers runs beside the loop: it bounds the pace (the max), it adds nothing.
    `in_line_ms`: a copy on the compute stream (`IN_LINE`), part of the feed: what the host hides
    of it (1 - serial) still runs between two steps on the device, so it lengthens the device's
    share of the step (the feed alone has it already). `launch_ms`: the loop thread's own work for
    a step whose device time `step_ms` does not hold it (a graph's replay, `graph_launch_ms`): with
    the feed's work on that thread, it sets a pace of its own (a 0.15 ms graphed step fed by a
    0.16 ms gather on an H200 ran at 0.18)."""
    if not (math.isfinite(step_ms) and math.isfinite(feed_ms)):
        return math.nan  # (Python's max and min do not carry a nan through)
    own = min(loop_ms, feed_ms) if math.isfinite(loop_ms) else feed_ms
    return (max(step_ms + (1 - serial) * min(step_ms, in_line_ms), feed_ms, own + launch_ms)
            + serial * min(step_ms, own))


def eager_host_share(eager_ms: float, graphed_ms: float, tol: float = MIN_TOLERANCE) -> float:
    """The share of the feed's work on the loop's thread that an eager step does not hide. A step
    whose graph is faster by more than `tol` is set by its launches: the loop's thread (forward,
    optimizer) and autograd's (backward, while the loop's thread waits) are busy all along, and the
    feed's work adds in full (1). A step its graph does not speed up is set by its kernels: the host
    has the rest of the step free, and only what the graph saves, 1 - graphed / eager (about 0),
    takes turns. 1 without a graphed step to compare (on the CPU, one thread does everything)."""
    if math.isfinite(graphed_ms) and eager_ms > 0:
        if eager_ms > (1 + tol) * graphed_ms:
            return 1.0
        return min(1.0, max(0.0, 1.0 - graphed_ms / eager_ms))
    return 1.0


def host_share(ladder: Ladder, graphed: bool) -> float:
    """The share of the feed's work on the loop's thread that the step does not hide: a graphed
    step hides all of it (0); an eager one: `eager_host_share`."""
    return 0.0 if graphed else eager_host_share(ladder.ceiling_eager, ladder.ceiling_graphed, ladder.tolerance)


def graph_launch_ms(ladder: Ladder, graphed: bool, feed: Setting = ()) -> float:
    """What a graphed step adds to the loop thread's work per step fed by `feed` (() : the
    configured loader): its time in the graphed step (replaying the graph) over its time in that
    feed alone's no-op step, which the feed alone's ms/step holds already (a `baseline` feed's
    no-op step takes 0.08 ms on an H200, a gather's 0.02). 0: an eager step, whose launches its own
    ms/step holds, or not measured, or not a launch: a graphed ceiling whose host time in the step
    is over half its ms/step waited there for the device (a host far enough ahead fills CUDA's
    launch queue, and the replay waits for room), which says nothing of what launching costs."""
    noop = ladder.feeds_host_step.get(feed, math.nan) if feed else ladder.feed_host_step
    host = ladder.graphed_host_step
    if not graphed or not (math.isfinite(host) and math.isfinite(noop)) or host > 0.5 * ladder.ceiling_graphed:
        return 0.0
    return max(0.0, host - noop)


def in_line(ladder: Ladder, strategy: str) -> float:
    """The copy the configured strategy makes on the compute stream (`IN_LINE`), ms per batch: it
    takes turns with the step on the device, however well the host's work is hidden (0: none)."""
    copy = ladder.copy_achieved
    return copy if strategy in IN_LINE and strategy == ladder.strategy and math.isfinite(copy) else 0.0


def feed_work(ladder: Ladder, feed: Setting = ()) -> float:
    """The part of a feed that takes turns with the step (`L`): its work on the loop's thread
    (nan: all of it). For the configured strategy copying in line on the compute stream (`pinned`,
    its workers changed or not), at least its copy: issued without blocking, it costs the loop's
    thread little but runs on the device before the step does."""
    loop = ladder.feeds_loop.get(feed, math.nan) if feed else ladder.feed_loop
    copy = in_line(ladder, dict(feed).get("strategy", ladder.strategy))
    return max(loop, copy) if math.isfinite(loop) and copy > 0 else loop


def modelled(ladder: Ladder) -> float:
    """What the model gives for the run as configured (against `configured`: how far to trust it)."""
    return predict(ladder.ceiling, ladder.feed, host_share(ladder, ladder.graphed), feed_work(ladder),
                   in_line(ladder, ladder.strategy), graph_launch_ms(ladder, ladder.graphed))


def miss_tolerance(ladder: Ladder) -> float:
    """How far the run may be from the model and still be explained by it: the rungs' tolerance,
    or where wider, at most `MAX_TOLERANCE`: the configured run's own 95% interval (a run on a host
    whose speed moves: the interval of an asynchronous run of a few steps reads the host's clock
    running ahead of the device, and can span more than the run itself), its own drift or the
    feed's (each measured first and last), or twice the eager step's. The last, because the run
    and its parts are read at other moments of a host whose speed moved by d between two readings
    of one step: with its noise normal, a reading lands within 2d of the mean of two others about
    3 times in 4 (2/pi atan(2 / sqrt(0.75))); the caution is for what the drift the ladder saw
    explains less well than that."""
    widest = max(ladder.configured_spread, ladder.configured_drift, ladder.feed_drift, 2 * ladder.drift)
    return max(ladder.tolerance, min(widest, MAX_TOLERANCE))


def disagreeing_rung(ladder: Ladder) -> str:
    """Which rung the run disagrees with most, in words, by how many ms per step each part of the
    run is off what the model expects of it: the feed (the run's wait for batches against what
    feeding adds in the model) or the step (the rest of the run's step against its ceiling)."""
    wait, model = ladder.configured_wait, modelled(ladder)
    if not (math.isfinite(wait) and math.isfinite(model) and math.isfinite(ladder.ceiling)):
        return ""
    expected_wait = max(0.0, model - ladder.ceiling)
    feed_off, step_off = wait - expected_wait, (ladder.configured - wait) - ladder.ceiling
    if abs(feed_off) > abs(step_off):
        slowed = " (the loader slowed beside the step: cores, caches or the clock shared)" if feed_off > 0 else ""
        return (f"the feed: in the run it waited {wait:.3g} ms for each batch, where the model expects {expected_wait:.3g} "
                f"(the feed alone: {ladder.feed:.3g}){slowed}")
    return (f"the step: in the run it took {ladder.configured - wait:.3g} ms a step besides the wait for batches, against "
            f"{ladder.ceiling:.3g} fed from the device")


def cautioned(ladder: Ladder, verdict: Verdict) -> bool:
    """The run is further from the model than its tolerance (and a verdict was given)."""
    return verdict.bound != "none" and abs(model_miss(ladder)) > miss_tolerance(ladder)


def model_miss(ladder: Ladder) -> float:
    """How far the configured run is from what the model gives for it (0.52: measured 52% above)."""
    m = modelled(ladder)
    return ladder.configured / m - 1 if math.isfinite(m) and m > 0 and math.isfinite(ladder.configured) else 0.0


# ----------------------------------------------------------------------------- the verdict
def judge(ladder: Ladder) -> Verdict:
    """What bounds the run: the removal that the ceilings say would save the most per step.

    - feeding costs `T - ceiling` (the run against its own step fed from the device);
    - the eager step's launches cost `T - (the run with the graphed step)` (the model, with the
      graphed ceiling);
    - neither above the tolerance (the ceiling's jitter, 3-20%): `compute`.
    Feeding's cost is `copy` when the achieved copy alone accounts for it (or for the whole feed),
    else `input`: the host producing batches."""
    t, eps = ladder.configured, ladder.tolerance
    c = ladder.ceiling
    feeding = t - c if math.isfinite(c) else math.nan
    contradiction = _contradiction(ladder)
    if contradiction:
        return Verdict("none", contradiction, feeding, math.nan)
    launch = 0.0
    if not ladder.graphed and math.isfinite(ladder.ceiling_graphed) and math.isfinite(ladder.feed):
        graphed = predict(ladder.ceiling_graphed, ladder.feed, host_share(ladder, True), feed_work(ladder),
                          in_line(ladder, ladder.strategy), graph_launch_ms(ladder, True))
        launch = max(0.0, t - graphed)
    if not math.isfinite(feeding):  # no ceiling: only the feed alone can speak
        if math.isfinite(ladder.feed) and ladder.feed >= (1 - eps) * t:
            return Verdict(_feed_bound(ladder, ladder.feed), f"the feed alone takes {ladder.feed:.3g} of the run's "
                           f"{t:.3g} ms/step (the step's ceiling could not be measured)", math.nan, launch)
        return Verdict("compute", f"the feed alone takes {ladder.feed:.3g} of {t:.3g} ms/step; the step's ceiling "
                       "could not be measured", math.nan, launch)
    if max(feeding, launch) <= eps * t:
        near = f"within {eps:.0%} of" if feeding >= 0 else "no slower than"  # (under it by less than noise: `_contradiction`)
        return Verdict("compute", f"the run takes {t:.3g} ms/step, {near} its step fed from the device ({c:.3g})",
                       feeding, launch)
    if launch > feeding:
        return Verdict("launch", f"the eager step takes {ladder.ceiling_eager:.3g} ms fed from the device, its CUDA "
                       f"graph {ladder.ceiling_graphed:.3g}: launching costs the run {launch:.3g} ms/step",
                       feeding, launch)
    bound = _feed_bound(ladder, feeding)
    part = (f"the copy takes {ladder.copy_achieved:.3g} ms" if bound == "copy"
            else f"the host feeds a batch in {ladder.feed:.3g} ms alone")
    return Verdict(bound, f"feeding costs {feeding:.3g} of {t:.3g} ms/step (the step fed from the device: {c:.3g}); "
                   f"{part}", feeding, launch)


def _contradiction(ladder: Ladder) -> str:
    """Why no verdict can be given ("" when one can): the run measured faster than a part of itself
    measured alone (its step fed from the device, or its feed with no model), by more than the
    rungs' noise can explain (the tolerance, and at least `MAX_TOLERANCE`: a run of a few steps on
    a shared machine may come out a few percent under its ceiling). A part cannot take longer than
    the whole, so the rungs ran at different speeds of the host (a shared or throttled machine),
    and any verdict drawn from them would contradict their own figures."""
    t = ladder.configured
    parts = [(f"its step fed from the device ({ladder.ceiling:.3g})", ladder.ceiling),
             (f"its feed with no model ({ladder.feed:.3g})", ladder.feed)]
    slower = [name for name, ms in parts if _outruns(ladder, ms)]
    if not slower:
        return ""
    return (f"no verdict: the run took {t:.3g} ms/step, less than {' and '.join(slower)} alone, and a part cannot "
            f"take longer than the whole: the host's speed changed between the rungs (other programs on a shared "
            f"machine, or throttling); run again on a quiet machine")


def _outruns(ladder: Ladder, part_ms: float) -> bool:
    """The run measured faster than a part of it alone (`part_ms`) by more than the rungs' noise
    can explain: the tolerance, and at least `MAX_TOLERANCE`."""
    t, margin = ladder.configured, max(ladder.tolerance, MAX_TOLERANCE)
    return math.isfinite(part_ms) and math.isfinite(t) and t < (1 - margin) * part_ms


def _feed_bound(ladder: Ladder, feeding: float) -> str:
    x = ladder.copy_achieved
    if math.isfinite(x) and x > 0 and x >= (1 - ladder.tolerance) * min(ladder.feed, feeding):
        return "copy"
    return "input"


# ----------------------------------------------------------------------------- the changes
STRATEGY_WHY = {"gpu_resident": "the dataset on the device: the step's own ceiling",
                "gpu_decode": "the image files sent compressed, decoded by nvJPEG on the GPU",
                "pinned_chunk": "slices of a page-locked chunk, copied on a side stream",
                "prefetch": "the same DataLoader, copies on a side stream"}


def describe(ladder: Ladder, lever: str, value) -> str:
    """What one lever's change does, in a few words."""
    if lever == "strategy" and value == "gpu_resident" and ladder.shuffles:
        return "the dataset on the device, each shuffled batch gathered there"
    if lever == "strategy":
        return STRATEGY_WHY.get(value, f"loader={value}")
    if lever == "workers" and value == 0 and ladder.workers > ladder.cores:
        return (f"batches made in the loop's own process: the {ladder.workers} workers took turns on the run's "
                f"{ladder.cores} CPU cores and cost more than they gave")
    if lever == "workers" and value < ladder.workers:
        return (f"{value} DataLoader workers, for the {ladder.cores} CPU cores the run is given "
                f"({ladder.workers} took turns on them)")
    return {"workers": f"{value} DataLoader worker processes",
            "graph": "the step replayed as one CUDA graph" if value else "the step launched eagerly",
            "compile": f"the step compiled (torch.compile, mode {value})",
            "optimizer": "the optimizer's fused implementation",
            "precision": f"autocast to {value}: changes the training"}[lever]


def feed_changes(ladder: Ladder, verdict: Verdict) -> Dict[Setting, str]:
    """The feed-side changes worth measuring (each by its feed alone) for this verdict: setting -> why."""
    eps, t = ladder.tolerance, ladder.configured
    found: Dict[Setting, str] = {}
    if verdict.bound == "none":  # rungs that contradict each other predict nothing
        return found
    feeding_matters = math.isfinite(verdict.feeding_costs_ms) and verdict.feeding_costs_ms > eps * t
    if feeding_matters and ladder.decodes_files and ladder.strategy != "gpu_decode":
        # An image folder's feed is mostly decoding: done by nvJPEG, it leaves the host's cores free.
        found[setting(strategy="gpu_decode")] = STRATEGY_WHY["gpu_decode"]
    if feeding_matters and ladder.holds_block and ladder.strategy not in ("pinned_chunk", "gpu_resident"):
        found[setting(strategy="pinned_chunk")] = STRATEGY_WHY["pinned_chunk"]
    if (ladder.shuffles and ladder.holds_block and ladder.strategy != "gpu_resident"
            and math.isfinite(ladder.ceiling_eager)):
        # Shuffled, the dataset on the device is gathered batch by batch: work on the loop's thread
        # beside an eager step's launches (unshuffled, its batches are the ceiling's own views).
        found[setting(strategy="gpu_resident")] = STRATEGY_WHY["gpu_resident"]
    if verdict.bound == "copy" and ladder.strategy in IN_LINE:
        found[setting(strategy="prefetch")] = STRATEGY_WHY["prefetch"]
    workers, cores = ladder.workers, ladder.cores or available_cores()
    most = min(max_workers(), cores)  # never more workers than the run's cores
    if LOADERS[ladder.strategy].Config.uses_dataloader and workers > cores:
        # More workers than cores take turns on them (the run's own warning says so): as many as the
        # cores, and none, whose feed says whether the workers give more than they cost.
        for fewer in (most, 0):
            found[setting(workers=fewer)] = describe(ladder, "workers", fewer)
    elif verdict.bound == "input" and ladder.strategy in DATALOADER_STRATEGIES and workers < most:
        found[setting(workers=most)] = describe(ladder, "workers", most)
    return found


def feed_of(ladder: Ladder, feed: Setting) -> float:
    """The feed alone of a feed-side setting (() : the configured loader's)."""
    return ladder.feed if not feed else ladder.feeds.get(feed, math.nan)


def predicted(ladder: Ladder, feed: Setting, step: Setting) -> float:
    """The ms/step of the job with a feed-side and a step-side change, from their measured rungs
    by the model (nan: one of them was not measured)."""
    steps = ladder.step_rungs()
    step_ms = steps.get(step, math.nan)
    strategy = dict(feed).get("strategy", ladder.strategy)
    if strategy == "gpu_resident" and not ladder.shuffles:
        return step_ms  # that rung is this change (its batches views of the resident data)
    if ladder.is_graphed(step):
        serial = 0.0
    else:  # the eager step's host share, against the same step graphed where that was measured
        serial = eager_host_share(step_ms, steps.get(ladder.flip(step, True), ladder.ceiling_graphed), ladder.tolerance)
    return predict(step_ms, feed_of(ladder, feed), serial, feed_work(ladder, feed), in_line(ladder, strategy),
                   graph_launch_ms(ladder, ladder.is_graphed(step), feed))


def reachable(ladder: Ladder, verdict: Verdict) -> List[Change]:
    """Every configuration the measured rungs predict: each measured feed (the configured one, the
    changes' feeds, the dataset on the device) against each measured step (eager, graphed, and the
    step's other levers), by the model."""
    if verdict.bound == "none":
        return []
    feeds = [(), *ladder.feeds]
    if (ladder.holds_block and ladder.strategy != "gpu_resident"
            and setting(strategy="gpu_resident") not in ladder.feeds):
        feeds.append(setting(strategy="gpu_resident"))
    found = []
    for feed in feeds:
        if not _offered(ladder, feed):
            continue
        for step in ladder.step_rungs():
            changes = merged(feed, step)
            ms = predicted(ladder, feed, step)
            if changes and math.isfinite(ms):
                found.append(Change(changes, ms, "; ".join(describe(ladder, k, v) for k, v in changes)))
    return found


def _offered(ladder: Ladder, feed: Setting) -> bool:
    """No workers is proposed only where its feed alone beats the feed with workers: where the
    workers cost more than they give."""
    if feed != setting(workers=0):
        return True
    with_workers = [ms for s, ms in ladder.feeds.items() if dict(s).get("workers", 0) > 0]
    return not with_workers or ladder.feeds[feed] < min(with_workers)


def recommend(ladder: Ladder, options: Sequence[Change]) -> List[Change]:
    """Up to three single changes predicted to save more than the tolerance, fastest first."""
    single = [c for c in options if len(c.changes) == 1 and _saves(ladder, c)]
    return sorted(single, key=lambda c: c.predicted_ms)[:3]


def best(ladder: Ladder, verdict: Verdict, options: Sequence[Change]) -> Optional[Change]:
    """The fastest reachable configuration that saves more than the tolerance (None: none does).
    Among those within the tolerance of the fastest (a tie, as far as the rungs can tell), the one
    that keeps the training as it is, then the fewest changes, then the fastest; its `chain` set."""
    better = [c for c in options if _saves(ladder, c)]
    if not better:
        return None
    fastest = min(c.predicted_ms for c in better)
    tied = [c for c in better if c.predicted_ms <= (1 + ladder.tolerance) * fastest]
    top = min(tied, key=lambda c: (bool(c.changes_training), len(c.changes), c.predicted_ms))
    top.chain = chain(ladder, verdict, top.changes)
    return top


def _saves(ladder: Ladder, change: Change) -> bool:
    return change.predicted_ms < (1 - ladder.tolerance) * ladder.configured


def chain(ladder: Ladder, verdict: Verdict, changes: Setting) -> List[str]:
    """The bounds the job goes through on its way to `changes`: the verdict's, then, lever by lever
    (those that remove the bound of the moment first: REMOVES), the bound of each configuration
    on the way, as `judge` calls it from the predicted figures."""
    bounds, done, left = [verdict.bound], {}, dict(changes)
    while left:
        levers = [k for k in REMOVES.get(bounds[-1], ()) if k in left] or list(left)
        done.update({k: left.pop(k) for k in levers})
        bound = bound_at(ladder, setting(**done))
        if bound and bound != bounds[-1]:
            bounds.append(bound)
    return bounds


def bound_at(ladder: Ladder, changes: Setting) -> Optional[str]:
    """What bounds the job with `changes`, judged as the job itself is, on the figures the rungs
    predict for it (None: the rungs do not predict it)."""
    feed = tuple((k, v) for k, v in changes if k in FEED_LEVERS)
    step = tuple((k, v) for k, v in changes if k not in FEED_LEVERS)
    steps, strategy = ladder.step_rungs(), dict(feed).get("strategy", ladder.strategy)
    ms = predicted(ladder, feed, step)
    if not math.isfinite(ms):
        return None
    at = Ladder(configured=ms, graphed=ladder.is_graphed(step), strategy=strategy, tolerance=ladder.tolerance,
                ceiling_eager=steps.get(ladder.flip(step, False), math.nan),
                ceiling_graphed=steps.get(ladder.flip(step, True), math.nan),
                # views of resident data are free; a shuffled gather, measured, is a feed
                feed=0.0 if strategy == "gpu_resident" and not ladder.shuffles else feed_of(ladder, feed),
                feed_loop=feed_work(ladder, feed), copy_achieved=ladder.copy_achieved if strategy == ladder.strategy else math.nan,
                graphed_host_step=ladder.graphed_host_step,
                feed_host_step=ladder.feeds_host_step.get(feed, math.nan) if feed else ladder.feed_host_step)
    return judge(at).bound


# ----------------------------------------------------------------------------- the rungs
def with_loader(cfg, name: str, **keys):
    """A copy of the job with the loader strategy `name`, its common keys (batch size, ...) the job's."""
    job = copy.deepcopy(cfg)
    common = {k: job.loader[k] for k in COMMON_LOADER_KEYS if k in job.loader}
    if not LOADERS[name].Config.uses_dataloader:  # its DataLoader keys would only be warned about
        common = {k: v for k, v in common.items() if k not in DATALOADER_KEYS}
    with open_dict(job):
        job.loader = OmegaConf.structured(LOADERS[name].Config(**{**common, **keys}))
    return job


def with_values(cfg, **values):
    """A copy of the job with dotted keys set (`engine.cuda_graph=True`)."""
    job = copy.deepcopy(cfg)
    with open_dict(job):
        for key, value in values.items():
            OmegaConf.update(job, key, value, merge=False)
    return job


def with_changes(cfg, changes: Setting):
    """A copy of the job with a Setting's changes made (a strategy first, the other keys on it)."""
    values = dict(changes)
    strategy = values.pop("strategy", None)
    if strategy is not None and strategy != cfg.loader.name:
        cfg = with_loader(cfg, strategy)
    return with_values(cfg, **{LEVERS[lever]: value for lever, value in values.items()})


def noop_feed(cfg):
    """The job's loader with a model that does nothing: its feed alone."""
    job = copy.deepcopy(cfg)
    with open_dict(job):
        job.model = OmegaConf.structured(MODELS["noop"].Config())
    return with_values(job, **{LEVERS[k]: v for k, v in FEED_ALONE.items() if has_lever(job, k)})


def step_levers(cfg, allow: Sequence[str], cuda: bool) -> tuple:
    """(the step levers past the graph to measure, {lever: why not} for those said not to be)."""
    tried, not_tried = [], {}
    for lever, (off, value) in STEP_TRIALS.items():
        if not has_lever(cfg, lever) or OmegaConf.select(cfg, LEVERS[lever]) != off:
            continue  # an engine without the key (nothing to say), or the job has the lever on already
        if lever in CHANGES_TRAINING and lever not in allow:
            not_tried[lever] = (f"not tried: it changes the training; --allow {lever} measures "
                                f"{overrides_of(setting(**{lever: value}))[0]}")
        elif lever in CUDA_ONLY and not cuda:
            not_tried[lever] = "no CUDA: measured on a GPU only (it acts on kernels and their launches)"
        else:
            tried.append(lever)
    return tried, not_tried


class Advisor:
    """Runs the rungs as children of one MLflow run (`parent_id`) and keeps what they measured."""

    def __init__(self, cfg, steps: int, parent_id: str, run_fn: Callable, log: Callable[[str], None],
                 allow: Sequence[str] = ()):
        self.cfg, self.steps, self.parent_id, self.run_fn, self.log = cfg, steps, parent_id, run_fn, log
        self.cuda = _is_cuda(cfg)  # the rungs run on CUDA
        self.allow = tuple(allow)  # levers that change the training, allowed by the user
        self.refusal: Optional[ConfigError] = None  # why the last rung not measured was refused

    def sized(self, cfg, name: str, window: int = 0, steps: int = 0):
        """The rung's job: `steps` timed steps (0: the advice's) after the job's warm-up (one, for a
        rung that takes a kernel window: only its window counts), nested under the advice."""
        job = copy.deepcopy(cfg)
        with open_dict(job):
            job.engine.max_steps = job.engine.warmup_steps + (1 if window else steps or self.steps)
            job.engine.kernel_window_steps = window
            job.engine.progress = False
            job.engine.quiet = True  # the rung's one progress line says what it measured, not a run's summary
            job.tracking.plots = False  # a dozen rungs: their steps.csv, without a timeline drawn for each
            job.tracking.parent_run_id = self.parent_id
            job.tracking.run_name = f"advise: {name}"
        return job

    def measure(self, cfg, name: str, window: int = 0, steps: int = 0) -> tuple:
        """(summary, "") of one rung, or (None, why it could not be measured)."""
        start = time.perf_counter()
        try:
            summary = self.run_fn(self.sized(cfg, name, window, steps))
        except (ConfigError, RunFailed) as e:
            self.refusal = e if isinstance(e, ConfigError) else None
            self.log(f"  {name}: not measured ({' '.join(str(e).split())[:300]})")
            return None, " ".join(str(e).split())[:300]
        self.log(f"  {name}: {summary.get('ms_per_step', math.nan):.3f} ms/step ({time.perf_counter() - start:.0f} s)")
        return summary, ""

    def ladder(self) -> Ladder:
        """The timing rungs (no kernel window: nothing timed runs after CUPTI attaches)."""
        cfg = self.cfg
        configured, why = self.measure(cfg, "configured")
        if configured is None:
            raise ConfigError(f"the run as configured failed: {why}")
        ladder = Ladder(configured=configured["ms_per_step"], graphed=bool(OmegaConf.select(cfg, LEVERS["graph"])) and self.cuda,
                        strategy=cfg.loader.name, workers=cfg.loader.num_workers, shuffles=bool(cfg.loader.shuffle),
                        cores=_cores(configured), configured_wait=_wait(configured),
                        configured_spread=_spread(configured),
                        decodes_files=self.cuda and getattr(DATASETS.get(cfg.dataset.name), "image_files", False))
        ceiling = with_loader(cfg, "gpu_resident", shuffle=False, drop_last=True)  # views of resident data
        as_read = {key: value for key, value in CEILING_DATASET.items()
                   if OmegaConf.select(ceiling, key, default=value) != value}
        if as_read:
            ladder.holds_block = False
            ceiling = with_values(ceiling, **as_read)
        eager, why = self.measure(with_values(ceiling, **{LEVERS["graph"]: False}), "ceiling, eager")
        # Decoded, the dataset does not fit in one block: the step alone is the same on its first
        # images, and the one-block strategies are not proposed. Half of what fits, at most 64
        # batches: the host keeps room, and the block must fit the GPU too.
        part = min(self.refusal.fits // 2, 64 * cfg.loader.batch_size) if isinstance(self.refusal, DoesNotFit) else 0
        if eager is None and part >= cfg.loader.batch_size:
            ladder.holds_block = False
            ceiling = with_values(ceiling, **{"dataset.num_samples": part})
            eager, why = self.measure(with_values(ceiling, **{LEVERS["graph"]: False}),
                                      f"ceiling, eager, the first {part} samples (all do not fit)")
        if eager is None:
            ladder.missing["ceiling"] = why
        else:
            ladder.ceiling_eager = eager["ms_per_step"]
            ladder.tolerance = tolerance(eager)
        if not self.cuda:
            ladder.missing["ceiling, graphed"] = "no CUDA: a CUDA graph needs a GPU"
        elif eager is not None:
            graphed, why = self.measure(with_values(ceiling, **{LEVERS["graph"]: True}), "ceiling, graphed")
            if graphed is None:
                ladder.missing["ceiling, graphed"] = why
            else:
                ladder.ceiling_graphed = graphed["ms_per_step"]
                ladder.graphed_host_step = graphed.get("median_host_step_ms", math.nan)
        if eager is not None:
            self._step_levers(ladder, ceiling)
        feed, why = self.measure(noop_feed(cfg), "feed alone")
        if feed is None:
            ladder.missing["feed"] = why
        else:
            ladder.feed, ladder.feed_loop = feed["ms_per_step"], _loop_ms(feed)
            ladder.feed_host_step = feed.get("median_host_step_ms", math.nan)
        self._again(ladder, ceiling)
        self._copies(ladder, configured)
        return ladder

    def _again(self, ladder: Ladder, ceiling) -> None:
        """Rungs measured a second time, last, for the host's drift: on a GPU host the same eager
        step measures 10-30% apart from one run to the next, and a feed made by Python on the
        loop's thread 20-40%. The eager ceiling, the feed alone and the configured run once more,
        in that order (the configured run first and last: its pair spans the ladder; not where its
        timed steps took `AGAIN_UNDER_MS` already), each the pair's mean: the model is held against
        the run on means over the same span of the host's time (one MNIST run at 6.7 ms/step beside
        feeds of 7.8 and 9.7 alone read the host's moment as the model's miss). Where a part's mean
        contradicts the whole run, the part's faster reading stands (a part of the run, at its best).
        How far apart the ceilings are (`drift`) widens the tolerance, the steps' as the run's; the
        run's and the feeds' (`configured_drift`, `feed_drift`) only how far the run may be from
        the model (`miss_tolerance`): their noise says nothing of whether a step is set by its launches."""
        eager_again = feed_again = run_again = None
        if math.isfinite(ladder.ceiling_eager):
            eager_again = _timed(self.measure(with_values(ceiling, **{LEVERS["graph"]: False}), "ceiling, eager, again")[0])
        if math.isfinite(ladder.feed):
            feed_again = _timed(self.measure(noop_feed(self.cfg), "feed alone, again")[0])
        if ladder.configured * self.steps < AGAIN_UNDER_MS:
            run_again = _timed(self.measure(self.cfg, "configured, again")[0])
        if run_again is not None:
            ladder.configured_drift = _apart(ladder.configured, run_again["ms_per_step"])
            ladder.configured = (ladder.configured + run_again["ms_per_step"]) / 2
            ladder.configured_wait = _mean(ladder.configured_wait, _wait(run_again))
            ladder.configured_spread = max(ladder.configured_spread, _spread(run_again))
        eagers = feeds = None
        if eager_again is not None:
            eagers = (ladder.ceiling_eager, eager_again["ms_per_step"])
            ladder.drift = _apart(*eagers)
            ladder.ceiling_eager = sum(eagers) / 2
            ladder.tolerance = min(MAX_TOLERANCE, max(ladder.tolerance, ladder.drift))
        if feed_again is not None:
            feeds = ((ladder.feed, ladder.feed_loop), (feed_again["ms_per_step"], _loop_ms(feed_again)))
            ladder.feed_drift = _apart(feeds[0][0], feeds[1][0])
            ladder.feed, ladder.feed_loop = (feeds[0][0] + feeds[1][0]) / 2, _mean(feeds[0][1], feeds[1][1])
        # Each part against the run on its own: a feed that contradicts it says nothing of the step's pair.
        if eagers and not ladder.graphed and _outruns(ladder, ladder.ceiling_eager):
            ladder.ceiling_eager = min(eagers)
        if feeds and _outruns(ladder, ladder.feed):
            ladder.feed, ladder.feed_loop = min(feeds)

    def _step_levers(self, ladder: Ladder, ceiling) -> None:
        """The step's levers past the graph (STEP_TRIALS), each measured once on top of the fastest
        step measured so far (or, where that step is graphed and the run fails, on the fastest eager one:
        an engine may refuse a lever with CUDA graphs)."""
        tried, not_tried = step_levers(self.cfg, self.allow, self.cuda)
        ladder.missing.update(not_tried)
        for lever in tried:
            rungs = ladder.step_rungs()
            eager = {s: ms for s, ms in rungs.items() if not ladder.is_graphed(s)}
            fastest = min(rungs, key=rungs.get)
            bases = [fastest, min(eager, key=eager.get)] if ladder.is_graphed(fastest) and eager else [fastest]
            if lever in GRAPH_EXCLUSIVE:  # the engine refuses it with its own graph: its eager base only
                bases = [b for b in bases if not ladder.is_graphed(b)]
            for base in bases:
                changes = merged(base, setting(**{lever: STEP_TRIALS[lever][1]}))
                name = step_name(ladder, changes)
                # The graph set either way: a CPU job may say cuda_graph=true and run eager.
                job = with_values(with_changes(ceiling, changes), **{LEVERS["graph"]: ladder.is_graphed(changes)})
                summary, why = self.measure(job, name)
                if summary is not None:
                    ladder.steps[changes] = summary["ms_per_step"]
                    break
                ladder.missing[name] = why

    def _copies(self, ladder: Ladder, configured: dict) -> None:
        """The copy rung: one batch at the pinned peak and the pageable rate, against the achieved."""
        mb = configured.get("h2d_batch_mb", math.nan)
        if not self.cuda:
            ladder.missing["copy"] = "no CUDA: a CPU run copies nothing to a device"
            return
        if not (mb > 0):
            ladder.missing["copy"] = f"loader={ladder.strategy} copies nothing from the host in the timed steps"
            return
        ladder.batch_mb = mb
        ladder.copy_achieved = configured.get("median_h2d_ms", math.nan)
        for attr, key in (("copy_pinned", "h2d_peak_pinned_GBps"), ("copy_pageable", "h2d_peak_pageable_GBps")):
            rate = configured.get(key, math.nan)
            setattr(ladder, attr, mb * 2**20 / (rate * 1e6) if rate > 0 else math.nan)

    def feeds(self, ladder: Ladder, found: Dict[Setting, str]) -> None:
        """Measure the feed alone of each feed-side change (a strategy, a number of workers)."""
        for changes in found:
            name = f"feed alone, {' '.join(overrides_of(changes))}"
            summary, why = self.measure(noop_feed(with_changes(self.cfg, changes)), name)
            if summary is None:
                ladder.missing[name] = why
            else:
                ladder.feeds[changes], ladder.feeds_loop[changes] = summary["ms_per_step"], _loop_ms(summary)
                ladder.feeds_host_step[changes] = summary.get("median_host_step_ms", math.nan)

    def verify(self, changes: Sequence[Change], drift: float = 0.0, twice: int = 2) -> None:
        """Run each change as the configured run was run: its measured ms/step. Where the host's
        speed moved during the ladder (`drift`: how far apart a rung measured first and last came
        out, beyond the minimum tolerance), the first `twice` distinct configurations (the best and the top
        change, what the user is told first; the next change where those two are one) run twice,
        in turns (the second pass in reverse order), and measure the mean of their two runs: one
        run on such a host reads its drift as the model's miss (an eager step on an H200 host: 1.6
        to 2.2 ms/step in ten runs in a row). Each runs for at least `MIN_TIMED_MS` of timed steps
        at its predicted pace (`timed_steps`): a fast configuration's 100 steps are a moment."""
        order = list(dict.fromkeys(c.changes for c in changes))  # each configuration once a pass
        # (reversed: a configuration listed twice is sized by its first listing, the best's prediction)
        expect = {c.changes: c.predicted_ms for c in reversed(changes)}
        runs: Dict[Setting, List[float]] = {c: [] for c in order}
        again = order[:twice] if drift > MIN_TOLERANCE else []
        for turn in (order, again[::-1]):
            for changes_ in turn:
                if runs[changes_] and not math.isfinite(runs[changes_][0]):
                    continue  # it failed: a second run would fail as the first
                name = f"verify {' '.join(overrides_of(changes_))}" + (f", run {len(runs[changes_]) + 1}" if changes_ in again else "")
                summary, _ = self.measure(with_changes(self.cfg, changes_), name,
                                          steps=timed_steps(self.steps, expect[changes_]))
                runs[changes_].append(summary["ms_per_step"] if summary is not None else math.nan)
        for change in changes:
            got = [ms for ms in runs[change.changes] if math.isfinite(ms)]
            change.measured_ms = sum(got) / len(got) if got else math.nan
            change.measured_runs = len(got)
            change.measured_apart = _apart(min(got), max(got)) if len(got) > 1 else 0.0

    def kernels(self, ladder: Ladder) -> None:
        """The kernel windows of the configured run and of the eager ceiling (CUDA only), last."""
        if not self.cuda:
            ladder.missing["kernels"] = "no CUDA: a CPU run has no kernels to trace"
            return
        window = self.cfg.engine.kernel_window_steps or 20
        rungs = {"configured": self.cfg}
        if math.isfinite(ladder.ceiling_eager):
            rungs["ceiling, eager"] = with_values(with_loader(self.cfg, "gpu_resident", shuffle=False, drop_last=True),
                                                  **{LEVERS["graph"]: False})
        for name, cfg in rungs.items():
            summary, why = self.measure(cfg, f"kernels of {name}", window=window)
            if summary is None or not math.isfinite(summary.get("gpu_kernel_ms_per_step", math.nan)):
                ladder.missing[f"kernels of {name}"] = why or "the kernel window was not taken (see its run's tag kernel_window)"
            else:
                ladder.kernels[name] = {k: summary[k] for k in ("gpu_kernel_ms_per_step", "gpu_kernel_busy_fraction",
                                                                 "launch_gap_ms", "h2d_overlapped_by_kernels_fraction")}


def _timed(summary: Optional[dict]) -> Optional[dict]:
    """A rung's summary where it timed its steps (None: not measured, or no ms/step)."""
    return summary if summary is not None and math.isfinite(summary.get("ms_per_step", math.nan)) else None


def timed_steps(steps: int, expect_ms: float) -> int:
    """Timed steps for a run expected at `expect_ms` a step: `steps`, or as many as fill
    `MIN_TIMED_MS` where more, at most `MOST_TIMES_STEPS` times `steps`."""
    if not (math.isfinite(expect_ms) and expect_ms > 0):
        return steps
    return max(steps, min(MOST_TIMES_STEPS * steps, math.ceil(MIN_TIMED_MS / expect_ms)))


def _apart(first: float, second: float) -> float:
    """How far apart two measurements of one rung are, over the faster (0 where either is 0)."""
    return abs(second - first) / min(first, second) if min(first, second) > 0 else 0.0


def _mean(first: float, second: float) -> float:
    """The mean of two readings, or the one that was read (nan: neither)."""
    read = [v for v in (first, second) if math.isfinite(v)]
    return sum(read) / len(read) if read else math.nan


def _tolerances(ladder: Ladder) -> str:
    """What widened the tolerance (the eager ceiling's drift) and how far the run may be from the
    model, where wider, and why (its own interval, the feed's drift): `miss_tolerance`."""
    text = f" (the eager step fed from the device measured first and last {ladder.drift:.0%} apart)" if ladder.drift > 0 else ""
    wider = miss_tolerance(ladder)
    if wider > ladder.tolerance:
        why = [w for w, v in (("its own interval", ladder.configured_spread),
                              (f"the run measured first and last {ladder.configured_drift:.0%} apart", ladder.configured_drift),
                              (f"the feed alone measured first and last {ladder.feed_drift:.0%} apart", ladder.feed_drift),
                              ("one run against the mean of the eager step's two: twice their distance", 2 * ladder.drift))
               if v > ladder.tolerance]
        text += f", {wider:.0%} against the run ({'; '.join(why)})"
    return text


def step_name(ladder: Ladder, changes: Setting) -> str:
    """A step rung's name: `ceiling, graphed, engine.optimizer.impl=fused`."""
    rest = overrides_of(tuple((k, v) for k, v in changes if k != "graph"))
    return ", ".join(["ceiling", "graphed" if ladder.is_graphed(changes) else "eager", *rest])


def _loop_ms(summary: dict) -> float:
    """A feed alone's work on the loop's thread per step (nan where the run did not read it)."""
    ms = summary.get("loop_thread_cpu_ms_per_step", math.nan)
    return ms if ms > 0 else math.nan


def _wait(summary: dict) -> float:
    """The run's wait for batches, ms per step."""
    return summary.get("data_wait_fraction", math.nan) * summary.get("ms_per_step", math.nan)


def _spread(summary: dict) -> float:
    """Half the run's 95% interval of ms/step over its ms/step (0: no interval)."""
    low, high, ms = (summary.get(k, math.nan) for k in ("ms_per_step_ci_low", "ms_per_step_ci_high", "ms_per_step"))
    half = (high - low) / 2 / ms if ms > 0 else math.nan
    return half if math.isfinite(half) else 0.0


def _cores(configured: dict) -> int:
    """The CPU cores the configured run was given: its own `host_cores`, else this process's."""
    cores = configured.get("host_cores", math.nan)
    return int(cores) if cores > 0 else available_cores()


def tolerance(ceiling: dict) -> float:
    """"Within a few percent": the ceiling run's own jitter (its mean step against its median),
    between 3% and 20%."""
    mean, median = ceiling.get("ms_per_step", math.nan), ceiling.get("median_step_ms", math.nan)
    jitter = abs(mean - median) / mean if mean > 0 and math.isfinite(median) else 0.0
    return min(MAX_TOLERANCE, max(MIN_TOLERANCE, jitter))


def _is_cuda(cfg) -> bool:
    return cfg.engine.device != "cpu" and torch.cuda.is_available()


# ----------------------------------------------------------------------------- the answer
def render(ladder: Ladder, verdict: Verdict, changes: Sequence[Change], gpu: str, top: Optional[Change] = None) -> str:
    """The advice in a few lines (also `advice.md`): the best configuration first."""
    t = ladder.configured
    kind = "graphed" if ladder.graphed else "eager"
    rows = [(f"configured (loader={ladder.strategy}, {kind})", _ms(t)),
            ("step fed from the device, eager", _ms(ladder.ceiling_eager)),
            ("step fed from the device, graphed", _ms(ladder.ceiling_graphed))]
    if math.isfinite(ladder.graphed_host_step):
        rows.append(("  its replay, on the loop's thread", _ms(ladder.graphed_host_step)))
    rows += [(f"step fed from the device, {step_name(ladder, s)[len('ceiling, '):]}", _ms(ms)) for s, ms in ladder.steps.items()]
    rows.append((f"feed alone (loader={ladder.strategy}, no model)", _ms(ladder.feed)))
    rows += [(f"feed alone ({' '.join(overrides_of(s))}, no model)", _ms(ms)) for s, ms in ladder.feeds.items()]
    if math.isfinite(ladder.batch_mb):
        rows += [(f"copy of one batch ({ladder.batch_mb:.1f} MiB), achieved", _ms(ladder.copy_achieved)),
                 ("  the same at the pinned peak", _ms(ladder.copy_pinned)),
                 ("  the same at the pageable rate", _ms(ladder.copy_pageable))]
    width = max(len(label) for label, _ in rows)
    lines = [*best_lines(ladder, verdict, top), "", f"bound: {verdict.bound} — {verdict.reason}", "",
             f"ladder (ms/step, {gpu}):"]
    lines += [f"  {label.ljust(width)}  {value}" for label, value in rows]
    for name, k in ladder.kernels.items():
        lines.append(f"  kernels of {name}: {k['gpu_kernel_ms_per_step']:.3f} ms/step, busy "
                     f"{k['gpu_kernel_busy_fraction']:.2f} of the wall, launch gaps {k['launch_gap_ms']:.3f} ms/step, "
                     f"copies under kernels {_fraction(k['h2d_overlapped_by_kernels_fraction'])}")
    lines.append(f"  the model gives {modelled(ladder):.3f} for the run as configured; tolerance {ladder.tolerance:.0%}"
                 + _tolerances(ladder))
    miss = model_miss(ladder)
    if cautioned(ladder, verdict):  # (no verdict: its line says why)
        rung = disagreeing_rung(ladder)
        lines.append(f"  caution: the run measured {miss:+.0%} against the model, more than the tolerance: the rungs "
                     "do not explain it, so take the verdict and the predictions as leads"
                     + (f"; the rung it disagrees with most is {rung}" if rung else
                        " (the host's speed may have changed between them: run again on a quiet machine)"))
    lines.append("")
    if changes:
        lines.append("changes (predicted ms/step):")
        for i, c in enumerate(changes, 1):
            lines.append(f"  {i}. {' '.join(c.overrides):34s} {c.predicted_ms:8.3f}  ({t / c.predicted_ms:.2f}x: "
                         f"{c.why}){_verified(c, '   ')}")
    else:
        lines.append("changes: none predicted to save more than the tolerance: the step itself sets the pace "
                     "(a faster model or a larger batch would)" if verdict.bound == "compute"
                     else "changes: none predicted: rungs that contradict each other predict nothing"
                     if verdict.bound == "none"
                     else "changes: none of those the ladder can predict would save more than the tolerance")
    if ladder.missing:
        lines += ["", "not measured: " + "; ".join(f"{k} ({v})" for k, v in ladder.missing.items())]
    return "\n".join(lines)


def best_lines(ladder: Ladder, verdict: Verdict, top: Optional[Change]) -> List[str]:
    """The best configuration: its overrides on one line, then its prediction and its bounds."""
    if top is None:
        if verdict.bound == "none":
            return ["best: unknown — rungs that contradict each other predict nothing"]
        return [f"best: as configured — nothing the ladder measured is predicted to save more than the tolerance "
                f"({ladder.tolerance:.0%})"]
    through = f"bounds {' → '.join(top.chain)}" if len(top.chain) > 1 else f"bound: {top.chain[0]} throughout"
    lines = [f"best: {' '.join(top.overrides)}",
             f"  {top.predicted_ms:.3f} ms/step predicted ({ladder.configured / top.predicted_ms:.2f}x), "
             f"{through}{_verified(top, '; ')}"]
    if top.changes_training:
        lines.append(f"  changes the training: {' '.join(top.changes_training)} (autocast: the loss and the weights "
                     f"it reaches differ from the configured run's)")
    return lines


def _verified(change: Change, sep: str) -> str:
    if not math.isfinite(change.measured_ms):
        return ""
    runs = f", the mean of {change.measured_runs} runs {change.measured_apart:.0%} apart" if change.measured_runs > 1 else ""
    return f"{sep}measured {change.measured_ms:.3f} ({(change.measured_ms / change.predicted_ms - 1):+.0%}{runs})"


def _ms(value: float) -> str:
    return f"{value:8.3f}" if math.isfinite(value) else "       —"


def _fraction(value: float) -> str:
    return f"{value:.2f}" if math.isfinite(value) else "— (no copy)"


def _slug(changes: Setting) -> str:
    """A Setting in a metric's name: `graphed_optimizer_fused`, `workers2`, `pinned_chunk`."""
    parts = []
    for lever, value in changes:
        if lever == "graph":
            parts.append("graphed" if value else "eager")
        elif lever == "workers":
            parts.append(f"workers{value}")
        elif isinstance(value, bool):
            parts.append(lever if value else f"no_{lever}")
        else:
            parts.append(str(value) if lever in ("strategy", "precision") else f"{lever}_{value}")
    return "_".join(parts)


def metrics(ladder: Ladder, verdict: Verdict, changes: Sequence[Change], top: Optional[Change] = None) -> Dict[str, float]:
    """The ladder as the advice run's metrics (nan ones left out: not measured)."""
    out = {"ladder.configured_ms": ladder.configured, "ladder.ceiling_eager_ms": ladder.ceiling_eager,
           "ladder.ceiling_graphed_ms": ladder.ceiling_graphed, "ladder.feed_ms": ladder.feed,
           "ladder.copy_achieved_ms": ladder.copy_achieved, "ladder.copy_pinned_peak_ms": ladder.copy_pinned,
           "ladder.copy_pageable_ms": ladder.copy_pageable, "ladder.batch_mb": ladder.batch_mb,
           "ladder.feed_loop_thread_ms": ladder.feed_loop, "ladder.configured_wait_ms": ladder.configured_wait,
           "ladder.modelled_ms": modelled(ladder), "tolerance": ladder.tolerance,
           "ladder.model_miss": model_miss(ladder), "ladder.miss_tolerance": miss_tolerance(ladder),
           "ladder.drift": ladder.drift, "ladder.feed_drift": ladder.feed_drift,
           "ladder.configured_drift": ladder.configured_drift,
           "ladder.graphed_host_step_ms": ladder.graphed_host_step,
           "feeding_costs_ms": verdict.feeding_costs_ms, "launch_costs_ms": verdict.launch_costs_ms}
    for s, ms in ladder.steps.items():
        out[f"ladder.ceiling_{_slug(merged(setting(graph=ladder.is_graphed(s)), s))}_ms"] = ms  # ceiling_graphed_optimizer_fused_ms
    for s, ms in ladder.feeds.items():
        out[f"ladder.feed_{_slug(s)}_ms"] = ms
    for name, k in ladder.kernels.items():
        for key, value in k.items():
            out[f"kernels.{name.replace(', ', '_')}.{key}"] = value
    for i, c in enumerate(changes, 1):
        out[f"change{i}.predicted_ms"], out[f"change{i}.measured_ms"] = c.predicted_ms, c.measured_ms
    if top is not None:
        out["best.predicted_ms"], out["best.measured_ms"] = top.predicted_ms, top.measured_ms
    return {k: float(v) for k, v in out.items() if math.isfinite(v)}


# ----------------------------------------------------------------------------- the command
def advise(cfg, steps: int, verify: bool, overrides: Sequence[str] = (), run_fn: Optional[Callable] = None,
           log: Callable[[str], None] = lambda line: print(line, file=sys.stderr), allow: Sequence[str] = (),
           kernels: bool = True) -> dict:
    """Measure, judge, search and recommend (and verify), recorded as one MLflow run (tagged with
    the job's `overrides`); `allow`: levers that change the training, searched too (`precision`);
    `kernels=False`: no kernel windows (said under "not measured").
    Returns {run_id, bound, best, changes, text, ladder}."""
    if run_fn is None:
        run_fn = rungs_of_the_loop()
    check_tracking_uri(cfg.tracking.uri)
    uri = cfg.tracking.uri or default_uri()
    with store_errors(uri):
        client = MlflowClient(uri)
        exp_id = experiment_id(client, cfg.tracking.experiment, uri)
        parent = client.create_run(exp_id, run_name=f"advise {cfg.loader.name} {cfg.model.name}",
                                   tags={"advise": "true", "strategy": cfg.loader.name, "model": cfg.model.name,
                                         "dataset": cfg.dataset.name, "gpu_name": _gpu_name() if _is_cuda(cfg) else "none",
                                         "advise.overrides": " ".join(o for o in overrides if not o.startswith("tracking.")),
                                         **owner_tags()})
    parent_id = parent.info.run_id
    status = RunStatus.to_string(RunStatus.FAILED)
    try:
        advisor = Advisor(cfg, steps, parent_id, run_fn, log, allow)
        log(f"advise: measuring the ladder ({steps} timed steps a rung; runs nested under {parent_id})")
        ladder = advisor.ladder()
        verdict = judge(ladder)
        advisor.feeds(ladder, feed_changes(ladder, verdict))
        options = reachable(ladder, verdict)
        top, changes = best(ladder, verdict, options), recommend(ladder, options)
        if verify:
            # Twice in turns where any rung measured twice moved: the step's, the feed's or the run's.
            advisor.verify([*([top] if top else []), *changes],
                           drift=max(ladder.drift, ladder.feed_drift, ladder.configured_drift))
        if kernels:
            advisor.kernels(ladder)
        else:
            ladder.missing["kernels"] = "not asked (--no-kernels)"
        gpu = _gpu_name() if advisor.cuda else "CPU"
        text = render(ladder, verdict, changes, gpu, top)
        _record(client, parent_id, ladder, verdict, changes, top, text)
        status = RunStatus.to_string(RunStatus.FINISHED)
        return {"run_id": parent_id, "bound": verdict.bound, "best": top, "changes": changes, "text": text,
                "ladder": ladder}
    except KeyboardInterrupt as stop:
        status = RunStatus.to_string(RunStatus.KILLED)
        stop.advice_run_id = parent_id  # for the command's one line
        raise
    finally:
        client.set_terminated(parent_id, status)


def rungs_of_the_loop() -> Callable[[object], dict]:
    """The rungs as runs of the loop, in this process, sharing one dataset (MNIST's and CIFAR-10's
    files are read once, not once a rung) and one model's initial weights (built once: the
    compute-bound preset's took 2-3 s a rung), each `BuiltOnce`."""
    import datasets
    import models
    from trainer.loop.run import run  # here: the rungs are runs of the loop
    from trainer.memory import host_available_bytes
    built, weights = datasets.BuiltOnce(), models.BuiltOnce(keep_at_most=lambda: host_available_bytes() / 4)

    def run_rung(job) -> dict:
        try:
            dataset = built(job.dataset)
        except Exception:  # left to the run, which builds it again and fails as a run, recorded with its one line
            dataset = None
        return run(job, dataset=dataset, models=weights)
    return run_rung


def _record(client, run_id: str, ladder: Ladder, verdict: Verdict, changes: Sequence[Change], top: Optional[Change],
            text: str) -> None:
    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, v, now, 0) for k, v in metrics(ladder, verdict, changes, top).items()])
    client.set_tag(run_id, "bound", verdict.bound)
    client.set_tag(run_id, "caution", str(cautioned(ladder, verdict)).lower())
    for i, c in enumerate(changes, 1):
        client.set_tag(run_id, f"change{i}", " ".join(c.overrides))
    if top is not None:
        client.set_tag(run_id, "best", " ".join(top.overrides))
        client.set_tag(run_id, "best.chain", " → ".join(top.chain))
        if top.changes_training:
            client.set_tag(run_id, "best.changes_training", " ".join(top.changes_training))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "advice.md"
        path.write_text(f"# What bounds this run\n\n```\n{text}\n```\n\nThe rules: docs/advisor.md.\n")
        client.log_artifact(run_id, str(path))


def _gpu_name() -> str:
    return torch.cuda.get_device_name()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line: bad input is one line and exit 1, a Ctrl-C or SIGTERM one line and exit
    130 or 143 (the advice run and the rung then running closed as KILLED), as `python -m trainer`."""
    p = argparse.ArgumentParser(prog="python -m trainer.advise", description=__doc__.splitlines()[0])
    p.add_argument("--verify", action="store_true",
                   help="run the best configuration and each recommended change, and print their measured ms/step")
    p.add_argument("--no-kernels", action="store_true",
                   help="skip the two kernel windows (a few seconds each): the advice without its device-side figures")
    p.add_argument("--steps", type=int, default=300, help="timed steps of each rung, after the job's warm-up (default 300)")
    p.add_argument("--allow", action="append", default=[], choices=CHANGES_TRAINING,
                   help="also measure and propose a lever that changes the training (precision: engine.precision=bf16)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for python -m trainer")
    p.error = lambda message: _refuse(f"{message}: see python -m trainer.advise --help")
    # Overrides on both sides of an option (`loader=pinned --steps 10 loader.batch_size=512`): plain
    # parse_args takes the positionals once, and refuses those after the option.
    args = p.parse_intermixed_args(argv)
    if args.steps < 1:
        print(f"error: --steps must be >= 1 (got {args.steps}): use --steps 300", file=sys.stderr)
        return 1
    before = signal.signal(signal.SIGTERM, _terminate) if _main_thread() else None
    try:
        try:
            with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
                cfg = compose("config", overrides=list(args.overrides))  # the config python -m trainer would run
        except Exception as e:
            line = hydra_error_line(e, multirun=False)
            if line is None:
                raise
            print(f"error: {line}", file=sys.stderr)
            return 1
        result = advise(cfg, args.steps, args.verify, args.overrides, allow=args.allow, kernels=not args.no_kernels)
    except ConfigError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as stop:
        signum = getattr(stop, "signum", signal.SIGINT)
        advice = getattr(stop, "advice_run_id", None)
        closed = f": advice run {advice} marked KILLED, the rungs it measured are saved" if advice else ": nothing was recorded"
        print(f"interrupted by {signal.Signals(signum).name}{closed}", file=sys.stderr)
        return 128 + signum
    finally:
        if before is not None:
            signal.signal(signal.SIGTERM, before)
    print(result["text"])
    print(f"(MLflow run {result['run_id']}: tags bound and best, the ladder as metrics, advice.md)")
    return 0


def _refuse(line: str):
    print(f"error: {line}", file=sys.stderr)
    raise SystemExit(1)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
