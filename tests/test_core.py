"""The core contract: composition, the CPU path of every loader, and what a run leaves in MLflow."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from mlflow.tracking import MlflowClient

from trainer.config import PROJECT_ROOT, SCHEMAS
from trainer.loop.run import run
from trainer.tracking.runs import PER_STEP_METRICS

from conftest import compose_config

SUMMARIES = ["throughput_samples_per_s", "data_wait_fraction", "gpu_busy_fraction", "h2d_GBps", "setup_s",
             "peak_gpu_mem_mb", "total_steps", "total_samples"]
TAGS = ["strategy", "dataset", "model", "device", "degraded", "gpu_name", "torch_version", "cuda_version"]


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in SCHEMAS.items() for o in opts])
def test_every_option_composes(group, option):
    cfg = compose_config(f"{group}={option}")
    assert cfg[group].name == option
    # the YAML file of every option exists and is the one composed
    assert (PROJECT_ROOT / "conf" / group / f"{option}.yaml").is_file()


def test_defaults():
    cfg = compose_config()
    assert (cfg.dataset.name, cfg.loader.name, cfg.model.name) == ("synthetic", "baseline", "autoencoder")
    assert set(cfg.engine) >= {"device", "seed", "epochs", "max_steps", "warmup_steps", "verify", "progress"}
    assert set(cfg.loader) >= {"batch_size", "num_workers", "prefetch_factor", "persistent_workers", "shuffle"}
    assert set(cfg.tracking) >= {"uri", "experiment"}


@pytest.mark.parametrize("override", ["loader.pin_memroy=true", "loader.batch_size=abc", "engine.epochs=many",
                                      "model.hidden=1.5", "dataset.shape=[a]"])
def test_schema_rejects_typos_and_types(override):
    with pytest.raises(ConfigCompositionException):
        compose_config(override)


@pytest.mark.parametrize("strategy", list(SCHEMAS["loader"]))
def test_each_loader_runs_on_cpu_and_records_the_contract(strategy, tiny_cfg, runs):
    summary = run(tiny_cfg(f"loader={strategy}"))
    assert summary["throughput_samples_per_s"] > 0
    assert summary["total_steps"] == 6 and summary["total_samples"] == 96
    (r,) = runs()
    assert r.info.status == "FINISHED"
    for key in SUMMARIES + list(PER_STEP_METRICS):
        assert key in r.data.metrics, key
    for tag in TAGS:
        assert tag in r.data.tags, tag
    assert r.data.tags["strategy"] == strategy and r.data.tags["device"] == "cpu"
    assert r.data.tags["degraded"] == ("false" if strategy == "baseline" else "true")
    assert r.data.params["loader.batch_size"] == "16" and r.data.params["engine.device"] == "cpu"
    assert r.data.metrics["h2d_ms"] == 0.0  # no copy on CPU


def test_per_step_series_and_artifacts(tiny_cfg, tracking_uri, runs):
    run(tiny_cfg("engine.epochs=2"))
    (r,) = runs()
    client = MlflowClient(tracking_uri)
    history = client.get_metric_history(r.info.run_id, "step_ms")
    assert sorted(m.step for m in history) == list(range(1, 13))
    names = {a.path for a in client.list_artifacts(r.info.run_id)}
    assert {"config.yaml", "steps.csv", "environment.json"} <= names
    local = Path(client.download_artifacts(r.info.run_id, "steps.csv"))
    rows = list(csv.DictReader(io.StringIO(local.read_text())))
    assert len(rows) == 12 and [int(x["step"]) for x in rows] == list(range(1, 13))
    assert {int(x["epoch"]) for x in rows} == {0, 1}
    assert all(float(x["step_ms"]) >= float(x["compute_ms"]) > 0 for x in rows)
    env = json.loads(Path(client.download_artifacts(r.info.run_id, "environment.json")).read_text())
    assert env["torch"] and env["cpu"] and env["python"]


def test_max_steps_caps_across_epochs(tiny_cfg):
    summary = run(tiny_cfg("engine.epochs=5", "engine.max_steps=8"))
    assert summary["total_steps"] == 8


def test_warmup_is_excluded_from_summaries(tiny_cfg):
    summary = run(tiny_cfg("engine.warmup_steps=4"))
    assert summary["timed_steps"] == 2 and summary["total_steps"] == 6


def test_model_input_follows_dataset(tiny_cfg):
    from datasets import build_dataset
    from models import build_model
    cfg = tiny_cfg("dataset.shape=[3,5,7]", "model=mlp")
    ds = build_dataset(cfg.dataset)
    model = build_model(cfg.model, ds.sample_shape, ds.num_classes)
    assert model.net[1].in_features == 105 and model.net[-1].out_features == ds.num_classes


def test_cuda_device_without_cuda_is_an_error(tiny_cfg):
    import torch
    from trainer.errors import ConfigError
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="engine.device=cuda"):
        run(tiny_cfg("engine.device=cuda"))


def test_main_command_and_sweep_from_another_directory(tmp_path, tracking_uri, runs):
    """`python -m trainer -m ...` from elsewhere: three runs in the store named by the URI."""
    cmd = [sys.executable, "-m", "trainer", "-m", "loader=baseline,pinned,prefetch", "engine.max_steps=4",
           "dataset.num_samples=64", "dataset.shape=[8,8]", "engine.progress=false", f"tracking.uri={tracking_uri}"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    found = runs()
    children = [r for r in found if r.data.tags.get("strategy")]
    assert sorted(r.data.tags["strategy"] for r in children) == ["baseline", "pinned", "prefetch"]
    assert all(r.info.status == "FINISHED" for r in children)
    assert not (tmp_path / "outputs").exists()  # nothing written relative to where it was launched
