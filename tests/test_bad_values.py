"""Values that used to reach a library unchecked (torch's seed, a dataset file's labels, the
number of DataLoader workers) and hints that pointed at the wrong key: each is one line naming
the key or the file and the fix."""

from __future__ import annotations

import os
import pickle
import resource
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from clirun import TINY, all_runs, error_line, run_cli
from conftest import compose_config
from datasets import build_dataset
from trainer.fake_data import write_cifar10, write_mnist
from trainer.errors import ConfigError, RunFailed
from trainer.loop.faults import explain_faults
from trainer.memory import host_available_bytes
from trainer.validate import validate


@pytest.mark.parametrize("seed", ["99999999999999999999", "-1", "4294967296"])
def test_a_seed_torch_cannot_take_is_one_line(tmp_path, tracking_uri, seed):
    proc = run_cli(tmp_path, tracking_uri, *TINY, f"engine.seed={seed}")
    error_line(proc, rf"^error: engine\.seed must be from 0 to 4294967295 \(got {seed}\): set engine\.seed=0$")
    assert all_runs(tracking_uri) == []


@pytest.mark.parametrize("overrides,message", [
    (["engine.compile=fast"], "engine.compile must be one of off, default, reduce-overhead, max-autotune, "
                              "max-autotune-no-cudagraphs (got 'fast'): set engine.compile=default (torch.compile's "
                              "default mode), or engine.compile=off"),
    (["engine.compile=true"], "engine.compile must be one of off, default, reduce-overhead, max-autotune, "
                              "max-autotune-no-cudagraphs (got 'True'): set engine.compile=default (torch.compile's "
                              "default mode), or engine.compile=off"),
    (["engine.compile=default", "engine.cuda_graph=true"],
     "engine.compile=default cannot be used with engine.cuda_graph=true (torch.compile records its own CUDA graphs in "
     "mode reduce-overhead): set engine.compile=reduce-overhead engine.cuda_graph=false, or engine.compile=off"),
    (["engine.optimizer.impl=apex"], "engine.optimizer.impl must be one of default, for-loop, foreach, fused (got "
                                     "'apex'): set engine.optimizer.impl=fused"),
])
def test_a_bad_compile_or_optimizer_implementation_is_one_line(overrides, message):
    with pytest.raises(ConfigError) as refused:
        validate(compose_config(*TINY, *overrides))
    assert str(refused.value) == message


def test_the_largest_seed_runs(tiny_cfg, runs):
    from trainer.loop.run import run
    assert run(tiny_cfg("engine.seed=4294967295", "loader.shuffle=true"))["total_steps"] == 6


# -- a dataset file's labels ---------------------------------------------------------------------------
def vision(name: str, root: Path, *overrides: str):
    extra = ["dataset.verify_md5=false"] if name == "cifar10" else []
    return compose_config(f"dataset={name}", f"dataset.root={root}", *extra, *overrides).dataset


def test_a_label_out_of_range_in_an_mnist_file_names_the_file(tmp_path, tracking_uri):
    write_mnist(tmp_path)
    labels = tmp_path / "MNIST" / "raw" / "train-labels-idx1-ubyte"
    data = bytearray(labels.read_bytes())
    data[8 + 7] = 12  # after the IDX header: sample 7's label
    labels.write_bytes(bytes(data))
    proc = run_cli(tmp_path, tracking_uri, *[o for o in TINY if not o.startswith(("dataset.shape", "dataset.num_samples"))],
                   "dataset=mnist", f"dataset.root={tmp_path}", "dataset.download=false")
    error_line(proc, rf"^error: dataset=mnist: {labels} gives sample 7 the label 12, not one of MNIST's 10 classes "
                     r"\(0 to 9\): the file is damaged or not MNIST's; delete it and rerun with dataset\.download=true, "
                     r"or copy the intact file there \(run \w+ marked FAILED\)$")


def test_a_label_out_of_range_in_a_cifar10_batch_names_the_batch(tmp_path):
    write_cifar10(tmp_path)  # 50 training samples, 10 per batch
    batch = tmp_path / "cifar-10-batches-py" / "data_batch_3"
    content = pickle.loads(batch.read_bytes(), encoding="latin1")
    content["labels"][2] = -1
    batch.write_bytes(pickle.dumps(content, protocol=2))
    with pytest.raises(ConfigError, match=rf"^dataset=cifar10: {batch} gives sample 2 the label -1, not one of CIFAR-10's"):
        build_dataset(vision("cifar10", tmp_path, "dataset.download=false"))
    # a label past the samples the run takes is not its concern
    assert len(build_dataset(vision("cifar10", tmp_path, "dataset.download=false", "dataset.num_samples=22"))) == 22


def test_cifar10_missing_its_meta_file_with_download_on_says_download_does_not_fetch_it(tmp_path):
    write_cifar10(tmp_path)
    folder = tmp_path / "cifar-10-batches-py"
    (folder / "batches.meta").unlink()
    with pytest.raises(ConfigError) as refused:
        build_dataset(vision("cifar10", tmp_path, "dataset.download=true"))
    assert str(refused.value) == (
        f"dataset=cifar10: CIFAR-10 in {folder} (dataset.root={tmp_path}): missing batches.meta, which "
        f"dataset.download=true did not fetch (torchvision downloads only when the data files are missing or damaged): "
        f"copy those files there, or delete {folder} and rerun to download all of CIFAR-10 again")
    with pytest.raises(ConfigError, match=r"missing batches\.meta: set dataset\.download=true \(needs internet\)"):
        build_dataset(vision("cifar10", tmp_path, "dataset.download=false"))


# -- more workers than cores ---------------------------------------------------------------------------
def test_more_workers_than_cores_warns_once_naming_the_core_count(monkeypatch, capsys):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    validate(compose_config(*TINY, "loader.num_workers=2"))
    assert capsys.readouterr().err == ""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        validate(compose_config(*TINY, "loader.num_workers=500"))
        # PyTorch's own multi-line warning, when the DataLoader is made, would say it again
        warnings.warn("This DataLoader will create 500 worker processes in total. Our suggested max ...", UserWarning)
    assert capsys.readouterr().err == ("warning: loader.num_workers=500 but this machine gives the run 2 CPU cores: the "
                                       "workers take turns on them and the run slows down; set loader.num_workers=2 or "
                                       "fewer\n")
    assert caught == []


def test_dataloader_keys_on_a_strategy_without_a_dataloader_are_said_to_change_nothing(monkeypatch, capsys):
    """pinned_chunk and gpu_resident read the dataset themselves: workers asked of them are not
    made (nor warned about as too many for the cores), and the user is told so in one line."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    validate(compose_config(*TINY, "loader=pinned_chunk", "loader.num_workers=8"))
    assert capsys.readouterr().err == ("warning: loader=pinned_chunk has no DataLoader: loader.num_workers=8 changes "
                                       "nothing in this run (DataLoader keys apply to loader=baseline, pinned, prefetch "
                                       "and iterable_chunks)\n")
    validate(compose_config(*TINY, "loader=gpu_resident", "loader.prefetch_factor=4", "loader.persistent_workers=true"))
    assert "loader.prefetch_factor=4, loader.persistent_workers=True change nothing" in capsys.readouterr().err
    for strategy in ("baseline", "pinned", "prefetch", "iterable_chunks"):
        validate(compose_config(*TINY, f"loader={strategy}", "loader.num_workers=2", "loader.prefetch_factor=4"))
    validate(compose_config(*TINY, "loader=pinned_uva"))
    assert capsys.readouterr().err == ""


# -- out of host memory -----------------------------------------------------------------------------
def test_out_of_host_memory_while_building_the_dataset_leads_with_the_dataset(tiny_cfg):
    def build_dataset():  # as the run calls it: the failed allocation is the dataset's
        raise MemoryError()

    with pytest.raises(RunFailed) as failed:
        with explain_faults(tiny_cfg()):
            build_dataset()
    assert str(failed.value) == ("out of host memory building dataset=synthetic for loader=baseline: the dataset does "
                                 "not fit; set a smaller dataset.num_samples, or a smaller dataset.shape")


LIMIT = 8 << 30  # address space for the run: torch and MLflow fit, a 5.2 GB dataset and its copies do not


@pytest.mark.skipif(host_available_bytes() < 7 << 30, reason="needs ~7 GiB free, so that only the limit refuses the dataset")
def test_a_dataset_over_the_process_memory_limit_is_one_line_naming_the_dataset(tmp_path, tracking_uri):
    """A container's memory limit is not in /proc/meminfo: the up-front check lets it through."""
    proc = subprocess.run([sys.executable, "-m", "trainer", "engine.device=cpu", "engine.max_steps=2", "engine.progress=false",
                           "dataset.num_samples=20000", "dataset.shape=[256,256]", f"tracking.uri={tracking_uri}",
                           f"hydra.run.dir={tmp_path / 'hydra'}"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT)))
    error_line(proc, r"^error: out of host memory building dataset=synthetic for loader=baseline: the dataset does not "
                     r"fit; set a smaller dataset\.num_samples, or a smaller dataset\.shape \(run \w+ marked FAILED\)$")
