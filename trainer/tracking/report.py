"""`python -m trainer.report`: the latest run or sweep, read back from MLflow: a run's summary, or a
comparison of a sweep's jobs.

The comparison table built here is the one the sweep callback stores on the parent run as
`comparison.csv`; both read the child runs' logged metrics, so the numbers are the runs' own.
Each job's speedup is against the `baseline` job with the same other settings. Jobs whose timed
regions ran at the same time on a device they share (a launcher that starts them all at once,
as submitit_local does) are marked in the `overlap` column: their timings disturb each other.

What the figures can be trusted for is said beside them: `ms_per_step_ci95` is the half-width
of each job's 95% interval of ms per step (`trainer.loop.summary.step_interval`); a speedup
whose interval includes 1 is marked `~` (not shown by these runs); the GPU's columns are blank
for a job that ran on the CPU; a degraded job (a CUDA strategy that ran its CPU path) is marked.
A job that stopped (KILLED, FAILED) shows what it timed before it stopped, marked by its status: it
gets no speedup, is no job's baseline and is never the best; nor is a degraded job the best.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from mlflow.entities import Run
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from trainer.config import OBJECTIVES
from trainer.errors import ConfigError, one_line_argument_errors
from trainer.tracking.journal import recover_dead_runs, shown_status
from trainer.tracking.run_summary import describe
from trainer.tracking.store import PER_STEP_METRICS, check_store_to_read, default_uri, reason
from trainer.tracking.store import shown as masked

METRICS = ("throughput_samples_per_s", "speedup_vs_baseline", "ms_per_step", "ms_per_step_ci95",
           "compute_stream_span_fraction", "data_wait_fraction", "h2d_GBps", "host_page_faults_per_step",
           "host_cpu_ms_per_step")
# Shown only when some job has them: written by `--plain` (a plain loop over the same loader, timed
# then), and by earlier versions of it, which logged the ratio too.
PLAIN = ("plain_ms_per_step", "engine_vs_plain")
# Shown after `h2d_GBps` when some job has it (CUDA runs that copy): the same transfer timed alone
# from a reused pinned buffer after the loop, the ceiling to read `h2d_GBps` against.
PEAK = "h2d_peak_pinned_GBps"
# Shown only when some job has them: image folders (`dataset=image_folder`; the first and the last,
# decoded on the GPU by `loader=gpu_decode`).
IMAGES = ("decode_ms_per_batch", "host_decode_ms_per_image", "link_bytes_per_image", "gpu_decoded_fraction")
FORMATS = {"decode_ms_per_batch": "{:.2f}", "host_decode_ms_per_image": "{:.2f}", "link_bytes_per_image": "{:.0f}",
           "gpu_decoded_fraction": "{:.2f}",
           "throughput_samples_per_s": "{:.1f}", "speedup_vs_baseline": "{:.2f}", "ms_per_step": "{:.3f}",
           "ms_per_step_ci95": "±{:.3f}",
           "compute_stream_span_fraction": "{:.3f}", "data_wait_fraction": "{:.3f}", "h2d_GBps": "{:.2f}",
           "host_page_faults_per_step": "{:.0f}", "host_cpu_ms_per_step": "{:.2f}",
           "plain_ms_per_step": "{:.3f}", "engine_vs_plain": "{:.2f}", PEAK: "{:.2f}"}
BASELINE = "baseline"
STRATEGY = "loader.name"
GPU_ONLY = ("compute_stream_span_fraction", "h2d_GBps", PEAK)  # nothing to measure on the CPU: blank there
WITHIN_NOISE = "~"  # after a speedup whose 95% interval includes 1
LEGEND = {"noise": f"{WITHIN_NOISE}  speedup within noise: its 95% interval includes 1, so these runs do not show it",
          "cpu": "blank compute_stream_span_fraction, h2d_GBps: the job ran on the CPU, where they mean nothing",
          "all_cpu": "no compute_stream_span_fraction, h2d_GBps columns: every job ran on the CPU, where they mean nothing",
          "degraded": "degraded: no CUDA, the job ran the CPU path in place of its strategy's: not a measurement of it",
          "stopped": "KILLED, FAILED: the figures of the steps the job timed before it stopped: no speedup, never best",
          "plain": "plain_ms_per_step: a plain loop timed by report --plain after the job, not beside it: against "
                   "ms_per_step it compares two moments of a host whose speed drifts (python -m trainer.overhead "
                   "times what the engine costs, in turns)"}
FINISHED = "FINISHED"


# ----------------------------------------------------------------------------- reading MLflow
def open_store(uri: Optional[str]) -> Tuple[MlflowClient, str]:
    """A client on `uri` (default: the project's sqlite DB), checked as the trainer checks a store;
    a missing sqlite file is an error, not silently created empty."""
    uri = uri or default_uri()
    check_store_to_read(uri)
    return MlflowClient(uri), uri


def find_parent(client: MlflowClient, experiment: Optional[str] = None, run_id: Optional[str] = None,
                sweeps_only: bool = True, option: str = "--run") -> Run:
    """The run to show: `run_id` (a sweep's job leads to its sweep's parent run), else the newest
    sweep in `experiment` (default: in any experiment); with `sweeps_only=False`, the latest run
    or sweep, whichever came last (a sweep's newest job leads to its sweep). `option`: the flag
    that gave `run_id`, as its error names it."""
    if run_id:
        try:
            run = client.get_run(run_id)
        except MlflowException:
            raise ConfigError(f"{option} {run_id}: no such run in this store") from None
        parent = run.data.tags.get("mlflow.parentRunId")
        return client.get_run(parent) if parent else run
    if experiment:
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            raise ConfigError(f"no experiment {experiment!r} in this store: pass --experiment NAME")
        ids = [exp.experiment_id]
    else:
        ids = [e.experiment_id for e in client.search_experiments()]
    found = client.search_runs(ids, filter_string="tags.sweep = 'true'" if sweeps_only else "",
                               order_by=["attributes.start_time DESC"], max_results=1) if ids else []
    if not found:
        where = f"experiment {experiment!r}" if experiment else "this store"
        if sweeps_only:
            raise ConfigError(f"no sweep in {where}: run one with `python -m trainer -m loader=baseline,pinned` "
                              "or pass --sweep RUN_ID")
        raise ConfigError(f"no run or sweep in {where}: run one with `python -m trainer` (a sweep: "
                          "`python -m trainer -m loader=baseline,pinned`) or pass --run RUN_ID")
    parent = found[0].data.tags.get("mlflow.parentRunId")
    return client.get_run(parent) if parent else found[0]


def children(client: MlflowClient, parent: Run) -> List[Run]:
    """The parent's child runs in job order (Hydra's job number, then start time)."""
    runs = client.search_runs([parent.info.experiment_id],
                              filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'",
                              max_results=10000)

    def order(r: Run):
        job = r.data.tags.get("sweep.job", "")
        return (0, int(job), r.info.start_time) if job.isdigit() else (1, 0, r.info.start_time)
    return sorted(runs, key=order)


# ----------------------------------------------------------------------------- the table
def setting_keys(runs: Sequence[Run], swept: Sequence[str] = ()) -> Tuple[List[str], List[str]]:
    """(shown, compared): the params that tell the jobs apart, and those that make 'the same
    other settings' (every differing param but the strategy).

    A param counts when it is set in every run and not equal in all of them: a strategy-only
    option (`loader.depth`) is absent from other strategies' runs, so it never splits them.
    Shown are the sweep's own keys, in their order, when the parent run names them.
    """
    params = [r.data.params for r in runs]
    if not params:
        return [], []
    common = set.intersection(*(set(p) for p in params))
    varying = sorted(k for k in common if not k.startswith("tracking.") and len({p[k] for p in params}) > 1)
    shown = [k for k in (s if s in common else f"{s}.name" for s in swept) if k in common]
    return shown or varying, [k for k in varying if k != STRATEGY]


def column(key: str) -> str:
    """`loader.name` -> `loader`: a config group's choice reads as the group."""
    group, _, leaf = key.partition(".")
    return group if leaf == "name" else key


def comparison_rows(parent: Run, runs: Sequence[Run],
                    others: Sequence[Run] = ()) -> Tuple[List[str], List[Dict[str, object]]]:
    """One row per job: its distinguishing settings, status and metrics, and its speedup over
    the `baseline` job with the same other settings (None when there is no finished one).

    A job that stopped (KILLED, FAILED) shows what it timed before it stopped, its status saying
    so; a speedup is only of a finished job over a finished baseline: a partial run compares with
    nothing. `others`: the store's runs outside this sweep, whose timed regions may have
    overlapped the jobs' (another sweep into the same store at the same time).
    """
    keys, others_keys = setting_keys(runs, [k for k in parent.data.tags.get("sweep.keys", "").split(",") if k])
    overlaps = overlapping(runs, others)
    full = {f"run {o.info.run_id[:8]}": o.info.run_id for o in others}  # an other run's label -> its id
    rows: List[Dict[str, object]] = []
    for i, r in enumerate(runs):
        tags = r.data.tags
        row: Dict[str, object] = {"job": tags.get("sweep.job", str(i)), "run_name": r.info.run_name}
        row.update({column(k): r.data.params.get(k, "") for k in keys})
        row["status"] = shown_status(r)
        row["degraded"] = "yes" if tags.get("degraded") == "true" else ""
        row["device"], row["model"] = tags.get("device", ""), r.data.params.get("model.name", tags.get("model", ""))
        for m in METRICS + PLAIN + (PEAK,) + IMAGES:
            row[m] = None if m in GPU_ONLY and row["device"] == "cpu" else r.data.metrics.get(m)
        row["ms_per_step_ci95"] = half_width(r.data.metrics)
        row["overlap"] = ",".join(overlaps.get(r.info.run_id, []))
        row["overlap_runs"] = [full[label] for label in overlaps.get(r.info.run_id, []) if label in full]  # full ids
        row["run_id"] = r.info.run_id
        rows.append(row)
    for row, r in zip(rows, runs):
        if row["throughput_samples_per_s"] is None or row["status"] != FINISHED:
            continue
        setting = [r.data.params.get(k) for k in others_keys]
        for b_row, b in zip(rows, runs):
            if (b.data.params.get(STRATEGY) == BASELINE and b_row["status"] == FINISHED
                    and b_row["throughput_samples_per_s"] and [b.data.params.get(k) for k in others_keys] == setting):
                row["speedup_vs_baseline"] = row["throughput_samples_per_s"] / b_row["throughput_samples_per_s"]
                row["speedup_within_noise"] = None if b_row is row else within_noise(row, b_row)
                break
    return [column(k) for k in keys], rows


def half_width(metrics: Dict[str, float]) -> Optional[float]:
    """Half the width of the run's 95% interval of ms per step (None when it has none)."""
    low, high = metrics.get("ms_per_step_ci_low"), metrics.get("ms_per_step_ci_high")
    if low is None or high is None or math.isnan(low) or math.isnan(high):
        return None
    return (high - low) / 2


def within_noise(row: dict, baseline: dict) -> Optional[bool]:
    """Whether the 95% interval of `row`'s speedup over `baseline` includes 1 (None: a job has no
    interval). The two runs' relative half-widths add in quadrature, on the log of the speedup."""
    spread = [(r["ms_per_step_ci95"], r["ms_per_step"]) for r in (row, baseline)]
    if any(h is None or not ms for h, ms in spread):
        return None
    return abs(math.log(row["speedup_vs_baseline"])) <= math.hypot(*(h / ms for h, ms in spread))


def overlapping(runs: Sequence[Run], others: Sequence[Run] = ()) -> Dict[str, List[str]]:
    """run id -> the jobs (`sweep.job`) whose timed region overlapped its own in time on a device
    both used (tag `device_ids`: host and GPU UUID, or host and `cpu`), and the other runs of the
    store that did (`run <first 8 characters of its id>`: another sweep's, a run of its own)."""
    def spans(group: Sequence[Run], label) -> list:
        found = []
        for i, r in enumerate(group):
            m, devices = r.data.metrics, set(filter(None, r.data.tags.get("device_ids", "").split(",")))
            if devices and "timed_start_unix_s" in m and "timed_end_unix_s" in m:
                found.append((r.info.run_id, label(i, r), devices, m["timed_start_unix_s"], m["timed_end_unix_s"]))
        return found
    jobs = spans(runs, lambda i, r: r.data.tags.get("sweep.job", str(i)))
    mine = {run_id for run_id, *_ in jobs}
    elsewhere = spans([o for o in others if o.info.run_id not in mine], lambda i, r: f"run {r.info.run_id[:8]}")
    found: Dict[str, List[str]] = {}
    for run_id, _, devices, start, end in jobs:
        found[run_id] = [label for other, label, d, a, b in jobs + elsewhere
                         if other != run_id and devices & d and a < end and start < b]
    return found


def timed_beside(client: MlflowClient, parent: Run, runs: Sequence[Run]) -> List[Run]:
    """The store's other runs that were open while any of `runs` was timed: those whose timed
    region may have overlapped a job's (two sweeps into one store at once). Runs still open have
    logged no timed region yet; a later report sees them."""
    windows = [(r.data.metrics["timed_start_unix_s"], r.data.metrics["timed_end_unix_s"]) for r in runs
               if "timed_start_unix_s" in r.data.metrics and "timed_end_unix_s" in r.data.metrics]
    if not windows:
        return []
    first, last = min(a for a, _ in windows), max(b for _, b in windows)
    ids = [e.experiment_id for e in client.search_experiments()]
    # A run is open (start_time to end_time, in ms) around its timed region: a window in SQL first.
    near = client.search_runs(ids, f"attributes.start_time <= {math.ceil(last * 1000)} and "
                                   f"attributes.end_time >= {math.floor(first * 1000)}", max_results=5000)
    ours = {parent.info.run_id, *(r.info.run_id for r in runs)}
    return [r for r in near if r.info.run_id not in ours]


def overlap_warning(rows: Sequence[dict]) -> Optional[str]:
    """One line naming the jobs timed at the same time on one device as another job or another
    run of the store, or None."""
    jobs = [str(r["job"]) for r in rows if r.get("overlap")]
    if not jobs:
        return None
    elsewhere = sorted({run_id for r in rows for run_id in r.get("overlap_runs", ())})
    return (f"warning: jobs {', '.join(jobs)} were timed at the same time on a shared device (column overlap)"
            + (f", some beside other runs of this store ({', '.join(elsewhere)})" if elsewhere else "")
            + ": their figures disturb each other; run a timing sweep one job at a time"
            + (", and no other run beside it" if elsewhere else "") + " (see README)")


def metric_columns(rows: Sequence[dict]) -> List[str]:
    def present(m: str) -> bool:
        return any(row.get(m) is not None for row in rows)
    at = METRICS.index("h2d_GBps") + 1
    return [*METRICS[:at], *([PEAK] if present(PEAK) else []), *METRICS[at:], *filter(present, PLAIN),
            *filter(present, IMAGES)]


def header(keys: Sequence[str], rows: Sequence[dict]) -> List[str]:
    return ["job", *keys, "status", "degraded", *metric_columns(rows), "speedup_within_noise", "overlap",
            "run_name", "run_id"]


def _cell(key: str, value, exact: bool) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return repr(value) if exact else FORMATS.get(key, "{:.4g}").format(value)
    return str(value)


def _shown_cell(key: str, row: dict) -> str:
    """A printed cell: rounded, and a speedup within noise marked."""
    text = _cell(key, row.get(key), exact=False)
    return f"{text} {WITHIN_NOISE}" if key == "speedup_vs_baseline" and row.get("speedup_within_noise") else text


def shown(keys: Sequence[str], rows: Sequence[dict]) -> List[str]:
    """The printed columns: run name and id are in the CSV, the noise is a mark on the speedup;
    `degraded`, `overlap` and the GPU's columns only when a job has one."""
    return [c for c in header(keys, rows)[:-2] if c != "speedup_within_noise" and
            (c not in ("degraded", "overlap", *GPU_ONLY) or any(r.get(c) not in (None, "") for r in rows))]


def legend(rows: Sequence[dict]) -> List[str]:
    """One line per mark the table shows."""
    on_cpu = any(r.get("device") == "cpu" for r in rows)
    gpu_columns = any(r.get(c) is not None for r in rows for c in GPU_ONLY)
    marks = {"noise": any(r.get("speedup_within_noise") for r in rows),
             "cpu": on_cpu and gpu_columns, "all_cpu": on_cpu and not gpu_columns,
             "degraded": any(r.get("degraded") for r in rows),
             "stopped": any(r.get("status") != FINISHED and _cell("ms_per_step", r.get("ms_per_step"), False)
                            for r in rows),
             "plain": any(r.get("plain_ms_per_step") is not None for r in rows)}
    return [LEGEND[k] for k, shown_ in marks.items() if shown_]


def format_table(keys: Sequence[str], rows: Sequence[dict]) -> str:
    """An aligned plain-text table (text left, numbers right) and the legend of its marks."""
    cols = shown(keys, rows)
    cells = [[_shown_cell(c, row) for c in cols] for row in rows]
    widths = [max([len(c)] + [len(line[i]) for line in cells]) for i, c in enumerate(cols)]
    numeric = [c in FORMATS for c in cols]

    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()
    return "\n".join([line(cols), line(["-" * w for w in widths])] + [line(c) for c in cells] + legend(rows))


def to_csv(keys: Sequence[str], rows: Sequence[dict]) -> str:
    """Every value at full precision (`repr` of the logged float)."""
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    cols = header(keys, rows)
    w.writerow(cols)
    for row in rows:
        w.writerow([_cell(c, row.get(c), exact=True) for c in cols])
    return out.getvalue()


def to_markdown(keys: Sequence[str], rows: Sequence[dict]) -> str:
    cols = shown(keys, rows)
    lines = ["| " + " | ".join(cols) + " |",
             "|" + "|".join("---:" if c in FORMATS else "---" for c in cols) + "|"]
    lines += ["| " + " | ".join(_shown_cell(c, row) for c in cols) + " |" for row in rows]
    notes = legend(rows)
    return "\n".join(lines + ([""] + [f"{note}  " for note in notes] if notes else [])) + "\n"


def best_trial(runs: Sequence[Run]) -> Optional[Dict[str, object]]:
    """The finished job with the best objective (`engine.objective`, better as `OBJECTIVES` says:
    what a tuner optimised), and the settings that tell it from the other jobs; None when no job
    finished with it. A degraded job (its strategy's CPU path) did not measure what it names: it
    is never ranked (`left_out`), and beside degraded jobs a job left alone is not the best of
    anything: then `job` is None and `measured` lists what did measure its own settings."""
    objective = next((r.data.params["engine.objective"] for r in runs if "engine.objective" in r.data.params),
                     "throughput_samples_per_s")
    done = [r for r in runs if r.info.status == FINISHED and math.isfinite(r.data.metrics.get(objective, math.nan))]
    if not done:
        return None
    measured = [r for r in done if r.data.tags.get("degraded") != "true"]
    left_out = [job_number(runs, r) for r in done if r not in measured]
    found: Dict[str, object] = {"objective": objective, "left_out": left_out,
                                "measured": [job_number(runs, r) for r in measured], "job": None}
    if left_out and len(measured) < 2:
        return found
    sign = 1.0 if OBJECTIVES.get(objective) == "maximize" else -1.0
    best = max(measured, key=lambda r: sign * r.data.metrics[objective])
    # A setting counts when the jobs differ in it, a key a strategy lacks (loader.depth) included.
    keys = sorted({k for r in runs for k in r.data.params if not k.startswith("tracking.")})
    varying = [k for k in keys if len({r.data.params.get(k) for r in runs}) > 1 and k in best.data.params]
    overrides = [f"{column(k)}={best.data.params[k]}" for k in sorted(varying, key=lambda k: (k != STRATEGY, k))]
    return dict(found, job=job_number(runs, best), run_id=best.info.run_id, value=best.data.metrics[objective],
                overrides=overrides)


def job_number(runs: Sequence[Run], run: Run) -> str:
    return run.data.tags.get("sweep.job", str(list(runs).index(run)))


def best_line(best: Dict[str, object]) -> str:
    """`best: job 3 (run ...): throughput_samples_per_s=1234.5 with loader=prefetch loader.depth=2`,
    or why no job is ranked (every finished job but one, or all, degraded)."""
    degraded = "degraded (no CUDA: the CPU path ran, not the strategy named)"
    if best["job"] is None and not best["measured"]:
        return f"best: none: every job is {degraded}, so none measured what it names"
    if best["job"] is None:
        return (f"best: none: {_jobs(best['left_out'])} {'are' if len(best['left_out']) > 1 else 'is'} {degraded}, "
                f"so job {best['measured'][0]} alone measured what it names: nothing to rank")
    line = (f"best: job {best['job']} (run {best['run_id']}): {best['objective']}={best['value']:.6g} with "
            f"{' '.join(best['overrides']) or 'the same settings as the others'}")
    return line + (f" (not ranked: {_jobs(best['left_out'])}, degraded)" if best["left_out"] else "")


def _jobs(numbers: Sequence[str]) -> str:
    """`job 1`, `jobs 1, 2`."""
    return f"job{'s' * (len(numbers) > 1)} {', '.join(numbers)}"


def compare(client: MlflowClient, parent: Run) -> Tuple[List[str], List[Dict[str, object]]]:
    """The comparison of one sweep (the parent run and its children), each job marked with the
    jobs and the store's other runs timed beside it on its device."""
    runs = children(client, parent)
    return comparison_rows(parent, runs, timed_beside(client, parent, runs))


# ----------------------------------------------------------------------------- one run
def run_items(run: Run) -> List[Tuple[str, str, str]]:
    """(section, key, value) of a run: its status (and error), its summary metrics, its params.
    The per-step series' last values are left out: they are one step's, not the run's."""
    tags = run.data.tags
    items = [("status", "status", shown_status(run))]
    items += [("status", k, tags[k]) for k in ("error", "failed_step", "interrupted_by") if k in tags]
    items += [("metric", k, _cell(k, v, exact=False)) for k, v in sorted(run.data.metrics.items())
              if k not in PER_STEP_METRICS]
    return items + [("param", k, v) for k, v in sorted(run.data.params.items())]


def format_run(run: Run) -> str:
    """A run as aligned `key  value` lines: status, summary metrics, then params."""
    items = run_items(run)
    width = max(len(k) for _, k, _ in items)
    lines, section = [], None
    for part, key, value in items:
        if part != section:
            lines.append({"status": "", "metric": "summary metrics:", "param": "params:"}[part])
            section = part
        lines.append(f"  {key.ljust(width)}  {value}")
    return "\n".join(line for line in lines if line)


def run_csv(run: Run) -> str:
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(["section", "key", "value"])
    for part, key, value in run_items(run):
        w.writerow([part, key, repr(run.data.metrics[key]) if part == "metric" else value])  # full precision
    return out.getvalue()


def run_markdown(run: Run) -> str:
    rows = [f"| {part} | {key} | {value} |" for part, key, value in run_items(run)]
    return "\n".join(["| section | key | value |", "|---|---|---|", *rows]) + "\n"


# ----------------------------------------------------------------------------- command line
def unwritable(option: str, path: Path, error: OSError) -> str:
    return (f"{option} {path}: cannot write there ({error.strerror or error}): pass a path in a folder that exists "
            "and that you can write in")


def check_writable(option: str, path: Path) -> None:
    """Try the file now, before the store is read and `--plain` runs its loops: a path that cannot be
    written fails in one line at once, not in a traceback at the end. Leaves no file behind."""
    existed = path.exists()
    try:
        with path.open("a"):
            pass
    except OSError as e:
        raise ConfigError(unwritable(option, path, e)) from None
    if not existed:
        path.unlink()


def write_tables(paths: Dict[str, Path], tables: Dict[str, str]) -> int:
    """Write each asked-for table (`--csv`, `--markdown`); a write that still fails (a full disk) is one line, exit 1."""
    for option, path in paths.items():
        try:
            path.write_text(tables[option])
        except OSError as e:
            print(f"error: {unwritable(option, path, e)}", file=sys.stderr)
            return 1
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.report", description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--uri", help="MLflow tracking URI (default: the project's outputs/mlflow.db)")
    p.add_argument("--experiment", help="look for the latest run or sweep in this experiment only")
    which = p.add_mutually_exclusive_group()  # two names for one choice: an error names the one typed
    which.add_argument("--run", metavar="RUN_ID",
                       help="a run's id, a sweep's parent run id, or one of its jobs' (default: the latest run or sweep)")
    which.add_argument("--sweep", metavar="RUN_ID", help="the same as --run")
    p.add_argument("--csv", type=Path, metavar="PATH", help="also write the table as CSV (full precision)")
    p.add_argument("--markdown", type=Path, metavar="PATH", help="also write the table as Markdown")
    p.add_argument("--plain", action="store_true",
                   help="first run a plain loop for each finished job now (same config, fresh process) and log "
                        "plain_ms_per_step on it, tagged plain_timed (timed after the job, not beside it)")
    args = one_line_argument_errors(p, "python -m trainer.report", exit_status=2).parse_args(argv)
    paths = {option: path for option, path in (("--csv", args.csv), ("--markdown", args.markdown)) if path}
    try:
        for option, path in paths.items():
            check_writable(option, path)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        client, uri = open_store(args.uri)
        try:
            recover_dead_runs(client)  # runs of this host whose process died: KILLED, from their journals
        except Exception as e:  # a store on a full disk: reading it still works, closing runs does not
            print(f"warning: the store at {masked(uri)} refused to close the runs whose process is gone ({reason(e)}): "
                  "free space on its disk; the next report or run closes them", file=sys.stderr)
        parent = find_parent(client, args.experiment, args.run or args.sweep, sweeps_only=False,
                             option="--sweep" if args.sweep else "--run")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    single = parent.data.tags.get("sweep") != "true"  # --run of a run of its own, not of a sweep
    if args.plain:
        from trainer.tracking.plain import annotate  # runs the plain loop's program: only loaded when asked for
        annotate(client, [parent] if single else children(client, parent), log=lambda line: print(line, file=sys.stderr))
    if single:
        run = client.get_run(parent.info.run_id)  # with what --plain logged
        print(describe(run, uri))  # what it found, as the run printed it when it ended
        print(f"\nrun {run.info.run_name!r}, all it recorded:")
        print(format_run(run))
        return write_tables(paths, {"--csv": run_csv(run), "--markdown": run_markdown(run)})
    keys, rows = compare(client, parent)
    print(f"sweep {parent.info.run_name!r} ({parent.info.run_id}, {parent.info.status}): {len(rows)} jobs in {uri}")
    print(format_table(keys, rows) if rows else "(no child runs)")
    best = best_trial(children(client, parent))
    if best is not None:
        print(best_line(best))
    warning = overlap_warning(rows)
    if warning:
        print(warning, file=sys.stderr)
    return write_tables(paths, {"--csv": to_csv(keys, rows), "--markdown": to_markdown(keys, rows)})


if __name__ == "__main__":
    sys.exit(main())
