"""The run's journal: its measured steps on disk every few seconds, so a run killed outright keeps them.

A run that is SIGKILLed (the kernel's out-of-memory killer, a lost node, `kill -9`) runs no
`finally`: without a journal its steps, which reach MLflow only after the loop, are lost and the
run stays RUNNING for ever. So:

- while a run trains, a background thread (`Journal`) appends the host-side columns of the steps
  ended since its last visit to `journal.csv` in the run's folder, every `engine.journal_s`
  seconds. The loop's thread does nothing for it: the meter already writes each step's host
  times into arrays it allocated before the loop, and the thread reads the rows behind it.
- every run is tagged with its host, process id and the process's start time;
- at the start of any run or report on the same store, `recover_dead_runs` closes a RUNNING run
  whose process is gone from this host as KILLED: its journal becomes `steps.csv` and summary
  metrics, tagged `recovered=true`, said in one line. Runs of other hosts are left alone.
"""

from __future__ import annotations

import csv
import math
import os
import shutil
import socket
import sys
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from trainer.loop.meter import STEP_COLUMNS
from trainer.loop.summary import summarise

JOURNAL = "journal.csv"
# Per step, as the meter's host clock has them: when its wait began, when the step began and ended.
HOST_COLUMNS = ("step", "epoch", "samples", "wait_at", "start_at", "end_at")


def process_start(pid: int) -> Optional[str]:
    """The process's start time (clock ticks since boot, /proc/<pid>/stat field 22): with the pid,
    it names one process even after its pid is reused. None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def owner_tags() -> Dict[str, str]:
    """Tags that let a later process on this host tell whether the run's process is still alive."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": str(pid), "pid_start": process_start(pid) or ""}


def is_dead_here(tags: Dict[str, str]) -> bool:
    """A run of this host whose process is gone (or whose pid now belongs to another process)."""
    if tags.get("host") != socket.gethostname() or not tags.get("pid", "").isdigit():
        return False
    start = process_start(int(tags["pid"]))
    return start is None or (bool(tags.get("pid_start")) and start != tags["pid_start"])


def shown_status(run) -> str:
    """The run's status as a report shows it: a RUNNING run of another host may have died there,
    which this host cannot tell."""
    status, tags = run.info.status, run.data.tags
    if status == "RUNNING" and tags.get("host") not in (None, socket.gethostname()):
        return f"RUNNING (on {tags['host']}: running elsewhere?)"
    return status


class Journal:
    """Appends `rows(first)` (the host columns of steps `first+1 ..` ended so far) to `path` every
    `every_s` seconds, from a thread of its own; `close()` writes the rest and stops it."""

    def __init__(self, path: Path, rows: Callable[[int], List[Sequence[float]]], every_s: float = 2.0):
        self.path, self.rows, self.every_s = Path(path), rows, every_s
        self.written = 0
        self._stop = threading.Event()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("w") as f:
            f.write(",".join(HOST_COLUMNS) + "\n")
        self._thread = threading.Thread(target=self._run, name="feedbench-journal", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.flush()
            except OSError:  # a full or vanished disk: the journal stops; the run's own records say what failed
                return

    def flush(self) -> None:
        """Append the steps ended since the last flush (no-op when there are none)."""
        new = self.rows(self.written)
        if not new:
            return
        text = "".join(",".join(repr(float(v)) if isinstance(v, float) else str(v) for v in row) + "\n" for row in new)
        with self.path.open("a") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())  # a lost node keeps what reached the disk
        self.written += len(new)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self.flush()
        except OSError:
            pass  # the run's own records are written next; the journal was only a fallback


def read_journal(path: Path) -> List[Dict[str, float]]:
    """The journal's rows as dicts (a row cut off by the kill is skipped)."""
    rows = []
    with Path(path).open() as f:
        for row in csv.DictReader(f):
            try:
                rows.append({k: float(v) for k, v in row.items()})
            except (TypeError, ValueError):
                break  # the last line, half written when the process died
    return rows


def journal_summary(rows: List[Dict[str, float]], warmup_steps: int) -> Tuple[List[dict], Dict[str, float]]:
    """The journal as the meter's rows (GPU columns and losses nan: they were never read) and the
    summary of its timed steps (after the warm-up), their wall time from the first one's wait
    to the last one's end: `trainer.loop.summary.summarise`, as for a run that closed itself."""
    out = [{"step": int(r["step"]), "epoch": int(r["epoch"]), "samples": int(r["samples"]),
            "data_wait_ms": (r["start_at"] - r["wait_at"]) * 1e3, "h2d_ms": math.nan, "compute_ms": math.nan,
            "step_ms": (r["end_at"] - r["wait_at"]) * 1e3, "loss": math.nan, "host_clock_s": r["wait_at"],
            "_bytes": 0, "_busy": None} for r in rows]
    summary = {"total_steps": float(len(out)), "total_samples": float(sum(r["samples"] for r in out)),
               "timed_steps": 0.0}
    timed = [r for r in out if r["step"] > warmup_steps]
    if timed:
        wall_s = rows[-1]["end_at"] - timed[0]["host_clock_s"]
        figures = summarise(timed, wall_s, copy_spans=None)
        for key in ("host_page_faults_per_step", "host_cpu_ms_per_step"):  # not journaled
            figures.pop(key)
        summary.update(figures)
    return out, summary


def recover_dead_runs(client, experiment_ids: Optional[List[str]] = None, log=None) -> List[str]:
    """Close every RUNNING run of this host whose process is gone as KILLED, from its journal;
    returns their ids. Runs of other hosts, and live ones, are left alone."""
    from mlflow.entities import Metric, RunStatus

    log = log or (lambda line: print(line, file=sys.stderr))
    if experiment_ids is None:
        experiment_ids = [e.experiment_id for e in client.search_experiments()]
    if not experiment_ids:
        return []
    recovered = []
    for run in client.search_runs(experiment_ids, "attributes.status = 'RUNNING'", max_results=1000):
        tags = run.data.tags
        if "pid" not in tags or not is_dead_here(tags):
            continue  # another host's, a live one, or a run from before runs were tagged
        run_id = run.info.run_id
        path = Path(tags["journal"]) if tags.get("journal") else _in_artifacts(run.info.artifact_uri)
        journal = read_journal(path) if path.is_file() else []  # a sweep's parent has none
        # when it last wrote its journal: the closest known time to its death
        end_ms = int((path.stat().st_mtime if path.is_file() else time.time()) * 1000)
        if journal:
            rows, summary = journal_summary(journal, int(float(run.data.params.get("engine.warmup_steps", "0"))))
            metrics = [Metric(k, v, end_ms, 0) for k, v in summary.items() if math.isfinite(v)]
            metrics += [Metric(k, r[k], end_ms, r["step"]) for r in rows for k in ("data_wait_ms", "step_ms")]
            for i in range(0, len(metrics), 1000):  # log_batch takes at most 1000 metrics
                client.log_batch(run_id, metrics=metrics[i:i + 1000], synchronous=True)
            client.log_artifact(run_id, str(_steps_csv(path.parent / "steps.csv", rows)))
        _remove_scratch(tags.get("scratch", ""))
        client.set_tag(run_id, "recovered", "true")
        client.set_tag(run_id, "interrupted_by", "killed (process gone)")
        client.set_terminated(run_id, RunStatus.to_string(RunStatus.KILLED), end_time=end_ms)
        recovered.append(run_id)
        kept = len(journal) if "journal" in tags or path.is_file() else None
        log(f"feedbench: {_what_ended(tags, run_id, kept)} (tag recovered=true)")
    return recovered


def _in_artifacts(artifact_uri: str) -> Path:
    """Where a run keeps its journal when its artifact folder is local (`trainer.loop.run`): found
    there when the store refused the tag naming it (a full disk)."""
    parts = urllib.parse.urlsplit(artifact_uri)
    return Path(urllib.parse.unquote(parts.path)) / JOURNAL if parts.scheme in ("file", "") else Path("")


def _remove_scratch(folder: str) -> None:
    """A killed run's scratch folder (its traces): nothing else would remove it. Only a folder the
    run made (`feedbench-*`), whatever the tag says."""
    if folder and Path(folder).name.startswith("feedbench-"):
        shutil.rmtree(folder, ignore_errors=True)


def _what_ended(tags: Dict[str, str], run_id: str, steps: Optional[int]) -> str:
    """The recovered run in words true of it: a sweep's (or an advice's) parent run takes no steps
    of its own, its jobs are runs of their own; a run with no journal kept none."""
    ended = f"(pid {tags['pid']}) ended without closing: marked KILLED"
    if tags.get("sweep") == "true":
        return f"sweep run {run_id} {ended}; a sweep's parent run takes no steps of its own, its jobs are runs of their own"
    if tags.get("advise") == "true":
        return f"advice run {run_id} {ended}; it takes no steps of its own, its rungs are runs of their own"
    kept = f"with the {steps} steps of its journal" if steps is not None else \
        "with no steps (it kept no journal: it died before its loop, or engine.journal_s=0)"
    return f"run {run_id} {ended} {kept}"


def _steps_csv(out: Path, rows: List[dict]) -> Path:
    """Recovered rows as `steps.csv` (the meter's columns; the GPU's are empty: never read)."""
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(STEP_COLUMNS), extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return out
