"""Run `python -m trainer` as a user does, and read back what it left in MLflow."""

from __future__ import annotations

import csv
import io
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

import pytest
from mlflow.tracking import MlflowClient

from conftest import TINY  # noqa: F401  (re-exported for the tests)
from trainer.tracking.journal import read_journal

# Long enough to interrupt: 20 ms per step for thousands of steps.
LONG = ["model=noop", "model.busy_ms=20", "dataset.num_samples=100000", "dataset.shape=[4,4]", "loader.batch_size=8",
        "engine.epochs=1", "engine.warmup_steps=2", "engine.progress=false", "engine.device=cpu"]


def command(tmp_path: Path, uri: str, *overrides: str) -> List[str]:
    """The command line, with Hydra's output folders inside `tmp_path`."""
    multirun = "-m" in overrides
    return [sys.executable, "-m", "trainer", *overrides, f"tracking.uri={uri}",
            f"hydra.sweep.dir={tmp_path / 'multirun'}" if multirun else f"hydra.run.dir={tmp_path / 'hydra'}"]


def run_cli(tmp_path: Path, uri: str, *overrides: str, env: Optional[dict] = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(command(tmp_path, uri, *overrides), cwd=tmp_path, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, **(env or {})))


def run_args(cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m trainer` with exactly these arguments (no store, no run folder added), run in `cwd`."""
    return subprocess.run([sys.executable, "-m", "trainer", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


_started: List[subprocess.Popen] = []  # processes `start` began, stopped by `stop_leftovers`


def start(tmp_path: Path, uri: str, *overrides: str, run_dir: Optional[str] = None, **popen) -> subprocess.Popen:
    """`python -m trainer` in the background (its Hydra folder `run_dir` inside `tmp_path`, if given)."""
    args = command(tmp_path, uri, *overrides)
    if run_dir is not None:
        args = [a if not a.startswith("hydra.run.dir=") else f"hydra.run.dir={tmp_path / run_dir}" for a in args]
    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
    _started.append(proc)
    return proc


def stop_leftovers() -> None:
    """A test that fails half-way must not leave its `python -m trainer` running into the next one."""
    while _started:
        proc = _started.pop()
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)


def error_line(proc: subprocess.CompletedProcess, pattern: str) -> re.Match:
    """The process failed with exit status 1 and exactly one `error:` line matching `pattern`,
    and no traceback."""
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, proc.stderr
    found = re.search(pattern, lines[0])
    assert found, lines[0]
    return found


def all_runs(uri: str, experiment: str = "feedbench"):
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    return client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"]) if exp else []


def steps_csv(uri: str, run_id: str) -> List[dict]:
    local = Path(MlflowClient(uri).download_artifacts(run_id, "steps.csv"))
    return list(csv.DictReader(io.StringIO(local.read_text())))


def at_the_loop(run) -> bool:
    """The run is open and has built its loader: it tags `degraded` right before the model and the
    loop (nothing is logged inside the loop to poll for)."""
    return run.info.status == "RUNNING" and "degraded" in run.data.tags


def journaled_steps(run) -> int:
    """How many steps the run has measured, as far as its journal on disk shows (written every
    `engine.journal_s`): proof that its loop is taking steps, however slow the machine."""
    try:
        return len(read_journal(Path(run.data.tags["journal"])))
    except (KeyError, OSError):  # no journal yet, or gone with the closed run
        return 0


def has_steps(run, steps: int) -> bool:
    """The run is at its loop (`at_the_loop`) and its journal holds at least `steps` steps."""
    return at_the_loop(run) and (steps <= 0 or journaled_steps(run) >= steps)


def wait_for_running(uri: str, proc: subprocess.Popen, count: int = 1, timeout: float = 180, steps: int = 1,
                     settle: float = 0.0):
    """Block until `count` runs are RUNNING-or-done and the newest is RUNNING at its loop with at
    least `steps` steps in its journal (`has_steps`), then `settle` seconds more. A signal sent after
    this finds the run taking steps, not still setting up, on a machine however slow."""
    MlflowClient(uri).search_experiments()  # create the store's tables before the child opens it
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        runs = [r for r in all_runs(uri) if r.data.tags.get("sweep") != "true"]
        if len(runs) >= count and has_steps(runs[-1], steps):
            time.sleep(settle)
            return runs
        time.sleep(0.2)
    raise AssertionError(f"no RUNNING run with {steps} steps at its loop after {timeout} s")


def children_of(pid: int) -> List[int]:
    """Child processes of `pid` forked from it, as DataLoader workers are, or exited and not
    reaped (zombies) (Linux /proc)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    command = Path(f"/proc/{pid}/cmdline").read_bytes()
    return [c for c in found if _read(f"/proc/{c}/cmdline") == command or b") Z " in _read(f"/proc/{c}/stat")]


def wait_for_library(proc: subprocess.Popen, library: str, timeout: float = 120) -> None:
    """Block until the process has mapped a shared library whose path contains `library` (Linux
    /proc): it is importing the module that loads it, however slow the machine."""
    deadline = time.monotonic() + timeout
    while library.encode() not in _read(f"/proc/{proc.pid}/maps"):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{library} not loaded after {timeout} s"
        time.sleep(0.005)


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError:
        return b""


def turns_repeat(out: str) -> dict:
    """The one "repeat" line that `trainer.overhead` and `trainer.versus` print per turn-taking run:
    "repeat 1: X 1.234 ms/step, Y 1.111 ms/step, ratio 1.111 (turns of 20 ms: T counted, steps X S, Y S; ...)"."""
    (line,) = [line for line in out.splitlines() if line.strip().startswith("repeat")]
    words = line.replace(",", "").replace(";", "").split()
    return {"first": float(words[3]), "second": float(words[6]), "ratio": float(words[9]),
            "turns": int(words[14]), "steps": (int(words[18]), int(words[20]))}


def check_turns_run(out: str, table: Path, first_cell: str, max_steps: int):
    """What any turn-taking comparison must show: both sides timed, the ratio theirs, several turns
    counted, only the steps inside them (fewer than the run's timed steps); and its table row."""
    got = turns_repeat(out)
    first, second = got["first"], got["second"]
    assert first > 0 and second > 0 and got["ratio"] == pytest.approx(first / second, rel=0.05)  # printed to 0.001 ms
    assert got["turns"] >= 4 and all(0 < n < max_steps - 10 for n in got["steps"])  # 10 warm-up steps
    return got, markdown_row(table, first_cell)


def markdown_row(table: Path, first_cell: str) -> List[str]:
    """The cells of the one row of a markdown table file whose first cell begins with `first_cell`."""
    (row,) = [r for r in table.read_text().splitlines() if r.startswith(f"| {first_cell}")]
    return [c.strip() for c in row.strip("|").split("|")]
