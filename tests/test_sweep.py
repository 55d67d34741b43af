"""Sweeps: one MLflow parent run per multirun, nested child runs, the comparison and the report."""

from __future__ import annotations

import csv
import io
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from clirun import LONG, start, stop_leftovers, wait_for_running
from trainer.tracking import report, sweep
from trainer.tracking.plain import ACROSS_TIME
from trainer.errors import ConfigError
from trainer.loop.run import run

SMALL = ["engine.max_steps=8", "dataset.num_samples=128", "dataset.shape=[8,8]", "engine.progress=false",
         "engine.warmup_steps=2"]
PNG = b"\x89PNG\r\n\x1a\n"


def multirun(tmp_path: Path, uri: str, *overrides: str, env=None, sweep_dir: bool = True) -> subprocess.CompletedProcess:
    """`python -m trainer -m ...` from a scratch directory, tracked in `uri`; Hydra's output folders
    in `tmp_path` (`sweep_dir=False`: where the config puts them)."""
    cmd = [sys.executable, "-m", "trainer", "-m", *overrides, *SMALL, f"tracking.uri={uri}",
           *([f"hydra.sweep.dir={tmp_path / 'multirun'}"] if sweep_dir else [])]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, **(env or {})))


def parent_and_children(uri: str):
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("feedbench")
    found = client.search_runs([exp.experiment_id])
    parents = [r for r in found if r.data.tags.get("sweep") == "true"]
    assert len(parents) == 1, [r.info.run_name for r in found]
    parent = parents[0]
    children = [r for r in found if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == len(found) - 1  # every other run is nested under the parent
    return client, parent, children


def read_artifact(client: MlflowClient, run_id: str, path: str) -> bytes:
    return Path(client.download_artifacts(run_id, path)).read_bytes()


def csv_rows(text: str):
    return list(csv.DictReader(io.StringIO(text)))


@pytest.mark.fresh_store
def test_sweep_is_one_parent_with_nested_children_and_a_comparison(tmp_path, tracking_uri):
    """Launched from a scratch directory, into a store the sweep creates: everything lands in the
    store named by the URI and in the project's output folders, nothing where it was launched."""
    proc = multirun(tmp_path, tracking_uri, "loader=baseline,pinned", "model=mlp,autoencoder", "engine.device=cpu",
                    sweep_dir=False)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlartifacts", "mlflow.db", "mlflow.db.lock"]  # the store, beside its DB
    client, parent, children = parent_and_children(tracking_uri)

    assert parent.info.status == "FINISHED"
    assert parent.info.run_name == "sweep loader=baseline,pinned model=mlp,autoencoder"
    assert parent.data.tags["sweep.keys"] == "loader,model"
    assert (parent.data.tags["jobs"], parent.data.tags["failed_jobs"]) == ("4", "0")
    assert sorted(r.data.tags["sweep.job"] for r in children) == ["0", "1", "2", "3"]
    assert sorted(r.info.run_name for r in children) == [
        "loader=baseline model=autoencoder", "loader=baseline model=mlp",
        "loader=pinned model=autoencoder", "loader=pinned model=mlp"]
    assert all(r.info.status == "FINISHED" for r in children)
    for r in children:
        assert read_artifact(client, r.info.run_id, "timeline.png").startswith(PNG)
    assert read_artifact(client, parent.info.run_id, "comparison.png").startswith(PNG)

    # comparison.csv holds each child's own logged metrics, and speedups against the
    # baseline job with the same model.
    stored = read_artifact(client, parent.info.run_id, "comparison.csv").decode()
    rows = {row["run_id"]: row for row in csv_rows(stored)}
    assert set(rows) == {r.info.run_id for r in children}
    by_setting = {(r.data.tags["strategy"], r.data.tags["model"]): r for r in children}
    for r in children:
        row = rows[r.info.run_id]
        assert (row["loader"], row["model"], row["status"]) == (r.data.tags["strategy"], r.data.tags["model"], "FINISHED")
        for m in ("throughput_samples_per_s", "data_wait_fraction"):
            assert float(row[m]) == r.data.metrics[m], m
        assert row["compute_stream_span_fraction"] == row["h2d_GBps"] == ""  # CPU jobs: blank, not numbers
        base = by_setting[("baseline", r.data.tags["model"])].data.metrics["throughput_samples_per_s"]
        assert float(row["speedup_vs_baseline"]) == r.data.metrics["throughput_samples_per_s"] / base
    assert {float(rows[by_setting[("baseline", m)].info.run_id]["speedup_vs_baseline"]) for m in ("mlp", "autoencoder")} == {1.0}
    assert "speedup_vs_baseline" in proc.stdout  # the table is printed at the end of the sweep

    # The report command reads the same table back (latest sweep by default, no server).
    out_csv, out_md = tmp_path / "report.csv", tmp_path / "report.md"
    rep = subprocess.run([sys.executable, "-m", "trainer.report", "--uri", tracking_uri, "--csv", str(out_csv),
                          "--markdown", str(out_md)], capture_output=True, text=True, timeout=300)
    assert rep.returncode == 0, rep.stderr
    assert out_csv.read_text() == stored
    lines = rep.stdout.splitlines()
    assert parent.info.run_id in lines[0]
    head = lines[1].split()
    assert head[:4] == ["job", "loader", "model", "status"] and "speedup_vs_baseline" in head
    assert lines[7:-1] == report.legend(report.compare(client, parent)[1])  # title, header, rule, 4 jobs, legend, best
    assert len({len(line) for line in lines[1:7]}) <= 2  # aligned: the rule and the rows as wide as the header
    measured = [r for r in children if r.data.tags["degraded"] != "true"]  # pinned on the CPU ran its CPU path
    fastest = max(measured, key=lambda r: r.data.metrics["throughput_samples_per_s"])
    assert lines[-1].startswith(f"best: job {fastest.data.tags['sweep.job']} (run {fastest.info.run_id}): ")  # last
    left_out = sorted(r.data.tags["sweep.job"] for r in children if r not in measured)
    assert len(left_out) == 2 and lines[-1].endswith(f" (not ranked: jobs {', '.join(left_out)}, degraded)")
    assert client.get_run(parent.info.run_id).data.tags["best_run_id"] == fastest.info.run_id
    for r in children:
        line = next(x for x in lines[3:] if x.split()[0] == r.data.tags["sweep.job"])
        assert line.split()[1:3] == [r.data.tags["strategy"], r.data.tags["model"]]
        assert f"{r.data.metrics['throughput_samples_per_s']:.1f}" in line.split()
    md = out_md.read_text().splitlines()
    assert md[0].startswith("| job | loader | model | status |") and len([x for x in md if x.startswith("|")]) == 2 + 4


def test_failed_jobs_are_listed_as_failed_and_the_rest_still_compared(tmp_path, tracking_uri):
    # engine.device=nope fails before the job's run is opened; a batch larger than the dataset
    # (128 samples) fails inside the open run.
    proc = multirun(tmp_path, tracking_uri, "loader=baseline,pinned", "engine.device=cpu,nope",
                    "loader.batch_size=16,1000")
    assert proc.returncode != 0  # Hydra's sweeper reports the failure
    client, parent, children = parent_and_children(tracking_uri)
    assert sorted(int(r.data.tags["sweep.job"]) for r in children) == list(range(8))  # one run per job
    assert parent.info.status == "FAILED" and parent.data.tags["failed_jobs"] == "6"

    status = {(r.data.tags["strategy"], r.data.params["engine.device"], r.data.params["loader.batch_size"]): r
              for r in children}
    assert len(status) == 8
    for (strategy, device, batch), r in status.items():
        assert r.info.status == ("FINISHED" if (device, batch) == ("cpu", "16") else "FAILED")
        if device == "nope":
            assert "engine.device" in r.data.tags["error"]
        elif batch == "1000":
            assert "loader.batch_size" in r.data.tags["error"]

    rows = {row["run_id"]: row for row in csv_rows(read_artifact(client, parent.info.run_id, "comparison.csv").decode())}
    assert len(rows) == 8
    base = status[("baseline", "cpu", "16")].data.metrics["throughput_samples_per_s"]
    pinned = status[("pinned", "cpu", "16")]
    assert float(rows[pinned.info.run_id]["speedup_vs_baseline"]) == pinned.data.metrics["throughput_samples_per_s"] / base
    for r in children:
        if r.info.status == "FAILED":
            row = rows[r.info.run_id]
            assert row["status"] == "FAILED" and row["throughput_samples_per_s"] == row["speedup_vs_baseline"] == ""
    assert read_artifact(client, parent.info.run_id, "comparison.png").startswith(PNG)


def test_submitit_local_jobs_run_in_their_own_processes_nested_under_the_parent(tmp_path, tracking_uri):
    """Hydra's submitit launcher starts every job as its own process, all at once: the parent id
    travels in the overrides, and the comparison sees the jobs' timed regions side by side."""
    proc = multirun(tmp_path, tracking_uri, "hydra/launcher=submitit_local", "loader=baseline,pinned", "engine.device=cpu")
    assert proc.returncode == 0, proc.stderr
    client, parent, children = parent_and_children(tracking_uri)
    assert parent.info.status == "FINISHED"
    assert sorted(r.info.run_name for r in children) == ["loader=baseline", "loader=pinned"]
    assert [r.info.status for r in children] == ["FINISHED", "FINISHED"]
    assert len({r.data.tags["device_ids"] for r in children}) == 1  # this host's CPU, in both jobs
    keys, rows = report.compare(client, parent)
    assert keys == ["loader"] and [r["status"] for r in rows] == ["FINISHED", "FINISHED"]
    speedup = {r["loader"]: r["speedup_vs_baseline"] for r in rows}
    thr = {r.data.tags["strategy"]: r.data.metrics["throughput_samples_per_s"] for r in children}
    assert speedup == {"baseline": 1.0, "pinned": thr["pinned"] / thr["baseline"]}
    # Started together, the two jobs may or may not have been timed at the same moment: the mark says which.
    windows = sorted((r.data.metrics["timed_start_unix_s"], r.data.metrics["timed_end_unix_s"]) for r in children)
    at_once = windows[1][0] < windows[0][1]
    assert [bool(r["overlap"]) for r in rows] == [at_once, at_once]
    assert ("were timed at the same time" in proc.stderr) == at_once
    assert sorted(r.data.tags["sweep.job"] for r in children) == ["0", "1"]
    assert len(list((tmp_path / "multirun" / ".submitit").iterdir())) >= 2  # submitit's own job folders


@pytest.mark.slow  # the overlap marking runs by default in test_distributed.py
def test_a_job_timed_beside_another_run_of_the_store_is_marked(tmp_path, tiny_cfg, tracking_uri):
    """Two sweeps (or a sweep and a run) into one store at once, on one device: both finish, and
    the sweep's table marks its job timed while the other run was being timed, naming that run."""
    other = start(tmp_path, tracking_uri, *LONG)
    try:
        (theirs,) = wait_for_running(tracking_uri, other, steps=4)  # past its 2 warm-up steps: being timed
        parent_id = sweep.start_parent(tiny_cfg().tracking, "beside another", ["loader"], {})
        run(tiny_cfg("loader=baseline", f"tracking.parent_run_id={parent_id}"))
        other.send_signal(signal.SIGINT)  # stopped, it records the timed region it had
        assert other.wait(timeout=120) == 130
    finally:
        stop_leftovers()
    sweep.finish_parent(tracking_uri, parent_id)
    client = MlflowClient(tracking_uri)
    _, rows = report.compare(client, client.get_run(parent_id))
    assert [r["overlap"] for r in rows] == [f"run {theirs.info.run_id[:8]}"]
    assert report.overlap_warning(rows) == (
        f"warning: jobs 0 were timed at the same time on a shared device (column overlap), some beside other runs of "
        f"this store ({theirs.info.run_id}): their figures disturb each other; run a timing sweep one job at a time, "
        "and no other run beside it (see README)")


def test_speedup_pairs_jobs_with_the_same_other_settings(tiny_cfg, tracking_uri):
    """In-process: children attached by `tracking.parent_run_id`; `loader.depth` (prefetch only)
    does not split prefetch from its baseline, `loader.batch_size` does."""
    cfg = tiny_cfg()
    parent_id = sweep.start_parent(cfg.tracking, "sweep by hand", ["loader", "loader.batch_size"], {})
    for strategy in ("baseline", "prefetch"):
        for bs in (16, 32):
            summary = run(tiny_cfg(f"loader={strategy}", f"loader.batch_size={bs}", f"tracking.parent_run_id={parent_id}"))
            assert summary["total_samples"] == 96
    keys, rows = sweep.finish_parent(tracking_uri, parent_id)
    assert keys == ["loader", "loader.batch_size"]
    assert [(r["loader"], r["loader.batch_size"]) for r in rows] == [
        ("baseline", "16"), ("baseline", "32"), ("prefetch", "16"), ("prefetch", "32")]
    thr = {(r["loader"], r["loader.batch_size"]): r["throughput_samples_per_s"] for r in rows}
    for r in rows:
        assert r["speedup_vs_baseline"] == thr[(r["loader"], r["loader.batch_size"])] / thr[("baseline", r["loader.batch_size"])]
    client = MlflowClient(tracking_uri)
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED"
    names = {client.get_run(r["run_id"]).info.run_name for r in rows}
    assert names == {f"loader={s} loader.batch_size={b}" for s in ("baseline", "prefetch") for b in (16, 32)}


@pytest.mark.slow  # the report of a sweep runs by default
def test_report_finds_the_sweep_from_a_child_id_and_prints_the_table(tiny_cfg, tracking_uri, capsys, tmp_path):
    cfg = tiny_cfg()
    parent_id = sweep.start_parent(cfg.tracking, "small", ["loader"], {})
    for strategy in ("baseline", "pinned"):
        run(tiny_cfg(f"loader={strategy}", f"tracking.parent_run_id={parent_id}"))
    sweep.finish_parent(tracking_uri, parent_id)
    client = MlflowClient(tracking_uri)
    child = client.search_runs([client.get_run(parent_id).info.experiment_id],
                               filter_string=f"tags.`mlflow.parentRunId` = '{parent_id}'")[0]
    assert report.main(["--uri", tracking_uri, "--sweep", child.info.run_id]) == 0
    out = capsys.readouterr().out.splitlines()
    assert parent_id in out[0] and out[1].split()[:3] == ["job", "loader", "status"]
    assert sorted(line.split()[1] for line in out[3:5]) == ["baseline", "pinned"]  # then the legend, then the best
    # pinned ran its CPU path (degraded): the baseline alone measured what it names, so nothing is ranked.
    assert out[-1] == ("best: none: job 1 is degraded (no CUDA: the CPU path ran, not the strategy named), so job 0 "
                       "alone measured what it names: nothing to rank")
    assert "best_run_id" not in client.get_run(parent_id).data.tags
    assert "engine_vs_plain" not in out[1]

    # --plain: each job's config run again as a plain loop in its own process, now, logged on the job
    # as when it was timed; their ratio, across time, is printed as no measurement and never logged.
    assert report.main(["--uri", tracking_uri, "--plain", "--csv", str(tmp_path / "t.csv")]) == 0
    captured = capsys.readouterr()
    out = captured.out.splitlines()
    assert out[1].split()[-1] == "plain_ms_per_step" and report.LEGEND["plain"] in out
    said = [line for line in captured.err.splitlines() if line.startswith("loader=")]  # (MLflow's download bars aside)
    assert len(said) == 2 and all(re.fullmatch(rf"loader=\w+: engine [\d.]+ ms/step when it ran, plain loop [\d.]+ "
                                               rf"now; their ratio [\d.]+ is {re.escape(ACROSS_TIME)}", line) for line in said)
    rows = csv_rows((tmp_path / "t.csv").read_text())
    assert len(rows) == 2 and all("engine_vs_plain" not in row for row in rows)
    for row in rows:
        logged = client.get_run(row["run_id"])
        assert logged.data.metrics["plain_timed_steps"] == 5 and "engine_vs_plain" not in logged.data.metrics
        assert float(row["plain_ms_per_step"]) == logged.data.metrics["plain_ms_per_step"]
        assert re.fullmatch(r"after the run, at \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ \(report --plain\)",
                            logged.data.tags["plain_timed"])


def test_report_shows_the_pinned_ceiling_beside_the_copy_bandwidth_when_a_job_logged_it():
    # CPU runs log no ceiling (no copy): the column is absent. A CUDA run logs h2d_peak_pinned_GBps
    # after its loop, and the table puts it right after h2d_GBps so the two read together.
    cpu = [{"h2d_GBps": None, "h2d_peak_pinned_GBps": None}]
    assert report.PEAK not in report.metric_columns(cpu)
    cuda = [{"h2d_GBps": 45.1, "h2d_peak_pinned_GBps": 53.6, "plain_ms_per_step": 2.0, "engine_vs_plain": 1.01},
            {"h2d_GBps": 30.2}]
    cols = report.metric_columns(cuda)
    assert cols[cols.index("h2d_GBps") + 1] == report.PEAK and cols[-2:] == list(report.PLAIN)
    job = {"job": "0", "status": "FINISHED", **cuda[0]}
    assert csv_rows(report.to_csv([], [job]))[0][report.PEAK] == "53.6"
    assert "53.60" in report.format_table([], [job]).splitlines()[2].split()


def test_a_swept_key_given_on_the_command_line_replaces_the_presets_sweep_of_it():
    # As Hydra's basic sweeper runs it: the preset sweeps loader and batch size; the command line
    # narrows loader to one value and batch size to two. The parent is named after what ran.
    config = OmegaConf.create({"hydra": {
        "sweeper": {"params": {"loader": "baseline,pinned_chunk", "loader.batch_size": "1,4,16,64"}},
        "overrides": {"task": ["experiment=limits", "loader=pinned_chunk", "loader.batch_size=1,4",
                               "hydra.sweep.dir=x,y"]}}})
    overrides = sweep.sweep_overrides(config)
    assert overrides == ["loader.batch_size=1,4"]
    assert sweep.swept_keys(overrides) == ["loader.batch_size"]
    config.hydra.overrides.task = ["model=noop,mlp"]
    assert sweep.sweep_overrides(config) == ["loader=baseline,pinned_chunk", "loader.batch_size=1,4,16,64",
                                             "model=noop,mlp"]


def test_report_errors_name_the_fix_and_create_nothing(tmp_path, tracking_uri, capsys):
    missing = tmp_path / "none.db"
    assert report.main(["--uri", f"sqlite:///{missing}"]) == 2
    assert "run a sweep first" in capsys.readouterr().err and not missing.exists()
    MlflowClient(tracking_uri).create_experiment("feedbench")  # a store without a sweep
    assert report.main(["--uri", tracking_uri]) == 2
    assert "no run or sweep" in capsys.readouterr().err
    assert report.main(["--uri", tracking_uri, "--sweep", "0123abcd"]) == 2
    assert capsys.readouterr().err == "error: --sweep 0123abcd: no such run in this store\n"
    assert report.main(["--uri", tracking_uri, "--run", "deadbeef"]) == 2
    assert capsys.readouterr().err == "error: --run deadbeef: no such run in this store\n"  # the flag typed


def test_report_usage_lists_run_and_sweep(capsys):
    with pytest.raises(SystemExit) as done:
        report.main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "[--run RUN_ID | --sweep RUN_ID]" in " ".join(out.split())  # the usage, however argparse wraps it
    assert "\n  --run RUN_ID " in out and "\n  --sweep RUN_ID " in out


@pytest.mark.parametrize("args,line", [
    (["--run"], "error: --run: --run takes a value: write --run=<RUN_ID>"),
    (["--sweep", "a", "--run", "b"], "error: argument --run: not allowed with argument --sweep: see python -m trainer.report --help"),
    (["--rnu", "x"], "error: --rnu: not an option of python -m trainer.report; did you mean --run? "
                     "(python -m trainer.report --help lists them)"),
])
def test_a_bad_report_argument_is_one_line_not_the_usage(capsys, args, line):
    with pytest.raises(SystemExit) as done:
        report.main(args)
    assert done.value.code == 2 and capsys.readouterr().err == line + "\n"


@pytest.mark.parametrize("option,path", [("--csv", "{tmp}/nodir/x.csv"), ("--markdown", "/proc/nope.md"),
                                         ("--csv", "{tmp}")])
def test_a_table_path_that_cannot_be_written_is_one_line_before_the_store_is_read(tmp_path, capsys, option, path):
    path = path.format(tmp=tmp_path)
    missing = tmp_path / "none.db"  # read first, this store would be the error (exit 2)
    assert report.main(["--uri", f"sqlite:///{missing}", option, path]) == 1
    why = "Is a directory" if path == str(tmp_path) else "No such file or directory"
    assert capsys.readouterr().err == (f"error: {option} {path}: cannot write there ({why}): pass a path in a folder "
                                       "that exists and that you can write in\n")
    assert not missing.exists() and sorted(tmp_path.iterdir()) == []  # nothing created, nothing left


def test_unknown_parent_run_id_is_a_config_error(tiny_cfg):
    with pytest.raises(ConfigError, match="tracking.parent_run_id=0123abcd"):
        run(tiny_cfg("tracking.parent_run_id=0123abcd"))


def test_system_metrics_are_sampled_at_the_configured_interval(tiny_cfg, tracking_uri, runs):
    with pytest.raises(ConfigError, match="tracking.system_metrics_interval_s"):
        run(tiny_cfg("tracking.system_metrics=true", "tracking.system_metrics_interval_s=0"))
    cfg = tiny_cfg("tracking.system_metrics=true", "tracking.system_metrics_interval_s=0.2", "engine.epochs=10")
    try:
        import psutil  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="needs psutil"):
            run(cfg)
        return
    run(cfg)
    (r,) = runs()
    assert "system/cpu_utilization_percentage" in r.data.metrics
    assert "system/system_memory_usage_megabytes" in r.data.metrics


@pytest.mark.slow  # test_interrupts.py stops a sweep by default
def test_interrupted_sweep_closes_its_parent_as_killed_with_the_comparison(tmp_path, tracking_uri):
    # The first job would train for hours (5 ms a step); it is interrupted as soon as it trains.
    proc = start(tmp_path, tracking_uri, "-m", "loader=baseline,pinned", "engine.device=cpu", "engine.epochs=100000",
                 "model.busy_ms=5", "dataset.num_samples=128", "dataset.shape=[8,8]", "engine.progress=false")
    try:
        wait_for_running(tracking_uri, proc)  # the first job has journaled steps: in its loop
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        stop_leftovers()
    assert proc.returncode == 130, err
    client, parent, children = parent_and_children(tracking_uri)
    assert parent.info.status == "KILLED"
    assert [r.info.status for r in children] == ["KILLED"]  # the second job never started
    rows = csv_rows(read_artifact(client, parent.info.run_id, "comparison.csv").decode())
    assert [(row["loader"], row["status"]) for row in rows] == [("baseline", "KILLED")]
    # What the job timed before the interrupt is shown, marked by its status; it is no one's baseline.
    m = children[0].data.metrics
    assert m["timed_steps"] > 0
    for key in ("throughput_samples_per_s", "ms_per_step", "data_wait_fraction"):
        assert float(rows[0][key]) == m[key], key
    assert rows[0]["speedup_vs_baseline"] == ""
    (line,) = [x for x in out.splitlines() if x.startswith("0 ")]
    assert line.split()[:4] == ["0", "baseline", "KILLED", f"{m['throughput_samples_per_s']:.1f}"]
    assert report.LEGEND["stopped"] in out.splitlines() and "best:" not in out  # a stopped job is never the best


def test_timeline_draws_a_long_run_as_means_over_runs_of_steps(tmp_path):
    from trainer.tracking import plots
    rows = [{"step": i, "samples": 64, "data_wait_ms": float(i % 2), "h2d_ms": 0.5, "compute_ms": 2.0,
             "step_ms": 4.0 + i % 2} for i in range(1, 2501)]
    edges, bars, size = plots._binned(rows)
    assert size == 3 and len(bars) == 834 and (edges[0], edges[-1]) == (0.5, 2500.5)
    assert bars[0]["data_wait_ms"] == (1 + 0 + 1) / 3 and bars[-1]["step_ms"] == 4.0  # the last bin: step 2500 alone
    assert plots.timeline(rows, tmp_path / "t.png", warmup_steps=5).read_bytes().startswith(PNG)
    edges, bars, size = plots._binned(rows[:6])
    assert size == 1 and edges == [0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5]
