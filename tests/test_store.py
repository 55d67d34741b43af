"""The store under stress: runs started at once into a store that does not exist yet, a store
left half-made, and a store or artifact disk that fills or disappears while a run runs. Real
processes and a real sqlite store; a full disk is a small tmpfs (skipped where mounting is not
allowed)."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from clirun import LONG, TINY, all_runs, run_cli, start, stop_leftovers, wait_for_running
from disks import fill, small_tmpfs
from trainer.errors import ConfigError
from trainer.tracking import report
from trainer.tracking.store import PER_STEP_METRICS, check_tracking_uri, default_uri, mlflow_schemas


@pytest.fixture(autouse=True)
def _no_leftover_processes():
    yield
    stop_leftovers()


# -- a new store, opened by several runs at once ---------------------------------------------------
# Each round starts eight processes (~7 s of CPU each): two rounds keep the test near a minute on
# two cores; SOAK_ROUNDS=3 runs the three rounds of the acceptance.
ROUNDS, AT_ONCE = int(os.environ.get("SOAK_ROUNDS", "2")), 8


@pytest.mark.slow
@pytest.mark.fresh_store
def test_runs_started_at_once_into_a_new_store_all_finish(tmp_path):
    """Eight `python -m trainer` started together into a store that does not exist yet (two
    terminals on a fresh checkout, a submitit_local sweep), round after round: every run
    FINISHED with all its metrics, and the store is healthy (MLflow's latest schema, no
    half-done migration)."""
    steps = 6  # TINY: 96 samples in batches of 16
    for round_ in range(ROUNDS):
        db = tmp_path / f"round{round_}" / "mlflow.db"
        db.parent.mkdir()
        uri = f"sqlite:///{db}"
        # engine.quiet: no end-of-run summary, so any line on stderr is a warning or an MLflow log line
        procs = [start(db.parent, uri, *TINY, "engine.quiet=true", run_dir=f"hydra{i}") for i in range(AT_ONCE)]
        outcomes = [(p.wait(timeout=600), p.communicate()[1]) for p in procs]
        assert all(code == 0 for code, _ in outcomes), [err for code, err in outcomes if code]
        assert all(err == "" for _, err in outcomes), outcomes  # no warning, no MLflow log line
        runs = all_runs(uri)
        assert len(runs) == AT_ONCE and {r.info.status for r in runs} == {"FINISHED"}
        for r in runs:
            assert r.data.metrics["total_steps"] == steps and r.data.metrics["throughput_samples_per_s"] > 0
            history = MlflowClient(uri).get_metric_history(r.info.run_id, "step_ms")
            assert [m.step for m in history] == list(range(1, steps + 1))
        with contextlib.closing(sqlite3.connect(db)) as con:
            tables = {name for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            (revision,) = con.execute("SELECT version_num FROM alembic_version").fetchone()
            assert con.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        assert revision == mlflow_schemas()[0] and not [t for t in tables if t.startswith("_alembic_tmp_")]
        check_tracking_uri(uri)  # and the next run takes it as it is


def half_made(db: Path, empty_store: Path, leftovers: bool) -> None:
    """What an older feedbench left when MLflow stopped making a store in place: an older schema
    stamp, and a leftover `_alembic_tmp_*` table (runs racing through the migrations) or no
    experiment yet (a Ctrl-C or a full disk between two migrations). `mlflow db upgrade` fails on it."""
    db.write_bytes(empty_store.read_bytes())
    head, known = mlflow_schemas()
    with contextlib.closing(sqlite3.connect(db)) as con, con:
        con.execute("UPDATE alembic_version SET version_num = ?", (sorted(known - {head})[0],))
        if leftovers:
            con.execute("CREATE TABLE _alembic_tmp_runs (run_uuid VARCHAR(32))")
        else:
            con.execute("DELETE FROM experiments")
    os.utime(db, (time.time() - 3600,) * 2)  # left an hour ago: not a store another program is making now


@pytest.mark.parametrize("leftovers", [True, False], ids=["racing runs", "stopped while made"])
def test_a_half_made_store_is_said_and_made_anew(tmp_path, empty_store, capsys, leftovers):
    db = tmp_path / "mlflow.db"
    half_made(db, empty_store, leftovers)
    uri = f"sqlite:///{db}"
    check_tracking_uri(uri)
    assert re.fullmatch(rf"feedbench: {db} was left half-made by MLflow's table migrations \(schema \w+"
                        rf"{', leftover tables _alembic_tmp_runs' if leftovers else ''}\) and held no runs: made it anew\n",
                        capsys.readouterr().err)
    check_tracking_uri(uri)  # sound now: nothing said
    assert capsys.readouterr().err == ""
    assert healthy(db) and [e.name for e in MlflowClient(uri).search_experiments()] == ["Default"]


def test_a_half_made_store_changed_a_moment_ago_is_left_alone(tmp_path, empty_store):
    """Another program making MLflow's tables in place (`mlflow ui`) may pause between two migrations:
    such a store is not taken for one given up, nor replaced under it."""
    db = tmp_path / "mlflow.db"
    half_made(db, empty_store, leftovers=False)
    os.utime(db)  # changed now
    before = db.read_bytes()
    uri = f"sqlite:///{db}"
    with pytest.raises(ConfigError, match=rf"^tracking\.uri={uri}: {db} is half-made \(schema \w+\) and changed \d+ s "
                                          r"ago: another program may be making it now: rerun in a minute"):
        check_tracking_uri(uri)
    assert db.read_bytes() == before


def test_report_on_a_half_made_store_is_one_line(tmp_path, empty_store):
    db = tmp_path / "mlflow.db"
    half_made(db, empty_store, leftovers=False)
    proc = subprocess.run([sys.executable, "-m", "trainer.report", "--uri", f"sqlite:///{db}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and re.fullmatch(
        rf"error: --uri=sqlite:///{db}: {db} was left half-made by MLflow's table migrations \(schema \w+\) and holds "
        rf"no runs: nothing to read \(the next python -m trainer with tracking\.uri=sqlite:///{db} makes it anew\)\n",
        proc.stderr), proc.stderr


def healthy(db: Path) -> bool:
    """The store is complete: MLflow's latest schema, no half-done migration, sound pages."""
    with contextlib.closing(sqlite3.connect(db)) as con:
        tables = {name for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        (revision,) = con.execute("SELECT version_num FROM alembic_version").fetchone()
        sound = con.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    return sound and revision == mlflow_schemas()[0] and not [t for t in tables if t.startswith("_alembic_tmp_")]


def store_files(folder: Path) -> list:
    """The files in the store's folder but its lock: the store and anything left while it was made."""
    return sorted(p.name for p in folder.iterdir() if not p.name.endswith(".lock"))


@pytest.mark.fresh_store
@pytest.mark.parametrize("delay_s,again", [pytest.param(0.0, False, marks=pytest.mark.slow), (0.4, False), (0.1, True)],
                         ids=["as it begins", "half-way", "twice"])  # (the first with `-m slow`)
def test_a_new_store_interrupted_while_it_is_made_is_complete_or_absent(tmp_path, delay_s, again):
    """Ctrl-C at moments of the first run's making of its store (MLflow's migrations take
    seconds): the run stops (exit 130, one line), and the store is either complete or not there
    at all, never half-made; the next run takes it. A second Ctrl-C stops at once."""
    folder = tmp_path / "store"
    folder.mkdir()
    db = folder / "mlflow.db"
    uri = f"sqlite:///{db}"
    proc = start(tmp_path, uri, *TINY)
    deadline = time.monotonic() + 120
    while not store_files(folder):  # the store's file appears: MLflow is making its tables
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.005)
    time.sleep(delay_s)
    proc.send_signal(signal.SIGINT)
    if again:
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    # (a run that made its store before the signal came is stopped as at any other moment: KILLED)
    assert err.splitlines()[-1].startswith("interrupted by SIGINT") and "Traceback" not in err, err
    assert store_files(folder) in ([], ["mlflow.db"]), store_files(folder)  # nothing half-made left beside it
    if db.exists():
        assert healthy(db)
    check_tracking_uri(uri)  # what the next run does first: takes the store as it is, or makes it
    assert healthy(db) and MlflowClient(uri).search_experiments()


def test_a_new_store_whose_disk_fills_while_it_is_made_is_absent_and_said(tmp_path):
    """MLflow's migrations run out of space half-way (its finished store takes ~1 MB): one line,
    no half-made store left in the folder, and once there is room the next run makes it whole."""
    with small_tmpfs(tmp_path / "store", "400k") as disk:
        db = disk / "mlflow.db"
        uri = f"sqlite:///{db}"
        with pytest.raises(ConfigError) as refused:
            check_tracking_uri(uri)
        assert str(refused.value) == (f"tracking.uri={uri}: MLflow refused to record the run there (OperationalError: "
                                      "database or disk is full): correct what it names, or set tracking.uri=null to "
                                      f"record in {default_uri()}")
        assert store_files(disk) == []  # nothing half-made: the next run does not find a broken store
        subprocess.run(["mount", "-o", "remount,size=4m", str(disk)], check=True)  # room again
        check_tracking_uri(uri)
        assert healthy(db) and store_files(disk) == ["mlflow.db"]


# -- the store or its disk fails mid-run -------------------------------------------------------------
def one_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def csv_steps(path: Path) -> list:
    with path.open() as f:
        return [int(row["step"]) for row in csv.DictReader(f)]


def test_a_database_deleted_mid_run_keeps_the_exit_status_and_what_was_measured(tmp_path, tracking_uri):
    db = Path(tracking_uri[len("sqlite:///"):])
    proc = start(tmp_path, tracking_uri, *LONG)
    (run,) = wait_for_running(tracking_uri, proc, steps=10)  # the 10 steps asserted below, taken before the store goes
    artifacts = Path(run.info.artifact_uri[len("file://"):])
    db.unlink()
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130
    summary = tmp_path / "hydra" / "summary.json"
    assert re.fullmatch(re.escape(f"interrupted by SIGINT: run {run.info.run_id}: the store at {tracking_uri} refused its "
                                  f"summary metrics, per-step metrics, tags and status (") + r"OperationalError: [^()]+"
                        + re.escape(f"); summary metrics in {summary}; steps.csv in {artifacts}"), one_line(err))
    measured = json.loads(summary.read_text())
    steps = csv_steps(artifacts / "steps.csv")
    assert len(steps) >= 10 and steps == list(range(1, len(steps) + 1))
    assert measured["total_steps"] == len(steps) and measured["throughput_samples_per_s"] > 0
    assert (artifacts / "timeline.png").stat().st_size > 0


@pytest.mark.slow  # a store refusing a run's records runs by default below (the database deleted, the artifact disk full)
def test_a_store_whose_disk_fills_mid_run_fails_the_run_and_says_where_its_figures_are(tmp_path, empty_store):
    """The run took all its steps, but the store cannot take them: not a run recorded FINISHED
    without its figures, and not exit 0. The line says why and where each part went; the report
    on the still-full store is one line too, not SQLAlchemy's trace."""
    with small_tmpfs(tmp_path / "store", "4m") as disk:
        db = disk / "mlflow.db"
        db.write_bytes(empty_store.read_bytes())
        uri = f"sqlite:///{db}"
        steps = 400
        proc = start(tmp_path, uri, *LONG, f"engine.max_steps={steps}")
        (run,) = wait_for_running(uri, proc)  # journaled: its journal file is made before the disk fills
        fill(disk)
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 1
        line = one_line(err)
        assert line.startswith(f"error: the run finished, but the store did not take all it measured (run "
                               f"{run.info.run_id}: the store at {uri} refused its "), line
        assert "database or disk is full" in line or "No space left on device" in line, line
        folder = tmp_path / "hydra"
        assert f"steps.csv in {folder / 'steps.csv'}" in line and "lost" not in line
        assert csv_steps(folder / "steps.csv") == list(range(1, steps + 1))
        if "summary metrics in" in line:  # else the store took them, before the disk was full
            assert json.loads((folder / "summary.json").read_text())["total_steps"] == steps
        else:
            assert MlflowClient(uri).get_run(run.info.run_id).data.metrics["total_steps"] == steps
        recorded = MlflowClient(uri).get_run(run.info.run_id).info.status
        assert recorded == "FAILED" if "status" not in line else recorded == "RUNNING"  # not FINISHED: it holds no figures
        report_ = subprocess.run([sys.executable, "-m", "trainer.report", "--uri", uri], cwd=tmp_path,
                                 capture_output=True, text=True, timeout=120)
        assert "Traceback" not in report_.stderr and len(report_.stderr.splitlines()) <= 1, report_.stderr
        if recorded == "RUNNING":  # its process is gone: closing it is a write the full store refuses, said in one line
            assert report_.returncode == 0 and re.fullmatch(
                rf"warning: the store at {re.escape(uri)} refused to close the runs whose process is gone \((Operational"
                r"Error: database or disk is full|OSError: No space left on device)\): free space on its disk; the next "
                r"report or run closes them\n", report_.stderr), report_.stderr
            assert report_.stdout.startswith(f"run {run.info.run_id} (RUNNING)")


@pytest.mark.slow  # a long case: the store's other faults mid-run run by default
def test_an_artifact_disk_that_fills_mid_run_keeps_the_steps_in_the_run_folder(tmp_path, tracking_uri):
    with small_tmpfs(tmp_path / "mlartifacts", "1m") as disk:  # where the store puts artifacts (beside the DB)
        proc = start(tmp_path, tracking_uri, *LONG)
        (run,) = wait_for_running(tracking_uri, proc, steps=10)  # the 10 steps asserted below
        fill(disk)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143
    folder = tmp_path / "hydra"
    artifacts = Path(run.info.artifact_uri[len("file://"):])  # on the full disk: named, not the store's database
    assert one_line(err) == (f"interrupted by SIGTERM: run {run.info.run_id}: the artifact folder {artifacts} refused "
                             f"its steps.csv and timeline.png (OSError: No space left on device); steps.csv in "
                             f"{folder / 'steps.csv'}")
    steps = csv_steps(folder / "steps.csv")
    recorded = MlflowClient(tracking_uri).get_run(run.info.run_id)
    assert recorded.info.status == "KILLED" and recorded.data.tags["interrupted_by"] == "SIGTERM"
    assert recorded.data.metrics["total_steps"] == len(steps) >= 10 and steps == list(range(1, len(steps) + 1))
    history = MlflowClient(tracking_uri).get_metric_history(run.info.run_id, "step_ms")
    assert [m.step for m in history] == steps  # the per-step series reached the database


def test_an_artifact_disk_full_before_the_run_names_the_artifact_folder(tmp_path, tracking_uri):
    with small_tmpfs(tmp_path / "mlartifacts", "1m") as disk:  # where the store puts artifacts (beside the DB)
        fill(disk)
        proc = run_cli(tmp_path, tracking_uri, *TINY)
    (run,) = all_runs(tracking_uri)
    artifacts = Path(run.info.artifact_uri[len("file://"):])
    assert proc.returncode == 1 and one_line(proc.stderr) == (
        f"error: tracking.uri={tracking_uri}: its artifact folder {artifacts} cannot be written (No space left on "
        "device): free space on that disk (or make the folder writable), or set tracking.uri=sqlite:///<a folder on "
        f"another disk>/mlflow.db (a new store keeps its artifacts beside it) (run {run.info.run_id} marked FAILED)")
    assert run.info.status == "FAILED" and str(artifacts) in run.data.tags["error"]


# -- reading the store back ------------------------------------------------------------------------
@pytest.mark.parametrize("make,uri,message", ids=["not a database", "a bare path", "a bare path to a folder"], argvalues=[
    (lambda d: (d / "notes.txt").write_text("notes\n"), "sqlite:///{d}/notes.txt",
     "error: --uri=sqlite:///{d}/notes.txt: {d}/notes.txt is not an SQLite database: pass --uri "
     "sqlite:///<the MLflow database your runs are in>"),
    (lambda d: None, "{store}", "error: --uri {store} is a path, not a URI: pass --uri sqlite:///{store}"),
    (lambda d: None, "{d}", "error: --uri={d} is MLflow's file store, which MLflow 3 refuses unless "
                            "MLFLOW_ALLOW_FILE_STORE=true is set: set --uri=sqlite:///{d}/mlflow.db (or export "
                            "MLFLOW_ALLOW_FILE_STORE=true)"),
])
def test_report_checks_its_uri_as_the_trainer_checks_a_store(tmp_path, tracking_uri, make, uri, message):
    make(tmp_path)
    store = tracking_uri[len("sqlite:///"):]
    uri = uri.format(d=tmp_path, store=store)
    proc = subprocess.run([sys.executable, "-m", "trainer.report", "--uri", uri], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [message.format(d=tmp_path, store=store)]


def test_report_shows_a_single_run_as_a_run(tiny_cfg, tracking_uri, capsys, tmp_path):
    from trainer.loop.run import run
    summary = run(tiny_cfg("loader=pinned"))
    (only,) = all_runs(tracking_uri)
    assert report.main(["--uri", tracking_uri, "--run", only.info.run_id, "--csv", str(tmp_path / "run.csv")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"run {only.info.run_id} (FINISHED): loader=pinned ")  # the end-of-run summary first
    full = out.index(f"run {only.info.run_name!r}, all it recorded:")  # then every figure and param
    assert out[full - 1] == "" and f"python -m trainer.report --run {only.info.run_id}" in "\n".join(out[:full])
    assert re.fullmatch(r"  status +FINISHED", out[full + 1]) and out[full + 2] == "summary metrics:"
    shown = dict(line.split() for line in out if line.startswith("  ") and len(line.split()) == 2)
    assert float(shown["total_steps"]) == summary["total_steps"] == 6
    assert shown["loader.name"] == "pinned" and shown["loader.batch_size"] == "16"
    assert not set(PER_STEP_METRICS) & set(shown)  # a per-step series' last value is not the run's figure
    rows = list(csv.DictReader((tmp_path / "run.csv").open()))
    metric = {row["key"]: row["value"] for row in rows if row["section"] == "metric"}
    assert float(metric["throughput_samples_per_s"]) == summary["throughput_samples_per_s"]  # full precision
