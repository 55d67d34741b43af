"""MLflow bookkeeping: one run per experiment job, written only outside the timed loop.

Default store: sqlite `outputs/mlflow.db` at the project root (in the current directory for a
package installed from a wheel), artifacts under `outputs/mlartifacts`, both absolute so the UI
(`mlflow ui --backend-store-uri sqlite:///.../outputs/mlflow.db`) finds them wherever the job was
launched from (`trainer.tracking.store`). A job of a sweep is nested under the
sweep's parent run (`child_identity`).
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import mlflow
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from mlflow.entities import Metric, RunStatus, RunTag
from mlflow.exceptions import MlflowException
from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig, OmegaConf

from trainer.errors import ConfigError, RunFailed
from trainer.loop.meter import STEP_COLUMNS
from trainer.tracking import plots
from trainer.tracking.store import (OUTPUTS, PER_STEP_METRICS, default_uri, experiment_id, flatten, reason, shown,
                                    store_errors)


def system_metrics(tracking) -> Optional[bool]:
    """`tracking.system_metrics=true`: sample every `system_metrics_interval_s` (MLflow's default,
    10 s, would leave a short run with no sample). MLflow needs psutil for it."""
    if not tracking.system_metrics:
        return None
    if not tracking.system_metrics_interval_s > 0:
        raise ConfigError(f"tracking.system_metrics_interval_s must be > 0 (got {tracking.system_metrics_interval_s}): "
                          "set tracking.system_metrics_interval_s=1")
    if importlib.util.find_spec("psutil") is None:
        raise ConfigError("tracking.system_metrics=true needs psutil: `pip install psutil nvidia-ml-py` "
                          "(nvidia-ml-py adds GPU utilisation) or set tracking.system_metrics=false")
    mlflow.set_system_metrics_sampling_interval(tracking.system_metrics_interval_s)
    return True


def job_value(cfg: DictConfig, key: str) -> str:
    """A key's value in a job's config; a config group reads as its chosen option's name."""
    node = OmegaConf.select(cfg, key, default=None)
    if isinstance(node, DictConfig):
        return str(node.get("name", "?"))
    return str(node)


def _job_num() -> Optional[int]:
    """Hydra's job number when this process runs a multirun job, else None."""
    if not HydraConfig.initialized():
        return None
    hc = HydraConfig.get()
    return int(hc.job.num) if hc.mode == RunMode.MULTIRUN else None


def child_identity(client: MlflowClient, cfg: DictConfig) -> Tuple[Optional[str], Dict[str, str]]:
    """Run name and tags that nest a job's run under `tracking.parent_run_id` (none if unset).

    The name is the job's value of each swept key (`loader=pinned model=mlp`), keys read from
    the parent run's `sweep.keys` tag.
    """
    parent_id = cfg.tracking.parent_run_id
    if not parent_id:
        return None, {}
    try:
        parent = client.get_run(parent_id)
    except MlflowException:
        raise ConfigError(f"tracking.parent_run_id={parent_id} is not a run in {client.tracking_uri}: "
                          "drop the key to record a run of its own") from None
    keys = [k for k in parent.data.tags.get("sweep.keys", "").split(",") if k]
    name = " ".join(f"{k}={job_value(cfg, k)}" for k in keys) or None
    tags = {"mlflow.parentRunId": parent_id}
    num = _job_num()
    if num is not None:
        tags["sweep.job"] = str(num)
    return name, tags


class Tracker:
    """One MLflow run. Use as a context manager: an exception marks the run FAILED, an interrupt
    KILLED, and whatever was logged before stays.

    What the run measured is saved when it is closed, in the order that keeps the most if the
    store's disk fills or the store goes away: summary metrics, `steps.csv`, the per-step
    series, pictures, then the tags and the status. Artifacts go straight to the run's artifact
    folder, so they are kept when the database refuses them; a `steps.csv` or summary the store
    refuses is written to the run's folder (`local_folder`) instead. The exception closing the
    run then says what was refused, why, and where it went: a run that finished but whose
    records the store refused is closed FAILED with a `RunFailed` of its own (a run recorded
    FINISHED without its figures would be false).
    """

    def __init__(self, cfg, tags: Dict[str, str]):
        self.cfg = cfg
        self.uri = cfg.tracking.uri or default_uri()
        if self.uri == default_uri():
            OUTPUTS.mkdir(parents=True, exist_ok=True)
        with store_errors(self.uri):  # what the up-front check could not foresee: one line, no run
            mlflow.set_tracking_uri(self.uri)
            self.client = MlflowClient(self.uri)
            exp_id = experiment_id(self.client, cfg.tracking.experiment, self.uri)
            sweep_name, sweep_tags = child_identity(self.client, cfg)  # nested under tracking.parent_run_id
            self.run = mlflow.start_run(experiment_id=exp_id, run_name=cfg.tracking.run_name or sweep_name,
                                        tags={**tags, **sweep_tags}, log_system_metrics=system_metrics(cfg.tracking))
        self.run_id = self.run.info.run_id
        self.artifacts = get_artifact_repository(self.run.info.artifact_uri)  # written without the database
        self.folder = artifact_folder(self.run.info.artifact_uri)
        self.summary: Dict[str, float] = {}
        self.rows: List[dict] = []
        self.tables: List[Tuple[List[dict], str]] = []  # other ranks' steps: (rows, file name)
        self.files: List[Path] = []
        self.tags: Dict[str, str] = {}  # refused while the run ran: tried again at the close
        self.refused: List[Tuple[str, BaseException, bool]] = []  # (what, why, an artifact?), in the order saved
        self.kept: Dict[str, Path] = {}  # what the store refused -> where it was written instead
        try:
            with store_errors(self.uri):
                items = list(flatten(cfg).items())
                for i in range(0, len(items), 100):  # log_batch takes at most 100 params
                    mlflow.log_params(dict(items[i:i + 100]))
            with tempfile.TemporaryDirectory() as tmp:
                config = Path(tmp) / "config.yaml"
                config.write_text(OmegaConf.to_yaml(cfg, resolve=True))
                try:
                    self.artifacts.log_artifact(str(config))
                except OSError as e:  # the artifacts' disk, not the database's: name the folder that refused it
                    raise ConfigError(f"tracking.uri={shown(self.uri)}: its artifact folder {self.folder} cannot be "
                                      f"written ({e.strerror or e}): free space on that disk (or make the folder "
                                      "writable), or set tracking.uri=sqlite:///<a folder on another disk>/mlflow.db "
                                      "(a new store keeps its artifacts beside it)") from None
        except BaseException as e:  # the run is open but no `with` block holds it yet: close it here
            self.__exit__(type(e), e, e.__traceback__)
            raise

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            status = RunStatus.to_string(RunStatus.FINISHED)
        elif issubclass(exc_type, KeyboardInterrupt):  # Ctrl-C, or SIGTERM (trainer.errors.Interrupted)
            status = RunStatus.to_string(RunStatus.KILLED)
            self.tags["interrupted_by"] = str(exc) or "SIGINT"
        else:
            status = RunStatus.to_string(RunStatus.FAILED)
            if exc is not None:
                self.tags["error"] = f"{exc_type.__name__}: {exc}"[:5000]
            if getattr(exc, "step", None) is not None:
                self.tags["failed_step"] = str(exc.step)
        self._save()
        if exc is None and self.refused:
            # The run took its steps, but what it measured is not all in the store: a run recorded
            # FINISHED without its figures (and exit 0) would be false. Failed, saying where they are.
            exc = RunFailed("the run finished, but the store did not take all it measured")
            status = RunStatus.to_string(RunStatus.FAILED)
            self.tags["error"] = f"{exc} ({self.refusal()})"[:5000]
        if self.tags:
            tags = [RunTag(k, v) for k, v in self.tags.items()]
            self._attempt("tags", lambda: self.client.log_batch(self.run_id, tags=tags))
        self._attempt("status", lambda: mlflow.end_run(status))
        note = self.refusal()
        if exc is not None:
            exc.run_id = self.run_id  # lets the one-line report name the run
            if note:
                exc.refused = note
        if exc_type is None and exc is not None:
            raise exc
        return False

    def _save(self) -> None:
        """Everything the run measured, the most valuable first (see the class)."""
        now = int(time.time() * 1000)
        if self.summary and not self._attempt("summary metrics", lambda: self.client.log_batch(
                self.run_id, metrics=[Metric(k, v, now, 0) for k, v in self.summary.items()], synchronous=True)):
            self._keep_here("summary metrics", "summary.json",
                            lambda path: path.write_text(json.dumps(self.summary, indent=1)))
        with tempfile.TemporaryDirectory() as tmp:
            for rows, name in [(self.rows, "steps.csv")] * bool(self.rows) + self.tables:
                if not self._attempt(name, lambda: self.artifacts.log_artifact(str(write_rows(rows, Path(tmp) / name))),
                                     artifact=True):
                    self._keep_here(name, name, lambda local: write_rows(rows, local))
            if self.rows:
                self._attempt("per-step metrics", lambda: self._log_series(self.rows))
            if self.rows and self.cfg.tracking.get("plots", True):
                title = f"{self.cfg.loader.name} · {self.cfg.model.name} · {self.cfg.dataset.name}"
                self._attempt("timeline.png", lambda: self.artifacts.log_artifact(str(
                    plots.timeline(self.rows, Path(tmp) / "timeline.png", self.cfg.engine.warmup_steps, title))),
                    artifact=True)
        for path in self.files:
            self._attempt(path.name, lambda: self.artifacts.log_artifact(str(path)), artifact=True)

    def _attempt(self, what: str, write: Callable[[], object], artifact: bool = False) -> bool:
        """Run one write to the store (`artifact`: a file into the run's artifact folder, which the
        database does not hold); what it refuses is noted, not raised: the rest is still saved."""
        try:
            write()
            return True
        except Exception as e:  # MLflow's, SQLAlchemy's and the file system's errors alike
            self.refused.append((what, e, artifact))
            return False

    def _keep_here(self, what: str, name: str, write: Callable[[Path], object]) -> None:
        """Write what the store refused into the run's own folder instead."""
        path = local_folder(self.run_id) / name
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write(path)
            self.kept[what] = path
        except OSError:
            pass  # the one line says it is lost: the store refused it, and so did this disk

    def refusal(self) -> Optional[str]:
        """One phrase: what the store refused, why, and where the data went (None: nothing refused)."""
        if not self.refused:
            return None
        what = [w for w, _, _ in self.refused]
        # The database and the artifact folder may sit on different disks: each named for what it refused.
        refusals = []
        for artifact, by in ((False, f"the store at {shown(self.uri)}"), (True, f"the artifact folder {self.folder}")):
            mine = [(w, e) for w, e, a in self.refused if a == artifact]
            if mine:
                refusals.append(f"{by} refused its {_listed([w for w, _ in mine])} ({reason(mine[0][1])})")
        where = [f"{w} in {path}" for w, path in self.kept.items()]
        if self.rows and "steps.csv" not in what:
            where.append(f"steps.csv in {self.folder}")
        lost = [w for w in ("summary metrics", "steps.csv") if w in what and w not in self.kept]
        return "; ".join(refusals) + "".join(f"; {w}" for w in where) + (f"; lost: {' and '.join(lost)}" if lost else "")

    def _log_series(self, rows: List[dict]) -> None:
        """Per-step series (`log_batch`, step = global step). A column a loop adds to the rows
        (Lightning's `lightning_ms`) is logged too."""
        extra = tuple(k for k in (rows[0] if rows else {}) if k not in STEP_COLUMNS and not k.startswith("_"))
        # A GPU time of a step outside the meter's timed runs is nan: not logged (see trainer.loop.meter).
        metrics = [Metric(k, float(r[k]), 0, int(r["step"])) for r in rows for k in PER_STEP_METRICS + extra
                   if not math.isnan(float(r[k]))]
        for i in range(0, len(metrics), 1000):  # log_batch takes at most 1000 metrics
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000], synchronous=True)

    def set_tags(self, tags: Dict[str, object]) -> None:
        tags = {k: str(v) for k, v in tags.items()}
        try:
            self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
        except Exception:  # the store failed mid-run: tried again, and reported, when the run is closed
            self.tags.update(tags)

    def log_environment(self, env: Dict[str, object]) -> None:
        self._attempt("environment.json", lambda: mlflow.log_dict(env, "environment.json"), artifact=True)

    def log_steps(self, rows: List[dict]) -> None:
        """Per-step rows: `steps.csv`, the per-step series and `timeline.png`, saved at the close."""
        self.rows = rows

    def log_rows(self, rows: List[dict], name: str) -> None:
        """Another rank's per-step rows as a CSV artifact (`steps_rank1.csv`), saved at the close."""
        self.tables.append((rows, name))

    def log_summary(self, summary: Dict[str, float]) -> None:
        self.summary.update({k: float(v) for k, v in summary.items()})

    def log_artifact(self, path: Path) -> None:
        self.files.append(path)


def _listed(items: List[str]) -> str:
    """`a`, `a and b`, `a, b and c`."""
    return ", ".join(items[:-1]) + " and " + items[-1] if len(items) > 1 else items[0]


def write_rows(rows: List[dict], path: Path) -> Path:
    """Per-step rows as CSV; a column a loop adds (Lightning's `lightning_ms`) after the meter's."""
    extra = [k for k in (rows[0] if rows else {}) if k not in STEP_COLUMNS and not k.startswith("_")]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(STEP_COLUMNS) + extra, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return path


def artifact_folder(uri: str) -> str:
    """A run's artifact location as a path when it is local (`file://...`), else the URI."""
    parts = urllib.parse.urlsplit(uri)
    return urllib.parse.unquote(parts.path) if parts.scheme == "file" else uri


def local_folder(run_id: str) -> Path:
    """Where a run writes what the store refused: Hydra's folder for the run, else outputs/runs/<id>."""
    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return OUTPUTS / "runs" / run_id


class NoTracker:
    """The tracker of a rank other than 0 under torchrun: rank 0 records the run, this records nothing."""

    run_id = None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        return False

    def set_tags(self, tags) -> None:
        pass

    def log_environment(self, env) -> None:
        pass

    def log_steps(self, rows) -> None:
        pass

    def log_rows(self, rows, name) -> None:
        pass

    def log_summary(self, summary) -> None:
        pass

    def log_artifact(self, path) -> None:
        pass
