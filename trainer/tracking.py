"""MLflow bookkeeping: one run per experiment job, written only outside the timed loop.

Default store: sqlite `outputs/mlflow.db` at the project root, artifacts under `outputs/mlartifacts`,
both absolute so the UI (`mlflow ui --backend-store-uri sqlite:///.../outputs/mlflow.db`) finds them
wherever the job was launched from.
"""

from __future__ import annotations

import csv
import http.client
import importlib.util
import os
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional

import mlflow
from mlflow.entities import Metric, RunStatus
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from trainer import plots
from trainer.config import PROJECT_ROOT
from trainer.errors import ConfigError
from trainer.meter import STEP_COLUMNS

OUTPUTS = PROJECT_ROOT / "outputs"
PER_STEP_METRICS = ("data_wait_ms", "h2d_ms", "compute_ms", "step_ms", "loss")


def default_uri() -> str:
    return f"sqlite:///{OUTPUTS / 'mlflow.db'}"


def artifact_root(uri: str) -> Optional[str]:
    """Artifacts beside a local sqlite DB; a server decides for itself."""
    if uri.startswith("sqlite:///"):
        return (Path(uri[len("sqlite:///"):]).parent / "mlartifacts").as_uri()
    return None


def experiment_id(client: MlflowClient, name: str, uri: str) -> str:
    """The experiment's id, created on first use with its artifacts beside a sqlite DB."""
    exp = client.get_experiment_by_name(name)
    return exp.experiment_id if exp else client.create_experiment(name, artifact_location=artifact_root(uri))


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


PREFLIGHT_TIMEOUT_S = 5.0  # MLflow itself retries an unreachable server for minutes


def check_tracking_uri(uri: Optional[str]) -> None:
    """Fail before anything runs when runs could not be recorded at `tracking.uri`: a server that
    does not answer, or a sqlite file in a missing or read-only folder."""
    target = uri or default_uri()
    if target.startswith(("http://", "https://")):
        try:
            urllib.request.urlopen(target.rstrip("/") + "/health", timeout=PREFLIGHT_TIMEOUT_S).close()
        except urllib.error.HTTPError:
            pass  # the server answered (an error page still proves it is there)
        except (OSError, http.client.HTTPException) as e:  # refused, timed out, not an HTTP server
            raise ConfigError(f"tracking.uri={target} is unreachable ({getattr(e, 'reason', e)}): start the MLflow "
                              f"server there, or set tracking.uri=null to record in {default_uri()}") from None
    elif target.startswith("sqlite:///"):
        db = Path(target[len("sqlite:///"):])
        try:
            if uri is None:
                OUTPUTS.mkdir(parents=True, exist_ok=True)
            elif not db.parent.is_dir():
                raise ConfigError(f"tracking.uri={target}: folder {db.parent} does not exist: create it "
                                  f"(mkdir -p {db.parent}) or set tracking.uri=null")
            with tempfile.TemporaryFile(dir=db.parent):  # sqlite also writes a journal beside the file
                pass
            if db.exists() and (db.is_dir() or not os.access(db, os.W_OK)):
                raise PermissionError(0, f"{db} is not a writable file")
        except OSError as e:
            fix = "set tracking.uri=null" if uri else "set tracking.uri=sqlite:////<a writable folder>/mlflow.db"
            raise ConfigError(f"tracking.uri={target}: cannot write in {db.parent} ({e.strerror or e}): "
                              f"use a writable folder or {fix}") from None


def flatten(cfg) -> Dict[str, str]:
    """The composed config as `section.key -> value` params."""
    out: Dict[str, str] = {}

    def walk(node, prefix):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            out[prefix[:-1]] = str(node)

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return out


class Tracker:
    """One MLflow run. Use as a context manager: an exception marks the run FAILED, an interrupt
    KILLED, and whatever was logged before stays."""

    def __init__(self, cfg, tags: Dict[str, str]):
        self.cfg = cfg
        self.uri = cfg.tracking.uri or default_uri()
        if self.uri == default_uri():
            OUTPUTS.mkdir(parents=True, exist_ok=True)
        mlflow.set_tracking_uri(self.uri)
        self.client = MlflowClient(self.uri)
        exp_id = experiment_id(self.client, cfg.tracking.experiment, self.uri)
        from trainer.sweep import child_identity  # here: trainer.sweep imports this module
        sweep_name, sweep_tags = child_identity(self.client, cfg)  # nested under tracking.parent_run_id
        self.run = mlflow.start_run(experiment_id=exp_id, run_name=cfg.tracking.run_name or sweep_name,
                                    tags={**tags, **sweep_tags}, log_system_metrics=system_metrics(cfg.tracking))
        self.run_id = self.run.info.run_id
        params = flatten(cfg)
        items = list(params.items())
        for i in range(0, len(items), 100):  # log_batch takes at most 100 params
            mlflow.log_params(dict(items[i:i + 100]))
        mlflow.log_text(OmegaConf.to_yaml(cfg, resolve=True), "config.yaml")

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
        """Per-step series (`log_batch`, step = global step), `steps.csv` and `timeline.png`."""
        metrics = [Metric(k, float(r[k]), 0, int(r["step"])) for r in rows for k in PER_STEP_METRICS]
        for i in range(0, len(metrics), 1000):  # log_batch takes at most 1000 metrics
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000], synchronous=True)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "steps.csv"
            with path.open("w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=STEP_COLUMNS, extrasaction="ignore")
                w.writeheader()
                w.writerows(rows)
            mlflow.log_artifact(str(path))
            if rows:
                title = f"{self.cfg.loader.name} · {self.cfg.model.name} · {self.cfg.dataset.name}"
                mlflow.log_artifact(str(plots.timeline(rows, Path(tmp) / "timeline.png",
                                                       self.cfg.engine.warmup_steps, title)))

    def log_summary(self, summary: Dict[str, float]) -> None:
        mlflow.log_metrics({k: float(v) for k, v in summary.items()})

    def log_artifact(self, path: Path) -> None:
        mlflow.log_artifact(str(path))
