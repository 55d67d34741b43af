"""Errors raised before our code runs (Hydra composing the config, making the run's folder) and
a Ctrl-C while Python imports: one line naming the key and the fix, a non-zero exit status, no
run left in the store. HYDRA_FULL_ERROR=1 still gives Hydra's full trace."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from clirun import TINY, all_runs, error_line, run_args, run_cli, start, stop_leftovers, wait_for_library
from disks import fill, small_tmpfs
from trainer.config import CONF_DIR, EngineConfig
from trainer.tracking.report import find_parent


LOADERS = "baseline, gpu_decode, gpu_resident, iterable_chunks, pinned, pinned_chunk, pinned_gather, pinned_uva, prefetch"


def only_line(proc: subprocess.CompletedProcess) -> str:
    """Exit status 1 and one `error:` line, nothing else on stderr."""
    error_line(proc, "")
    (line,) = proc.stderr.splitlines()
    return line


# -- composing the config ----------------------------------------------------------------------------
@pytest.mark.parametrize("override,expected", ids=["option typo", "wrong type", "unknown key", "list", "bool"], argvalues=[
    ("loader=prefech", f"error: loader=prefech: loader has no option prefech; did you mean prefetch? (options: {LOADERS})"),
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


@pytest.mark.slow  # a long case: its one-line error siblings run by default
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


# -- expanding a sweep --------------------------------------------------------------------------------
SWEEP_GRAMMAR = ("write one its basic sweeper takes (a,b,c, range(start,stop,step), choice(...), glob(...)): see "
                 "https://hydra.cc/docs/advanced/override_grammar/extended/")


@pytest.mark.parametrize("override,expected", ids=["numbers for a group", "a zero step", "an interval", "a bad range",
                                                   "an empty choice", "a glob matching nothing"], argvalues=[
    ("loader=range(1,3)", "error: loader=range(1,3): loader is a config group, swept by option name, and this sweep gives "
                          f"int values: name its options, e.g. loader=baseline,gpu_decode (options: {LOADERS})"),
    ("engine.max_steps=range(1,3,0)", "error: engine.max_steps=range(1,3,0): Hydra cannot expand this sweep (range() arg 3 "
                                      f"must not be zero): {SWEEP_GRAMMAR}"),
    ("engine.max_steps=interval(1,3)", "error: engine.max_steps=interval(1,3): Hydra cannot expand this sweep (BasicSweeper "
                                       f"does not support sweep type : INTERVAL_SWEEP): {SWEEP_GRAMMAR}"),
    ("engine.max_steps=range(a,3)", "error: engine.max_steps=range(a,3): not an override Hydra can read (TypeError while "
                                    "evaluating 'range(a,3)': mismatch type argument start: str is incompatible with "
                                    "Union[int, float]): see https://hydra.cc/docs/advanced/override_grammar/basic/"),
    ("loader=choice()", "error: loader=choice(): not an override Hydra can read (ValueError while evaluating 'choice()': "
                        "empty choice is not legal): see https://hydra.cc/docs/advanced/override_grammar/basic/"),
    ("loader=glob(zzz*)", "error: loader=glob(zzz*): the sweep has no job (a glob() that matches no option, an empty "
                          "range()?): give each swept key at least one value"),
])
def test_a_sweep_hydra_cannot_expand_is_one_line_and_records_nothing(tmp_path, tracking_uri, override, expected):
    proc = run_cli(tmp_path, tracking_uri, "-m", override, *TINY, "engine.max_steps=5")
    assert only_line(proc) == expected
    assert all_runs(tracking_uri) == []
    with pytest.raises(Exception, match="no sweep in this store"):
        find_parent(MlflowClient(tracking_uri))


# -- the command line's options ------------------------------------------------------------------------
@pytest.mark.parametrize("args", ids=["-q first", "-q after --cfg's value", "-q last", "overrides both sides",
                                      "--quiet between overrides"], argvalues=[
    ["-q", "--cfg", "job", "loader=pinned", "engine.max_steps=3"],
    ["--cfg", "job", "-q", "loader=pinned", "engine.max_steps=3"],
    ["--cfg", "job", "loader=pinned", "engine.max_steps=3", "-q"],
    ["loader=pinned", "-q", "--cfg", "job", "engine.max_steps=3"],
    ["loader=pinned", "--quiet", "engine.max_steps=3", "--cfg=job"],
])
def test_quiet_and_overrides_go_anywhere_beside_hydras_options(tmp_path, args):
    proc = run_args(tmp_path, *args)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    config = proc.stdout.splitlines()
    assert "  name: pinned" in config and "  max_steps: 3" in config and "  quiet: true" in config
    assert list(tmp_path.iterdir()) == []  # --cfg runs nothing


@pytest.mark.slow  # test_results.py runs a quiet run by default
def test_quiet_among_overrides_runs_without_the_summary(tmp_path, tracking_uri):
    proc = run_cli(tmp_path, tracking_uri, "engine.max_steps=2", "--quiet", *TINY)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    assert [r.info.status for r in all_runs(tracking_uri)] == ["FINISHED"]


def test_info_before_an_override_prints_all_the_info(tmp_path):
    proc = run_args(tmp_path, "-i", "loader=pinned", "-q")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert "loader: pinned" in proc.stdout  # the defaults list, with the override


@pytest.mark.parametrize("args,expected", ids=["a choice typo", "an unknown option", "an option typo", "a value missing",
                                               "two commands", "--resolve alone", "a missing config",
                                               "a missing config folder", "overrides for Hydra's help"], argvalues=[
    (["--cfg", "jobx"], "error: --cfg jobx: --cfg takes job, hydra, all; did you mean --cfg job?"),
    (["--bogus", "loader=pinned"], "error: --bogus: not an option of python -m trainer (python -m trainer --help lists "
                                   "them; overrides are written key=value)"),
    (["--cofg", "job", "-q"], "error: --cofg: not an option of python -m trainer; did you mean --cfg? (python -m trainer "
                              "--help lists them; overrides are written key=value)"),
    (["loader=pinned", "--cfg"], "error: --cfg: --cfg takes job, hydra, all: write --cfg=job"),
    (["-m", "--cfg", "job"], "error: --multirun and --cfg: Hydra does one of these at a time: keep one of them"),
    (["--resolve"], "error: --resolve: it resolves the config that --cfg or --help prints: add --cfg job, or drop --resolve"),
    (["--config-name=nope", "-q"], f"error: --config-name=nope: no config nope.yaml in {CONF_DIR} (configs: config): pass "
                                   "--config-name=<one of those> (or leave it out), or --config-dir=<the folder holding "
                                   "nope.yaml>"),
    (["--config-dir=/nonexistent/confs"], "error: --config-dir=/nonexistent/confs: no such folder: pass a folder of "
                                          "configs that exists, or drop --config-dir"),
    (["--hydra-help", "loader=pinned"], "error: --hydra-help loader=pinned: Hydra's help shows its own config, which has "
                                        "none of these keys: drop them, or use --help"),
])
def test_a_bad_option_is_one_line_naming_it_and_the_fix(tmp_path, args, expected):
    proc = run_args(tmp_path, *args)
    assert only_line(proc) == expected
    assert proc.stdout == "" and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flag,shows", [("--help", "python -m trainer --cfg job"), ("--hydra-help", "Hydra (1.")])
def test_hydras_help_still_works(tmp_path, flag, shows):
    proc = run_args(tmp_path, flag, "-q")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert shows in proc.stdout


def test_help_into_a_closed_pipe_ends_quietly(tmp_path):
    """`python -m trainer --help | head`: the reader has gone before the help is written."""
    proc = subprocess.Popen([sys.executable, "-m", "trainer", "--help"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # long before the imports end and the help is printed
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 1 and err == ""


# -- the run's folder --------------------------------------------------------------------------------
@pytest.mark.slow  # a long case: its one-line error siblings run by default
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


def test_a_read_only_run_folder_is_one_line(tmp_path, tracking_uri):
    """An existing folder the run cannot write in: Hydra's log file there is the first write."""
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(0o555)
    if os.access(folder, os.W_OK):  # root ignores permission bits: use a folder nobody can write in
        folder = Path("/sys")
    try:
        proc = subprocess.run([sys.executable, "-m", "trainer", *TINY, f"tracking.uri={tracking_uri}",
                               f"hydra.run.dir={folder}"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    finally:
        (tmp_path / "locked").chmod(0o755)
    assert only_line(proc) == (f"error: hydra.run.dir: cannot write the run's folder (Permission denied: "
                               f"{folder / '__main__.log'}): set hydra.run.dir=<a folder you can write in>")
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
