"""What a run and a comparison say: the end-of-run summary, the interval of ms/step, the marks of
the comparison (noise, CPU, degraded), a missing dataset caught once per sweep, a quiet profiler."""

from __future__ import annotations

import csv
import io
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from trainer.loop.run import run
from trainer.loop.summary import summarise
from trainer.tracking import plots, report
from trainer.tracking.run_summary import bound_by, describe, number

from clirun import all_runs, run_cli
from conftest import TINY


# ----------------------------------------------------------------------------- the interval
def _steps(block_ms, per_block: int = 10) -> tuple:
    """Rows of consecutive steps, `per_block` steps of each block's duration back to back on the
    host clock, and their wall time in seconds."""
    rows, t = [], 100.0
    for ms in block_ms:
        for _ in range(per_block):
            rows.append({"step": len(rows) + 1, "samples": 8, "data_wait_ms": 0.0, "h2d_ms": 0.0, "compute_ms": ms,
                         "step_ms": ms, "loss": 0.0, "host_clock_s": t, "_bytes": 0, "_busy": None})
            t += ms / 1e3
    return rows, t - 100.0


def _interval(block_ms) -> tuple:
    rows, wall_s = _steps(block_ms)
    s = summarise(rows, wall_s)
    return s["ms_per_step"], s["ms_per_step_ci_low"], s["ms_per_step_ci_high"]


def test_the_interval_of_a_known_series_is_the_batch_means_one_on_the_log_scale():
    # 10 blocks of 10 steps, alternately 10 and 12 ms: the blocks' logs have the sample standard
    # deviation sqrt(10/9) * ln(1.2) / 2; Student's t for 9 degrees of freedom is 2.262; the
    # interval is centred on 11 ms on the log scale.
    ms, low, high = _interval([10.0, 12.0] * 5)
    half = 2.262 * math.sqrt(10 / 9) * math.log(1.2) / 2 / math.sqrt(10)
    assert ms == pytest.approx(11.0)
    assert (low, high) == (pytest.approx(11.0 * math.exp(-half)), pytest.approx(11.0 * math.exp(half)))
    assert _interval([11.0] * 10)[1:] == (pytest.approx(11.0), pytest.approx(11.0))  # steady: no width
    _, noisy_low, noisy_high = _interval([5.0, 17.0] * 5)  # the same mean, six times the spread
    assert 0 < noisy_low < low and noisy_high > high


def test_the_interval_of_a_run_with_a_stalled_block_stays_above_zero():
    """Nine blocks of 10 ms/step and one of 2000 (a host that stalled the run): the plain interval
    over the blocks would reach below zero (209 ± 450 ms); a time cannot be negative."""
    ms, low, high = _interval([10.0] * 9 + [2000.0])
    assert ms == pytest.approx(209.0)
    assert 0 < low < ms < high
    assert low * high == pytest.approx(ms ** 2)  # centred on ms_per_step, on the log scale


def test_a_pause_between_steps_counts_in_its_block_and_one_step_has_no_interval():
    rows, wall_s = _steps([10.0] * 10)
    for r in rows[50:]:
        r["host_clock_s"] += 0.5  # half a second between steps 50 and 51 (a stall nobody timed as a step)
    s = summarise(rows, wall_s + 0.5)
    assert s["ms_per_step"] == pytest.approx(15.0)
    assert s["ms_per_step_ci_high"] > 20 and s["ms_per_step_ci_low"] < 15  # one block took 60 ms/step, nine 10
    one = summarise(rows[:1], 0.01)
    assert math.isnan(one["ms_per_step_ci_low"]) and math.isnan(one["ms_per_step_ci_high"])


# ----------------------------------------------------------------------------- the end-of-run summary
def test_a_run_ends_with_its_summary_read_back_from_the_store(tiny_cfg, tracking_uri, runs, capsys):
    summary = run(tiny_cfg("loader=prefetch"))  # on the CPU: degraded
    (recorded,) = runs()
    rid, exp = recorded.info.run_id, recorded.info.experiment_id
    m = recorded.data.metrics
    assert m["ms_per_step_ci_low"] <= m["ms_per_step"] == summary["ms_per_step"] <= m["ms_per_step_ci_high"]
    lines = capsys.readouterr().err.splitlines()
    start = lines.index(next(line for line in lines if line.startswith(f"run {rid} ")))
    text = lines[start:]
    assert text[0] == (f"run {rid} (FINISHED): loader=prefetch dataset=synthetic model=autoencoder on cpu, eager, "
                       f"feedbench loop")
    assert text[1].startswith("  degraded: no CUDA")
    assert text[2] == (f"  {number(m['ms_per_step'])} ms/step (95% interval {number(m['ms_per_step_ci_low'])} to "
                       f"{number(m['ms_per_step_ci_high'])}, {int(m['timed_steps'])} timed steps), "
                       f"{number(m['throughput_samples_per_s'])} samples/s")
    assert text[3].startswith("  bound by: ")
    noise = text[4:5] if text[4].startswith("  noise: the host was busy") else []  # a shared machine may be
    text = text[:4] + text[4 + len(noise):]
    assert text[4] == f"  report:  python -m trainer.report --run {rid} --uri {tracking_uri}"
    assert text[5] == f"  UI:      mlflow ui --backend-store-uri {tracking_uri} --host 127.0.0.1 --port 5000"
    assert text[6] == f"           then open http://127.0.0.1:5000/#/experiments/{exp}/runs?workflowType=machine_learning"
    assert len(text) == 7


def test_a_run_records_the_hosts_load_and_its_own_cpu_against_its_wall_time(tiny_cfg, runs):
    before = os.getloadavg()[0]
    run(tiny_cfg("engine.quiet=true"))
    after = os.getloadavg()[0]
    m = runs()[0].data.metrics
    cores = len(os.sched_getaffinity(0))
    assert m["host_cores"] == cores
    assert min(before, after) - 0.5 <= m["host_load_per_core"] * cores <= max(before, after) + 0.5  # read as the run ended
    cpu_s = m["host_cpu_ms_per_step"] * m["timed_steps"] / 1e3
    assert m["host_cpu_s_per_wall_s"] == pytest.approx(cpu_s / m["timed_wall_s"], rel=1e-6)


@pytest.mark.parametrize("load, own, busy", [(3.4, 1.0, True), (1.9, 1.0, False), (2.1, 2.0, False)])
def test_a_run_on_a_busy_host_says_its_figures_are_noise_and_why(tracking_uri, load, own, busy):
    """A 2-core host: a load average of 3.4 while the run kept one core busy leaves 2.4 to other
    programs; 1.9 leaves them 0.9, under half of the cores; 2.1 is nearly all the run's own."""
    client = MlflowClient(tracking_uri)
    rid = client.create_run(client.create_experiment("e"), tags={"device": "cpu"}).info.run_id
    for k, v in {"timed_steps": 50.0, "ms_per_step": 20.0, "ms_per_step_ci_low": 15.0, "ms_per_step_ci_high": 27.0,
                 "throughput_samples_per_s": 800.0, "data_wait_fraction": 0.1, "host_cores": 2.0,
                 "host_load_per_core": load / 2, "host_cpu_s_per_wall_s": own}.items():
        client.log_metric(rid, k, v)
    client.set_terminated(rid, "FINISHED")
    text = describe(client.get_run(rid), tracking_uri).splitlines()
    assert text[1] == "  20 ms/step (95% interval 15 to 27, 50 timed steps), 800 samples/s"
    noise = [line for line in text if line.startswith("  noise: ")]
    if not busy:
        assert noise == []
        return
    assert noise == [f"  noise: the host was busy: its 1-minute load average was {load:.1f} on the 2 cores this run "
                     f"had, {load - own:.1f} of it other programs' (this process used {own:.2f} CPU-s per s), so the "
                     f"steps waited for a core at random moments: these figures measure the other programs as much as "
                     f"this run; run again on a quiet machine"]
    assert text.index(noise[0]) == 3  # after what bounds it


def test_quiet_runs_print_no_summary(tmp_path, tracking_uri):
    proc = run_cli(tmp_path, tracking_uri, "-q", *TINY)  # the command line's -q is engine.quiet=true
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert all_runs(tracking_uri)[-1].data.params["engine.quiet"] == "True"


@pytest.mark.parametrize("status,tags,total,line", [
    ("KILLED", {"interrupted_by": "SIGINT"}, 3, "interrupted (SIGINT) after 3 of its 50 warm-up steps, before its timed region began"),
    ("KILLED", {"interrupted_by": "SIGTERM"}, None, "interrupted (SIGTERM) before its first step, before its timed region began"),
    ("FAILED", {"error": "ConfigError: ..."}, None, "it failed before its timed region began (its error is in the tag `error`)"),
    ("FINISHED", {}, 50, "set engine.max_steps above engine.warmup_steps"),
])
def test_a_run_without_timed_steps_says_why_as_fits_how_it_ended(tracking_uri, status, tags, total, line):
    client = MlflowClient(tracking_uri)
    rid = client.create_run(client.create_experiment("e"), tags={"device": "cpu", **tags}).info.run_id
    client.log_param(rid, "engine.warmup_steps", "50")
    client.log_param(rid, "engine.max_steps", "100000")
    for k, v in {"timed_steps": 0.0, **({} if total is None else {"total_steps": float(total)})}.items():
        client.log_metric(rid, k, v)
    client.set_terminated(rid, status)
    text = describe(client.get_run(rid), tracking_uri).splitlines()
    assert text[0].startswith(f"run {rid} ({status}): ") and text[1] == f"  no timed steps: {line}"


def test_what_bounds_a_run_is_read_from_its_own_figures():
    assert bound_by({"data_wait_fraction": 0.7}, "cpu").startswith("the data: the loop waited for its next batch 70%")
    assert bound_by({"data_wait_fraction": 0.1}, "cpu") == "the step's own work on the CPU (data wait 10% of the timed time)"
    gpu = {"data_wait_fraction": 0.05, "compute_stream_span_fraction": 0.9, "median_h2d_ms": 1.0, "median_step_ms": 10.0}
    assert bound_by(gpu, "cuda").startswith("the step on the GPU: the compute stream's span covers 90%")
    copying = dict(gpu, compute_stream_span_fraction=0.4, median_h2d_ms=6.0, h2d_beside_step_fraction=0.0)
    assert bound_by(copying, "cuda").startswith("the host-to-device copy: 60% of a step")
    assert bound_by(dict(copying, h2d_beside_step_fraction=1.0), "cuda").startswith("no single part")  # copies beside steps


# ----------------------------------------------------------------------------- the comparison
def _sweep(uri: str, jobs) -> tuple:
    """A sweep in the store as the callback leaves it: a parent and one child per job
    `(loader, model, device, degraded, ms_per_step, ci half-width[, status])` (FINISHED unless
    given); returns (client, parent)."""
    client = MlflowClient(uri)
    exp = client.create_experiment("sweeps")  # logs no artifacts: MLflow's default artifact root is never used
    parent = client.create_run(exp, run_name="sweep", tags={"sweep": "true", "sweep.keys": "loader,model"})
    for i, (loader, model, device, degraded, ms, half, *status) in enumerate(jobs):
        r = client.create_run(exp, run_name=f"job {i}", tags={
            "mlflow.parentRunId": parent.info.run_id, "sweep.job": str(i), "device": device, "model": model,
            "degraded": str(degraded).lower(), "strategy": loader})
        rid = r.info.run_id
        client.log_param(rid, "loader.name", loader)
        client.log_param(rid, "model.name", model)
        for k, v in {"throughput_samples_per_s": 64e3 / ms, "ms_per_step": ms, "ms_per_step_ci_low": ms - half,
                     "ms_per_step_ci_high": ms + half, "compute_stream_span_fraction": 0.95, "h2d_GBps": 3.0,
                     "data_wait_fraction": 0.1}.items():
            client.log_metric(rid, k, v)
        client.set_terminated(rid, (status or ["FINISHED"])[0])
    return client, client.get_run(parent.info.run_id)


JOBS = [("baseline", "mlp", "cuda", False, 10.0, 0.2), ("prefetch", "mlp", "cuda", False, 9.7, 0.3),  # 1.03: noise
        ("pinned", "mlp", "cuda", False, 5.0, 0.1),  # 2.00, shown
        ("baseline", "autoencoder", "cpu", False, 100.0, 1.0), ("prefetch", "autoencoder", "cpu", True, 90.0, 1.0)]


def test_the_comparison_marks_noise_cpu_columns_and_degraded_jobs(tracking_uri):
    client, parent = _sweep(tracking_uri, JOBS)
    keys, rows = report.compare(client, parent)
    by = {(r["loader"], r["model"]): r for r in rows}
    assert by[("prefetch", "mlp")]["speedup_within_noise"] is True  # |log 1.031| < hypot(0.02, 0.031)
    assert by[("pinned", "mlp")]["speedup_within_noise"] is False
    assert by[("baseline", "mlp")]["speedup_within_noise"] is None  # the baseline against itself
    assert by[("prefetch", "mlp")]["ms_per_step_ci95"] == pytest.approx(0.3)
    for r in rows:  # the GPU's figures of a CPU job are blank, not the numbers it logged
        cpu = r["device"] == "cpu"
        assert (r["compute_stream_span_fraction"] is None, r["h2d_GBps"] is None) == (cpu, cpu)
        assert r["data_wait_fraction"] == 0.1

    table = report.format_table(keys, rows).splitlines()
    head = table[0].split()
    cells = {tuple(line.split()[1:3]): line for line in table[2:7]}
    assert "1.03 ~" in cells[("prefetch", "mlp")] and "2.00 ~" not in cells[("pinned", "mlp")]
    assert "±0.300" in cells[("prefetch", "mlp")].split()
    degraded = cells[("prefetch", "autoencoder")].split()
    assert degraded[head.index("degraded")] == "yes" and "yes" not in cells[("baseline", "autoencoder")].split()
    assert table[7:] == [report.LEGEND["noise"], report.LEGEND["cpu"], report.LEGEND["degraded"]]
    assert report.to_markdown(keys, rows).splitlines()[-3:] == [f"{line}  " for line in table[7:]]
    csv_rows = {r["run_id"]: r for r in _csv(report.to_csv(keys, rows))}
    cpu_row = csv_rows[by[("baseline", "autoencoder")]["run_id"]]
    assert (cpu_row["compute_stream_span_fraction"], cpu_row["h2d_GBps"]) == ("", "")
    assert csv_rows[by[("prefetch", "mlp")]["run_id"]]["speedup_within_noise"] == "true"


def test_a_stopped_job_shows_what_it_timed_but_is_no_baseline_and_never_best(tracking_uri):
    jobs = [("baseline", "mlp", "cpu", False, 10.0, 0.2), ("pinned_gather", "mlp", "cpu", False, 4.0, 0.1, "KILLED"),
            ("baseline", "noop", "cpu", False, 2.0, 0.1, "KILLED"), ("pinned_gather", "noop", "cpu", False, 8.0, 0.1),
            ("pinned_gather", "autoencoder", "cpu", False, 1.0, 0.1, "FAILED")]
    client, parent = _sweep(tracking_uri, jobs)
    keys, rows = report.compare(client, parent)
    assert [(r["status"], r["throughput_samples_per_s"], r["ms_per_step"], r["ms_per_step_ci95"], r["speedup_vs_baseline"])
            for r in rows] == [("FINISHED", 6400.0, 10.0, pytest.approx(0.2), 1.0),
                               ("KILLED", 16000.0, 4.0, pytest.approx(0.1), None),  # a partial run compares with nothing
                               ("KILLED", 32000.0, 2.0, pytest.approx(0.1), None),
                               ("FINISHED", 8000.0, 8.0, pytest.approx(0.1), None),  # its baseline was KILLED
                               ("FAILED", 64000.0, 1.0, pytest.approx(0.1), None)]
    table = report.format_table(keys, rows).splitlines()
    assert [line.split()[:5] for line in table[2:7]] == [
        ["0", "baseline", "mlp", "FINISHED", "6400.0"], ["1", "pinned_gather", "mlp", "KILLED", "16000.0"],
        ["2", "baseline", "noop", "KILLED", "32000.0"], ["3", "pinned_gather", "noop", "FINISHED", "8000.0"],
        ["4", "pinned_gather", "autoencoder", "FAILED", "64000.0"]]
    assert table[7:] == [report.LEGEND["all_cpu"], report.LEGEND["stopped"]]
    best = report.best_trial(report.children(client, parent))
    assert report.best_line(best) == (f"best: job 3 (run {rows[3]['run_id']}): throughput_samples_per_s=8000 with "
                                      "loader=pinned_gather model=noop")


def _best(uri: str, degraded) -> str:
    """The best line of a sweep of baseline and GPU strategies, on the CPU, the i-th job degraded as
    `degraded[i]` says (the faster the later)."""
    loaders = ["baseline", "pinned_chunk", "gpu_resident", "prefetch"]
    jobs = [(loaders[i], "mlp", "cpu", d, 10.0 - i, 0.1) for i, d in enumerate(degraded)]
    client, parent = _sweep(uri, jobs)
    return report.best_line(report.best_trial(report.children(client, parent)))


def test_the_best_is_never_a_degraded_job_the_readmes_sweep_ranks_none(tracking_uri):
    # The README's sweep on the CPU: both GPU strategies ran their CPU path, faster than the baseline.
    assert _best(tracking_uri, [False, True, True]) == (
        "best: none: jobs 1, 2 are degraded (no CUDA: the CPU path ran, not the strategy named), so job 0 alone "
        "measured what it names: nothing to rank")


def test_the_best_is_ranked_among_the_jobs_that_measured_their_strategy(tracking_uri):
    line = _best(tracking_uri, [False, True, False, True])
    client = MlflowClient(tracking_uri)
    (parent,) = client.search_runs([client.get_experiment_by_name("sweeps").experiment_id], "tags.sweep = 'true'")
    job2 = report.children(client, parent)[2].info.run_id
    assert line == (f"best: job 2 (run {job2}): throughput_samples_per_s=8000 with loader=gpu_resident "
                    "(not ranked: jobs 1, 3, degraded)")


def test_no_best_when_every_job_is_degraded(tracking_uri):
    assert _best(tracking_uri, [True, True]) == (
        "best: none: every job is degraded (no CUDA: the CPU path ran, not the strategy named), so none measured "
        "what it names")


def _csv(text: str):
    return list(csv.DictReader(io.StringIO(text)))


def test_the_plot_gives_each_model_its_own_throughput_axis_and_marks_degraded_jobs(tracking_uri):
    client, parent = _sweep(tracking_uri, JOBS)
    keys, rows = report.compare(client, parent)
    fig = plots.comparison_figure(rows, keys)
    throughput_axes = fig.axes[0::2]
    assert len(fig.axes) == 4  # two models: a throughput panel and a time panel each
    labels = [[t.get_text() for t in ax.get_yticklabels()] for ax in throughput_axes]
    assert labels == [["baseline mlp", "prefetch mlp", "pinned mlp"], ["baseline autoencoder", "prefetch autoencoder"]]
    notes = [t.get_text() for t in throughput_axes[1].texts]
    assert notes == ["×1.00", "×1.11  degraded: CPU path"]
    assert [bar.get_hatch() for bar in throughput_axes[1].patches] == [None, "//"]
    assert [t.get_text() for t in throughput_axes[0].texts][1].startswith("×1.03~")
    gpu_bars = [bar.get_width() for bar in fig.axes[3].patches][2:]  # the CPU jobs' compute_stream_span_fraction bars
    assert gpu_bars == [0.0, 0.0]


def test_the_report_shows_the_latest_run_or_sweep_and_a_run_as_a_run(tiny_cfg, tracking_uri, capsys):
    client, parent = _sweep(tracking_uri, JOBS[:2])
    assert report.main(["--uri", tracking_uri]) == 0
    assert capsys.readouterr().out.startswith(f"sweep 'sweep' ({parent.info.run_id}, ")  # the latest is the sweep
    run(tiny_cfg("engine.quiet=true"))
    (single,) = all_runs(tracking_uri)
    rid = single.info.run_id
    assert report.main(["--uri", tracking_uri]) == 0  # now the latest is the run
    shown = capsys.readouterr().out
    assert shown.splitlines()[0] == (f"run {rid} (FINISHED): loader=baseline dataset=synthetic model=autoencoder "
                                     "on cpu, eager, feedbench loop")
    assert " ms/step (95% interval " in shown.splitlines()[1] and f"python -m trainer.report --run {rid}" in shown
    assert report.main(["--uri", tracking_uri, "--run", rid]) == 0 and capsys.readouterr().out == shown
    job = report.children(client, parent)[0].info.run_id  # a sweep's job still leads to its sweep
    assert report.main(["--uri", tracking_uri, "--run", job]) == 0
    assert capsys.readouterr().out.startswith(f"sweep 'sweep' ({parent.info.run_id}, ")


GPU_FIGURES = ("compute_stream_span_fraction", "h2d_GBps", "h2d_beside_step_fraction", "peak_gpu_mem_mb")


def test_a_cpu_run_records_no_gpu_figure_as_a_number(tiny_cfg, tracking_uri, capsys):
    """No copy to a device and no compute stream on a CPU: their figures are nan, in the summary,
    in MLflow and in the report, never a 0 that reads as measured."""
    summary = run(tiny_cfg("engine.quiet=true"))
    (recorded,) = all_runs(tracking_uri)
    for key in GPU_FIGURES:
        assert math.isnan(summary[key]) and math.isnan(recorded.data.metrics[key]), key
    assert report.main(["--uri", tracking_uri, "--run", recorded.info.run_id]) == 0
    listed = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines() if line.startswith("  ")}
    assert all(listed.get(key, []) == [] for key in GPU_FIGURES), {k: listed.get(k) for k in GPU_FIGURES}
    assert listed["ms_per_step"] != []  # the host's figures are there


# ----------------------------------------------------------------------------- the sweep and the profiler
def test_a_missing_dataset_fails_the_sweep_once_before_any_run(tmp_path, tracking_uri):
    proc = run_cli(tmp_path, tracking_uri, "-m", "dataset=mnist", f"dataset.root={tmp_path / 'none'}",
                   "dataset.download=false", "loader=baseline,pinned", "model=mlp,autoencoder", "engine.device=cpu")
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "dataset=mnist: MNIST not found" in errors[0] and "python -m trainer.fake_data" in errors[0]
    assert all_runs(tracking_uri) == []  # no parent, no FAILED job
    assert not (tmp_path / "multirun").exists()  # no job was launched


@pytest.mark.slow  # test_sweep.py prints a sweep's table by default
def test_a_sweep_prints_its_table_once_and_no_summary_per_job(tmp_path, tracking_uri):
    proc = run_cli(tmp_path, tracking_uri, "-m", *TINY, "loader=baseline,pinned")
    assert proc.returncode == 0, proc.stderr
    assert "report:" not in proc.stderr and "ms/step" not in proc.stderr  # no end-of-run summary per job
    out = proc.stdout.splitlines()
    assert out.count(report.LEGEND["all_cpu"]) == 1
    (head,) = [line.split() for line in out if line.startswith("job ")]  # one table
    assert "ms_per_step_ci95" in head and "compute_stream_span_fraction" not in head and "h2d_GBps" not in head


def test_a_cpu_run_with_the_profiler_prints_nothing_from_it(tmp_path):
    code = ("import sys, torch; from trainer.loop.profiling import StepProfiler\n"
            f"p = StepProfiler(True, {str(tmp_path)!r}, skip=4)\n"
            "for _ in range(6):\n    torch.ones(8).sum(); p.step()\n"
            "print(p.close())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # before: kineto's profiler_start/stop and "gpuGetDeviceCount failed with code 35"
    assert Path(proc.stdout.strip()).name == "trace.json"
