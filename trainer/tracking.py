"""MLflow bookkeeping: one run per experiment job, written only outside the timed loop.

Default store: sqlite `outputs/mlflow.db` at the project root, artifacts under `outputs/mlartifacts`,
both absolute so the UI (`mlflow ui --backend-store-uri sqlite:///.../outputs/mlflow.db`) finds them
wherever the job was launched from.
"""

from __future__ import annotations

import csv
import json
import tempfile
from pathlib import Path
from typing import Dict, Iterable, List, Optional

import mlflow
from mlflow.entities import Metric, RunStatus
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from trainer.config import PROJECT_ROOT
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
        exp = self.client.get_experiment_by_name(cfg.tracking.experiment)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(
            cfg.tracking.experiment, artifact_location=artifact_root(self.uri))
        self.run = mlflow.start_run(experiment_id=exp_id, run_name=cfg.tracking.run_name, tags=tags,
                                    log_system_metrics=cfg.tracking.system_metrics or None)
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
        elif issubclass(exc_type, KeyboardInterrupt):
            status = RunStatus.to_string(RunStatus.KILLED)
        else:
            status = RunStatus.to_string(RunStatus.FAILED)
            if exc is not None:
                mlflow.set_tag("error", f"{exc_type.__name__}: {exc}"[:5000])
        mlflow.end_run(status)
        return False

    def set_tags(self, tags: Dict[str, object]) -> None:
        mlflow.set_tags({k: str(v) for k, v in tags.items()})

    def log_environment(self, env: Dict[str, object]) -> None:
        mlflow.log_dict(env, "environment.json")

    def log_steps(self, rows: List[dict]) -> None:
        """Per-step series (`log_batch`, step = global step) and `steps.csv`."""
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

    def log_summary(self, summary: Dict[str, float]) -> None:
        mlflow.log_metrics({k: float(v) for k, v in summary.items()})

    def log_artifact(self, path: Path) -> None:
        mlflow.log_artifact(str(path))
