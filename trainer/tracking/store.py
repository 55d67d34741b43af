"""Where runs are stored: the default sqlite store, its artifact folder, and the up-front check
that `tracking.uri` can be written. Imported by the run tracker, the sweep and the report alike.
"""

from __future__ import annotations

import http.client
import os
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, Optional

from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from trainer.config import BASE_DIR
from trainer.errors import ConfigError

OUTPUTS = BASE_DIR / "outputs"  # the checkout's outputs/, or ./outputs for an installed package
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
