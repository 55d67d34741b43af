"""Where the device's time goes in the kernel window: kernels, gaps inside steps, idle between
steps, on a trace written as torch.profiler writes a `KernelWindow`'s (CUDA activity only), checked
against hand-computed values and, where it is installed, against Holistic Trace Analysis."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest

from trainer.loop.profiling import kernel_figures, step_annotated_trace
from trainer.loop.run import run
from trainer.tracking.run_summary import describe, device_time

PARTS = ("gpu_kernel_ms_per_step", "gpu_gap_in_step_ms_per_step", "gpu_idle_between_steps_ms_per_step")
BASE = 1_700_000_000_000  # µs, as Kineto writes them: whole numbers here, so every sum below is exact
HOST, COMPUTE, SIDE = 4242, 7, 20  # the process (and its loop thread), the compute stream, a side stream
# Holistic Trace Analysis (`pip install HolisticTraceAnalysis`): no dependency of feedbench, compared with where installed
needs_hta = pytest.mark.skipif(importlib.util.find_spec("hta") is None, reason="HolisticTraceAnalysis is not installed")
DOCS = Path(__file__).resolve().parent.parent / "docs"
KERNEL = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float> >(int, float)"
# The host's clock around the window: read just before the first marker, just after the closing sync.
WALL_US = (99, 465)


class Kineto:
    """A trace as torch.profiler(activities=[CUDA]).export_chrome_trace writes it: the host's CUDA
    runtime calls on the loop thread, the device's kernels, copies and memsets on pid = device and
    tid = stream, joined by `correlation` (and by "ac2g" flow arrows), and the metadata rows."""

    def __init__(self):
        self.events, self.correlation = [], 1000

    def call(self, name: str, cbid: int, at: int, dur: int, on_device=None) -> None:
        """A runtime call at `at` µs; `on_device`: (cat, name, start, dur, stream) of what it launched."""
        self.correlation += 1
        c = self.correlation
        self.events.append({"ph": "X", "cat": "cuda_runtime", "name": name, "pid": HOST, "tid": HOST, "ts": BASE + at,
                            "dur": dur, "args": {"cbid": cbid, "correlation": c}})
        if on_device is None:
            return
        cat, what, start, length, stream = on_device
        args = {"queued": 0, "device": 0, "context": 1, "stream": stream, "correlation": c}
        if cat == "kernel":
            args.update({"registers per thread": 16, "shared memory": 0, "blocks per SM": 0.5, "warps per SM": 2.0,
                         "grid": [66, 1, 1], "block": [128, 1, 1], "est. achieved occupancy %": 3})
        else:
            args.update({"bytes": 262144, "memory bandwidth (GB/s)": 13.1})
        self.events += [{"ph": "X", "cat": cat, "name": what, "pid": 0, "tid": stream, "ts": BASE + start, "dur": length,
                         "args": args},
                        {"ph": "s", "id": c, "pid": HOST, "tid": HOST, "ts": BASE + at, "cat": "ac2g", "name": "ac2g"},
                        {"ph": "f", "id": c, "pid": 0, "tid": stream, "ts": BASE + start, "cat": "ac2g", "name": "ac2g",
                         "bp": "e"}]

    def kernel(self, at: int, start: int, dur: int, stream: int = COMPUTE) -> None:
        self.call("cudaLaunchKernel", 211, at, 2, ("kernel", KERNEL, start, dur, stream))

    def copy_in(self, at: int, start: int, dur: int) -> None:
        self.call("cudaMemcpyAsync", 41, at, 3, ("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", start, dur, COMPUTE))

    def marker(self, at: int) -> None:
        self.call("cudaStreamQuery", 132, at, 1)  # `KernelWindow`'s step marker: no device work

    def write(self, path: Path) -> Path:
        meta = [{"ph": "M", "name": name, "ts": BASE, "pid": pid, "tid": tid, "args": args} for name, pid, tid, args in (
            ("process_name", HOST, 0, {"name": "python3"}), ("process_labels", HOST, 0, {"labels": "CPU"}),
            ("thread_name", HOST, HOST, {"name": f"thread {HOST} (python3)"}),
            ("process_name", 0, 0, {"name": "python3"}), ("process_labels", 0, 0, {"labels": "GPU 0"}),
            ("thread_name", 0, COMPUTE, {"name": f"stream {COMPUTE} "}), ("thread_name", 0, SIDE, {"name": f"stream {SIDE} "}))]
        spans = [{"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans", "tid": "PyTorch Profiler",
                  "ts": BASE - 50, "dur": 520, "args": {"Op count": 0}},
                 {"ph": "i", "s": "g", "name": "Iteration Start: PyTorch Profiler", "pid": "Traces",
                  "tid": "Trace PyTorch Profiler", "ts": BASE - 50},
                 {"ph": "i", "s": "g", "name": "Record Window End", "pid": "", "tid": "", "ts": BASE + 470}]
        path.write_text(json.dumps({
            "schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3", "totalGlobalMem": 85_031_714_816,
                                                      "computeMajor": 9, "computeMinor": 0, "numSms": 132}],
            "cupti_version": 24, "cuda_runtime_version": 12060, "cuda_driver_version": 12080, "trace_id": "5E2C1D",
            "displayTimeUnit": "ms", "baseTimeNanoseconds": BASE * 1000,
            "traceEvents": meta + self.events + spans, "traceName": str(path)}))
        return path


def window_trace(path: Path) -> Path:
    """Three steps of a host-fed loader (collate, then a copy from pageable memory in line with the
    step) after the untraced step that a sync ends. In µs from BASE:

        untraced   kernel 20-60, sync to 62
        step 0     marker 100; copy 152-172; kernels 177-190, 190-195, 205-225     spans 177-225
        step 1     marker 210; copy 262-282; memset 287-289; kernels 292-330-350   spans 287-350
        step 2     marker 300; copy 402-422; kernels 427-447, 440-460 (side)       spans 427-460
                   marker 435; sync 436-461

    Kernels: 18 + 20 + 58 + 33 = 129. In a step's span with no kernel: 195-205, 287-292 = 15.
    The rest of the host's 366 µs (99-465): 366 - 48 - 63 - 33 = 222, between the steps.
    """
    t = Kineto()
    t.kernel(0, 20, 40)
    t.call("cudaDeviceSynchronize", 165, 5, 57)
    t.marker(100)
    t.copy_in(150, 152, 20)
    t.kernel(175, 177, 13), t.kernel(180, 190, 5), t.kernel(200, 205, 20)
    t.marker(210)
    t.copy_in(260, 262, 20)
    t.call("cudaMemsetAsync", 51, 285, 2, ("gpu_memset", "Memset (Device)", 287, 2, COMPUTE))
    t.kernel(290, 292, 38), t.kernel(295, 330, 20)
    t.marker(300)
    t.copy_in(400, 402, 20)
    t.kernel(425, 427, 20), t.kernel(430, 440, 20, stream=SIDE)
    t.marker(435)
    t.call("cudaDeviceSynchronize", 165, 436, 25)
    return t.write(path)


def figures(tmp_path: Path) -> dict:
    return kernel_figures(window_trace(tmp_path / "kernel_window.json"), 3, (WALL_US[1] - WALL_US[0]) * 1e-6)


def test_kernels_gaps_in_steps_and_idle_between_steps_add_up_to_the_wall(tmp_path):
    found = figures(tmp_path)
    assert found == pytest.approx({
        "gpu_kernel_busy_fraction": 129 / 366,
        "gpu_kernel_ms_per_step": 0.129 / 3,
        "gpu_gap_in_step_ms_per_step": 0.015 / 3,  # the memset's 2 µs count: it is no kernel
        "gpu_idle_between_steps_ms_per_step": 0.222 / 3,  # the copies from the host fall here
        "launch_gap_ms": 0.013 / 3,  # step by step, the memset fills its step
        "h2d_overlapped_by_kernels_fraction": 0.0,
        "kernel_window_ms_per_step": 0.366 / 3}, rel=1e-12)
    assert sum(found[k] for k in PARTS) == pytest.approx(found["kernel_window_ms_per_step"], rel=1e-12)


def test_the_step_annotated_copy_holds_the_window_steps_as_profiler_steps(tmp_path):
    out = step_annotated_trace(window_trace(tmp_path / "kernel_window.json"), 3, tmp_path / "hta" / "rank0.json")
    data = json.loads(out.read_text())
    steps = [(e["name"], e["ts"] - BASE, e["dur"]) for e in data["traceEvents"] if e["name"].startswith("ProfilerStep")]
    assert steps == [("ProfilerStep#0", 100, 110), ("ProfilerStep#1", 210, 90), ("ProfilerStep#2", 300, 135),
                     ("ProfilerStep#3", 435, 35)]  # the last: only the closing sync, to the window's end
    assert all(e["ts"] >= BASE + 100 for e in data["traceEvents"] if e["ph"] != "M")  # the untraced step is gone
    assert data["distributedInfo"] == {"rank": 0}
    with pytest.raises(ValueError, match="no thread made the 5 step markers"):
        step_annotated_trace(tmp_path / "kernel_window.json", 4, tmp_path / "x.json")


@needs_hta
def test_holistic_trace_analysis_reads_the_same_kernels_and_steps(tmp_path):
    """HTA's temporal breakdown finds the same kernel time, and the steps it gives each kernel (through
    the ProfilerStep ranges and the launches' correlation) split the rest as ours do."""
    from hta.trace_analysis import TraceAnalysis
    from hta.utils.utils import merge_kernel_intervals
    ours = figures(tmp_path)
    step_annotated_trace(tmp_path / "kernel_window.json", 3, tmp_path / "hta" / "rank0.json")
    analysis = TraceAnalysis(trace_dir=str(tmp_path / "hta"))
    temporal = analysis.get_temporal_breakdown(visualize=False).iloc[0]
    assert temporal["compute_time(us)"] == pytest.approx(ours["gpu_kernel_ms_per_step"] * 3e3)
    # HTA's span runs from the device's first work (the first copy) to its last: the rest of the
    # wall (99-152, 460-465) is idle between steps for us and outside HTA's span.
    assert temporal["idle_time(us)"] + temporal["non_compute_time(us)"] == pytest.approx(
        (ours["gpu_gap_in_step_ms_per_step"] + ours["gpu_idle_between_steps_ms_per_step"]) * 3e3 - (53 + 5))
    # Its idle time counts no copy (3 x 20) or memset (2) either, and its idle time breakdown finds
    # all of it waiting for the host's launches (`host_wait`), in steps and between them alike.
    assert temporal["idle_time(us)"] == 15 + 222 - (53 + 5) - 60 - 2
    idle, _ = analysis.get_idle_time_breakdown(visualize=False)
    waits = idle[idle["stream"].eq(COMPUTE)].set_index("idle_category")["idle_time"]
    assert waits["host_wait"] == temporal["idle_time(us)"] and waits.sum() == waits["host_wait"]

    df = analysis.t.get_trace(0)
    names = analysis.t.symbol_table.get_sym_table()
    # (its `end` column keeps the times from before it moved them to start at 0)
    df = df.assign(name=df["name"].map(names.__getitem__), cat=df["cat"].map(names.__getitem__), end=df["ts"] + df["dur"])
    work = df[df["stream"].ge(0) & ~df["name"].str.startswith("Memcpy HtoD")]  # a step's own device work
    spans = work.groupby("iteration").agg(first=("ts", "min"), last=("end", "max"))
    assert list(spans.index) == [0, 1, 2] and (spans["first"].iloc[1:].values >= spans["last"].iloc[:-1].values).all()
    in_steps = (spans["last"] - spans["first"]).sum()  # the steps do not overlap: their spans add up
    merged = merge_kernel_intervals(work[work["cat"].eq("kernel")][["ts", "dur"]].copy())  # step 2 runs two streams at once
    kernels = (merged["end"] - merged["ts"]).sum()
    wall = WALL_US[1] - WALL_US[0]
    assert (in_steps - kernels) / 3e3 == pytest.approx(ours["gpu_gap_in_step_ms_per_step"])
    assert (wall - in_steps) / 3e3 == pytest.approx(ours["gpu_idle_between_steps_ms_per_step"])


@needs_hta
def test_the_documented_hta_comparison_runs_on_a_run_artifact(tmp_path, tracking_uri, monkeypatch, capsys):
    """docs/metrics.md's snippet, as printed, on a run that holds the trace as its artifact."""
    from mlflow.tracking import MlflowClient
    snippet = re.search(r"```python\n(.*?)```", (DOCS / "metrics.md").read_text().split("Checking with Holistic")[1], re.S)[1]
    trace = window_trace(tmp_path / "kernel_window.json")
    client = MlflowClient(tracking_uri)
    run_id = client.create_run(client.create_experiment("hta", artifact_location=str(tmp_path / "artifacts"))).info.run_id
    client.log_param(run_id, "engine.kernel_window_steps", 3)
    client.log_metric(run_id, "gpu_kernel_ms_per_step", figures(tmp_path)["gpu_kernel_ms_per_step"])
    client.log_artifact(run_id, str(trace))
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    exec(snippet.replace("sqlite:///outputs/mlflow.db", tracking_uri).replace("RUN_ID", run_id), {})
    assert "kernels, ms per step: HTA 0.043, feedbench 0.043" in capsys.readouterr().out


def test_the_run_summary_puts_the_device_time_beside_the_host_wait(tracking_uri):
    """What the run prints as it ends and `python -m trainer.report --run` prints again (`describe`)."""
    from mlflow.tracking import MlflowClient
    m = {"gpu_kernel_ms_per_step": 1.2, "gpu_gap_in_step_ms_per_step": 0.25, "gpu_idle_between_steps_ms_per_step": 3.04,
         "kernel_window_ms_per_step": 4.49, "data_wait_fraction": 0.5, "ms_per_step": 6.0, "timed_steps": 50.0}
    client = MlflowClient(tracking_uri)
    rid = client.create_run(client.create_experiment("e"), tags={"device": "cuda"}).info.run_id
    for k, v in m.items():
        client.log_metric(rid, k, v)
    client.set_terminated(rid, "FINISHED")
    text = describe(client.get_run(rid), tracking_uri).splitlines()
    assert text[2].startswith("  bound by: the data") and text[3] == (
        "  device, per step of the kernel window: 1.2 ms kernels + 0.25 ms gaps in steps + 3.04 ms idle between steps "
        "= 4.49 ms; the host waited 3 ms per step for data")
    assert device_time(dict(m, gpu_idle_between_steps_ms_per_step=math.nan)) is None  # no step markers
    assert device_time({"data_wait_fraction": 0.5, "ms_per_step": 6.0}) is None  # no window (a CPU run)


@pytest.mark.gpu
def test_a_real_window_adds_up_and_a_host_fed_loader_idles_the_device_between_steps(tiny_cfg, runs, tracking_uri, tmp_path):
    """On CUDA: the three parts make the window's wall per step, also on the trace's own clock (from
    the first marker to the end of the closing sync, within 1% of the host's), and the device idles
    longer between the steps of `baseline` (collate and a pageable copy in line with the step) than
    of `gpu_resident` (the batch is indexed on the device)."""
    from mlflow.tracking import MlflowClient
    idle = {}
    for loader in ("baseline", "gpu_resident"):
        s = run(tiny_cfg("engine.device=cuda", f"loader={loader}", "engine.cuda_graph=false", "dataset.shape=[64,64]",
                         "dataset.num_samples=2048", "loader.batch_size=64", "engine.max_steps=40", "engine.warmup_steps=5",
                         "engine.kernel_window_steps=20"))
        assert all(s[k] >= 0 for k in PARTS), s
        assert sum(s[k] for k in PARTS) == pytest.approx(s["kernel_window_ms_per_step"], rel=1e-9)
        trace = Path(MlflowClient(tracking_uri).download_artifacts(runs()[0].info.run_id, "kernel_window.json", str(tmp_path)))
        calls = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "cuda_runtime"]
        first = min(e["ts"] for e in calls if e["name"].startswith("cudaStreamQuery"))
        end = max(e["ts"] + e["dur"] for e in calls if e["name"].startswith("cudaDeviceSynchronize"))
        on_trace = kernel_figures(trace, 20, (end - first) * 1e-6)
        assert on_trace["kernel_window_ms_per_step"] == pytest.approx(s["kernel_window_ms_per_step"], rel=0.01)
        assert on_trace["gpu_idle_between_steps_ms_per_step"] >= 0  # every step's work lies between the two
        assert sum(on_trace[k] for k in PARTS) == pytest.approx(s["kernel_window_ms_per_step"], rel=0.01)
        idle[loader] = s["gpu_idle_between_steps_ms_per_step"]
    assert idle["baseline"] > idle["gpu_resident"], idle
