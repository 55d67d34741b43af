"""Errors raised before our code runs (Hydra composing the config, making the run's folder) and
a Ctrl-C while Python imports: one line naming the key and the fix, a non-zero exit status, no
run left in the store. HYDRA_FULL_ERROR=1 still gives Hydra's full trace."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from clirun import TINY, all_runs, error_line, run_cli, start, stop_leftovers, wait_for_library
from disks import fill, small_tmpfs
from trainer.config import EngineConfig
from trainer.tracking.report import find_parent


def only_line(proc: subprocess.CompletedProcess) -> str:
    """Exit status 1 and one `error:` line, nothing else on stderr."""
    error_line(proc, "")
    (line,) = proc.stderr.splitlines()
    return line


# -- composing the config ----------------------------------------------------------------------------
@pytest.mark.parametrize("override,expected", ids=["option typo", "wrong type", "unknown key", "list", "bool"], argvalues=[
    ("loader=prefech", "error: loader=prefech: loader has no option prefech; did you mean prefetch? (options: baseline, "
                       "gpu_resident, iterable_chunks, pinned, pinned_chunk, pinned_gather, pinned_uva, prefetch)"),
    ("loader.batch_size=abc", "error: loader.batch_size=abc: Value 'abc' of type 'str' could not be converted to Integer: "
                              "set loader.batch_size to an integer, e.g. loader.batch_size=16"),
    ("engine.wramup_steps=1", "error: engine.wramup_steps: engine has no key wramup_steps; did you mean warmup_steps? "
                              f"(keys: {', '.join(f.name for f in dataclasses.fields(EngineConfig))})"),
    ("dataset.shape=abc", "error: dataset.shape=abc: Invalid value assigned: str is not a ListConfig, list or tuple: "
                          "set dataset.shape to a list, e.g. dataset.shape=[8,8]"),
    ("engine.progress=maybe", "error: engine.progress=maybe: Value 'maybe' is not a valid bool (type str): set "
                              "engine.progress to true or false, e.g. engine.progress=false"),
])
def test_a_bad_override_is_one_line_naming_the_key_and_the_fix(tmp_path, tracking_uri, override, expected):
    proc = run_cli(tmp_path, tracking_uri, *TINY, override)
    assert only_line(proc) == expected
    assert all_runs(tracking_uri) == []


def test_a_non_ascii_value_says_how_to_quote_it_and_quoted_it_runs(tmp_path, tracking_uri):
    proc = run_cli(tmp_path, tracking_uri, *TINY, "engine.max_steps=2", "tracking.experiment=mesure-é")
    assert only_line(proc) == ("error: tracking.experiment=mesure-é: Hydra reads characters outside ASCII only inside "
                               "quotes: write tracking.experiment='mesure-é' (in the shell: \"tracking.experiment='mesure-é'\")")
    proc = run_cli(tmp_path, tracking_uri, *TINY, "engine.max_steps=2", "tracking.experiment='mesure-é'")
    assert proc.returncode == 0, proc.stderr
    assert [r.info.status for r in all_runs(tracking_uri, "mesure-é")] == ["FINISHED"]


def test_hydra_full_error_still_gives_the_full_trace(tmp_path, tracking_uri):
    proc = run_cli(tmp_path, tracking_uri, *TINY, "loader=prefech", env={"HYDRA_FULL_ERROR": "1"})
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr and "MissingConfigException" in proc.stderr
    assert "error: loader=prefech" not in proc.stderr


def test_a_sweep_with_an_invalid_option_is_one_line_and_leaves_no_sweep_behind(tmp_path, tracking_uri):
    proc = run_cli(tmp_path, tracking_uri, "-m", *TINY, "loader=baseline,prefech")
    assert only_line(proc).startswith("error: loader=prefech: loader has no option prefech; did you mean prefetch?")
    assert all_runs(tracking_uri) == []  # the parent run made before Hydra checked the jobs is in MLflow's trash
    with pytest.raises(Exception, match="no sweep in this store"):
        find_parent(MlflowClient(tracking_uri))


# -- the run's folder --------------------------------------------------------------------------------
def test_a_file_where_the_run_folder_goes_is_one_line(tmp_path, tracking_uri):
    in_the_way = tmp_path / "taken"
    in_the_way.write_text("not a folder\n")
    for key, args in (("hydra.run.dir", [*TINY, f"hydra.run.dir={in_the_way}"]),
                      ("hydra.sweep.dir", ["-m", *TINY, "loader=baseline,pinned", f"hydra.sweep.dir={in_the_way / 'sub'}"])):
        proc = subprocess.run([sys.executable, "-m", "trainer", *args, f"tracking.uri={tracking_uri}"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
        assert only_line(proc).startswith(f"error: {key}: cannot write the run's folder (a file is in the way: "
                                          f"{in_the_way}"), proc.stderr
        assert only_line(proc).endswith(f"move that file away or set {key}=<another folder>")
    assert all_runs(tracking_uri) == []


@pytest.fixture
def full_disk(tmp_path):
    with small_tmpfs(tmp_path / "full") as mount:
        fill(mount)
        yield mount


def test_a_full_disk_where_the_run_folder_goes_is_one_line(tmp_path, tracking_uri, full_disk):
    proc = subprocess.run([sys.executable, "-m", "trainer", *TINY, f"tracking.uri={tracking_uri}",
                           f"hydra.run.dir={full_disk / 'run'}"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert only_line(proc).startswith("error: hydra.run.dir: cannot write the run's folder (its disk is full")
    assert only_line(proc).endswith("free space there or set hydra.run.dir=<a folder on another disk>")
    assert all_runs(tracking_uri) == []


# -- Ctrl-C while Python starts ---------------------------------------------------------------------
# Sent once the process's memory map shows torch's own library, or numpy's (torch imports it later
# on; an interrupt raised inside its initialisation became an ImportError traceback): both well
# inside the seconds of imports, where a fixed delay could land in Python's own start-up instead.
@pytest.mark.parametrize("library", ["libtorch_cpu", "_multiarray_umath"])
def test_ctrl_c_while_importing_is_one_line_and_exit_130(tmp_path, tracking_uri, library):
    proc = start(tmp_path, tracking_uri, *TINY)
    try:
        wait_for_library(proc, library)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        stop_leftovers()
    assert proc.returncode == 128 + signal.SIGINT
    assert err.splitlines() == ["interrupted by SIGINT while starting: nothing was run"]
    assert not Path(tracking_uri[len("sqlite:///"):]).with_name("hydra").exists()
