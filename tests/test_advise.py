"""Answers, not only numbers: the kernel window's honest device figures, the advisor's verdict and
changes, and the tuner's objective through Hydra's Optuna sweeper."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from clirun import stop_leftovers, wait_for_running
from conftest import compose_config
from trainer.errors import ConfigError, DoesNotFit
from trainer.fake_data import write_image_folder
from trainer.loop.engine import train
from trainer.loop.meter import StepMeter
from trainer.loop.run import run
from trainer.tools import advisor
from trainer.tools.advisor import (Ladder, best, feed_changes, judge, predict, reachable, recommend, setting,
                                   tolerance)
from trainer.loop.profiling import WINDOW_FIGURES, KernelWindow, kernel_figures

TESTS = Path(__file__).resolve().parent
# A tiny CPU job, as conftest's TINY, with a model that does nothing (the CPU's step is then only
# what a test adds: `model.busy_ms`, or nothing).
TINY_NOOP = ["model=noop", "dataset.num_samples=96", "dataset.shape=[8,8]", "loader.batch_size=16",
             "engine.warmup_steps=1", "engine.progress=false", "engine.device=cpu"]


# ----------------------------------------------------------------------------- the kernel window
def _event(name, cat, ts, dur, pid=0, tid=7, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": pid, "tid": tid, "args": args}


def _runtime(name, ts, correlation=None, tid=1):
    return _event(name, "cuda_runtime", ts, 2, pid=4242, tid=tid, **({} if correlation is None else {"correlation": correlation}))


def _window_trace(tmp_path: Path, markers=True) -> Path:
    """Two traced steps after an untraced one (a sync between), as a CUDA-only trace has them:
    step 0 launches kernels at 110 and 120 that run 200-250 and 300-350 (50 us idle between);
    step 1 a device copy and a kernel that run back to back, 380-400 and 400-500; a side-stream
    copy 200-300 runs half under a kernel."""
    events = [_event("warm", "kernel", 10, 40, correlation=1), _runtime("cudaLaunchKernel", 5, 1)]  # before the window
    if markers:
        events += [_runtime("cudaStreamQuery", ts) for ts in (100, 130, 160)]  # the loop thread's step marks
        events += [_runtime("cudaStreamQuery", ts, tid=9) for ts in (140, 150)]  # another thread's queries
    events += [_runtime("cudaLaunchKernel", 110, 2), _runtime("cudaLaunchKernel", 120, 3),
               _runtime("cudaMemcpyAsync", 135, 4), _runtime("cudaLaunchKernel", 140, 5),
               _event("gemm", "kernel", 200, 50, correlation=2), _event("relu", "kernel", 300, 50, correlation=3),
               _event("Memcpy DtoD (Device -> Device)", "gpu_memcpy", 380, 20, correlation=4),
               _event("gemm", "kernel", 400, 100, correlation=5),
               _event("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 200, 100, tid=20)]
    path = tmp_path / "kernel_window.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_kernel_figures_count_the_kernels_not_the_launch_gaps(tmp_path):
    figures = kernel_figures(_window_trace(tmp_path), steps=2, wall_s=500e-6)
    assert figures == pytest.approx({
        "gpu_kernel_busy_fraction": 200 / 500,  # 50 + 50 + 100 us of kernels in 500 us; the warm-up's left out
        "gpu_kernel_ms_per_step": 0.2 / 2,
        # the steps span 200-350 and 380-500: no kernel ran in 250-300 and (the device copy) 380-400
        "gpu_gap_in_step_ms_per_step": (50 + 20) / 1e3 / 2,
        "gpu_idle_between_steps_ms_per_step": (500 - 150 - 120) / 1e3 / 2,  # the rest of the 500 us
        "launch_gap_ms": (50 + 0) / 1e3 / 2,  # step 0 idles 250-300; step 1's copy fills its span
        "h2d_overlapped_by_kernels_fraction": 0.5,  # 200-250 of the copy's 200-300 under a kernel
        "kernel_window_ms_per_step": 0.25})


def test_kernel_figures_without_step_markers_keep_the_rest(tmp_path):
    figures = kernel_figures(_window_trace(tmp_path, markers=False), steps=2, wall_s=500e-6)
    assert all(math.isnan(figures[k]) for k in ("launch_gap_ms", "gpu_gap_in_step_ms_per_step",
                                                  "gpu_idle_between_steps_ms_per_step"))  # no step boundaries
    assert figures["h2d_overlapped_by_kernels_fraction"] == pytest.approx(0.5)
    assert figures["gpu_kernel_ms_per_step"] == pytest.approx(0.24 / 2)  # without the first mark, the warm-up's kernel counts too


def test_a_cpu_run_has_nan_kernel_figures_and_says_why(tiny_cfg, runs):
    summary = run(tiny_cfg())
    assert all(math.isnan(summary[k]) for k in WINDOW_FIGURES)  # not measured: nan, never 0
    assert runs()[0].data.tags["kernel_window"] == "not taken: no CUDA: a CPU run has no kernels to trace"
    run(tiny_cfg("engine.kernel_window_steps=0"))
    assert runs()[0].data.tags["kernel_window"] == "not taken: off (engine.kernel_window_steps=0)"
    assert "compute_stream_span_fraction" in summary and "h2d_beside_step_fraction" in summary
    assert not {"gpu_busy_fraction", "hidden_h2d_fraction"} & set(summary)  # the old names said more than they measured


def test_a_failed_window_never_fails_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr("trainer.loop.profiling._cannot_trace", lambda device: "")
    window = KernelWindow(3, torch.device("cpu"), tmp_path)
    assert window.enabled
    window.run(lambda x, y: x.sum(), iter([(torch.ones(2), torch.ones(2))] * 4))  # no CUDA stream to mark
    assert window.reason.startswith("failed: ") and not window.enabled
    assert all(math.isnan(v) for v in window.figures().values())


class RecordingWindow:
    """A kernel window that traces nothing: what `train` hands it, and what it sees meanwhile."""

    enabled = True

    def __init__(self, steps, loader):
        self.steps, self.loader, self.seen = steps, loader, []

    def run(self, step_fn, batches):
        for x, y in batches:
            assert self.loader.copy_probe is None  # the window's copies are not metered
            step_fn(x, y)
            self.seen.append(int(x[0]))
            if len(self.seen) == self.steps + 1:
                return


class Numbered:
    """Batches 0..n-1 of one pass, each a tensor holding its number."""

    def __init__(self, n):
        self.n, self.copy_probe, self.closed = n, "meter", 0

    def __len__(self):
        return self.n

    def __iter__(self):
        try:
            for i in range(self.n):
                yield torch.full((2,), float(i)), torch.zeros(2)
        finally:
            self.closed += 1


def test_the_window_runs_after_the_timed_region_and_changes_nothing_in_it():
    cfg = OmegaConf.create({"max_steps": 7, "epochs": 1, "warmup_steps": 2, "progress": False, "optimizer": {"lr": 0.1}})

    class Step:
        graph_replays, eager_steps = 0, 0

        def __call__(self, x, y):
            self.eager_steps += 1
            return x.sum()

    results = []
    for traced in (False, True):
        loader, step = Numbered(5), Step()
        window = RecordingWindow(3, loader) if traced else None
        meter = StepMeter(torch.device("cpu"), 2, capacity=7)
        assert train(step, loader, meter, cfg, window=window) == 7
        result = meter.finish()
        results.append(result)
        assert step.eager_steps == 7  # the run's own steps, not the window's
        assert loader.copy_probe == "meter" and loader.closed == 2 + traced  # every pass it began was closed
        if traced:
            assert window.seen == [2, 3, 4, 0]  # the rest of the run's last pass, then a new one
    untimed, traced = results
    assert len(traced.rows) == len(untimed.rows) == 7 and traced.summary["timed_steps"] == untimed.summary["timed_steps"] == 5


# ----------------------------------------------------------------------------- the verdict
def ladder(**values) -> Ladder:
    return Ladder(**{"graphed": False, "strategy": "baseline", "tolerance": 0.03, **values})


@pytest.mark.parametrize("values, bound", [
    # the host makes a batch in 9.5 ms, the step alone takes 1: feeding is the cost, and not the copy
    (dict(configured=10.0, ceiling_eager=1.0, feed=9.5), "input"),
    # the copy alone takes what the feed does
    (dict(configured=3.0, ceiling_eager=1.0, feed=2.2, copy_achieved=2.1), "copy"),
    # a 15 ms step, a 5.5 ms feed whose 2.5 ms copy is what the run pays on top of the step
    (dict(configured=17.5, ceiling_eager=15.0, ceiling_graphed=14.9, feed=5.5, copy_achieved=2.5), "copy"),
    # an eager step of 1.8 ms that its graph does in 0.8, fed in 0.35 beside it
    (dict(configured=1.9, ceiling_eager=1.8, ceiling_graphed=0.8, feed=0.35, copy_achieved=0.33,
          strategy="pinned_chunk"), "launch"),
    # within the tolerance of its ceiling, graphed or not
    (dict(configured=15.2, ceiling_eager=15.0, ceiling_graphed=14.9, feed=1.0, strategy="gpu_resident"), "compute"),
    (dict(configured=0.81, ceiling_graphed=0.8, ceiling_eager=1.8, feed=0.35, graphed=True,
          strategy="pinned_chunk"), "compute"),
])
def test_the_bound_is_what_the_ceilings_say_costs_the_most(values, bound):
    assert judge(ladder(**values)).bound == bound


def test_the_tolerance_is_the_ceilings_own_jitter():
    assert tolerance({"ms_per_step": 10.0, "median_step_ms": 9.0}) == pytest.approx(0.1)
    assert tolerance({"ms_per_step": 10.0, "median_step_ms": 10.0}) == 0.03  # a few percent at least
    assert tolerance({"ms_per_step": 10.0, "median_step_ms": 5.0}) == 0.2  # at most
    # A gap of 5% is the run's bound with a steady ceiling, noise with a jittery one.
    steady = ladder(configured=1.05, ceiling_eager=1.0, feed=0.5, tolerance=0.03)
    assert judge(steady).bound == "input" and judge(ladder(**{**steady.__dict__, "tolerance": 0.1})).bound == "compute"


def test_changes_are_predicted_from_the_ladder_fastest_first():
    found = ladder(configured=10.0, ceiling_eager=1.0, feed=9.5, feeds={setting(strategy="pinned_chunk"): 0.5})
    verdict = judge(found)
    assert list(feed_changes(found, verdict))[0] == setting(strategy="pinned_chunk")
    changes = recommend(found, reachable(found, verdict))
    # gpu_resident is the ceiling rung itself; pinned_chunk's feed beside the step, on one CPU thread
    assert [(c.overrides, c.predicted_ms) for c in changes] == [(["loader=gpu_resident"], 1.0),
                                                                (["loader=pinned_chunk"], pytest.approx(1.5))]
    assert predict(1.0, 9.5, 1.0) == 10.5 and predict(1.0, 9.5, 0.0) == 9.5
    # A change that would not save more than the tolerance is not offered.
    near = ladder(configured=1.02, ceiling_eager=1.0, feed=0.1)
    assert recommend(near, reachable(near, judge(near))) == [] and best(near, judge(near), reachable(near, judge(near))) is None


def test_the_best_configuration_follows_the_bounds_down():
    """Seed 000's workload fed by a DataLoader: feeding costs 5 of 5.6 ms; fed from the device the
    eager step is launch-bound (0.6 ms, 0.2 graphed). The best configuration removes both bounds,
    which no single change does."""
    found = ladder(configured=5.6, ceiling_eager=0.6, ceiling_graphed=0.2, feed=5.0,
                   feeds={setting(strategy="pinned_chunk"): 0.4})
    verdict = judge(found)
    options = reachable(found, verdict)
    top = best(found, verdict, options)
    assert top.overrides == ["loader=gpu_resident", "engine.cuda_graph=true"] and top.predicted_ms == 0.2
    assert top.chain == ["input", "launch", "compute"]
    assert recommend(found, options)[0].overrides == ["loader=gpu_resident"]  # the best single change: 0.6
    # pinned_chunk with the graph: its 0.4 ms feed hidden behind nothing of the graphed step
    assert {" ".join(c.overrides): c.predicted_ms for c in options}["loader=pinned_chunk engine.cuda_graph=true"] == 0.4
    lines = advisor.render(found, verdict, recommend(found, options), "GPU", top).splitlines()
    assert lines[:2] == ["best: loader=gpu_resident engine.cuda_graph=true",
                         "  0.200 ms/step predicted (28.00x), bounds input → launch → compute"]
    assert lines[3].startswith("bound: input — ")
    # Within the tolerance of the fastest, the fewest changes win: the graph alone, if the feed hides.
    hidden = ladder(configured=1.9, ceiling_eager=1.8, ceiling_graphed=0.8, feed=0.35, copy_achieved=0.33,
                    strategy="pinned_chunk")
    top = best(hidden, judge(hidden), reachable(hidden, judge(hidden)))
    assert top.overrides == ["engine.cuda_graph=true"] and top.chain == ["launch", "compute"]


def test_a_graphed_step_adds_its_replay_to_the_feeds_work_on_the_loops_thread():
    """The MNIST MLP on an H200: its graphed step takes the device 0.154 ms, a shuffled gather on
    the device 0.156 (all on the loop's thread, a no-op step's 0.020 in it); replaying the graph
    takes that thread 0.035. Together they ran at 0.180: the feed's work and the replay take turns
    on the thread, where max(step, feed) says 0.156. A step whose device time is longer hides them."""
    gather = setting(strategy="gpu_resident")
    found = ladder(configured=9.3, ceiling_eager=1.33, ceiling_graphed=0.154, feed=9.28, feed_loop=9.27, shuffles=True,
                   graphed_host_step=0.0345, feed_host_step=0.0777, feeds={gather: 0.156}, feeds_loop={gather: 0.156},
                   feeds_host_step={gather: 0.0199})
    # each feed's own no-op step is in its ms/step already: the configured `baseline` one takes longer
    assert advisor.graph_launch_ms(found, True, gather) == pytest.approx(0.0146)
    assert advisor.graph_launch_ms(found, True) == 0.0 and advisor.graph_launch_ms(found, False, gather) == 0.0
    graphed = advisor.predicted(found, setting(strategy="gpu_resident"), setting(graph=True))
    assert graphed == pytest.approx(0.156 + 0.0146)  # within 5% of the 0.180 measured (0.156: -13%)
    assert predict(0.469, 0.321, 0.0, 0.321, launch_ms=0.03) == 0.469  # the reference step, graphed: hidden
    # Not measured (a CPU ladder, an older run's figures): nothing added. Nor where the host's time
    # in the graphed step is over half the step: it waited there for the device, launching nothing.
    assert advisor.graph_launch_ms(ladder(configured=1.0, graphed_host_step=0.03), True) == 0.0
    found.graphed_host_step = 0.09
    assert advisor.graph_launch_ms(found, True, gather) == 0.0


def test_one_run_is_held_against_the_model_within_twice_the_eager_steps_drift():
    """The reference workload fed by pinned_chunk on an H200: the eager step measured 1.764 and
    1.875 (6% apart), the run 1.836 with its feed hidden, the model 2.135 (-14%). One run against
    the mean of two runs lands within about twice their distance: no caution at -12%, one at -14%."""
    found = ladder(configured=1.836, ceiling_eager=1.82, ceiling_graphed=0.615, feed=0.316, drift=0.063, tolerance=0.063,
                   strategy="pinned_chunk")
    assert advisor.miss_tolerance(found) == pytest.approx(0.126)
    assert advisor.cautioned(found, judge(found))  # -14%
    found.configured = 1.88
    assert not advisor.cautioned(found, judge(found))  # -12%
    found.drift = 0.15
    assert advisor.miss_tolerance(found) == advisor.MAX_TOLERANCE  # at most 20%


def test_where_the_host_drifted_each_change_is_verified_twice_in_turns(tracking_uri):
    """Where the eager ceiling measured first and last moved beyond the minimum tolerance, the
    first two configurations (the best, the top change) run twice, the second pass in reverse
    order, and measure the mean of their runs; one that failed is not run again, the others run
    once. On a steady host, once each."""
    cfg = compose_config(*TINY_NOOP, f"tracking.uri={tracking_uri}")
    readings = {"loader=gpu_resident": [2.0, 2.2], "loader=pinned_chunk": [3.0, 2.4], "loader=pinned": [None]}
    asked = []

    def run_fn(job):
        asked.append(job.tracking.run_name)
        configuration = [name.split("verify ")[1].split(",")[0] for name in asked]
        ms = readings[configuration[-1]][configuration.count(configuration[-1]) - 1]
        if ms is None:
            raise advisor.RunFailed("it failed")
        return {"ms_per_step": ms}

    adv = advisor.Advisor(cfg, 4, None, run_fn, log=lambda line: None)
    readings["loader=prefetch"] = [5.0]
    changes = [advisor.Change(setting(strategy=name), 1.0, "")
               for name in ("gpu_resident", "pinned_chunk", "pinned", "prefetch", "gpu_resident")]
    adv.verify(changes, drift=0.25, twice=3)
    assert asked == ["advise: verify loader=gpu_resident, run 1", "advise: verify loader=pinned_chunk, run 1",
                     "advise: verify loader=pinned, run 1", "advise: verify loader=prefetch",
                     "advise: verify loader=pinned_chunk, run 2", "advise: verify loader=gpu_resident, run 2"]
    assert [(c.measured_ms, c.measured_runs) for c in changes] == [
        (pytest.approx(2.1), 2), (pytest.approx(2.7), 2), (pytest.approx(math.nan, nan_ok=True), 0), (5.0, 1),
        (pytest.approx(2.1), 2)]  # a configuration listed twice is run as one
    assert changes[1].measured_apart == pytest.approx(0.25)
    assert "measured 2.700 (+170%, the mean of 2 runs 25% apart)" in advisor._verified(changes[1], " ")
    asked.clear()
    readings.update({"loader=gpu_resident": [2.0], "loader=pinned_chunk": [3.0]})
    steady = [advisor.Change(setting(strategy=name), 1.0, "") for name in ("gpu_resident", "pinned_chunk")]
    adv.verify(steady, drift=0.02)
    assert asked == ["advise: verify loader=gpu_resident", "advise: verify loader=pinned_chunk"]
    assert [(c.measured_ms, c.measured_runs) for c in steady] == [(2.0, 1), (3.0, 1)]
    assert advisor._verified(steady[0], " ") == " measured 2.000 (+100%)"


def test_only_the_feeds_work_on_the_loops_thread_takes_turns_with_the_step():
    """A DataLoader whose workers make a batch in 2.5 ms, 0.5 of it on the loop's thread (dequeue
    and copy): beside an eager step of 2 ms whose launches set its pace (0.5 graphed), the workers'
    share runs beside it and only the loop thread's 0.5 ms adds, in full; without that figure, the
    step's 2 ms would. A step its graph does not speed up hides the feed's work."""
    workers = ladder(configured=2.95, ceiling_eager=2.0, ceiling_graphed=0.5, feed=2.5, feed_loop=0.5, strategy="prefetch")
    assert advisor.modelled(workers) == pytest.approx(2.5 + 0.5)
    assert predict(2.0, 2.5, 1.0) == pytest.approx(4.5) and predict(2.0, 2.5, 1.0, 0.5) == 3.0
    assert not advisor.cautioned(workers, judge(workers))
    # The verdict weighs the graph with the same share: the graph hides the host's work, and the
    # in-line copy still runs between two replays, on the device: a feed of 2.5 ms (its 0.2 ms copy
    # within) beside a 0.5 ms graph sets the pace alone (3 against 2.5); a 0.6 ms feed, 0.3 of it
    # the copy, does not: the graph and the copy (0.8) do.
    inline = ladder(configured=3.0, ceiling_eager=2.0, ceiling_graphed=0.5, feed=2.5, feed_loop=0.2, copy_achieved=0.2)
    assert judge(inline).launch_costs_ms == pytest.approx(0.5)
    inline = ladder(configured=3.0, ceiling_eager=2.0, ceiling_graphed=0.5, feed=0.6, feed_loop=0.2, copy_achieved=0.3)
    assert judge(inline).launch_costs_ms == pytest.approx(3.0 - 0.8)
    kernels = ladder(configured=2.5, ceiling_eager=2.0, ceiling_graphed=1.99, feed=2.5, feed_loop=0.5, strategy="prefetch")
    assert advisor.modelled(kernels) == pytest.approx(2.5 + (1 - 1.99 / 2.0) * 0.5)


def test_a_copy_on_the_compute_stream_adds_to_a_step_set_by_its_kernels_and_the_rest_of_the_feed_hides():
    """The compute-bound preset on an H200 (2026-11-27): an eager step of 15.5 ms that its graph
    does not speed up (16.9), `baseline` with no workers making a batch in 5.8 ms on the loop's
    thread, 2.8 of it the pageable copy on the compute stream. The host collates the next batch
    while the device runs the step, then the copy waits for it: the run is the step and the copy
    (18.3; measured 19.7), not the step and the whole feed (21.3). The same with the optimizer's
    fused step (9.4 ms): 12.2 predicted, 11.8 measured."""
    lad = ladder(configured=19.747, ceiling_eager=15.478, ceiling_graphed=16.864, feed=5.818, feed_loop=5.818,
                 copy_achieved=2.803, tolerance=0.09)
    lad.steps[advisor.setting(optimizer="fused")] = 9.362
    assert advisor.modelled(lad) == pytest.approx(15.478 + 2.803)
    assert not advisor.cautioned(lad, judge(lad))
    assert advisor.predicted(lad, (), advisor.setting(optimizer="fused")) == pytest.approx(9.362 + 2.803)
    # A launch-bound step hides none of the host's work: step, then the whole feed (copy within it).
    launches = ladder(configured=8.0, ceiling_eager=2.0, ceiling_graphed=0.5, feed=5.8, feed_loop=5.8, copy_achieved=2.8)
    assert advisor.modelled(launches) == pytest.approx(5.8 + 2.0)
    # `pinned` with workers: the loop's thread only issues the copy (0.1 ms), the copy itself (1.5)
    # runs on the compute stream before the step: it takes turns with the step all the same.
    pinned = ladder(configured=6.0, strategy="pinned", ceiling_eager=2.0, ceiling_graphed=0.5, feed=3.0, feed_loop=3.0,
                    copy_achieved=1.5)
    pinned.feeds[advisor.setting(workers=4)], pinned.feeds_loop[advisor.setting(workers=4)] = 1.6, 0.1
    assert advisor.predicted(pinned, advisor.setting(workers=4), ()) == pytest.approx(2.0 + 1.5)


def test_a_shuffled_dataset_on_the_device_is_gathered_and_its_gather_is_measured_and_predicted():
    """Shuffled, `loader=gpu_resident` gathers each batch on the device: launches on the loop's
    thread that an eager step set by its launches pays in full. Its feed alone is measured (a
    rung) and the change is predicted from it; unshuffled, its batches are the ceiling's views."""
    shuffled = ladder(configured=10.0, ceiling_eager=1.0, ceiling_graphed=0.1, feed=9.0, shuffles=True)
    verdict = judge(shuffled)
    resident = advisor.setting(strategy="gpu_resident")
    assert resident in advisor.feed_changes(shuffled, verdict)
    shuffled.feeds[resident], shuffled.feeds_loop[resident] = 0.15, 0.15
    assert advisor.predicted(shuffled, resident, ()) == pytest.approx(1.0 + 0.15)
    assert advisor.predicted(shuffled, resident, shuffled.flip((), True)) == pytest.approx(0.15)  # graphed: max(0.1, 0.15)
    views = ladder(configured=10.0, ceiling_eager=1.0, ceiling_graphed=0.1, feed=9.0)
    assert resident not in advisor.feed_changes(views, judge(views))
    assert advisor.predicted(views, resident, ()) == pytest.approx(1.0)
    # Its rung not measured, a shuffled dataset on the device is not predicted (not offered).
    del shuffled.feeds[resident], shuffled.feeds_loop[resident]
    assert math.isnan(advisor.predicted(shuffled, resident, ()))
    # The job itself on the device, shuffled and graphed: its eager step is fed by its own gather.
    graphed = ladder(configured=0.9, graphed=True, strategy="gpu_resident", ceiling_eager=0.6, ceiling_graphed=0.2,
                     feed=0.8, shuffles=True)
    assert advisor.predicted(graphed, (), graphed.flip((), False)) == pytest.approx(0.8 + 0.6)


def test_the_advice_cautions_when_the_model_misses_the_run():
    """A run that the rungs do not explain (here 184 ms/step where step and feed, one after the
    other on a CPU, give 120.8) is said to be so; one they explain is not."""
    missed = ladder(configured=184.0, ceiling_eager=120.3, feed=0.544, tolerance=0.2)
    assert advisor.model_miss(missed) == pytest.approx(184.0 / (120.3 + 0.544) - 1)
    text = advisor.render(missed, judge(missed), [], "CPU")
    assert "caution: the run measured +52% against the model, more than the tolerance" in text
    fits = ladder(configured=125.0, ceiling_eager=120.3, feed=0.544, tolerance=0.2)
    assert "caution" not in advisor.render(fits, judge(fits), [], "CPU")
    # The rung it disagrees with is named: here the run waited 11.2 ms a batch where the feed alone took 6.8.
    slowed = ladder(configured=12.6, ceiling_eager=1.2, feed=6.8, configured_wait=11.2, strategy="baseline")
    assert "the rung it disagrees with most is the feed: in the run it waited 11.2 ms for each batch, where the model expects 6.8" in (
        advisor.render(slowed, judge(slowed), [], "GPU"))
    # A feed hidden behind the step (waits of 0.05 ms) and a step 40% over its ceiling: the step is named.
    step_off = ladder(configured=14.0, ceiling_eager=10.0, ceiling_graphed=9.9, feed=5.0, feed_loop=0.3,
                      configured_wait=0.05, strategy="prefetch")
    assert advisor.disagreeing_rung(step_off).startswith("the step: in the run it took 13.9 ms a step")
    # `pinned` copies in line on the compute stream: its copy takes turns with the step even where
    # the loop's thread spends little on issuing it.
    pinned = ladder(configured=12.0, ceiling_eager=10.0, ceiling_graphed=9.9, feed=3.0, feed_loop=0.2,
                    copy_achieved=2.0, strategy="pinned")
    assert advisor.modelled(pinned) == pytest.approx(10.0 + 2.0)
    # A run whose own interval is wide is explained within it.
    noisy = ladder(configured=140.0, ceiling_eager=120.3, feed=0.544, tolerance=0.03, configured_spread=0.2)
    assert advisor.model_miss(noisy) > 0.15 and not advisor.cautioned(noisy, judge(noisy))


def test_rungs_that_contradict_each_other_give_no_verdict():
    """The run measured 15.9 ms/step and its own step fed from the device 109 (the host slowed down
    between them): "compute, within 18% of its step fed from the device" would contradict the
    figures printed under it."""
    odd = ladder(configured=15.9, ceiling_eager=109.0, feed=0.5, tolerance=0.18)
    verdict = judge(odd)
    assert verdict.bound == "none" and verdict.reason.startswith(
        "no verdict: the run took 15.9 ms/step, less than its step fed from the device (109) alone, and a part cannot "
        "take longer than the whole")
    options = reachable(odd, verdict)
    changes = recommend(odd, options)
    text = advisor.render(odd, verdict, changes, "CPU", best(odd, verdict, options))
    assert changes == [] and text.splitlines()[:3] == [
        "best: unknown — rungs that contradict each other predict nothing", "", f"bound: none — {verdict.reason}"]
    assert "caution" not in text and "within" not in text
    assert "changes: none predicted: rungs that contradict each other predict nothing" in text
    assert judge(ladder(configured=10.0, ceiling_eager=1.0, feed=30.0)).bound == "none"  # a feed slower than the run
    # A run a little under its ceiling (noise of a few steps): compute, said as it is.
    near = judge(ladder(configured=0.95, ceiling_eager=1.0, feed=0.1))
    assert near.bound == "compute" and near.reason == ("the run takes 0.95 ms/step, no slower than its step fed from "
                                                       "the device (1)")


# ----------------------------------------------------------------------------- the advisor, end to end
def _advise(tracking_uri, *overrides, verify=False, allow=()):
    cfg = compose_config(*TINY_NOOP, f"tracking.uri={tracking_uri}", *overrides)
    return advisor.advise(cfg, steps=4, verify=verify, log=lambda line: None, allow=allow)


def test_a_loader_slowed_on_purpose_is_judged_input_and_recorded(tracking_uri):
    # Every batch is a chunk 'read from disk' in 40 ms; the ceiling uploads them once, up front.
    # (Unshuffled: on the device, the batches are the ceiling's own views.)
    result = _advise(tracking_uri, "loader=iterable_chunks", "dataset.chunks=6", "dataset.load_ms=40", "loader.shuffle=false",
                     verify=True, allow=["precision"])
    assert result["bound"] == "input"
    top = result["changes"][0]
    assert top.overrides == ["loader=gpu_resident"] and top.predicted_ms < 10 and top.measured_ms < 10
    ladder_ = result["ladder"]
    assert list(ladder_.steps) == [setting(precision="bf16")]  # allowed: the step in bf16 was measured too
    # (A model that does nothing: bf16 may come out faster or not, by the noise of a few steps.)
    best_ = result["best"]
    assert best_.overrides[0] == "loader=gpu_resident" and best_.chain == ["input", "compute"] and best_.measured_ms < 10
    assert ladder_.feed >= 35 and ladder_.configured >= 35 and ladder_.ceiling_eager < 10
    # What a CPU cannot measure is said, not zero.
    assert {"ceiling, graphed", "copy", "kernels"} <= set(ladder_.missing)
    assert "not measured: ceiling, graphed (no CUDA" in result["text"]

    client = MlflowClient(tracking_uri)
    advice = client.get_run(result["run_id"])
    assert advice.info.status == "FINISHED" and advice.data.tags["bound"] == "input"
    assert advice.data.tags["change1"] == "loader=gpu_resident"
    assert advice.data.metrics["ladder.configured_ms"] == ladder_.configured
    assert advice.data.metrics["ladder.feed_ms"] == ladder_.feed and "ladder.ceiling_graphed_ms" not in advice.data.metrics
    assert advice.data.metrics["change1.measured_ms"] == top.measured_ms
    text = Path(client.download_artifacts(result["run_id"], "advice.md")).read_text()
    assert "bound: input" in text and "loader=gpu_resident" in text
    rungs = client.search_runs([advice.info.experiment_id], f"tags.`mlflow.parentRunId` = '{result['run_id']}'")
    names = {r.info.run_name for r in rungs}
    assert names >= {"advise: configured", "advise: ceiling, eager", "advise: feed alone"}
    # once, or twice in turns where the eager ceiling moved between its two runs (this host's drift)
    verified = sorted(n for n in names if re.fullmatch(r"advise: verify loader=gpu_resident(, run \d)?", n))
    assert verified in (["advise: verify loader=gpu_resident"],
                        ["advise: verify loader=gpu_resident, run 1", "advise: verify loader=gpu_resident, run 2"])
    assert (len(verified) == 2) == (ladder_.drift > advisor.MIN_TOLERANCE) and top.measured_runs == len(verified)


def test_a_busy_model_is_judged_compute(tracking_uri, capsys):
    assert advisor.main(["--steps", "3", *TINY_NOOP, "model.busy_ms=150", f"tracking.uri={tracking_uri}"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert out.startswith("best: as configured — nothing the ladder measured is predicted to save more than the tolerance")
    assert "\n\nbound: compute — " in out and "changes: none predicted" in out
    (advice,) = [r for r in MlflowClient(tracking_uri).search_runs(["0", *_experiments(tracking_uri)])
                 if r.data.tags.get("advise") == "true"]
    assert advice.data.tags["bound"] == "compute"
    # On stderr: one progress line per rung (the rungs are quiet runs: no summary of their own),
    # and the warning of a rung that ran a CUDA strategy's CPU path.
    rungs = MlflowClient(tracking_uri).search_runs([advice.info.experiment_id],
                                                  f"tags.`mlflow.parentRunId` = '{advice.info.run_id}'")
    err = captured.err.splitlines()
    assert err[0] == f"advise: measuring the ladder (3 timed steps a rung; runs nested under {advice.info.run_id})"
    progress = [line for line in err[1:] if not line.startswith("warning: no CUDA for loader=")]
    assert sorted(line.split(":")[0].strip() for line in progress) == sorted(r.info.run_name[len("advise: "):] for r in rungs)
    assert all(re.fullmatch(r"  .+: \d+\.\d{3} ms/step \(\d+ s\)", line) for line in progress), progress


def _experiments(uri):
    return [e.experiment_id for e in MlflowClient(uri).search_experiments()]


def test_a_config_the_run_refuses_is_one_line(tracking_uri, capsys):
    assert advisor.main(["--steps", "2", *TINY_NOOP, "loader.batch_size=1000", f"tracking.uri={tracking_uri}"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: the run as configured failed: ") and "loader.batch_size" in err


def _advise_cli(tmp_path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer.advise", *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)


def test_a_setting_is_read_back_from_its_overrides():
    """The table's best configuration (one line of overrides) becomes the Setting that makes it
    again, every lever's value typed as the advisor set it; a key no lever moves is refused."""
    for changes in (setting(strategy="gpu_resident", graph=True), setting(workers=0),
                    setting(strategy="pinned_chunk", compile="default", optimizer="fused"),
                    setting(graph=False, precision="bf16")):
        assert advisor.setting_of(advisor.overrides_of(changes)) == changes
    assert advisor.setting_of(["engine.optimizer.impl=fused", "loader=prefetch"]) == setting(strategy="prefetch",
                                                                                               optimizer="fused")
    with pytest.raises(ValueError, match="loader.batch_size=8: not a lever the advisor moves"):
        advisor.setting_of(["loader.batch_size=8"])


def test_overrides_stand_on_both_sides_of_an_option(tracking_uri, capsys):
    assert advisor.main(["loader=pinned", "--steps", "2", *TINY_NOOP, "loader.batch_size=32",
                         f"tracking.uri={tracking_uri}"]) == 0
    (advice,) = [r for r in MlflowClient(tracking_uri).search_runs(_experiments(tracking_uri))
                 if r.data.tags.get("advise") == "true"]
    assert advice.data.tags["strategy"] == "pinned" and "loader.batch_size=32" in advice.data.tags["advise.overrides"]


@pytest.mark.parametrize("args, line", [
    (["engine.bogus=1"], r"error: engine.bogus: engine has no key bogus \(keys: loop, device, .*\)"),
    (["loader=prefech"], r"error: loader=prefech: loader has no option prefech; did you mean prefetch\? \(options: .*\)"),
    (["--stpes", "3"], r"error: unrecognized arguments: --stpes: see python -m trainer.advise --help"),
])
def test_a_bad_argument_is_one_line_as_python_m_trainer_says_it(tmp_path, tracking_uri, args, line):
    proc = _advise_cli(tmp_path, *args, f"tracking.uri={tracking_uri}")
    assert proc.returncode == 1 and re.fullmatch(line, proc.stderr.strip()), proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("sig", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)])  # (SIGTERM: `-m slow`)
def test_a_signal_during_the_advice_is_one_line_and_closes_its_runs_killed(tmp_path, tracking_uri, sig):
    proc = subprocess.Popen([sys.executable, "-m", "trainer.advise", "--steps", "100000", *TINY_NOOP, "model.busy_ms=20",
                             "dataset.num_samples=100000", "dataset.shape=[4,4]", f"tracking.uri={tracking_uri}"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        advice, rung = wait_for_running(tracking_uri, proc, count=2)  # the advice, then its first rung at its loop
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        stop_leftovers() if proc.poll() is not None else proc.kill()
    assert proc.returncode == 128 + sig and out == "", err
    assert err.splitlines()[-1] == (f"interrupted by {sig.name}: advice run {advice.info.run_id} marked KILLED, the "
                                    f"rungs it measured are saved")
    assert "Traceback" not in err and len(err.splitlines()) == 2  # the ladder's first line, then this one
    client = MlflowClient(tracking_uri)
    assert client.get_run(advice.info.run_id).info.status == client.get_run(rung.info.run_id).info.status == "KILLED"


def stand_in_cpu(feeds: dict, step_ms: float = 1.0, bf16_ms: float = math.nan):
    """A run on a made-up 2-core host, from its config alone: the DataLoader's feed by its workers
    (`feeds`), pinned_chunk's 6 ms, the step fed from the device `step_ms` (`bf16_ms` in bf16); one
    thread does everything, so a run takes its feed plus its step."""
    def run_fn(cfg) -> dict:
        feed = {"gpu_resident": 0.0, "pinned_chunk": 6.0}.get(cfg.loader.name, feeds.get(cfg.loader.num_workers))
        step = 0.0 if cfg.model.name == "noop" else bf16_ms if cfg.engine.precision == "bf16" else step_ms
        return {"ms_per_step": feed + step, "median_step_ms": feed + step, "host_cores": 2.0}
    return run_fn


@pytest.mark.parametrize("no_workers_ms, offered", [
    (5.7, [("loader=gpu_resident", 1.0), ("loader.num_workers=2", 5.0), ("loader=pinned_chunk", 7.0)]),
    # The workers cost more than they give: none, too.
    (2.5, [("loader=gpu_resident", 1.0), ("loader.num_workers=0", 3.5), ("loader.num_workers=2", 5.0)]),
])
def test_more_workers_than_cores_get_a_change_with_fewer(tracking_uri, no_workers_ms, offered):
    """64 DataLoader workers on 2 cores take turns on them: 99 ms a batch, against 4 with 2 workers."""
    cfg = compose_config(*TINY_NOOP[1:], "model=autoencoder", "loader.num_workers=64", f"tracking.uri={tracking_uri}")
    result = advisor.advise(cfg, steps=4, verify=False, run_fn=stand_in_cpu({64: 99.0, 2: 4.0, 0: no_workers_ms}),
                            log=lambda line: None)
    assert result["bound"] == "input" and result["ladder"].cores == 2
    assert [(" ".join(c.overrides), c.predicted_ms) for c in result["changes"]] == offered
    fewer = next(c for c in result["changes"] if c.overrides == ["loader.num_workers=2"])
    assert fewer.why == "2 DataLoader workers, for the 2 CPU cores the run is given (64 took turns on them)"
    assert re.search(r"\n  feed alone \(loader.num_workers=2, no model\) +4\.000\n", result["text"])  # the rung it came from


def test_a_precision_change_is_searched_only_when_allowed(tracking_uri, capsys):
    """A compute-bound step that bf16 halves: proposed with --allow precision only, and said to
    change the training."""
    cfg = compose_config(*TINY_NOOP[1:], "model=autoencoder", "loader=gpu_resident", f"tracking.uri={tracking_uri}")
    run_fn = stand_in_cpu({}, step_ms=4.0, bf16_ms=2.0)
    plain = advisor.advise(cfg, steps=4, verify=False, run_fn=run_fn, log=lambda line: None)
    assert plain["bound"] == "compute" and plain["best"] is None and plain["changes"] == []
    assert not plain["ladder"].steps and "--allow precision measures engine.precision=bf16" in plain["text"]
    asked = []
    allowed = advisor.advise(cfg, steps=4, verify=True, run_fn=lambda job: asked.append(job.tracking.run_name) or run_fn(job),
                             log=lambda line: None, allow=["precision"])
    assert asked.count("advise: verify engine.precision=bf16") == 1  # the best and the first change: one run
    top = allowed["best"]
    assert (top.overrides, top.predicted_ms, top.measured_ms) == (["engine.precision=bf16"], 2.0, 2.0)
    assert allowed["text"].splitlines()[:3] == [
        "best: engine.precision=bf16", "  2.000 ms/step predicted (2.00x), bound: compute throughout; measured 2.000 (+0%)",
        "  changes the training: engine.precision=bf16 (autocast: the loss and the weights it reaches differ from the "
        "configured run's)"]
    assert allowed["changes"][0].why == "autocast to bf16: changes the training"
    tags = MlflowClient(tracking_uri).get_run(allowed["run_id"]).data.tags
    assert (tags["best"], tags["best.chain"], tags["best.changes_training"]) == (
        "engine.precision=bf16", "compute", "engine.precision=bf16")
    with pytest.raises(SystemExit):  # a lever it does not know: one line
        advisor.main(["--allow", "speed"])
    assert capsys.readouterr().err == ("error: argument --allow: invalid choice: 'speed' (choose from 'precision'): see "
                                       "python -m trainer.advise --help\n")


def simulated_gpu(cfg) -> dict:
    """A run's summary on a made-up GPU, from its config alone: seed 000's workload fed by a
    DataLoader (5 ms a batch alone), its eager step 0.6 ms fed from the device, 0.2 graphed."""
    loader, model, graphed = cfg.loader.name, cfg.model.name, cfg.engine.cuda_graph
    if graphed and cfg.engine.compile != "off":  # as the engine refuses it
        raise ConfigError(f"engine.compile={cfg.engine.compile} cannot be used with engine.cuda_graph=true")
    feeds = {"baseline": 5.0, "pinned": 3.0, "prefetch": 3.0, "pinned_chunk": 0.4, "gpu_resident": 0.01}
    feed = 2.5 if cfg.loader.num_workers else feeds[loader]
    step = 0.2 if graphed else 0.6
    # The fused optimizer saves 0.03 ms, compiling 0.05.
    step -= 0.03 * (cfg.engine.optimizer.impl == "fused") + 0.05 * (cfg.engine.compile != "off")
    ms = {"noop": feed, "autoencoder": {"baseline": feed + step, "pinned_chunk": 0.9, "gpu_resident": step}[loader]}[model]
    if loader == "gpu_resident" and cfg.loader.shuffle:
        ms += 0.02  # the gather of a shuffled batch
    summary = {"ms_per_step": ms, "median_step_ms": ms, "h2d_batch_mb": 16.0, "median_h2d_ms": 2.0,
               "h2d_peak_pinned_GBps": 50.0, "h2d_peak_pageable_GBps": 8.0, "host_cores": 8.0}
    if cfg.engine.kernel_window_steps:
        summary.update(gpu_kernel_ms_per_step=0.15, gpu_kernel_busy_fraction=0.15 / ms, launch_gap_ms=0.4,
                       h2d_overlapped_by_kernels_fraction=0.0 if loader == "baseline" else math.nan)
    return summary


def test_the_ladder_on_a_gpu_judges_and_predicts_from_its_rungs(tracking_uri, monkeypatch):
    """The GPU's rungs (graphed ceiling, copy, kernel windows, verified changes) on a simulated
    device: which runs the advisor asks for, and what it concludes from their figures."""
    monkeypatch.setattr(advisor, "_is_cuda", lambda cfg: True)
    monkeypatch.setattr(advisor, "_gpu_name", lambda: "Simulated GPU")
    monkeypatch.setattr(advisor, "max_workers", lambda: 4)
    asked = []

    def run_fn(cfg):
        asked.append((cfg.tracking.run_name, cfg.engine.max_steps, cfg.engine.kernel_window_steps))
        return simulated_gpu(cfg)

    cfg = compose_config("dataset.num_samples=96", "dataset.shape=[8,8]", "loader.batch_size=16", "engine.warmup_steps=5",
                         f"tracking.uri={tracking_uri}")
    result = advisor.advise(cfg, steps=100, verify=True, run_fn=run_fn, log=lambda line: None)
    ladder_ = result["ladder"]
    assert (ladder_.configured, ladder_.ceiling_eager, ladder_.ceiling_graphed, ladder_.feed) == (5.6, 0.6, 0.2, 5.0)
    assert ladder_.copy_achieved == 2.0 and ladder_.copy_pinned == pytest.approx(16 * 2**20 / 50e6)
    # Feeding costs 5 ms a step, launching 0.4; the copy is 2 of the feed's 5: the host is the bound.
    # The engine refuses compile with its own graph: compile is measured on the eager step only, never
    # asked on the graphed one (no run spent on a refusal).
    assert result["bound"] == "input" and sorted(ladder_.missing) == ["precision"]  # (precision not allowed: said)
    assert ladder_.missing["precision"] == ("not tried: it changes the training; --allow precision measures "
                                            "engine.precision=bf16")
    assert [(c.overrides, round(c.predicted_ms, 3), c.measured_ms) for c in result["changes"]] == [
        (["loader=gpu_resident"], 0.63, 0.62),  # its shuffled gather (0.03 alone) after the launch-bound step's
        (["loader=pinned_chunk"], 1.0, 0.9),  # its feed's host work after a launch-bound eager step's
        (["loader.num_workers=4"], 3.1, 2.5 + 0.6)]  # the in-line copy still takes turns with the step
    # Past the feed, the eager step's launches bound it, then its own kernels: the best configuration
    # removes the first two and takes the fused optimizer's 0.03 ms (compile, refused with the graph, saves less).
    top = result["best"]
    assert (top.overrides, top.predicted_ms, top.measured_ms) == (
        ["loader=gpu_resident", "engine.cuda_graph=true", "engine.optimizer.impl=fused"], pytest.approx(0.17), 0.19)
    assert result["text"].splitlines()[:2] == ["best: loader=gpu_resident engine.cuda_graph=true engine.optimizer.impl=fused",
                                               "  0.170 ms/step predicted (32.94x), bounds input → launch → compute; "
                                               "measured 0.190 (+12%)"]
    # Timing rungs first, without a window; the kernel windows last, one timed step each.
    names = [name for name, _, _ in asked]
    assert names[:3] == ["advise: configured", "advise: ceiling, eager", "advise: ceiling, graphed"]
    assert "advise: feed alone" in names
    assert "advise: verify loader=gpu_resident engine.cuda_graph=true engine.optimizer.impl=fused" in names
    assert {"advise: ceiling, graphed, engine.optimizer.impl=fused",  # the step's levers, on the fastest step so far
            "advise: ceiling, eager, engine.compile=default"} <= set(names)
    assert names[-2:] == ["advise: kernels of configured", "advise: kernels of ceiling, eager"]
    # Each verified configuration runs for at least 250 ms of timed steps at its predicted pace (at
    # most 10 times the rungs' 100); every other rung, the configured run's second reading last
    # among them, for the rungs' 100.
    verified = {name: steps for name, steps, _ in asked if name.startswith("advise: verify")}
    assert verified == {"advise: verify loader=gpu_resident engine.cuda_graph=true engine.optimizer.impl=fused": 1005,
                        "advise: verify loader=gpu_resident": 5 + 397, "advise: verify loader=pinned_chunk": 5 + 250,
                        "advise: verify loader.num_workers=4": 105}
    timing = [(name, steps) for name, steps, window in asked[:-2] if name not in verified and window == 0]
    assert len(timing) == len(asked) - 2 - len(verified) and all(steps == 105 for _, steps in timing)
    at = [name for name, _ in timing].index("advise: ceiling, eager, again")
    assert [name for name, _ in timing][at:at + 3] == ["advise: ceiling, eager, again", "advise: feed alone, again",
                                                       "advise: configured, again"]
    assert all(window == 20 and steps == 6 for _, steps, window in asked[-2:])
    assert ladder_.kernels["ceiling, eager"]["gpu_kernel_ms_per_step"] == 0.15
    assert "launch gaps 0.400 ms/step" in result["text"] and "Simulated GPU" in result["text"]
    metrics = MlflowClient(tracking_uri).get_run(result["run_id"]).data.metrics
    assert metrics["ladder.ceiling_graphed_ms"] == 0.2 and metrics["change3.measured_ms"] == pytest.approx(3.1)
    assert metrics["kernels.configured.launch_gap_ms"] == 0.4
    assert (metrics["best.predicted_ms"], metrics["best.measured_ms"]) == (pytest.approx(0.17), 0.19)
    tags = MlflowClient(tracking_uri).get_run(result["run_id"]).data.tags
    assert (tags["best"], tags["best.chain"]) == ("loader=gpu_resident engine.cuda_graph=true engine.optimizer.impl=fused",
                                                   "input → launch → compute")
    assert "best.changes_training" not in tags and metrics["ladder.feed_workers4_ms"] == 2.5


def image_folder_gpu(cfg) -> dict:
    """A run on a made-up GPU over an image folder whose decoded images do not fit in one block:
    the DataLoader's workers decode a batch in 20 ms, nvJPEG in 6 (0.2 of it on the loop's thread);
    the step fed from the device 8 ms eager, 7 graphed. A one-block strategy on the whole folder is
    refused as `check_block` refuses it (64 images would fit: half of them are measured)."""
    loader, graphed = cfg.loader.name, cfg.engine.cuda_graph
    if loader in ("gpu_resident", "pinned_chunk") and (cfg.dataset.num_samples == 0 or cfg.dataset.augment != "none"):
        raise DoesNotFit("dataset=image_folder decoded is 300 MiB, over dataset.max_host_mb=100: use loader=gpu_decode",
                         fits=64)
    feed = {"gpu_decode": 6.0, "gpu_resident": 0.01, "pinned_chunk": 0.5}.get(loader, 20.0)
    step = 7.0 if graphed else 8.0
    ms = feed if cfg.model.name == "noop" else feed + step if loader == "baseline" else max(feed, step)
    return {"ms_per_step": ms, "median_step_ms": ms, "host_cores": 8.0,
            "loop_thread_cpu_ms_per_step": 0.2 if loader == "gpu_decode" else ms}


@pytest.mark.parametrize("augment", ["none", "crop_flip"])
def test_an_image_folder_past_its_memory_gets_gpu_decoding_and_no_one_block_strategy(tmp_path, tracking_uri,
                                                                                       monkeypatch, augment):
    """An image folder larger decoded than `dataset.max_host_mb` (or augmented per sample): the step
    alone is measured on the images that fit (without the augmentation), decoding on the GPU is a
    change measured by its feed alone and predicted, and no one-block strategy is proposed (they
    would refuse the folder)."""
    monkeypatch.setattr(advisor, "_is_cuda", lambda cfg: True)
    monkeypatch.setattr(advisor, "_gpu_name", lambda: "Simulated GPU")
    monkeypatch.setattr(advisor, "max_workers", lambda: 2)  # the configured workers: no more to offer
    asked = []

    def run_fn(cfg):
        asked.append((cfg.tracking.run_name, cfg.dataset.num_samples, cfg.dataset.augment))
        return image_folder_gpu(cfg)

    folder = write_image_folder(tmp_path, 20, size=16)
    cfg = compose_config("dataset=image_folder", f"dataset.root={folder}", "dataset.size=16", "dataset.max_host_mb=100",
                         f"dataset.augment={augment}", "loader.batch_size=16", "loader.num_workers=2", "engine.warmup_steps=5",
                         f"tracking.uri={tracking_uri}")
    result = advisor.advise(cfg, steps=10, verify=True, run_fn=run_fn, log=lambda line: None, kernels=False)
    ladder_ = result["ladder"]
    assert ladder_.decodes_files and not ladder_.holds_block
    assert (ladder_.configured, ladder_.ceiling_eager, ladder_.ceiling_graphed) == (28.0, 8.0, 7.0)
    ceiling = [(n, samples, aug) for n, samples, aug in asked if n.startswith("advise: ceiling")]
    assert all(aug == "none" for _, _, aug in ceiling)  # the step alone reads batches of the same shape
    assert ceiling[:2] == [("advise: ceiling, eager", 0, "none"),  # refused whole: on the first 32 images
                           ("advise: ceiling, eager, the first 32 samples (all do not fit)", 32, "none")]
    assert {samples for _, samples, _ in ceiling[1:]} == {32}
    assert result["bound"] == "input" and ladder_.feeds == {setting(strategy="gpu_decode"): 6.0}
    # The eager step is set by its launches: the decoding thread's 0.2 ms on the loop's thread adds to it.
    assert [(c.overrides, round(c.predicted_ms, 3), c.measured_ms) for c in result["changes"]] == [
        (["loader=gpu_decode"], 8.2, 8.0), (["engine.cuda_graph=true"], 20.0, 27.0)]
    assert "the image files sent compressed, decoded by nvJPEG on the GPU" in result["text"]
    top = result["best"]
    assert (top.overrides, top.predicted_ms, top.chain) == (["loader=gpu_decode", "engine.cuda_graph=true"], 7.0,
                                                            ["input", "launch", "compute"])
    assert not any("gpu_resident" in " ".join(c.overrides) or "pinned_chunk" in " ".join(c.overrides)
                   for c in [top, *result["changes"]])


def test_a_feed_alone_slower_than_the_whole_run_is_measured_again(tracking_uri, monkeypatch):
    """The host slowed while the feed alone ran (28 ms where the whole run took 5.6): rather than no
    verdict, the faster of the feed's two measurements stands; the eager ceiling and the feed,
    each measured first and last, give the drift the tolerance takes in (at most 20%)."""
    monkeypatch.setattr(advisor, "_is_cuda", lambda cfg: True)
    monkeypatch.setattr(advisor, "_gpu_name", lambda: "Simulated GPU")
    asked, eager = [], iter([0.6, 0.66])

    def run_fn(cfg):
        name = cfg.tracking.run_name
        asked.append(name)
        summary = simulated_gpu(cfg)
        if name == "advise: feed alone":
            summary["ms_per_step"] = 28.0
        if name in ("advise: ceiling, eager", "advise: ceiling, eager, again"):
            summary["ms_per_step"] = next(eager)
        return summary

    cfg = compose_config("dataset.num_samples=96", "dataset.shape=[8,8]", "loader.batch_size=16", "engine.warmup_steps=5",
                         f"tracking.uri={tracking_uri}")
    result = advisor.advise(cfg, steps=10, verify=False, run_fn=run_fn, log=lambda line: None, kernels=False)
    ladder_ = result["ladder"]
    assert "advise: feed alone, again" in asked and ladder_.feed == 5.0 and result["bound"] == "input"
    assert ladder_.drift == pytest.approx(0.1) and ladder_.ceiling_eager == pytest.approx(0.63)
    # The feeds' drift says how far the run may be from the model; the steps' tolerance stays the ceiling's.
    assert ladder_.feed_drift == pytest.approx(28 / 5 - 1) and ladder_.tolerance == pytest.approx(0.1)
    assert advisor.miss_tolerance(ladder_) == advisor.MAX_TOLERANCE
    assert ("tolerance 10% (the eager step fed from the device measured first and last 10% apart), 20% against the "
            "run (the feed alone measured first and last 460% apart; one run against the mean of the eager step's "
            "two: twice their distance)") in result["text"]
    assert not any(name.startswith("advise: kernels") for name in asked) and "kernels (not asked" in result["text"]
    # The eager ceiling once at 14 ms (above the whole run's 5.6), once at 0.6: the faster stands.
    eager = iter([14.0, 0.6])
    ladder_ = advisor.advise(cfg, steps=10, verify=False, run_fn=run_fn, log=lambda line: None, kernels=False)["ladder"]
    assert ladder_.ceiling_eager == 0.6 and ladder_.tolerance == advisor.MAX_TOLERANCE


def test_only_the_part_that_contradicts_the_run_falls_back_to_its_faster_reading(tracking_uri, monkeypatch):
    """The feed alone measured 28 and 30 ms where the whole run took 5.6 (a contradiction: its
    faster reading stands), while the eager ceiling's pair, 5.8 and 6.2, is above the run by less
    than the rungs' noise: it says nothing against the run, and its mean stays."""
    monkeypatch.setattr(advisor, "_is_cuda", lambda cfg: True)
    monkeypatch.setattr(advisor, "_gpu_name", lambda: "Simulated GPU")
    feeds, eagers = iter([28.0, 30.0]), iter([5.8, 6.2])

    def run_fn(cfg):
        summary = simulated_gpu(cfg)
        if cfg.tracking.run_name in ("advise: feed alone", "advise: feed alone, again"):
            summary["ms_per_step"] = next(feeds)
        if cfg.tracking.run_name in ("advise: ceiling, eager", "advise: ceiling, eager, again"):
            summary["ms_per_step"] = next(eagers)
        return summary

    cfg = compose_config("dataset.num_samples=96", "dataset.shape=[8,8]", "loader.batch_size=16", "engine.warmup_steps=5",
                         f"tracking.uri={tracking_uri}")
    ladder_ = advisor.advise(cfg, steps=10, verify=False, run_fn=run_fn, log=lambda line: None, kernels=False)["ladder"]
    assert ladder_.feed == 28.0 and ladder_.ceiling_eager == pytest.approx(6.0)


def test_a_verified_run_is_timed_for_at_least_a_quarter_second_at_its_predicted_pace():
    """100 steps of a 0.12 ms step are 12 ms: such a configuration runs 250 ms of steps, at most
    ten times the rungs' count; a slow one, or one with no prediction, the rungs' count."""
    assert advisor.timed_steps(100, 0.5) == 500 and advisor.timed_steps(100, 0.12) == 1000
    assert advisor.timed_steps(100, 7.0) == 100 and advisor.timed_steps(100, 2.5) == 100
    assert advisor.timed_steps(100, math.nan) == advisor.timed_steps(100, 0.0) == 100


def test_the_feed_alone_is_measured_first_and_last_and_its_drift_widens_the_runs_tolerance(tracking_uri, monkeypatch):
    """A feed made by Python on the loop's thread measures 20-40% apart from one run to the next
    on a GPU host: measured first and last, the feed is their mean, and their distance how far
    the run may be from the model; whether a step is set by its launches stays the steps' call."""
    monkeypatch.setattr(advisor, "_is_cuda", lambda cfg: True)
    monkeypatch.setattr(advisor, "_gpu_name", lambda: "Simulated GPU")
    feeds = iter([5.0, 6.0])

    def run_fn(cfg):
        summary = simulated_gpu(cfg)
        if cfg.tracking.run_name in ("advise: feed alone", "advise: feed alone, again"):
            summary["ms_per_step"], summary["loop_thread_cpu_ms_per_step"] = (v := next(feeds)), v
        return summary

    cfg = compose_config("dataset.num_samples=96", "dataset.shape=[8,8]", "loader.batch_size=16", "engine.warmup_steps=5",
                         f"tracking.uri={tracking_uri}")
    ladder_ = advisor.advise(cfg, steps=10, verify=False, run_fn=run_fn, log=lambda line: None, kernels=False)["ladder"]
    assert (ladder_.feed, ladder_.feed_loop) == (5.5, 5.5) and ladder_.feed_drift == pytest.approx(0.2)
    assert ladder_.tolerance == advisor.MIN_TOLERANCE and advisor.miss_tolerance(ladder_) == pytest.approx(0.2)
    assert advisor.modelled(ladder_) == pytest.approx(5.5 + 0.6)


def test_the_configured_run_is_measured_first_and_last_and_the_model_held_against_their_mean(tracking_uri, monkeypatch):
    """One configured run read the host's moment (4.4 ms/step where its parts alone add to 5.6):
    measured again after the other rungs, the run is the pair's mean (5.2, 7% under the model,
    no caution), and the pair's distance widens how far the run may be from the model. A run
    whose timed steps took 5 s already is not measured again."""
    monkeypatch.setattr(advisor, "_is_cuda", lambda cfg: True)
    monkeypatch.setattr(advisor, "_gpu_name", lambda: "Simulated GPU")
    readings, asked = iter([4.4, 6.0]), []

    def run_fn(cfg):
        asked.append(cfg.tracking.run_name)
        summary = simulated_gpu(cfg)
        if cfg.tracking.run_name in ("advise: configured", "advise: configured, again"):
            summary["ms_per_step"] = next(readings)
            summary["data_wait_fraction"] = 0.9
        return summary

    cfg = compose_config("dataset.num_samples=96", "dataset.shape=[8,8]", "loader.batch_size=16", "engine.warmup_steps=5",
                         f"tracking.uri={tracking_uri}")
    result = advisor.advise(cfg, steps=10, verify=False, run_fn=run_fn, log=lambda line: None, kernels=False)
    ladder_ = result["ladder"]
    assert asked.index("advise: configured, again") == asked.index("advise: feed alone, again") + 1
    assert ladder_.configured == pytest.approx(5.2) and ladder_.configured_drift == pytest.approx(6.0 / 4.4 - 1)
    assert ladder_.configured_wait == pytest.approx(0.9 * 5.2)
    assert advisor.modelled(ladder_) == pytest.approx(5.6) and advisor.model_miss(ladder_) == pytest.approx(5.2 / 5.6 - 1)
    assert advisor.miss_tolerance(ladder_) == advisor.MAX_TOLERANCE and not advisor.cautioned(ladder_, advisor.judge(ladder_))
    assert "the run measured first and last 36% apart" in result["text"] and "caution" not in result["text"]
    metrics = MlflowClient(tracking_uri).get_run(result["run_id"]).data.metrics
    assert metrics["ladder.configured_ms"] == pytest.approx(5.2) and metrics["ladder.configured_drift"] == pytest.approx(0.3636, abs=1e-4)
    # 900 timed steps of 5.6 ms: 5 s of the host's time in one reading.
    asked.clear()
    long = advisor.advise(cfg, steps=900, verify=False, run_fn=lambda job: asked.append(job.tracking.run_name) or simulated_gpu(job),
                          log=lambda line: None, kernels=False)["ladder"]
    assert "advise: configured, again" not in asked and "advise: feed alone, again" in asked
    assert (long.configured, long.configured_drift) == (5.6, 0.0)


def test_compile_and_the_fused_optimizer_are_measured_on_the_fastest_step_they_run_with(tracking_uri, monkeypatch):
    """On a GPU, `engine.optimizer.impl=fused` is measured on top of the fastest step so far (the
    graphed one); `engine.compile=default`, which the engine refuses with its own CUDA graph, is
    measured on the eager step only (no run spent on the refusal); the best configuration takes
    what the measured rungs save."""
    monkeypatch.setattr(advisor, "_is_cuda", lambda cfg: True)
    monkeypatch.setattr(advisor, "_gpu_name", lambda: "Simulated GPU")
    cfg = compose_config(*TINY_NOOP[1:-1], "model=autoencoder", f"tracking.uri={tracking_uri}")
    asked = []
    result = advisor.advise(cfg, steps=4, verify=False, run_fn=lambda job: asked.append(job.tracking.run_name) or
                            simulated_gpu(job), log=lambda line: None)
    assert {"advise: ceiling, graphed, engine.optimizer.impl=fused",
            "advise: ceiling, eager, engine.compile=default"} <= set(asked)
    ladder_ = result["ladder"]
    assert ladder_.steps[setting(compile="default")] == pytest.approx(0.55)
    assert not any("graphed, engine.compile" in name for name in asked) and list(ladder_.missing) == ["precision"]
    top = result["best"]
    assert top.overrides == ["loader=gpu_resident", "engine.cuda_graph=true", "engine.optimizer.impl=fused"]
    assert top.predicted_ms == pytest.approx(0.2 - 0.03) and top.chain == ["input", "launch", "compute"]
    metrics = MlflowClient(tracking_uri).get_run(result["run_id"]).data.metrics
    assert metrics["ladder.ceiling_graphed_optimizer_fused_ms"] == pytest.approx(0.17)
    assert metrics["ladder.ceiling_eager_compile_default_ms"] == pytest.approx(0.55)


# ----------------------------------------------------------------------------- the tuner
def test_the_entry_point_returns_the_objective_to_hydra(tiny_cfg, runs):
    from trainer.__main__ import main
    value = main(tiny_cfg())  # Hydra's decorator hands a given config straight to the task
    assert value == runs()[0].data.metrics["throughput_samples_per_s"]
    assert main(tiny_cfg("engine.objective=ms_per_step")) == runs()[0].data.metrics["ms_per_step"]
    with pytest.raises(ConfigError, match="engine.objective must be one of .*: set engine.objective=throughput_samples_per_s"):
        run(tiny_cfg("engine.objective=speed"))


def test_loader_knobs_are_suggested_only_where_a_strategy_has_them():
    optuna = pytest.importorskip("optuna")
    from trainer.tools.tuning import loader_knobs

    def knobs(loader, **fixed):
        study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
        trial = study.ask()
        trial.suggest_categorical("loader", [loader])
        for key, value in fixed.items():
            trial.set_user_attr(key, value)
        loader_knobs(OmegaConf.create({"loader": {"name": "baseline"}}), trial)
        return trial.params

    gather = knobs("pinned_gather")
    assert set(gather) == {"loader", "loader.depth", "loader.threads"}  # no DataLoader, so none of its knobs
    pinned = knobs("pinned", **{"loader.num_workers": 2})  # fixed on the command line: left as it is
    assert set(pinned) == {"loader", "loader.non_blocking", "loader.prefetch_factor", "loader.persistent_workers"}
    assert set(knobs("baseline", **{"loader.num_workers": 0})) == {"loader"}  # without workers they change nothing


def fail_two_trials(cfg, trial) -> None:
    """The study test's search space: trial 1 asks for -1 DataLoader workers, which no run accepts;
    trial 2 for one batch of the whole dataset, so its one step is warm-up and it times nothing
    (no objective, which Optuna refuses as nan)."""
    if trial.number == 1:
        trial.suggest_categorical("loader.num_workers", [-1])
    elif trial.number == 2:
        trial.suggest_categorical("loader.batch_size", [256])
    else:
        trial.suggest_categorical("loader.drop_last", [False])


def test_an_optuna_study_survives_failed_trials_and_reports_the_best(tmp_path, tracking_uri, capsys):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    # One epoch of 256 samples: 4 batches of the default 64, the first one warm-up.
    cmd = [sys.executable, "-m", "trainer", "-m", "experiment=tune_dataloader", "hydra.sweeper.n_trials=4",
           "hydra.sweeper.params.loader=baseline", "hydra.sweeper.custom_search_space=test_advise.fail_two_trials",
           "model=noop", "dataset.num_samples=256", "dataset.shape=[8,8]", "engine.max_steps=0", "engine.epochs=1",
           "engine.warmup_steps=1", "engine.device=cpu", f"tracking.uri={tracking_uri}",
           f"hydra.sweep.dir={tmp_path / 'multirun'}"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name("tune_dataloader")
    found = client.search_runs([exp.experiment_id])
    (parent,) = [r for r in found if r.data.tags.get("sweep") == "true"]
    trials = {r.data.tags["sweep.job"]: r for r in found if r is not parent}
    assert sorted(trials) == ["0", "1", "2", "3"]  # the study went on after each failed trial
    assert [trials[j].info.status for j in "0123"] == ["FINISHED", "FAILED", "FAILED", "FINISHED"]
    assert "loader.num_workers must be >= 0" in trials["1"].data.tags["error"]
    assert trials["2"].data.tags["error"].startswith(
        "RunFailed: engine.objective=throughput_samples_per_s was not measured, and a study ranks its trials by it: "
        "engine.warmup_steps=1 covers all 1 steps of this trial")
    assert trials["2"].data.metrics["timed_steps"] == 0 and "throughput_samples_per_s" not in trials["2"].data.metrics
    best = max((trials["0"], trials["3"]), key=lambda r: r.data.metrics["throughput_samples_per_s"])
    assert parent.data.tags["best_run_id"] == best.info.run_id
    line = (f"best: job {best.data.tags['sweep.job']} (run {best.info.run_id}): throughput_samples_per_s="
            f"{best.data.metrics['throughput_samples_per_s']:.6g} with loader.batch_size=64 loader.num_workers=0")
    assert line in proc.stdout.splitlines()  # the swept values that tell the best from the failed trials
    results = OmegaConf.load(tmp_path / "multirun" / "optimization_results.yaml")  # Optuna's own answer agrees
    assert results.best_value == pytest.approx(best.data.metrics["throughput_samples_per_s"])
    from trainer.report import main as report
    assert report(["--uri", tracking_uri]) == 0  # the table again, read back from the store
    table = capsys.readouterr().out.splitlines()
    statuses = {row.split()[0]: row.split()[3] for row in table[3:7]}  # job, batch size, workers, status
    assert statuses == {"0": "FINISHED", "1": "FAILED", "2": "FAILED", "3": "FINISHED"} and table[-1] == line


def fail_every_trial(cfg, trial) -> None:
    trial.suggest_categorical("loader.num_workers", [-1])


def test_a_study_whose_every_trial_failed_ends_in_one_line(tmp_path, tracking_uri):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    cmd = [sys.executable, "-m", "trainer", "-m", "experiment=tune_dataloader", "hydra.sweeper.n_trials=1",
           "hydra.sweeper.params.loader=baseline", "hydra.sweeper.custom_search_space=test_advise.fail_every_trial",
           *TINY_NOOP, "engine.max_steps=4", f"tracking.uri={tracking_uri}", f"hydra.sweep.dir={tmp_path / 'multirun'}"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1].startswith("error: the study completed none of its trials: every one failed")
    (parent,) = [r for r in MlflowClient(tracking_uri).search_runs(_experiments(tracking_uri))
                 if r.data.tags.get("sweep") == "true"]
    assert parent.info.status == "FAILED" and parent.data.tags["failed_jobs"] == "1"  # closed, with its table


@pytest.mark.parametrize("override, line", [
    ("engine.objective=speed", r"engine.objective must be one of .* \(got 'speed'\): set engine.objective=throughput_samples_per_s"),
    ("loader.batch_size=1000", r"loader.batch_size must be <= 96, the samples in dataset=synthetic \(got 1000\): set "
                               r"loader.batch_size=64 or dataset.num_samples>=1000"),
    ("engine.precision=fp16", r"engine.precision=fp16 needs a GPU: .*: set engine.precision=bf16 .*"),  # (engine.device=cpu)
    ("engine.warmup_steps=4", r"engine.warmup_steps=4 covers all 4 steps of each trial, so none is timed \(timed_steps=0\): "
                              r"set engine.max_steps above 4 or engine.warmup_steps below 4"),  # no objective to rank
])
def test_a_config_error_every_trial_would_hit_is_refused_once_before_the_study(tmp_path, tracking_uri, override, line):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    proc = subprocess.run([sys.executable, "-m", "trainer", "-m", "experiment=tune_dataloader", "hydra.sweeper.n_trials=3",
                           *TINY_NOOP, "engine.max_steps=4", override, f"tracking.uri={tracking_uri}",
                           f"hydra.sweep.dir={tmp_path / 'multirun'}"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert re.fullmatch(rf"error: {line} \(the study ran no trial: every trial of this sweep would stop on it\)\n",
                        proc.stderr), proc.stderr[-3000:]
    assert MlflowClient(tracking_uri).search_runs(_experiments(tracking_uri)) == []  # no trial, no empty sweep


# ----------------------------------------------------------------------------- the sweep it is checked against
def _benchmark(name: str, monkeypatch):
    """A script of benchmarks/ as a module (its sibling imports found as when it runs)."""
    import importlib.util
    folder = Path(__file__).resolve().parents[1] / "benchmarks"
    monkeypatch.syspath_prepend(str(folder))
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_sweep_times_again_the_jobs_near_its_fastest_then_the_fastest_until_it_was_timed_long(monkeypatch):
    """First readings a: 1.0, b: 1.4, c: 1.6 (over 1.5x), d: 1.2. The jobs within 1.5x of the
    fastest go first, fastest first, one slot short of the cap; then the fastest by the readings
    so far, until it is one timed again: here every near job read slower timed longer, so c,
    never near, is timed again too."""
    sweep = _benchmark("advisor_sweep", monkeypatch)
    first = {"a": 1.0, "b": 1.4, "c": 1.6, "d": 1.2}
    order, now = [], dict(first)
    longer = {"a": 1.7, "b": 1.8, "c": 1.65, "d": 1.75}  # every near job slower, timed longer
    while (key := sweep.next_to_retime(first, now, order, most=6)) is not None:
        order.append(key)
        now[key] = longer[key]
    assert order == ["a", "d", "b", "c"]
    # With the cap at 3, two near jobs, and the last slot for the fastest by then: b (1.4).
    order, now = [], dict(first)
    while (key := sweep.next_to_retime(first, now, order, most=3)) is not None:
        order.append(key)
        now[key] = longer[key]
    assert order == ["a", "d", "b"]
    assert sweep.next_to_retime({}, {}, [], most=6) is None
    assert not sweep.finite(None) and not sweep.finite(math.nan) and sweep.finite(0.5)


def test_the_table_takes_the_ratio_measured_in_turns_where_the_sweep_has_one(monkeypatch):
    """Best ÷ fastest: the sweep's ratio of the two timed in turns for that workload's own grid;
    1 where they are the same job; elsewhere (a grid shared with another workload, a compiled
    best) the ratio of the two commands' readings."""
    table = _benchmark("advisor_table", monkeypatch)
    figures = {"configured": 20.0, "bound": "input", "miss": 0.1, "miss_tolerance": 0.2, "caution": False,
               "best": "loader=pinned_chunk engine.cuda_graph=true", "chain": "input → launch", "best_predicted": 2.0,
               "best_measured": 2.1, "top": "loader=pinned_chunk", "top_predicted": 8.0, "top_measured": 8.2}
    rows = [{"label": label, "figures": figures, "took": 10.0, "ended": "finished"}
            for label in ("CIFAR-10 resnet18, pinned, 0 workers", "reference, baseline", "reference, pinned")]
    fastest = {"overrides": "loader=pinned_gather engine.cuda_graph=true", "ms_per_step": 2.0}
    sweep = {"CIFAR-10 resnet18, pinned, 0 workers": {"fastest": fastest, "in_turns": {
                 "best": figures["best"], "ratio": 1.002}},
             "reference, baseline": {"fastest": fastest, "in_turns": {"best": figures["best"], "same_job": True,
                                                                       "ratio": 1.0}}}
    cells = [line.split(" | ") for line in table.table(rows, "Simulated GPU", sweep).splitlines() if line.startswith("| ")][1:]
    assert [c[12] for c in cells] == ["1.00 (in turns)", "1.00 (same job)", "1.05"]
