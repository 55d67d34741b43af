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
import math
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mlflow
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from mlflow.entities import Metric, RunStatus
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig, OmegaConf

from trainer.errors import ConfigError
from trainer.loop.meter import STEP_COLUMNS
from trainer.tracking import plots
from trainer.tracking.store import OUTPUTS, PER_STEP_METRICS, default_uri, experiment_id, flatten, store_errors


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
    KILLED, and whatever was logged before stays."""

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
        try:
            params = flatten(cfg)
            items = list(params.items())
            for i in range(0, len(items), 100):  # log_batch takes at most 100 params
                mlflow.log_params(dict(items[i:i + 100]))
            mlflow.log_text(OmegaConf.to_yaml(cfg, resolve=True), "config.yaml")
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
            mlflow.set_tag("interrupted_by", str(exc) or "SIGINT")
        else:
            status = RunStatus.to_string(RunStatus.FAILED)
            if exc is not None:
                mlflow.set_tag("error", f"{exc_type.__name__}: {exc}"[:5000])
            if getattr(exc, "step", None) is not None:
                mlflow.set_tag("failed_step", str(exc.step))
        if exc is not None:
            exc.run_id = self.run_id  # lets the one-line report name the run
        mlflow.end_run(status)
        return False

    def set_tags(self, tags: Dict[str, object]) -> None:
        mlflow.set_tags({k: str(v) for k, v in tags.items()})

    def log_environment(self, env: Dict[str, object]) -> None:
        mlflow.log_dict(env, "environment.json")

    def log_steps(self, rows: List[dict]) -> None:
        """Per-step series (`log_batch`, step = global step), `steps.csv` and `timeline.png`.
        A column a loop adds to the rows (Lightning's `lightning_ms`) is logged too."""
        extra = tuple(k for k in (rows[0] if rows else {}) if k not in STEP_COLUMNS and not k.startswith("_"))
        # A GPU time of a step outside the meter's timed runs is nan: not logged (see trainer.loop.meter).
        metrics = [Metric(k, float(r[k]), 0, int(r["step"])) for r in rows for k in PER_STEP_METRICS + extra
                   if not math.isnan(float(r[k]))]
        for i in range(0, len(metrics), 1000):  # log_batch takes at most 1000 metrics
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000], synchronous=True)
        self.log_rows(rows, "steps.csv")
        with tempfile.TemporaryDirectory() as tmp:
            if rows:
                title = f"{self.cfg.loader.name} · {self.cfg.model.name} · {self.cfg.dataset.name}"
                mlflow.log_artifact(str(plots.timeline(rows, Path(tmp) / "timeline.png",
                                                       self.cfg.engine.warmup_steps, title)))

    def log_rows(self, rows: List[dict], name: str) -> None:
        """Per-step rows as a CSV artifact (`steps.csv`; another rank's: `steps_rank1.csv`)."""
        extra = [k for k in (rows[0] if rows else {}) if k not in STEP_COLUMNS and not k.startswith("_")]
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / name
            with path.open("w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(STEP_COLUMNS) + extra, extrasaction="ignore")
                w.writeheader()
                w.writerows(rows)
            mlflow.log_artifact(str(path))

    def log_summary(self, summary: Dict[str, float]) -> None:
        mlflow.log_metrics({k: float(v) for k, v in summary.items()})

    def log_artifact(self, path: Path) -> None:
        mlflow.log_artifact(str(path))


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
