"""The meter's parts: which steps the GPU sample times, the events made before the loop, the full
batch's size, the host-side result, the timed region's start and hooks, and the one summary."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from trainer.loop import run as run_module
from trainer.loop.meter import StepMeter
from trainer.loop.run import run
from trainer.loop.sampler import TIMING_RUN, EventSampler, Schedule, pool_sizes
from trainer.loop.summary import summarise

CPU = torch.device("cpu")


def _steps(meter, n, start_timed_after=None, samples=4):
    for i in range(n):
        meter.wait_begin()
        meter.step_begin(samples)
        meter.step_end(torch.tensor(float(i)))
        if i + 1 == start_timed_after:
            meter.start_timed()


# ----------------------------------------------------------------------------- the GPU sample
@pytest.mark.parametrize("seed", range(5))
def test_the_gpu_sample_reaches_every_position_of_an_epoch(seed):
    """Epochs of 256 batches, one run of 32 in every 8: runs at fixed places (every 256th step from
    the end of warm-up) would time positions 0-31 of each epoch and nothing else."""
    schedule = Schedule(0, 8, seed)
    timed = [i for i in range(2000) if schedule.timed(i)]
    assert len({i % 256 for i in timed}) >= 128  # 2000 steps: about 8 runs, at different places
    assert len(timed) / 2000 == pytest.approx(1 / 8, abs=0.02)
    assert {i % 256 for i in range(20000) if schedule.timed(i)} == set(range(256))  # in time, every position


def test_the_gpu_sample_is_one_run_per_block_after_the_warm_up_the_first_one_always():
    warmup, every = 5, 4
    schedule = Schedule(warmup, every, seed=7)
    mask = [schedule.timed(i) for i in range(warmup + 40 * every * TIMING_RUN)]
    assert all(mask[:warmup])  # every warm-up step
    runs = [mask[warmup + r * TIMING_RUN:warmup + (r + 1) * TIMING_RUN] for r in range(40 * every)]
    assert all(all(run) or not any(run) for run in runs)  # whole runs of TIMING_RUN steps
    picked = [r for r, run in enumerate(runs) if run[0]]
    assert picked[0] == 0  # the first run of the timed region
    assert [r // every for r in picked] == list(range(40))  # one run in each block of `every`
    assert len({r % every for r in picked}) == every  # at different places in their blocks
    assert [Schedule(warmup, every, seed=7).timed(i) for i in range(len(mask))] == mask  # the seed decides
    assert [Schedule(warmup, every, seed=8).timed(i) for i in range(len(mask))] != mask
    assert all(Schedule(warmup, 1, seed=7).timed(i) for i in range(1000))  # gpu_timing_every=1: every step


# ----------------------------------------------------------------------------- events made before the loop
class FakeEvent:
    """Stands in for torch.cuda.Event on a machine without CUDA: counts what is made and recorded."""

    made: list = []

    def __init__(self, enable_timing=False):
        self.records = 0
        FakeEvent.made.append(self)

    def record(self, stream=None):
        self.records += 1

    def elapsed_time(self, other):
        return 1.0


@pytest.fixture
def fake_cuda(monkeypatch):
    FakeEvent.made = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "compute")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    return FakeEvent.made


def test_event_pools_are_sized_from_the_planned_steps_and_the_sample():
    schedule = Schedule(5, 8, seed=3)
    steps, copies = pool_sizes(schedule, 2000, copies_ahead=3)
    assert steps == sum(schedule.timed(i) for i in range(2000))
    assert copies == sum(schedule.timed(i) for i in range(2003))  # batches copied ahead of the last step
    assert 5 + 7 * TIMING_RUN <= steps <= 5 + 2000 / 8 + TIMING_RUN  # the sampled steps, ~1/8, not every step


def test_a_planned_run_records_only_events_made_and_created_before_it(fake_cuda):
    depth, planned = 3, 2000
    sampler = EventSampler(Schedule(5, 8, seed=3), torch.device("cuda"), planned, copies_ahead=depth)
    pools = [list(p) for p in (sampler.starts, sampler.ends, sampler.copy_starts, sampler.copy_ends)]
    made = len(fake_cuda)
    assert made == sum(map(len, pools)) + 1  # and the reference event
    assert all(e.records == 1 for e in fake_cuda)  # each recorded once before the loop: it exists on the device
    copied = 0
    for i in range(planned):  # a loader copying `depth` batches ahead of the steps, as SideStreamCopier does
        while copied <= i + depth:
            sampler.copy_begin("side")
            sampler.copy_end("side", 1024)
            copied += 1
        sampler.step_begin(i)
        sampler.step_end()
    assert len(fake_cuda) == made  # no event was made in the loop
    assert [list(p) for p in (sampler.starts, sampler.ends, sampler.copy_starts, sampler.copy_ends)] == pools
    assert sampler.steps_timed == len(pools[0]) and sampler.copies_timed == len(pools[2])
    assert len(sampler.step_times(planned)) == sampler.steps_timed and len(sampler.copy_times()) == sampler.copies_timed
    for i in range(planned, planned + 300):  # past the plan, the pools grow rather than fail
        sampler.step_begin(i)
        sampler.step_end()
    assert sampler.steps_timed == sampler.schedule.count(planned + 300)


def test_the_copy_ceilings_use_a_full_batch_not_the_last_one(fake_cuda, monkeypatch):
    sampler = EventSampler(Schedule(0, 8, seed=0), torch.device("cuda"), 3, copies_ahead=0)
    for nbytes in (4096, 4096, 1024):  # an epoch of two full batches and a partial one
        sampler.copy_begin("side")
        sampler.copy_end("side", nbytes)
    assert sampler.batch_bytes == 4096
    monkeypatch.setattr(run_module, "h2d_bandwidth", lambda nbytes, pinned, device: float(nbytes))
    meter = SimpleNamespace(batch_bytes=sampler.batch_bytes, copy_bytes=1024)
    assert run_module.ceilings(meter, torch.device("cuda")) == {"h2d_batch_mb": 4096 / 2**20, "h2d_peak_pinned_GBps": 4096.0,
                                                                "h2d_peak_pageable_GBps": 4096.0}


@pytest.mark.gpu
def test_gpu_the_meter_makes_every_event_before_the_loop_and_none_in_it():
    device = torch.device("cuda")
    meter = StepMeter(device, 3, capacity=600, gpu_timing_every=4, seed=1, copies_ahead=2)
    s = meter.sampler
    pools = [list(p) for p in (s.starts, s.ends, s.copy_starts, s.copy_ends)]
    assert all(e.cuda_event != 0 for p in pools for e in p)  # created on the device, not at a first record
    host, side = torch.ones(64, 1024).pin_memory(), torch.cuda.Stream(device)
    ahead = []

    def copy():
        with torch.cuda.stream(side):
            meter.copy_begin(side)
            ahead.append(host.to(device, non_blocking=True))
            meter.copy_end(side, host.nbytes)

    for _ in range(2):
        copy()
    for i in range(600):
        meter.wait_begin()
        torch.cuda.current_stream(device).wait_stream(side)
        x = ahead.pop(0)
        x.record_stream(torch.cuda.current_stream(device))  # made on the side stream, read on this one
        copy()
        meter.step_begin(64)
        meter.step_end((x * 2).sum())
        if i + 1 == 3:
            meter.start_timed()
    result = meter.finish()
    assert [list(p) for p in (s.starts, s.ends, s.copy_starts, s.copy_ends)] == pools  # the same events, no more
    timed = [r for r in result.rows if not math.isnan(r["compute_ms"])]
    assert len(timed) == meter.schedule.count(600) == len(pools[0]) and all(r["compute_ms"] > 0 for r in timed)
    assert meter.batch_bytes == host.nbytes and result.summary["h2d_GBps"] > 0


# ----------------------------------------------------------------------------- what the host measured
def test_the_host_result_has_the_host_columns_of_every_ended_step():
    meter = StepMeter(CPU, warmup_steps=2, capacity=8)  # grows past its capacity
    _steps(meter, 40, start_timed_after=2)
    meter.wait_begin()
    meter.step_begin(4)  # a step interrupted half-way
    host = meter.host_result()
    assert [r["step"] for r in host.rows] == list(range(1, 41)) and host.summary["timed_steps"] == 38
    assert all(r["samples"] == 4 and r["step_ms"] >= r["data_wait_ms"] >= 0 for r in host.rows)
    assert host.summary["total_samples"] == 160 and host.summary["throughput_samples_per_s"] > 0
    full = meter.finish()
    assert host.rows == full.rows  # on the CPU every column is the host's, losses included
    assert [r["loss"] for r in host.rows] == [float(i) for i in range(40)]


@pytest.mark.gpu
def test_gpu_the_host_result_needs_nothing_from_a_broken_device(monkeypatch):
    device = torch.device("cuda")
    meter = StepMeter(device, 2, capacity=100, gpu_timing_every=1)
    x = torch.ones(1000, device=device)
    for i in range(100):
        meter.wait_begin()
        meter.step_begin(8)
        meter.step_end((x * i).sum())
        if i + 1 == 2:
            meter.start_timed()
    meter.end_timed()

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with monkeypatch.context() as m:  # a sticky CUDA error: every device call fails from here
        for owner, name in ((torch.cuda, "synchronize"), (torch.cuda.Event, "elapsed_time"),
                            (torch.Tensor, "tolist"), (torch.Tensor, "cpu"), (torch.Tensor, "item")):
            m.setattr(owner, name, broken)
        host = meter.host_result()
    full = meter.finish()
    host_columns = ("step", "epoch", "samples", "data_wait_ms", "step_ms", "host_clock_s")
    assert [[r[k] for k in host_columns] for r in host.rows] == [[r[k] for k in host_columns] for r in full.rows]
    assert all(math.isnan(r["compute_ms"]) and math.isnan(r["loss"]) for r in host.rows)
    assert host.summary["timed_steps"] == 98 and math.isnan(host.summary["compute_stream_span_fraction"])
    assert host.summary["timed_wall_s"] == full.summary["timed_wall_s"]  # the region had ended


# ----------------------------------------------------------------------------- the timed region
def test_zero_warm_up_times_every_step(tiny_cfg, runs, capsys):
    summary = run(tiny_cfg("engine.warmup_steps=0"))
    assert summary["timed_steps"] == summary["total_steps"] == 6 and summary["throughput_samples_per_s"] > 0
    (r,) = runs()
    assert r.data.metrics["timed_steps"] == 6
    assert "warning" not in capsys.readouterr().err


def test_timed_start_hooks_run_after_the_warm_up_outside_the_timed_wall():
    calls = []
    meter = StepMeter(CPU, 1, capacity=8, on_timed_start=[lambda: calls.append(meter.n), lambda: time.sleep(1.0)])
    _steps(meter, 4, start_timed_after=1)
    summary = meter.finish().summary
    # The hook's second not timed; 3 tiny steps stay far below it on a loaded machine.
    assert calls == [1] and summary["timed_steps"] == 3 and summary["timed_wall_s"] < 1.0


def test_the_loop_does_not_import_the_turn_taking_harness():
    code = ("import sys, trainer.loop.engine, trainer.loop.meter, trainer.loop.lightning; "
            "print([m for m in sys.modules if m.startswith('trainer.tools')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ----------------------------------------------------------------------------- one summary
def _row(step, wait, compute, total, lightning=None, h2d=0.0):
    row = {"step": step, "samples": 10, "data_wait_ms": wait, "compute_ms": compute, "step_ms": total,
           "host_clock_s": float(step),
           "h2d_ms": h2d, "loss": float(step), "_bytes": 0, "_busy": None}
    if lightning is not None:
        row["lightning_ms"] = lightning
    return row


def test_one_summary_for_every_loop():
    rows = [_row(1, 1.0, 2.0, 4.0), _row(2, 3.0, math.nan, 6.0)]
    s = summarise(rows, wall_s=0.01, faults=8, cpu_s=0.004)
    assert s["throughput_samples_per_s"] == pytest.approx(2000.0) and s["data_wait_fraction"] == pytest.approx(0.4)
    assert s["compute_stream_span_fraction"] == pytest.approx(2.0 * 2 / 10) and s["median_compute_ms"] == 2.0
    assert (s["host_page_faults_per_step"], s["host_cpu_ms_per_step"], s["ms_per_step"]) == (4.0, 2.0, 5.0)
    assert s["timed_steps"] == 2 and s["final_loss"] == 2.0 and "lightning_fraction" not in s
    assert s["median_host_step_ms"] == 3.0  # the step itself, its batch in hand: 3 and 3 ms of 4 and 6
    lightning = summarise([_row(1, 1.0, 2.0, 4.0, 0.5), _row(2, 3.0, 2.0, 6.0, 1.5)], wall_s=0.01)
    assert lightning["lightning_fraction"] == pytest.approx(0.2) and lightning["median_lightning_ms"] == 1.0
    assert {k: v for k, v in lightning.items() if "lightning" not in k}.keys() == s.keys()
    # GPU figures a host-only result cannot have: nan, not 0
    untimed = summarise([_row(1, 1.0, math.nan, 4.0, h2d=math.nan)], wall_s=0.004, copy_spans=None)
    assert math.isnan(untimed["h2d_GBps"]) and math.isnan(untimed["h2d_beside_step_fraction"])
    assert summarise([_row(1, 1.0, 2.0, 4.0)], wall_s=0.004)["h2d_GBps"] == 0.0  # nothing was copied
