"""A Hydra multirun as one MLflow parent run with one nested child run per job.

`SweepCallback` (registered under `hydra.callbacks` in conf/config.yaml) first builds the
datasets read from files that the jobs will use, once each: a missing one ends the sweep in one
line before any job opens a run. It then creates the parent run before the first job and hands its id to every job as the override
`tracking.parent_run_id='<id>'`. The id travels with each job's overrides, so it reaches the job
whichever launcher runs it (in this process, a worker pool or a cluster). After the last job the
parent gets `comparison.csv` and `comparison.png` (trainer.tracking.report builds the table) and is closed.

Under torchrun every rank runs the sweep; rank 0 alone records it (and the jobs' runs).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import io
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from mlflow.entities import Param, RunStatus
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from datasets import DATASETS, build_dataset
from trainer.tracking.journal import owner_tags
from trainer.errors import EXIT_FAILED, ConfigError
from trainer.loop import distributed, faults
from trainer.loop.run import check_precision, select_device, untimed
from trainer.tracking import plots, report
from trainer.tracking.runs import child_identity, job_value
from trainer.tracking.store import check_tracking_uri, default_uri, experiment_id, flatten, store_errors
from trainer.validate import check_against_dataset, validate

PARENT_KEY = "tracking.parent_run_id"
# Overrides that can change a job's dataset section: its own keys, and presets (which set any key).
DATASET_KEYS = ("dataset", "experiment")
OFFLINE = "python -m trainer.fake_data"  # writes MNIST- and CIFAR-format files of random pixels
MAX_CHECKED_TRIALS = 32  # combinations of a study's listed values composed and checked before it (`check_trials`)


def _overrides(config: DictConfig) -> list:
    """The multirun's overrides, parsed: `hydra.sweeper.params` first, then the command line's,
    as Hydra's basic sweeper reads them."""
    params = OmegaConf.select(config, "hydra.sweeper.params") or {}
    lines = [f"{k}={v}" for k, v in params.items()] + [str(o) for o in config.hydra.overrides.task]
    return OverridesParser.create().parse_overrides(lines)


def sweep_overrides(config: DictConfig) -> List[str]:
    """The multirun's overrides that sweep (`loader=baseline,pinned`), command line and
    `hydra.sweeper.params` alike, as Hydra's basic sweeper combines them: a key given in both
    takes the command line's value at the params' place (`experiment=limits loader=baseline`
    sweeps the batch sizes only)."""
    final: Dict[str, object] = {}
    for o in _overrides(config):
        final[o.get_key_element()] = o   # a dict keeps the first place and takes the last value
    return [o.input_line for o in final.values() if o.is_sweep_override() and not o.is_hydra_override()]


def dataset_settings(config: DictConfig) -> List[Tuple[str, ...]]:
    """The distinct dataset-changing overrides (`DATASET_KEYS`) of the sweep's jobs, in job order,
    as Hydra's basic sweeper makes each job's."""
    jobs = BasicSweeper.split_arguments(_overrides(config), None)[0]
    picked = [tuple(o for o in job if o.lstrip("+~").startswith(DATASET_KEYS)) for job in jobs]
    return list(dict.fromkeys(picked))


def check_datasets(config: DictConfig) -> None:
    """Build each dataset read from files (a `root` in its Config) that the sweep's jobs will use,
    once: a missing one (no network to download it) ends the sweep here, in one line, before any
    job opens a run, instead of failing every job that uses it. A download made here serves them
    all. Datasets made in memory (synthetic) are left to the jobs."""
    loader = GlobalHydra.instance().config_loader()
    try:
        sections = [loader.load_sweep_config(config, list(o)).dataset for o in dataset_settings(config)]
    except Exception:  # overrides Hydra cannot expand or compose: each job reports that itself
        return
    checked = set()
    for section in sections:
        cls = DATASETS.get(section.name)
        if cls is None or "root" not in {f.name for f in dataclasses.fields(cls.Config)}:
            continue  # an unknown name is the job's error to report; in-memory data is cheap to make there
        key = OmegaConf.to_yaml(section, resolve=True)
        if key in checked:
            continue
        checked.add(key)
        try:
            DATASETS.build(section)
        except ConfigError as e:
            if distributed.is_main_process():
                print(f"error: {' '.join(str(e).split())} (the sweep ran no job; to try the presets without "
                      f"network, `{OFFLINE}` writes MNIST- and CIFAR-format files of random pixels)", file=sys.stderr)
            raise SystemExit(EXIT_FAILED) from None


def is_study(hydra: DictConfig) -> bool:
    """Whether the multirun is a study: a sampler's sweeper (Hydra's Optuna sweeper) that ranks its
    trials by the value each job returns, not Hydra's basic sweeper, which runs a list of jobs.
    `hydra`: the `hydra` section (`HydraConfig.get()`)."""
    return (hydra.mode == RunMode.MULTIRUN
            and not OmegaConf.select(hydra, "sweeper._target_", default="").endswith(".BasicSweeper"))


def check_trials(config: DictConfig) -> None:
    """A sampler's study (Hydra's Optuna sweeper, `experiment=tune_dataloader`) draws its trials
    from `hydra.sweeper.params` until `n_trials`: a config error that every trial would hit (an
    impossible batch size, an unknown `engine.objective`) would be printed once per trial and end
    in the sampler's "no trials are completed yet" trace. Each combination of the swept values it
    can list (at most `MAX_CHECKED_TRIALS`; an interval keeps its key's own value) is composed and
    checked as `run` checks it before opening a run: when all of them fail, the first one's error
    ends the sweep here, in one line, before the study. Hydra's basic sweeper is left alone: its
    jobs are final and each reports its own error once."""
    if not is_study(config.hydra):
        return
    try:
        listed = [o for o in _overrides(config) if not o.is_sweep_override() or o.is_discrete_sweep()]
        jobs = BasicSweeper.split_arguments(listed, None)[0]
    except Exception:  # overrides Hydra cannot expand: the sweeper reports that itself
        return
    if not jobs or len(jobs) > MAX_CHECKED_TRIALS:
        return
    loader, datasets, first = GlobalHydra.instance().config_loader(), {}, None
    for job in jobs:
        try:
            composed = loader.load_sweep_config(config, list(job))
        except Exception:  # Hydra refuses this combination: the trial says so
            return
        with read_write(composed), open_dict(composed):
            del composed["hydra"]  # the task's config, as Hydra hands it to the job
        error = refusal(composed, datasets)
        if error is None:
            return  # this trial can run
        first = first or error
    if distributed.is_main_process():
        print(f"error: {' '.join(str(first).split())} (the study ran no trial: every trial of this sweep would stop "
              f"on it)", file=sys.stderr)
    raise SystemExit(EXIT_FAILED)


def refusal(cfg: DictConfig, datasets: dict) -> Optional[ConfigError]:
    """The ConfigError `run` would raise for `cfg` before its first step (its values, its device
    and precision, its batch against its dataset), or None; and one for a warm-up that covers every
    step, which a trial fails on (nothing timed, no objective: `check_objective`). `datasets`:
    those built so far, by section: each is built once."""
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # a job's warnings are the job's to print
            job = validate(cfg)
            # A length in steps is every strategy's; in epochs it is the strategy's batches (its trials say).
            line = untimed(job.engine.max_steps, job.engine.warmup_steps, "each trial") if job.engine.max_steps else None
            if line is not None:
                raise ConfigError(line)
            check_precision(job.engine.precision, select_device(job.engine.device))
            key = OmegaConf.to_yaml(cfg.dataset, resolve=True)
            if key not in datasets:
                datasets[key] = build_dataset(job.dataset)
            check_against_dataset(job, datasets[key])
    except ConfigError as e:
        return e
    except Exception:  # not the config (the dataset's own code failed, say): the trials report that themselves
        return None
    return None


def swept_keys(overrides: Sequence[str]) -> List[str]:
    return [o.key_or_group for o in OverridesParser.create().parse_overrides(list(overrides))]


def start_parent(tracking: DictConfig, name: str, keys: Sequence[str], tags: Dict[str, str]) -> str:
    """Create the sweep's parent run (status RUNNING) and return its id."""
    check_tracking_uri(tracking.uri)
    uri = tracking.uri or default_uri()
    with store_errors(uri):
        client = MlflowClient(uri)
        exp_id = experiment_id(client, tracking.experiment, uri)
        run = client.create_run(exp_id, run_name=name[:250],
                                tags={"sweep": "true", "sweep.keys": ",".join(keys), **owner_tags(), **tags})
    return run.info.run_id


def finish_parent(uri: str, parent_id: str, stopped: Optional[str] = None) -> Tuple[List[str], List[dict]]:
    """Attach `comparison.csv`/`comparison.png` to the parent and close it: FINISHED when every
    job finished, FAILED when one did not, or `stopped` (FAILED, KILLED) when the sweep ended
    before its last job. Returns the table."""
    client = MlflowClient(uri)
    parent = client.get_run(parent_id)
    keys, rows = report.compare(client, parent)
    with tempfile.TemporaryDirectory() as tmp:
        csv_path = Path(tmp) / "comparison.csv"
        csv_path.write_text(report.to_csv(keys, rows))
        client.log_artifact(parent_id, str(csv_path))
        if rows:
            png = plots.comparison(rows, keys, Path(tmp) / "comparison.png", title=parent.info.run_name)
            client.log_artifact(parent_id, str(png))
    best = report.best_trial(report.children(client, parent))
    if best is not None:  # what a tuner found (experiment=tune_dataloader); any sweep's fastest job
        if best["job"] is not None:  # none when degraded jobs leave nothing to rank: the line says why
            client.set_tag(parent_id, "best_run_id", best["run_id"])
        client.set_tag(parent_id, "best", report.best_line(best))
    failed = sum(r["status"] != "FINISHED" for r in rows)
    client.set_tag(parent_id, "jobs", str(len(rows)))
    client.set_tag(parent_id, "failed_jobs", str(failed))
    status = stopped or RunStatus.to_string(RunStatus.FAILED if failed else RunStatus.FINISHED)
    client.set_terminated(parent_id, status)
    return keys, rows


def record_failed_job(config: DictConfig, error: BaseException) -> None:
    """A job that failed before its run was opened still shows up, as a FAILED child run."""
    task_cfg = OmegaConf.masked_copy(config, [k for k in config if k != "hydra"])
    uri = task_cfg.tracking.uri or default_uri()
    client = MlflowClient(uri)
    parent_id, num = task_cfg.tracking.parent_run_id, str(config.hydra.job.num)
    exp_id = client.get_run(parent_id).info.experiment_id
    found = client.search_runs([exp_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent_id}' "
                                                       f"and tags.`sweep.job` = '{num}'")
    if found:  # the run was opened and already marked FAILED
        return
    name, tags = child_identity(client, task_cfg)
    cause = error.__cause__ or error  # the entry point may wrap the error for Hydra's one-line report
    tags.update({"sweep.job": num, "error": f"{type(cause).__name__}: {cause}"[:5000],
                 "strategy": job_value(task_cfg, "loader"), "model": job_value(task_cfg, "model"),
                 "dataset": job_value(task_cfg, "dataset")})
    run = client.create_run(exp_id, run_name=name, tags=tags)
    params = [Param(k, v) for k, v in flatten(task_cfg).items()]
    for i in range(0, len(params), 100):  # log_batch takes at most 100 params
        client.log_batch(run.info.run_id, params=params[i:i + 100])
    client.set_terminated(run.info.run_id, RunStatus.to_string(RunStatus.FAILED))


class SweepCallback(Callback):
    """Hydra callback: parent run at multirun start, comparison and status at multirun end."""

    def __init__(self) -> None:
        self.parent_id: Optional[str] = None
        self.uri: Optional[str] = None

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        check_datasets(config)  # on every rank: a missing dataset ends them all, printed once
        check_trials(config)  # a study whose every trial would stop on a config error: refused before it
        if not distributed.is_main_process():
            return
        overrides = sweep_overrides(config)
        keys = swept_keys(overrides)
        name = config.tracking.sweep_name or ("sweep " + " ".join(overrides) if overrides else "sweep")
        fixed = [str(o) for o in config.hydra.overrides.task if str(o) not in overrides]
        self.uri = config.tracking.uri or default_uri()
        self.parent_id = start_parent(config.tracking, name, keys,
                                      {"sweep.overrides": " ".join(fixed)[:5000],
                                       "sweep.dir": str(config.hydra.sweep.dir),
                                       "world_size": str(distributed.world()[1])})
        # The sweeper reads the task overrides after this hook: every job is composed with this one.
        with read_write(config.hydra.overrides):
            config.hydra.overrides.task.append(f"{PARENT_KEY}='{self.parent_id}'")
        # A failing job makes Hydra's default sweeper raise before on_multirun_end; the parent
        # is then closed (with the comparison of the jobs that ran) when the process exits.
        atexit.register(self._finish_aborted)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs) -> None:
        if (config.hydra.mode != RunMode.MULTIRUN or job_return.status != JobStatus.FAILED
                or not OmegaConf.select(config, PARENT_KEY) or not distributed.is_main_process()):
            return
        try:
            record_failed_job(config, job_return._return_value)  # the exception (the property re-raises it)
        except Exception as e:  # recording the failure must not hide the job's own error
            print(f"warning: could not record the failed job in MLflow: {e}", file=sys.stderr)

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        if self.parent_id is None:  # on_multirun_start failed (Hydra turned its error into a warning)
            return
        atexit.unregister(self._finish_aborted)
        if self._dropped_if_empty():  # the overrides swept no value
            print(f"error: {' '.join(sweep_overrides(config))}: the sweep has no job (a glob() that matches no "
                  f"option, an empty range()?): give each swept key at least one value", file=sys.stderr)
            raise SystemExit(EXIT_FAILED)  # (Hydra turns a callback's exception into a warning)
        self._show(*finish_parent(self.uri, self.parent_id))

    def _dropped_if_empty(self) -> bool:
        """Delete the parent run when no job ran: an empty parent would be "the latest sweep" for
        the report (MLflow keeps it in its trash)."""
        client = MlflowClient(self.uri)
        if report.children(client, client.get_run(self.parent_id)):
            return False
        client.delete_run(self.parent_id)
        return True

    def _show(self, keys: List[str], rows: List[dict]) -> None:
        print(f"sweep {self.parent_id}: {len(rows)} jobs (`python -m trainer.report` prints this again)")
        print(report.format_table(keys, rows), flush=True)
        best = MlflowClient(self.uri).get_run(self.parent_id).data.tags.get("best")
        if best:
            print(best, flush=True)
        warning = report.overlap_warning(rows)
        if warning:
            print(warning, file=sys.stderr, flush=True)

    def _finish_aborted(self) -> None:
        # Interrupted (Ctrl-C, SIGTERM: the entry point notes the signal) or stopped by an error.
        stopped = "KILLED" if faults.stopped_by is not None else "FAILED"
        try:
            if self._dropped_if_empty():  # Hydra refused an override of the sweep, or a Ctrl-C came first
                return
            self._show(*finish_parent(self.uri, self.parent_id, stopped=stopped))
        except Exception as e:
            print(f"warning: could not close sweep run {self.parent_id}: {e}", file=sys.stderr)
