"""Datasets: the synthetic chunks, and MNIST / CIFAR-10 read by torchvision's own classes from
files written in their real on-disk formats (trainer.fake_data)."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torchvision

from datasets import DATASETS, BuiltOnce, build_dataset
from datasets.synthetic import SyntheticDataset
from models import build_model
from trainer.config import PROJECT_ROOT
from trainer.errors import ConfigError
from trainer.fake_data import write_cifar10, write_mnist
from trainer.loop.run import run

from conftest import compose_config

QUICK = ["loader.batch_size=16", "engine.epochs=1", "engine.warmup_steps=1", "engine.progress=false", "engine.device=cpu"]
MNIST_FILES = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]
CIFAR_FILES = [f"data_batch_{k}" for k in range(1, 6)] + ["test_batch", "batches.meta"]


def synthetic(*overrides: str) -> SyntheticDataset.Config:
    """The typed config of `dataset=synthetic` (checked: a bad value raises its ConfigError)."""
    return DATASETS.config(compose_config("dataset=synthetic", "dataset.shape=[4,6]", *overrides).dataset)


def vision(name: str, root: Path, *overrides: str):
    extra = ["dataset.verify_md5=false"] if name == "cifar10" else []
    return compose_config(f"dataset={name}", f"dataset.root={root}", "dataset.download=false", *extra, *overrides).dataset


# ----------------------------------------------------------------------------- synthetic
def test_chunks_are_reproducible_however_they_are_read():
    ds = SyntheticDataset(synthetic("dataset.num_samples=50", "dataset.chunks=5", "dataset.seed=3"))
    assert (ds.chunk_samples, ds.num_chunks, len(ds)) == (10, 5, 50)
    x2, y2 = ds.load_chunk(2)
    assert x2.shape == (10, 4, 6) and x2.dtype == torch.float32 and 0 <= x2.min() and x2.max() < 1
    assert torch.equal(ds.load_chunk(2)[0], x2)  # the same bytes on every load
    out = torch.zeros(10, 4, 6)
    assert torch.equal(ds.load_chunk(2, out=out)[0], x2) and torch.equal(out, x2)  # written into the caller's buffer
    assert torch.equal(ds.materialize()[20:30], x2) and torch.equal(y2, ds.labels[20:30])
    assert not torch.equal(ds.load_chunk(3)[0], x2)
    other = SyntheticDataset(synthetic("dataset.num_samples=50", "dataset.chunks=5", "dataset.seed=4"))
    assert not torch.equal(other.load_chunk(2)[0], x2)


def test_labels_are_fixed_per_sample_whatever_the_chunking():
    one = SyntheticDataset(synthetic("dataset.num_samples=200"))
    four = SyntheticDataset(synthetic("dataset.num_samples=200", "dataset.chunks=4"))
    assert torch.equal(one.labels, four.labels) and one.labels.dtype == torch.int64
    assert set(one.labels.tolist()) == set(range(10))


@pytest.mark.parametrize("overrides,chunk_samples,num_chunks", [
    (["dataset.num_samples=1000", "dataset.chunks=4"], 250, 4),
    (["dataset.num_samples=1000", "dataset.chunk_samples=250"], 250, 4),
    (["dataset.num_samples=1000", "dataset.chunk_samples=250", "dataset.chunks=4"], 250, 4),
    (["dataset.num_samples=1000", "dataset.chunk_samples=300"], 300, 4),  # the last chunk holds 100
    (["dataset.num_samples=10", "dataset.chunks=3"], 4, 3),
])
def test_chunking_by_chunks_or_by_chunk_samples(overrides, chunk_samples, num_chunks):
    ds = SyntheticDataset(synthetic(*overrides))
    assert (ds.chunk_samples, ds.num_chunks) == (chunk_samples, num_chunks)
    sizes = [b - a for a, b in map(ds.chunk_range, range(ds.num_chunks))]
    assert sum(sizes) == len(ds) and all(s == chunk_samples for s in sizes[:-1])


@pytest.mark.parametrize("overrides,fix", [
    (["dataset.num_samples=1000", "dataset.chunk_samples=1000", "dataset.chunks=2"], "dataset.num_samples=2000"),
    (["dataset.num_samples=10", "dataset.chunks=6"], "dataset.chunks=5"),
    (["dataset.num_samples=4", "dataset.chunks=5"], "dataset.chunks=1"),
    (["dataset.chunk_samples=5000"], "dataset.num_samples=5000"),
    (["dataset.num_samples=0"], "dataset.num_samples=1000"),
    (["dataset.shape=[4,0]"], "dataset.shape=[256,256]"),
    (["dataset.dtype=int64"], "dataset.dtype=float32"),
    (["dataset.load_ms=-1"], "dataset.load_ms=0"),
])
def test_bad_synthetic_values_say_how_to_fix_them(overrides, fix):
    with pytest.raises(ConfigError, match=fix.replace("[", r"\[")):
        SyntheticDataset(synthetic(*overrides))


@pytest.mark.parametrize("dtype,nbytes", [("float32", 4), ("float16", 2), ("bfloat16", 2), ("uint8", 1)])
def test_storage_dtype_crosses_as_is_and_becomes_float32_input(dtype, nbytes):
    ds = SyntheticDataset(synthetic("dataset.num_samples=8", f"dataset.dtype={dtype}"))
    x, _ = ds.load_chunk(0)
    assert x.dtype == ds.storage_dtype and x.element_size() == nbytes and ds.sample_bytes == 24 * nbytes
    model_input = ds.on_device(x)
    assert model_input.dtype == torch.float32 and 0 <= model_input.min() and model_input.max() <= 1
    expected = x.float() / 255 if dtype == "uint8" else x.float()
    assert torch.equal(model_input, expected)
    item, label = ds.per_sample()[5]
    assert torch.equal(item, model_input[5]) and label == ds.labels[5]


def test_iterable_chunks_loads_each_chunk_then_draws_batches_from_it():
    ds = SyntheticDataset(synthetic("dataset.num_samples=30", "dataset.chunk_samples=10", "dataset.batches_per_chunk=4",
                                    "dataset.load_ms=40"))
    it = ds.iterable(batch_size=8)
    assert len(it) == 12
    start = time.perf_counter()
    batches = list(it)
    assert time.perf_counter() - start >= 3 * 0.040  # one simulated disk read per chunk
    assert len(batches) == 12 and all(x.shape == (8, 4, 6) and y.shape == (8,) for x, y in batches)
    # The same samples as the map-style view, row for row.
    samples = ds.per_sample()
    batch_rows = [(c, rows) for c in range(3) for rows in it.rows(0, c)]
    for (x, y), (chunk, rows) in zip(batches, batch_rows):
        index = rows + ds.chunk_range(chunk)[0]
        assert torch.equal(x, torch.stack([samples[int(i)][0] for i in index]))
        assert torch.equal(y, torch.stack([samples[int(i)][1] for i in index]))
    # Every batch of chunk c comes from chunk c's rows; a new epoch draws other rows.
    assert all(0 <= r.min() and r.max() < 10 for _, r in batch_rows)
    assert not all(torch.equal(a, b) for a, b in zip(it.rows(0, 0), it.rows(1, 0)))
    second = list(it)
    assert not torch.equal(second[0][0], batches[0][0])


def test_iterable_chunks_one_pass_per_chunk_by_default():
    ds = SyntheticDataset(synthetic("dataset.num_samples=50", "dataset.chunks=2"))
    it = ds.iterable(batch_size=8)
    assert len(it) == 2 * math.ceil(25 / 8) == len(list(it))


def test_iterable_chunks_in_dataloader_workers_serves_each_chunk_once():
    ds = SyntheticDataset(synthetic("dataset.num_samples=40", "dataset.chunks=4", "dataset.batches_per_chunk=2"))
    in_process = list(ds.iterable(batch_size=4))
    loader = torch.utils.data.DataLoader(ds.iterable(batch_size=4), batch_size=None, num_workers=2)
    with_workers = list(loader)
    key = lambda batch: (batch[0].sum().item(), batch[1].tolist())  # noqa: E731
    assert len(with_workers) == len(in_process) == 8
    assert sorted(map(key, with_workers)) == sorted(map(key, in_process))


# ----------------------------------------------------------------------------- mnist / cifar10
@pytest.fixture
def mnist_root(tmp_path):
    written = write_mnist(tmp_path, n_train=40, n_test=12, seed=1)
    return tmp_path, written


@pytest.fixture
def cifar_root(tmp_path):
    written = write_cifar10(tmp_path, n_train=23, n_test=9, seed=2)
    return tmp_path, written


def test_fake_files_are_in_torchvision_layout(mnist_root, cifar_root):
    raw = mnist_root[0] / "MNIST" / "raw"
    assert sorted(p.name for p in raw.iterdir()) == sorted(MNIST_FILES + [f + ".gz" for f in MNIST_FILES])
    assert (raw / "train-images-idx3-ubyte").stat().st_size == 16 + 40 * 28 * 28
    assert (raw / "train-labels-idx1-ubyte").read_bytes()[:8] == bytes([0, 0, 8, 1, 0, 0, 0, 40])
    assert sorted(p.name for p in (cifar_root[0] / "cifar-10-batches-py").iterdir()) == sorted(CIFAR_FILES)


def test_fake_data_command_writes_both_datasets_named_as_random(tmp_path, capsys):
    """`python -m trainer.fake_data`: small files torchvision reads as MNIST and CIFAR-10, a README.txt and
    its output saying they are random pixels, the overrides to use them; never over files it did not write."""
    from trainer import fake_data
    root = tmp_path / "random_pixels"
    assert fake_data.main(["--root", str(root)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"wrote RANDOM PIXELS in the MNIST and CIFAR-10 file formats under {root}")
    assert f"python -m trainer dataset=mnist model=mlp dataset.root={root} dataset.download=false" in out
    assert "NOT MNIST or CIFAR-10" in (root / "README.txt").read_text()
    mnist = build_dataset(vision("mnist", root))
    cifar = build_dataset(vision("cifar10", root))
    assert (len(mnist), len(cifar)) == (fake_data.SMALL["mnist"][0], fake_data.SMALL["cifar10"][0])
    assert fake_data.main(["--root", str(root), "--seed", "1"]) == 0  # its own files: written again
    real = tmp_path / "real"
    write_mnist(real)  # MNIST files without the README.txt: not the command's to overwrite
    before = (real / "MNIST" / "raw" / "train-images-idx3-ubyte").read_bytes()
    capsys.readouterr()
    assert fake_data.main(["--root", str(real)]) == 1
    assert capsys.readouterr().err.startswith(f"error: {real} already holds MNIST that this command did not write")
    assert (real / "MNIST" / "raw" / "train-images-idx3-ubyte").read_bytes() == before


@pytest.mark.parametrize("train,split,n", [(True, "train", 40), (False, "test", 12)])
def test_mnist_through_torchvision(mnist_root, train, split, n):
    root, written = mnist_root
    ds = build_dataset(vision("mnist", root, f"dataset.train={str(train).lower()}"))
    assert isinstance(ds.tv, torchvision.datasets.MNIST)
    assert (len(ds), ds.sample_shape, ds.storage_dtype, ds.num_classes, ds.num_chunks) == (n, (1, 28, 28), torch.uint8, 10, 1)
    x, y = ds.load_chunk(0)
    assert x.dtype == torch.uint8 and y.dtype == torch.int64
    assert torch.equal(x, torch.from_numpy(written[split][0])) and torch.equal(y, torch.from_numpy(written[split][1]))
    assert ds.nbytes == n * 784


@pytest.mark.parametrize("train,split,n", [(True, "train", 23), (False, "test", 9)])
def test_cifar10_through_torchvision(cifar_root, train, split, n):
    root, written = cifar_root
    ds = build_dataset(vision("cifar10", root, f"dataset.train={str(train).lower()}"))
    assert isinstance(ds.tv, torchvision.datasets.CIFAR10)
    assert (len(ds), ds.sample_shape, ds.storage_dtype, ds.num_classes) == (n, (3, 32, 32), torch.uint8, 10)
    x, y = ds.load_chunk(0)
    # channel planes land where they were written (torchvision hands out H x W x C)
    assert torch.equal(x, torch.from_numpy(written[split][0])) and torch.equal(y, torch.from_numpy(written[split][1]))


@pytest.mark.parametrize("name", ["mnist", "cifar10"])
def test_per_sample_and_tensor_paths_give_identical_normalised_tensors(name, mnist_root, cifar_root):
    root = mnist_root[0]  # both datasets were written under the same tmp_path
    ds = build_dataset(vision(name, root))
    per_sample = ds.per_sample()
    assert per_sample is ds.tv and len(per_sample) == len(ds)
    x, y = ds.load_chunk(0)
    out = torch.empty_like(x)
    assert torch.equal(ds.load_chunk(0, out=out)[0], x)
    on_device = ds.on_device(x)
    assert on_device.dtype == torch.float32 and on_device.shape == (len(ds), *ds.sample_shape)
    for i in range(len(ds)):
        item, label = per_sample[i]
        assert torch.equal(item, on_device[i]), i  # bit for bit: same ops, same order
        assert label == y[i]
    assert ds.on_device(x[:4]).mean().abs() < 2  # normalised, not 0..255


def test_num_samples_takes_the_first_n(mnist_root):
    root, written = mnist_root
    ds = build_dataset(vision("mnist", root, "dataset.num_samples=10"))
    assert len(ds) == 10 and len(ds.per_sample()) == 10
    assert torch.equal(ds.load_chunk(0)[1], torch.from_numpy(written["train"][1][:10]))
    with pytest.raises(ConfigError, match="dataset.num_samples=41 but the MNIST train split has 40 samples"):
        build_dataset(vision("mnist", root, "dataset.num_samples=41"))


def test_models_adapt_to_the_images(mnist_root, cifar_root):
    root = mnist_root[0]
    for name, d in (("mnist", 784), ("cifar10", 3072)):
        ds = build_dataset(vision(name, root))
        mlp = build_model(compose_config("model=mlp").model, ds.sample_shape, ds.num_classes)
        assert (mlp.net[1].in_features, mlp.net[-1].out_features) == (d, 10)
        x = ds.on_device(ds.load_chunk(0)[0][:5])
        ae = build_model(compose_config("model=autoencoder").model, ds.sample_shape, ds.num_classes)
        assert ae.decoder(ae.encoder(x.flatten(1))).shape == (5, d)


def test_root_defaults_to_data_under_the_project():
    for name in ("mnist", "cifar10"):
        cfg = compose_config(f"dataset={name}").dataset
        assert cfg.root == str(PROJECT_ROOT / "data") and Path(cfg.root).is_absolute() and cfg.download is True


# ----------------------------------------------------------------------------- clear errors
def _one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("name,files", [("mnist", MNIST_FILES), ("cifar10", CIFAR_FILES)])
def test_missing_files_name_the_root_the_files_and_the_fix(tmp_path, name, files):
    with pytest.raises(ConfigError) as error:
        build_dataset(vision(name, tmp_path))
    message = _one_line(error)
    assert f"dataset.root={tmp_path}" in message and "dataset.download=true" in message
    assert all(f in message for f in files)
    assert isinstance(error.value.__cause__, RuntimeError)  # torchvision's own error, kept as the cause


def test_truncated_mnist_file_is_reported_as_such(mnist_root):
    root, _ = mnist_root
    images = root / "MNIST" / "raw" / "train-images-idx3-ubyte"
    images.write_bytes(images.read_bytes()[:5000])  # an interrupted copy
    with pytest.raises(ConfigError) as error:
        build_dataset(vision("mnist", root))
    message = _one_line(error)
    assert "train-images-idx3-ubyte is truncated or corrupt (5000 bytes; its header 40x28x28 needs 31376)" in message
    assert "dataset.download=true" in message and str(root) in message


def test_mnist_archive_not_yet_extracted_is_reported(mnist_root):
    root, _ = mnist_root
    (root / "MNIST" / "raw" / "train-labels-idx1-ubyte").unlink()
    with pytest.raises(ConfigError) as error:
        build_dataset(vision("mnist", root))
    assert "missing train-labels-idx1-ubyte (train-labels-idx1-ubyte.gz is there but incomplete or not the official file)" in _one_line(error)


def test_cifar10_checks_md5_unless_told_not_to(cifar_root, capsys):
    root, _ = cifar_root
    with pytest.raises(ConfigError) as error:
        build_dataset(vision("cifar10", root, "dataset.verify_md5=true"))
    message = _one_line(error)
    assert "fail torchvision's md5 check" in message and "set dataset.verify_md5=false" in message
    assert all(f in message for f in CIFAR_FILES)
    capsys.readouterr()
    ds = build_dataset(vision("cifar10", root, "dataset.verify_md5=false"))
    assert len(ds) == 23
    warning = capsys.readouterr().err.strip()
    assert warning.startswith("warning: dataset.verify_md5=false") and str(root) in warning and "\n" not in warning


def test_truncated_cifar10_batch_is_reported_as_such(cifar_root):
    root, _ = cifar_root
    batch = root / "cifar-10-batches-py" / "data_batch_3"
    batch.write_bytes(batch.read_bytes()[:1000])
    with pytest.raises(ConfigError) as error:
        build_dataset(vision("cifar10", root))
    assert "data_batch_3 cannot be unpickled (truncated or corrupt)" in _one_line(error)


@pytest.mark.parametrize("name", ["mnist", "cifar10"])
def test_failed_download_fails_fast_with_one_line(tmp_path, monkeypatch, name):
    """download=true without a network: every connection is refused (a proxy on a closed port)."""
    import urllib.request
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    for var in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(urllib.request, "_opener", None)  # urlopen builds its opener (and reads the proxy) once
    start = time.perf_counter()
    with pytest.raises(ConfigError) as error:
        build_dataset(vision(name, tmp_path, "dataset.download=true"))
    assert time.perf_counter() - start < 20
    message = _one_line(error)
    assert "failed (<urlopen error" in message and f"dataset.root={tmp_path}" in message
    assert "rerun with internet access" in message and "dataset.download=false" in message


@pytest.mark.parametrize("strategy", ["baseline", "pinned", "prefetch", "pinned_chunk", "pinned_gather", "gpu_resident"])
def test_every_loader_feeds_the_same_normalised_images(mnist_root, strategy):
    """DataLoader strategies take the per-sample path, the others the tensor path: same values."""
    from trainer.loaders import build_loader
    root, written = mnist_root
    ds = build_dataset(vision("mnist", root))
    cfg = compose_config(f"loader={strategy}", "loader.batch_size=16", "loader.shuffle=false").loader
    with build_loader(cfg, ds, torch.device("cpu")) as loader:
        batches = list(loader)
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    expected = torchvision.transforms.Normalize(ds.mean, ds.std)(torch.from_numpy(written["train"][0]).float().div(255))
    assert [len(b[0]) for b in batches] == [16, 16, 8]
    assert torch.equal(x, expected) and torch.equal(y, torch.from_numpy(written["train"][1]))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["mnist", "cifar10"])
def test_normalising_on_the_gpu_matches_the_per_sample_transform(name, mnist_root, cifar_root):
    ds = build_dataset(vision(name, mnist_root[0]))
    x, _ = ds.load_chunk(0)
    on_gpu = ds.on_device(x.cuda()).cpu()
    assert torch.equal(on_gpu, torch.stack([ds.per_sample()[i][0] for i in range(len(ds))]))


# ----------------------------------------------------------------------------- end to end
def test_mnist_mlp_pinned_and_cifar10_autoencoder_prefetch_train(mnist_root, cifar_root, tracking_uri, runs):
    root = mnist_root[0]
    mnist = run(compose_config(*QUICK, "dataset=mnist", f"dataset.root={root}", "dataset.download=false",
                               "model=mlp", "loader=pinned", f"tracking.uri={tracking_uri}"))
    cifar = run(compose_config(*QUICK, "dataset=cifar10", f"dataset.root={root}", "dataset.download=false",
                               "dataset.verify_md5=false", "model=autoencoder", "loader=prefetch", f"tracking.uri={tracking_uri}"))
    assert (mnist["total_steps"], mnist["total_samples"]) == (3, 40)
    assert (cifar["total_steps"], cifar["total_samples"]) == (2, 23)
    assert math.isfinite(mnist["final_loss"]) and math.isfinite(cifar["final_loss"])
    found = {r.data.tags["dataset"]: r for r in runs()}
    assert found["mnist"].data.tags["model"] == "mlp" and found["cifar10"].data.tags["strategy"] == "prefetch"
    assert all(r.info.status == "FINISHED" for r in found.values())


# `python -m trainer` training on these files: the sweeps of seeds 002-004 (test_presets.py).
def _trainer(*args: str, cwd: Path, env=None):
    return subprocess.run([sys.executable, "-m", "trainer", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=env)


def test_missing_dataset_exits_non_zero_with_one_line(tmp_path, tracking_uri, runs):
    runs()  # create the store first: MLflow logs its own lines when it creates a new database
    empty = tmp_path / "empty"
    proc = _trainer("dataset=mnist", f"dataset.root={empty}", "dataset.download=false", "engine.progress=false",
                    f"tracking.uri={tracking_uri}", cwd=tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "Traceback" not in output
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert f"dataset.root={empty}" in lines[0] and "train-images-idx3-ubyte" in lines[0] and "dataset.download=true" in lines[0]
    (r,) = runs()
    assert r.info.status == "FAILED" and "dataset.root" in r.data.tags["error"]


def test_many_runs_of_one_process_share_one_dataset_unless_it_is_large(monkeypatch):
    """The advisor's rungs and the overhead tool's rounds build a dataset once and hand it again
    while its config section is the same; another section builds the next (the last one let go).
    One of more than a quarter of the host's free memory is built for each run, never kept."""
    import trainer.memory
    built = BuiltOnce()
    small, other = compose_config(*TINY_DATASET).dataset, compose_config(*TINY_DATASET, "dataset.seed=1").dataset
    first = built(small)
    assert built(small) is first and built(other) is not first and built(other) is built(other)
    monkeypatch.setattr(trainer.memory, "host_available_bytes", lambda: 4 * first.nbytes - 1)
    large = BuiltOnce()
    assert large(small) is not large(small) and large.dataset is None


def test_many_runs_of_one_process_share_one_models_initial_weights(tmp_path, monkeypatch):
    """The advisor's rungs build the model once (`models.BuiltOnce`): each run gets its own copy of
    the weights the seed gives, whatever the run's loader drew from the generator before, and the
    generator is left as it was. Another seed or section builds anew; a model over what may be
    kept (the advisor: a quarter of the host's free memory) is built for each run; two runs of
    one job train alike."""
    import models
    cfg = compose_config(*TINY_DATASET, "model=mlp")
    shape, classes = (8, 8), 10
    torch.manual_seed(0)
    reference = models.build_model(cfg.model, shape, classes)
    weights = models.BuiltOnce()
    for drawn in (0, 3):
        torch.manual_seed(0)
        torch.rand(drawn)  # a loader drew from the generator before the model was asked for
        before = torch.get_rng_state()
        model = weights(cfg.model, shape, classes, torch.device("cpu"))
        assert torch.equal(torch.get_rng_state(), before)
        assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters()))
        with torch.no_grad():
            next(model.parameters()).add_(1.0)  # a run trains its copy: the next copy is untouched
    cached = weights.model
    torch.manual_seed(1)
    assert not torch.equal(next(weights(cfg.model, shape, classes, torch.device("cpu")).parameters()),
                           next(reference.parameters())) and weights.model is not cached
    # A model without weights (the advisor's feed-alone rungs) leaves the kept one alone.
    kept = weights.model
    assert weights(compose_config("model=noop").model, shape, classes, torch.device("cpu")) is not None
    assert weights.model is kept
    # A parameter a copy would make plain (a subclass, attributes of its own): built for each run.
    model = models.build_model(cfg.model, shape, classes)
    next(model.parameters()).note = "kept"
    assert not models._copyable(model) and models._copyable(reference)
    job = compose_config(*TINY_DATASET, "model=mlp", "engine.max_steps=6", "engine.warmup_steps=2",
                         f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}")
    builds = []  # weights made (the run's size checks build on the meta device: no weights)
    monkeypatch.setattr(models, "build_model", lambda *a: builds.extend(
        [a] if torch.get_default_device().type != "meta" else []) or build_model(*a))
    shared = models.BuiltOnce()
    first, second = (run(job, models=shared)["final_loss"] for _ in range(2))
    assert first == second and len(builds) == 1 and shared.model is not None
    large = models.BuiltOnce(keep_at_most=lambda: 1)
    assert large(cfg.model, shape, classes, torch.device("cpu")) is not None and large.model is None


TINY_DATASET = ("dataset.num_samples=96", "dataset.shape=[8,8]")
