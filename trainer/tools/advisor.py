"""`python -m trainer.advise [--verify] [--steps N] [overrides...]`: what bounds this run, and what
to change, each change with the ms/step it should give.

For the composed config it measures, in this process on this device, a short ladder of runs
(`trainer.loop.run.run`, each a child of the advice's MLflow run):

    configured        the run as configured
    ceiling           the same model, batch and dtype fed from data already on the device
                      (loader=gpu_resident, no shuffle): the step alone, eager and CUDA-graphed
    feed              the configured loader with no model (model=noop): how fast batches come
    copy              this batch's bytes at the pinned peak and at the pageable rate (after the
                      configured run), against the copy it achieved
    kernels           the configured run and the eager ceiling again, for their kernel windows
                      (last: nothing timed runs after CUPTI was attached)

and from them decides what bounds the run (`judge`: input, copy, launch or compute, by which
removal the measured ceilings say would save the most) and which changes would help
(`recommend`: exact overrides, each predicted from the ladder by one overlap model). With
`--verify` each change is run and its measured ms/step printed beside the prediction.
docs/advisor.md explains the rules and the model.
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
from typing import Callable, Dict, List, Optional, Sequence

import torch
from hydra import compose, initialize_config_dir
from mlflow.entities import Metric, RunStatus
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf, open_dict

from models import MODELS
from trainer.__main__ import _terminate, hydra_error_line  # the CLI's SIGTERM, and its one line for a bad override
from trainer.config import CONF_DIR
from trainer.errors import ConfigError, RunFailed
from trainer.loaders import LOADERS
from trainer.loaders.base import LoaderConfig
from trainer.tools.tuning import DATALOADER_STRATEGIES, max_workers
from trainer.tracking.journal import owner_tags
from trainer.tracking.store import check_tracking_uri, default_uri, experiment_id, store_errors

BOUNDS = ("input", "copy", "launch", "compute", "none")  # none: the rungs contradict each other, no verdict
IN_LINE = ("baseline", "pinned")  # strategies that copy on the compute stream: feed and step take turns
MIN_TOLERANCE, MAX_TOLERANCE = 0.03, 0.20  # "within a few percent": the ceiling's own jitter, kept in these bounds
# The loader keys every strategy has: carried over when a rung or a change swaps the strategy.
COMMON_LOADER_KEYS = tuple(f for f in LoaderConfig.__dataclass_fields__ if f != "name")


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
    feed: float = field(default_factory=_nan)
    copy_achieved: float = field(default_factory=_nan)  # the configured run's copies (median, CUDA events)
    copy_pinned: float = field(default_factory=_nan)  # one batch at the pinned peak
    copy_pageable: float = field(default_factory=_nan)  # one batch at the pageable rate
    batch_mb: float = field(default_factory=_nan)
    tolerance: float = MIN_TOLERANCE
    kernels: Dict[str, Dict[str, float]] = field(default_factory=dict)  # rung -> its kernel window's figures
    feeds: Dict[str, float] = field(default_factory=dict)  # a change's overrides -> its feed alone
    missing: Dict[str, str] = field(default_factory=dict)  # rung -> why it was not measured

    @property
    def ceiling(self) -> float:
        """The configured step kind's own ceiling (graphed or eager), feeding free."""
        return self.ceiling_graphed if self.graphed else self.ceiling_eager


@dataclass
class Verdict:
    bound: str  # one of BOUNDS
    reason: str  # one line: the figures that decided it
    feeding_costs_ms: float  # T - ceiling: what feeding adds per step
    launch_costs_ms: float  # what the eager step's launches add per step (0: graphed, or not measured)


@dataclass
class Change:
    overrides: List[str]
    predicted_ms: float
    why: str
    measured_ms: float = math.nan  # --verify


# ----------------------------------------------------------------------------- the model
def predict(step_ms: float, feed_ms: float, serial: float) -> float:
    """ms/step of a loop whose step alone takes `step_ms` and whose feed alone takes `feed_ms`,
    a share `serial` (0..1) of the shorter one not overlapping the longer one."""
    return max(step_ms, feed_ms) + serial * min(step_ms, feed_ms)


def host_share(ladder: Ladder, graphed: bool) -> float:
    """The share of a step during which the host, not the device, sets its pace: feed work on
    the loop's thread cannot overlap it. A graphed step: none; an eager one: what its graph saves
    (1 - graphed / eager); on the CPU, where one thread does everything: all of it."""
    if graphed:
        return 0.0
    if math.isfinite(ladder.ceiling_graphed) and ladder.ceiling_eager > 0:
        return min(1.0, max(0.0, 1.0 - ladder.ceiling_graphed / ladder.ceiling_eager))
    return 1.0


def serial_share(ladder: Ladder, strategy: str, graphed: bool) -> float:
    """How much of feed and step take turns: all of it for a strategy that copies on the compute
    stream; otherwise the step's host share (`host_share`)."""
    return 1.0 if strategy in IN_LINE else host_share(ladder, graphed)


def modelled(ladder: Ladder) -> float:
    """What the model gives for the run as configured (against `configured`: how far to trust it)."""
    return predict(ladder.ceiling, ladder.feed, serial_share(ladder, ladder.strategy, ladder.graphed))


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
        graphed = predict(ladder.ceiling_graphed, ladder.feed, serial_share(ladder, ladder.strategy, True))
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
    t, margin = ladder.configured, max(ladder.tolerance, MAX_TOLERANCE)
    parts = [(f"its step fed from the device ({ladder.ceiling:.3g})", ladder.ceiling),
             (f"its feed with no model ({ladder.feed:.3g})", ladder.feed)]
    slower = [name for name, ms in parts if math.isfinite(ms) and math.isfinite(t) and t < (1 - margin) * ms]
    if not slower:
        return ""
    return (f"no verdict: the run took {t:.3g} ms/step, less than {' and '.join(slower)} alone, and a part cannot "
            f"take longer than the whole: the host's speed changed between the rungs (other programs on a shared "
            f"machine, or throttling); run again on a quiet machine")


def _feed_bound(ladder: Ladder, feeding: float) -> str:
    x = ladder.copy_achieved
    if math.isfinite(x) and x > 0 and x >= (1 - ladder.tolerance) * min(ladder.feed, feeding):
        return "copy"
    return "input"


# ----------------------------------------------------------------------------- the changes
@dataclass
class Candidate:
    """A change the ladder can predict, as overrides: another strategy or DataLoader setting
    (`loader`, `loader_keys`: its feed alone is measured), or the graphed step (`graph`)."""

    overrides: List[str]
    why: str
    loader: Optional[str] = None  # the strategy it runs (None: the job's)
    loader_keys: Dict[str, object] = field(default_factory=dict)
    graph: bool = False

    def job(self, cfg):
        """The job with this change made."""
        if self.graph:
            return with_values(cfg, **{"engine.cuda_graph": True})
        if self.loader == cfg.loader.name:  # the same strategy: its own keys kept
            return with_values(cfg, **{f"loader.{k}": v for k, v in self.loader_keys.items()})
        return with_loader(cfg, self.loader, **self.loader_keys)


def candidates(ladder: Ladder, verdict: Verdict, loader_cfg) -> List[Candidate]:
    """The changes worth predicting for this verdict, in no order."""
    eps, t = ladder.tolerance, ladder.configured
    found = []
    if verdict.bound == "none":  # rungs that contradict each other predict nothing
        return found
    feeding_matters = math.isfinite(verdict.feeding_costs_ms) and verdict.feeding_costs_ms > eps * t
    if feeding_matters and ladder.strategy != "gpu_resident" and math.isfinite(ladder.ceiling):
        found.append(Candidate(["loader=gpu_resident"], "the dataset on the device: the step's own ceiling",
                               loader="gpu_resident"))
    if feeding_matters and ladder.strategy not in ("pinned_chunk", "gpu_resident"):
        found.append(Candidate(["loader=pinned_chunk"], "slices of a page-locked chunk, copied on a side stream",
                               loader="pinned_chunk"))
    if verdict.bound == "copy" and ladder.strategy in IN_LINE:
        found.append(Candidate(["loader=prefetch"], "the same DataLoader, copies on a side stream", loader="prefetch"))
    workers = max_workers()
    if verdict.bound == "input" and ladder.strategy in DATALOADER_STRATEGIES and loader_cfg.num_workers < workers:
        found.append(Candidate([f"loader.num_workers={workers}"], f"{workers} DataLoader worker processes",
                               loader=ladder.strategy, loader_keys={"num_workers": workers}))
    if not ladder.graphed and math.isfinite(ladder.ceiling_graphed) and verdict.launch_costs_ms > eps * t:
        found.append(Candidate(["engine.cuda_graph=true"], "the step replayed as one CUDA graph", graph=True))
    return found


def prediction(ladder: Ladder, change: Candidate) -> float:
    """The change's ms/step by the model: its step ceiling against its feed alone."""
    if change.graph:
        return predict(ladder.ceiling_graphed, ladder.feed, serial_share(ladder, ladder.strategy, True))
    if change.loader == "gpu_resident":
        return ladder.ceiling  # that rung is this change (its batches views of the resident data)
    feed = ladder.feeds.get(" ".join(change.overrides), math.nan)
    return predict(ladder.ceiling, feed, serial_share(ladder, change.loader, ladder.graphed))


def recommend(ladder: Ladder, found: Sequence[Candidate]) -> List[Change]:
    """Up to three changes predicted to save more than the tolerance, fastest first."""
    changes = [Change(c.overrides, prediction(ladder, c), c.why) for c in found]
    better = [c for c in changes if math.isfinite(c.predicted_ms)
              and c.predicted_ms < (1 - ladder.tolerance) * ladder.configured]
    return sorted(better, key=lambda c: c.predicted_ms)[:3]


# ----------------------------------------------------------------------------- the rungs
def with_loader(cfg, name: str, **keys):
    """A copy of the job with the loader strategy `name`, its common keys (batch size, ...) the job's."""
    job = copy.deepcopy(cfg)
    common = {k: job.loader[k] for k in COMMON_LOADER_KEYS if k in job.loader}
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


def noop_feed(cfg):
    """The job's loader with a model that does nothing: its feed alone."""
    job = copy.deepcopy(cfg)
    with open_dict(job):
        job.model = OmegaConf.structured(MODELS["noop"].Config())
        job.engine.cuda_graph = False
    return job


class Advisor:
    """Runs the rungs as children of one MLflow run (`parent_id`) and keeps what they measured."""

    def __init__(self, cfg, steps: int, parent_id: str, run_fn: Callable, log: Callable[[str], None]):
        self.cfg, self.steps, self.parent_id, self.run_fn, self.log = cfg, steps, parent_id, run_fn, log
        self.cuda = _is_cuda(cfg)  # the rungs run on CUDA

    def sized(self, cfg, name: str, window: int = 0):
        """The rung's job: `steps` timed steps after the job's warm-up (one, for a rung that takes a
        kernel window: only its window counts), nested under the advice."""
        job = copy.deepcopy(cfg)
        with open_dict(job):
            job.engine.max_steps = job.engine.warmup_steps + (1 if window else self.steps)
            job.engine.kernel_window_steps = window
            job.engine.progress = False
            job.engine.quiet = True  # the rung's one progress line says what it measured, not a run's summary
            job.tracking.parent_run_id = self.parent_id
            job.tracking.run_name = f"advise: {name}"
        return job

    def measure(self, cfg, name: str, window: int = 0) -> tuple:
        """(summary, "") of one rung, or (None, why it could not be measured)."""
        start = time.perf_counter()
        try:
            summary = self.run_fn(self.sized(cfg, name, window))
        except (ConfigError, RunFailed) as e:
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
        ladder = Ladder(configured=configured["ms_per_step"], graphed=bool(cfg.engine.cuda_graph) and self.cuda,
                        strategy=cfg.loader.name)
        ceiling = with_loader(cfg, "gpu_resident", shuffle=False, drop_last=True)  # views of resident data
        eager, why = self.measure(with_values(ceiling, **{"engine.cuda_graph": False}), "ceiling, eager")
        if eager is None:
            ladder.missing["ceiling"] = why
        else:
            ladder.ceiling_eager = eager["ms_per_step"]
            ladder.tolerance = tolerance(eager)
        if not self.cuda:
            ladder.missing["ceiling, graphed"] = "no CUDA: a CUDA graph needs a GPU"
        elif eager is not None:
            graphed, why = self.measure(with_values(ceiling, **{"engine.cuda_graph": True}), "ceiling, graphed")
            if graphed is None:
                ladder.missing["ceiling, graphed"] = why
            else:
                ladder.ceiling_graphed = graphed["ms_per_step"]
        feed, why = self.measure(noop_feed(cfg), "feed alone")
        if feed is None:
            ladder.missing["feed"] = why
        else:
            ladder.feed = feed["ms_per_step"]
        self._copies(ladder, configured)
        return ladder

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

    def feeds(self, ladder: Ladder, found: Sequence[Candidate]) -> None:
        """Measure the feed alone of each change that swaps the strategy or its DataLoader."""
        for c in found:
            if c.loader is None or c.loader == "gpu_resident":
                continue
            summary, why = self.measure(noop_feed(c.job(self.cfg)), f"feed alone, {' '.join(c.overrides)}")
            key = " ".join(c.overrides)
            if summary is None:
                ladder.missing[f"feed, {key}"] = why
            else:
                ladder.feeds[key] = summary["ms_per_step"]

    def verify(self, changes: Sequence[Change], found: Sequence[Candidate]) -> None:
        """Run each change as the configured run was run: its measured ms/step."""
        by_key = {" ".join(c.overrides): c for c in found}
        for change in changes:
            summary, _ = self.measure(by_key[" ".join(change.overrides)].job(self.cfg),
                                      f"verify {' '.join(change.overrides)}")
            change.measured_ms = summary["ms_per_step"] if summary is not None else math.nan

    def kernels(self, ladder: Ladder) -> None:
        """The kernel windows of the configured run and of the eager ceiling (CUDA only), last."""
        if not self.cuda:
            ladder.missing["kernels"] = "no CUDA: a CPU run has no kernels to trace"
            return
        window = self.cfg.engine.kernel_window_steps or 20
        rungs = {"configured": self.cfg}
        if math.isfinite(ladder.ceiling_eager):
            rungs["ceiling, eager"] = with_values(with_loader(self.cfg, "gpu_resident", shuffle=False, drop_last=True),
                                                  **{"engine.cuda_graph": False})
        for name, cfg in rungs.items():
            summary, why = self.measure(cfg, f"kernels of {name}", window=window)
            if summary is None or not math.isfinite(summary.get("gpu_kernel_ms_per_step", math.nan)):
                ladder.missing[f"kernels of {name}"] = why or "the kernel window was not taken (see its run's tag kernel_window)"
            else:
                ladder.kernels[name] = {k: summary[k] for k in ("gpu_kernel_ms_per_step", "gpu_kernel_busy_fraction",
                                                                 "launch_gap_ms", "h2d_overlapped_by_kernels_fraction")}


def tolerance(ceiling: dict) -> float:
    """"Within a few percent": the ceiling run's own jitter (its mean step against its median),
    between 3% and 20%."""
    mean, median = ceiling.get("ms_per_step", math.nan), ceiling.get("median_step_ms", math.nan)
    jitter = abs(mean - median) / mean if mean > 0 and math.isfinite(median) else 0.0
    return min(MAX_TOLERANCE, max(MIN_TOLERANCE, jitter))


def _is_cuda(cfg) -> bool:
    return cfg.engine.device != "cpu" and torch.cuda.is_available()


# ----------------------------------------------------------------------------- the answer
def render(ladder: Ladder, verdict: Verdict, changes: Sequence[Change], gpu: str) -> str:
    """The advice in a few lines (also `advice.md`)."""
    t = ladder.configured
    kind = "graphed" if ladder.graphed else "eager"
    rows = [(f"configured (loader={ladder.strategy}, {kind})", _ms(t)),
            ("step fed from the device, eager", _ms(ladder.ceiling_eager)),
            ("step fed from the device, graphed", _ms(ladder.ceiling_graphed)),
            (f"feed alone (loader={ladder.strategy}, no model)", _ms(ladder.feed))]
    if math.isfinite(ladder.batch_mb):
        rows += [(f"copy of one batch ({ladder.batch_mb:.1f} MiB), achieved", _ms(ladder.copy_achieved)),
                 ("  the same at the pinned peak", _ms(ladder.copy_pinned)),
                 ("  the same at the pageable rate", _ms(ladder.copy_pageable))]
    width = max(len(label) for label, _ in rows)
    lines = [f"bound: {verdict.bound} — {verdict.reason}", "", f"ladder (ms/step, {gpu}):"]
    lines += [f"  {label.ljust(width)}  {value}" for label, value in rows]
    for name, k in ladder.kernels.items():
        lines.append(f"  kernels of {name}: {k['gpu_kernel_ms_per_step']:.3f} ms/step, busy "
                     f"{k['gpu_kernel_busy_fraction']:.2f} of the wall, launch gaps {k['launch_gap_ms']:.3f} ms/step, "
                     f"copies under kernels {_fraction(k['h2d_overlapped_by_kernels_fraction'])}")
    lines.append(f"  the model gives {modelled(ladder):.3f} for the run as configured; tolerance {ladder.tolerance:.0%}")
    miss = model_miss(ladder)
    if abs(miss) > ladder.tolerance and verdict.bound != "none":  # (no verdict: its line says why)
        lines.append(f"  caution: the run measured {miss:+.0%} against the model, more than the tolerance: the rungs "
                     "do not explain it (the host's speed may have changed between them: run again on a quiet "
                     "machine), so take the verdict and the predictions as leads")
    lines.append("")
    if changes:
        lines.append("changes (predicted ms/step):")
        for i, c in enumerate(changes, 1):
            verified = (f"   measured {c.measured_ms:.3f} ({(c.measured_ms / c.predicted_ms - 1):+.0%})"
                        if math.isfinite(c.measured_ms) else "")
            lines.append(f"  {i}. {' '.join(c.overrides):34s} {c.predicted_ms:8.3f}  ({t / c.predicted_ms:.2f}x: "
                         f"{c.why}){verified}")
    else:
        lines.append("changes: none predicted to save more than the tolerance: the step itself sets the pace "
                     "(a faster model or a larger batch would)" if verdict.bound == "compute"
                     else "changes: none predicted: rungs that contradict each other predict nothing"
                     if verdict.bound == "none"
                     else "changes: none of those the ladder can predict would save more than the tolerance")
    if ladder.missing:
        lines += ["", "not measured: " + "; ".join(f"{k} ({v})" for k, v in ladder.missing.items())]
    return "\n".join(lines)


def _ms(value: float) -> str:
    return f"{value:8.3f}" if math.isfinite(value) else "       —"


def _fraction(value: float) -> str:
    return f"{value:.2f}" if math.isfinite(value) else "— (no copy)"


def metrics(ladder: Ladder, verdict: Verdict, changes: Sequence[Change]) -> Dict[str, float]:
    """The ladder as the advice run's metrics (nan ones left out: not measured)."""
    out = {"ladder.configured_ms": ladder.configured, "ladder.ceiling_eager_ms": ladder.ceiling_eager,
           "ladder.ceiling_graphed_ms": ladder.ceiling_graphed, "ladder.feed_ms": ladder.feed,
           "ladder.copy_achieved_ms": ladder.copy_achieved, "ladder.copy_pinned_peak_ms": ladder.copy_pinned,
           "ladder.copy_pageable_ms": ladder.copy_pageable, "ladder.batch_mb": ladder.batch_mb,
           "ladder.modelled_ms": modelled(ladder), "tolerance": ladder.tolerance,
           "feeding_costs_ms": verdict.feeding_costs_ms, "launch_costs_ms": verdict.launch_costs_ms}
    for name, k in ladder.kernels.items():
        for key, value in k.items():
            out[f"kernels.{name.replace(', ', '_')}.{key}"] = value
    for i, c in enumerate(changes, 1):
        out[f"change{i}.predicted_ms"], out[f"change{i}.measured_ms"] = c.predicted_ms, c.measured_ms
    return {k: float(v) for k, v in out.items() if math.isfinite(v)}


# ----------------------------------------------------------------------------- the command
def advise(cfg, steps: int, verify: bool, overrides: Sequence[str] = (), run_fn: Optional[Callable] = None,
           log: Callable[[str], None] = lambda line: print(line, file=sys.stderr)) -> dict:
    """Measure, judge, recommend (and verify), recorded as one MLflow run (tagged with the job's
    `overrides`); returns {run_id, bound, changes, text, ladder}."""
    if run_fn is None:
        from trainer.loop.run import run as run_fn  # here: the rungs are runs of the loop
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
        advisor = Advisor(cfg, steps, parent_id, run_fn, log)
        log(f"advise: measuring the ladder ({steps} timed steps a rung; runs nested under {parent_id})")
        ladder = advisor.ladder()
        verdict = judge(ladder)
        found = candidates(ladder, verdict, cfg.loader)
        advisor.feeds(ladder, found)
        changes = recommend(ladder, found)
        if verify:
            advisor.verify(changes, found)
        advisor.kernels(ladder)
        gpu = _gpu_name() if advisor.cuda else "CPU"
        text = render(ladder, verdict, changes, gpu)
        _record(client, parent_id, ladder, verdict, changes, text)
        status = RunStatus.to_string(RunStatus.FINISHED)
        return {"run_id": parent_id, "bound": verdict.bound, "changes": changes, "text": text, "ladder": ladder}
    except KeyboardInterrupt as stop:
        status = RunStatus.to_string(RunStatus.KILLED)
        stop.advice_run_id = parent_id  # for the command's one line
        raise
    finally:
        client.set_terminated(parent_id, status)


def _record(client, run_id: str, ladder: Ladder, verdict: Verdict, changes: Sequence[Change], text: str) -> None:
    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, v, now, 0) for k, v in metrics(ladder, verdict, changes).items()])
    client.set_tag(run_id, "bound", verdict.bound)
    for i, c in enumerate(changes, 1):
        client.set_tag(run_id, f"change{i}", " ".join(c.overrides))
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
    p.add_argument("--verify", action="store_true", help="run each recommended change and print its measured ms/step")
    p.add_argument("--steps", type=int, default=300, help="timed steps of each rung, after the job's warm-up (default 300)")
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
        result = advise(cfg, args.steps, args.verify, args.overrides)
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
    print(f"(MLflow run {result['run_id']}: tag bound, the ladder as metrics, advice.md)")
    return 0


def _refuse(line: str):
    print(f"error: {line}", file=sys.stderr)
    raise SystemExit(1)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
