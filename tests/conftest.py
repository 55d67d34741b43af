"""Shared fixtures: the real config composed through Hydra, shrunk to CPU and a few steps."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from mlflow.tracking import MlflowClient

import trainer.components  # noqa: F401  (registers every dataset, loader and model option)
from trainer.config import CONF_DIR as _CONF_DIR

CONF_DIR = str(_CONF_DIR)
TINY = ["dataset.num_samples=96", "dataset.shape=[8,8]", "loader.batch_size=16", "engine.epochs=1",
        "engine.warmup_steps=1", "engine.progress=false", "engine.device=cpu"]


def batch_that_runs_out_of_gpu_memory(hidden: int) -> int:
    """A batch for model=mlp whose hidden layer's output alone takes 60% of the free GPU memory:
    the up-front check (a lower bound, each layer's output once) lets it run, and the step, which
    also holds the ReLU's output and both their gradients, runs out of GPU memory."""
    free, _ = torch.cuda.mem_get_info()
    return int(0.6 * free / (4 * hidden))


def compose_config(*overrides: str):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("config", overrides=list(overrides))


@pytest.fixture(scope="session")
def empty_store(tmp_path_factory) -> Path:
    """An MLflow sqlite store with its tables created and nothing in it (MLflow's schema
    migrations take seconds: done once per session, then copied)."""
    db = tmp_path_factory.mktemp("store") / "empty.db"
    MlflowClient(f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture
def tracking_uri(request, tmp_path: Path, empty_store: Path) -> str:
    """A sqlite MLflow store of one test's own, empty. Tests marked `fresh_store` get no file at
    all: the code under test creates the store, as on a first run."""
    db = tmp_path / "mlflow.db"
    if request.node.get_closest_marker("fresh_store") is None:
        shutil.copyfile(empty_store, db)
    return f"sqlite:///{db}"


@pytest.fixture
def tiny_cfg(tracking_uri):
    """`tiny_cfg(*overrides)`: the composed config at tiny size on CPU, tracked in a temp DB."""
    def make(*overrides: str):
        return compose_config(*TINY, f"tracking.uri={tracking_uri}", *overrides)
    return make


@pytest.fixture
def runs(tracking_uri):
    """`runs()`: every run in the temp store, newest first."""
    def read(experiment: str = "feedbench"):
        client = MlflowClient(tracking_uri)
        exp = client.get_experiment_by_name(experiment)
        return client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"]) if exp else []
    return read


def pytest_configure(config):
    config.addinivalue_line("markers", "fresh_store: the test's tracking_uri names no file yet "
                                       "(the code under test creates the store, as on a first run)")


# Variants of a case the default run keeps (another strategy's, another file's, another grammar
# error's line), each several seconds on two cores: they run with `-m slow`, which keeps the default
# run within CI's time.
SLOW_VARIANTS = {
    "test_errors.py::test_more_host_memory_than_available_fails_before_allocating[pinned_chunk]",
    "test_errors.py::test_more_host_memory_than_available_fails_before_allocating[pinned_gather]",
    "test_errors.py::test_more_host_memory_than_available_fails_before_allocating[iterable_chunks]",
    "test_errors.py::test_a_sqlite_file_mlflow_cannot_use_is_refused_untouched[an older MLflow's database]",
    "test_errors.py::test_a_sqlite_file_mlflow_cannot_use_is_refused_untouched[a newer MLflow's database]",
    "test_hydra_errors.py::test_a_sweep_hydra_cannot_expand_is_one_line_and_records_nothing[an interval]",
    "test_hydra_errors.py::test_a_sweep_hydra_cannot_expand_is_one_line_and_records_nothing[a bad range]",
    "test_hydra_errors.py::test_a_sweep_hydra_cannot_expand_is_one_line_and_records_nothing[a glob matching nothing]",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.split("/")[-1] in SLOW_VARIANTS:
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
