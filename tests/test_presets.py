"""The `experiment=` presets: every one composes in every combination its sweep declares, the
presets of docs/results.md keep the sizes of the public experiments they rerun, and each runs
through `python -m trainer -m` on the CPU at a tiny size, one MLflow child run per combination.
Also the `iterable_chunks` loader those experiments used."""

from __future__ import annotations

import itertools
import math
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from datasets import build_dataset
from trainer.config import PROJECT_ROOT
from trainer.errors import ConfigError
from trainer.loaders import build_loader
from trainer.tracking.plain import annotate
from trainer.validate import validate

from clirun import run_cli
from conftest import CONF_DIR

PRESETS = sorted(p.stem for p in (PROJECT_ROOT / "conf" / "experiment").glob("*.yaml"))
# What tells the jobs of a sweep apart (MLflow params; a key a loader lacks reads "None").
SETTING = ("loader.name", "loader.variant", "loader.non_blocking", "loader.batch_size", "loader.num_workers",
           "loader.prefetch_factor", "model.name", "model.busy_ms", "engine.cuda_graph", "engine.loop")
CIFAR = ["dataset.download=false", "dataset.verify_md5=false"]
MNIST = ["dataset.download=false"]
STEPS = ["engine.max_steps=3", "engine.warmup_steps=1"]
# Per preset of docs/results.md: the jobs its sweep makes, and the size override that makes each tiny on the CPU
# (the swept keys are left alone, so every combination still runs). `{root}` is the generated data.
RESULTS_PRESETS: Dict[str, Tuple[int, List[str]]] = {
    "copy_4gb": (3, ["dataset.num_samples=64", "dataset.shape=[8,8]", "loader.batch_size=64"]),
    "iterable_chunk_loaders": (8, ["dataset.num_samples=64", "dataset.chunk_samples=32", "dataset.shape=[8,8]",
                            "loader.batch_size=8", "engine.epochs=2"]),
    "pin_memory_cifar": (6, ["dataset.root={root}", *CIFAR, *STEPS]),
    "mnist_mlp": (12, ["dataset.root={root}", *MNIST, *STEPS]),
    "dataloader_grid": (12, ["dataset.root={root}", *CIFAR, *STEPS]),
    "limits": (16, ["dataset.shape=[4]", "engine.epochs=3", "engine.warmup_steps=1"]),
    # the preset's length is engine.max_steps (the notebook's 240 steps, 30 passes of 8): here 2 passes of 8
    "lightning_vs_loop": (10, ["dataset.num_samples=64", "dataset.chunk_samples=32", "dataset.shape=[8,8]",
                               "loader.batch_size=8", "engine.max_steps=16"]),
    "gpu_prefetch": (8, ["dataset.num_samples=64", "dataset.shape=[8,8]", "loader.batch_size=8", "engine.max_steps=12",
                    "engine.warmup_steps=6"]),
}


def compose_preset(*overrides: str, hydra: bool = False):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=hydra)


def sweep_combinations(preset: str) -> List[List[str]]:
    """Every combination of the preset's `hydra.sweeper.params`, as override lists."""
    params = compose_preset(f"experiment={preset}", hydra=True).hydra.sweeper.params or {}
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()])
    axes = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] for o in parsed]
    return [list(combo) for combo in itertools.product(*axes)]


def setting(cfg) -> Tuple[str, ...]:
    return tuple(str(OmegaConf.select(cfg, k, default=None)) for k in SETTING)


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    """MNIST and CIFAR-10 files in their real formats, written by the command the docs give for trying
    the presets offline: the MNIST and CIFAR-10 presets below run end to end on what it wrote."""
    root = tmp_path_factory.mktemp("data") / "random_pixels"
    proc = subprocess.run([sys.executable, "-m", "trainer.fake_data", "--root", str(root)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "RANDOM PIXELS" in proc.stdout and f"dataset.root={root} dataset.download=false" in proc.stdout
    return root


# ----------------------------------------------------------------------------- composition
def test_tiny_overrides_shorten_the_presets_own_length():
    """A preset whose length is `engine.max_steps` (over as many epochs as it takes) is shortened by
    setting max_steps: `engine.epochs` would not count."""
    for preset, (_, tiny) in RESULTS_PRESETS.items():
        if compose_preset(f"experiment={preset}").engine.max_steps:
            assert any(o.startswith("engine.max_steps=") for o in tiny), preset


@pytest.mark.parametrize("preset", PRESETS)
def test_every_sweep_combination_composes_and_validates(preset):
    combos = sweep_combinations(preset)
    if preset in RESULTS_PRESETS:
        assert len(combos) == RESULTS_PRESETS[preset][0]
    settings = set()
    for combo in combos:
        cfg = compose_preset(f"experiment={preset}", *combo)
        validate(cfg)
        for override in combo:
            key, value = override.split("=", 1)
            if key.startswith("+experiment/"):
                continue  # a case file: checked through the settings it makes
            node = OmegaConf.select(cfg, key)
            assert (node.name if key in ("loader", "model", "dataset") else str(node).lower()) == value.lower(), override
        settings.add(setting(cfg))
    assert len(settings) == len(combos)  # no two combinations compose to the same job


def test_benchmark_presets_take_whole_batches_only():
    """A graphed job replays the graph at every step only if every batch has the captured shape:
    the bench_* presets and every preset that sweeps a CUDA graph drop the last partial batch."""
    for preset in PRESETS:
        graphed = any("engine.cuda_graph=true" in combo for combo in sweep_combinations(preset))
        if preset.startswith("bench_") or graphed:
            assert compose_preset(f"experiment={preset}").loader.drop_last, preset


def test_case_files_set_pinning_and_blocking_as_named():
    cases = {case: compose_preset("experiment=dataloader_grid", f"+experiment/copy_mode={case}").loader
             for case in ("pageable", "pinned_blocking", "pinned_async")}
    assert cases["pageable"].name == "baseline" and "non_blocking" not in cases["pageable"]
    assert (cases["pinned_blocking"].name, cases["pinned_blocking"].non_blocking) == ("pinned", False)
    assert (cases["pinned_async"].name, cases["pinned_async"].non_blocking) == ("pinned", True)
    question = compose_preset("experiment=pin_memory_cifar", "+experiment/pin_memory_cifar_setting=question", "+experiment/copy_mode=pinned_blocking")
    answer = compose_preset("experiment=pin_memory_cifar", "+experiment/pin_memory_cifar_setting=answer", "+experiment/copy_mode=pinned_async")
    assert (question.loader.batch_size, question.loader.num_workers, question.model.busy_ms) == (64, 0, 0.0)
    assert (answer.loader.batch_size, answer.loader.num_workers, answer.model.busy_ms) == (1024, 6, 100.0)
    assert question.tracking.run_name == "pinned non_blocking=False batch=64 workers=0 busy_ms=0.0"


def test_results_presets_keep_their_sources_sizes():
    copy = compose_preset("experiment=copy_4gb")
    assert copy.dataset.num_samples * math.prod(copy.dataset.shape) * 4 == 4 * 10**9  # torch.randn(1000, 1000, 1000)
    assert copy.loader.batch_size == copy.dataset.num_samples  # one copy of the whole tensor per step
    loaders = compose_preset("experiment=iterable_chunk_loaders")
    d = loaders.dataset
    assert (d.num_samples // d.chunk_samples, d.chunk_samples, list(d.shape), d.batches_per_chunk) == (2, 1000, [256, 256], 4)
    assert (loaders.loader.batch_size, loaders.loader.num_workers, loaders.model.hidden) == (64, 0, 64)
    for preset in ("pin_memory_cifar", "mnist_mlp", "dataloader_grid"):
        assert compose_preset(f"experiment={preset}").dataset.num_samples == 0  # the whole training split
    fit = compose_preset("experiment=lightning_vs_loop")  # Trainer(max_epochs=30) over the notebook's loader
    d = fit.dataset
    assert (d.num_samples // d.chunk_samples, d.chunk_samples, list(d.shape), d.batches_per_chunk) == (2, 1000, [256, 256], 4)
    assert (fit.engine.epochs, fit.engine.max_steps, fit.loader.batch_size, fit.model.hidden, fit.model.bottleneck,
            fit.engine.optimizer.name, fit.engine.optimizer.lr) == (30, 30 * 2 * 4, 64, 64, 3, "adam", 1e-3)
    prefetch = compose_preset("experiment=gpu_prefetch")
    assert prefetch.loader.batch_size * math.prod(prefetch.dataset.shape) * 4 == 16 * 2**20  # the 16 MB chunk Lightning issue #1316 quotes
    assert prefetch.engine.profile and prefetch.engine.warmup_steps >= 6  # the trace fits in the warm-up
    mnist = compose_preset("experiment=mnist_mlp")
    assert (mnist.dataset.name, mnist.model.hidden, mnist.loader.batch_size, mnist.engine.optimizer.name,
            mnist.engine.optimizer.lr, mnist.engine.warmup_steps) == ("mnist", 512, 64, "sgd", 0.01, math.ceil(60000 / 64))
    sizes = []
    for combo in sweep_combinations("limits"):
        cfg = compose_preset("experiment=limits", *combo)
        assert cfg.dataset.num_samples == cfg.loader.batch_size  # the dataset is one batch
        sizes.append(cfg.loader.batch_size * math.prod(cfg.dataset.shape) * 4)
    assert sorted(set(sizes)) == [64 * 2**10 * 4**k for k in range(8)] and max(sizes) == 2**30


# ----------------------------------------------------------------------------- on the CPU, through the CLI
@pytest.fixture(scope="module", autouse=True)
def preset_sweeps(request, tmp_path_factory, data_root, empty_store):
    """`preset_sweeps(preset)`: (tracking URI, the finished process) of `python -m trainer -m
    experiment=<preset>` at its tiny size. The sweeps of the presets this session runs start with
    the module, at most one per CPU core at a time, each with its own store, while the module's
    other tests run; each test below waits for its own."""
    selected = [item.callspec.params["preset"] for item in request.session.items
                if item.originalname == "test_results_preset_runs_every_combination_on_cpu"]

    def sweep(preset: str):
        folder = tmp_path_factory.mktemp(preset)
        shutil.copyfile(empty_store, folder / "mlflow.db")
        uri = f"sqlite:///{folder / 'mlflow.db'}"
        tiny = [o.format(root=data_root) for o in RESULTS_PRESETS[preset][1]]
        return uri, run_cli(folder, uri, "-m", f"experiment={preset}", *tiny, "engine.device=cpu", timeout=600)

    with ThreadPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1))) as pool:
        # the sweeps with the most jobs first: the last to start are the short ones
        started = {preset: pool.submit(sweep, preset) for preset in sorted(selected, key=lambda p: -RESULTS_PRESETS[p][0])}
        yield lambda preset: started[preset].result()
        for future in started.values():
            future.cancel()  # those a failed test left unstarted


# The longest sweeps on two cores (copy_4gb's eleven rows take more than a minute, lightning_vs_loop's 50 s): run with `-m slow`.
LONG_PRESETS = ("copy_4gb", "iterable_chunk_loaders", "pin_memory_cifar", "dataloader_grid", "lightning_vs_loop")


@pytest.mark.parametrize("preset", [pytest.param(p, marks=pytest.mark.slow) if p in LONG_PRESETS else p
                                    for p in RESULTS_PRESETS])
def test_results_preset_runs_every_combination_on_cpu(preset, data_root, preset_sweeps):
    jobs, tiny = RESULTS_PRESETS[preset]
    tiny = [o.format(root=data_root) for o in tiny]
    tracking_uri, proc = preset_sweeps(preset)
    assert proc.returncode == 0, proc.stderr[-3000:]

    client = MlflowClient(tracking_uri)
    experiment = compose_preset(f"experiment={preset}").tracking.experiment
    found = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    (parent,) = [r for r in found if r.data.tags.get("sweep") == "true"]
    children = [r for r in found if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert parent.info.status == "FINISHED" and (parent.data.tags["jobs"], parent.data.tags["failed_jobs"]) == (str(jobs), "0")
    assert len(children) == jobs and all(r.info.status == "FINISHED" for r in children)
    # The jobs that ran are exactly the combinations the preset declares, at the tiny size.
    expected = {setting(compose_preset(f"experiment={preset}", *combo, *tiny)) for combo in sweep_combinations(preset)}
    ran = {tuple(r.data.params.get(k, "None") for k in SETTING) for r in children}
    assert ran == expected
    assert len({r.info.run_name for r in children}) == jobs  # every job named apart
    for override in tiny:  # the files trainer.fake_data wrote, read through torchvision by every job
        if override.startswith("dataset.root="):
            assert all(r.data.params["dataset.root"] == str(data_root) for r in children)
    check = PER_PRESET.get(preset)
    if check:
        check(children)
    _check_results_table(preset, client, children)


def _check_results_table(preset, client, children):
    """benchmarks/results.py draws the preset's table from this very sweep: a row per case, figures in each."""
    results = _results_module()
    rows = [line for line in results.TABLES[preset](results.Sweep(client, preset)).splitlines()[2:]]
    assert rows and all("None" not in row and "nan" not in row for row in rows)
    expected = {"limits": 8, "copy_4gb": 11, "iterable_chunk_loaders": 4, "pin_memory_cifar": 6, "mnist_mlp": 12, "dataloader_grid": 12,
                "lightning_vs_loop": 6, "gpu_prefetch": 8}[preset]
    assert len(rows) == expected
    numbers = lambda row: re.findall(r"\| [\d,.]+ ", row)  # noqa: E731
    assert all(numbers(row) for row in rows[1 if preset == "lightning_vs_loop" else 0:])
    if preset == "copy_4gb":  # its plain-loop rows fill in once `report --plain` has run the three plain loops
        annotate(client, children, log=lambda line: None)
        table = results.TABLES[preset](results.Sweep(client, preset))
        for run in children:
            strategy = run.data.tags["strategy"]
            step, plain = run.data.metrics["ms_per_step"] / 1e3, run.data.metrics["plain_ms_per_step"] / 1e3
            assert f"| `{strategy}`: step in the loop (s), engine / plain loop |  | {step:.3f} / {plain:.3f} |" in table
    if preset == "lightning_vs_loop":  # one plain loop is the reference for a strategy's row, in either loop
        theirs = next(r for r in children if r.data.tags["loop"] == "lightning" and r.data.tags["strategy"] == "pinned")
        assert "plain_ms_per_step" not in theirs.data.metrics
        annotate(client, [theirs], log=lambda line: None)
        # Its figures, said to be timed after the run; their ratio to the run's, across time, is not logged.
        logged = client.get_run(theirs.info.run_id).data
        assert logged.metrics["plain_ms_per_step"] > 0 and "engine_vs_plain" not in logged.metrics
        assert logged.tags["plain_timed"].startswith("after the run, at ")


def _check_copy(children):
    by = {r.data.tags["strategy"]: r for r in children}
    assert all(r.data.metrics["total_samples"] == 4 * 64 for r in children)  # 4 epochs of one 64-sample batch
    assert by["pinned_chunk"].data.metrics["setup_s"] > 0 and by["baseline"].data.metrics["setup_s"] == 0


def _check_loaders(children):
    for r in children:
        # the notebook's 8 batches per pass (2 loads x 4), here 2 loads x 4 batches of 8 for 2 passes
        assert r.data.metrics["total_steps"] == 16 and r.data.metrics["total_samples"] == 128
        # only copying and pinning need CUDA: no_pinning runs as it would on a GPU machine
        assert r.data.tags["degraded"] == str(r.data.params["loader.variant"] != "no_pinning").lower()


def _check_limits(children):
    for r in children:
        assert r.data.metrics["total_samples"] == 3 * int(r.data.params["loader.batch_size"])


def _check_lightning(children):
    by_loop = {loop: {r.data.tags["strategy"]: r for r in children if r.data.tags["loop"] == loop} for loop in ("lightning", "feedbench")}
    assert set(by_loop["lightning"]) == set(by_loop["feedbench"]) == {"iterable_chunks", "pinned", "prefetch", "pinned_chunk", "gpu_resident"}
    for strategy, theirs in by_loop["lightning"].items():
        ours = by_loop["feedbench"][strategy]
        # engine.max_steps=16: the notebook's 2 loads x 4 batches per epoch, 2 epochs; the map-style ones 64 / 8 per epoch
        assert theirs.data.metrics["total_steps"] == ours.data.metrics["total_steps"] == 16
        assert theirs.data.metrics["final_loss"] == ours.data.metrics["final_loss"]  # the same training, either loop
        assert "lightning_fraction" in theirs.data.metrics and "lightning_fraction" not in ours.data.metrics


def _check_gpu_prefetch(children):
    assert sorted(r.data.tags["loop"] for r in children) == ["feedbench"] * 4 + ["lightning"] * 4
    for r in children:
        assert r.data.metrics["total_steps"] == 12
        assert r.data.metrics["trace_h2d_copies"] == 0  # profiled, on the CPU: no GPU copies in the trace


def _check_mnist_mlp(children):
    for r in children:  # the random-pixel MNIST files, 3 batches of 64
        assert (r.data.tags["dataset"], r.data.tags["model"]) == ("mnist", "mlp")
        assert (r.data.metrics["total_steps"], r.data.metrics["total_samples"]) == (3, 3 * 64)


PER_PRESET = {"copy_4gb": _check_copy, "iterable_chunk_loaders": _check_loaders, "limits": _check_limits,
              "lightning_vs_loop": _check_lightning, "gpu_prefetch": _check_gpu_prefetch, "mnist_mlp": _check_mnist_mlp}


# ----------------------------------------------------------------------------- the iterable_chunks loader
def chunks_loader(*overrides: str):
    cfg = compose_preset("loader=iterable_chunks", "dataset.num_samples=40", "dataset.chunk_samples=20", "dataset.shape=[3,4]",
                         "dataset.batches_per_chunk=3", "loader.batch_size=5", *overrides)
    ds = build_dataset(cfg.dataset)
    return build_loader(cfg.loader, ds, torch.device("cpu")), ds


def _same(batches_a, batches_b) -> bool:
    return len(batches_a) == len(batches_b) and all(
        torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(batches_a, batches_b))


@pytest.mark.parametrize("variant", ["no_pinning", "copy_in_loader", "pin_batches"])
def test_iterable_chunks_delivers_the_notebooks_random_draws(variant):
    loader, ds = chunks_loader(f"loader.variant={variant}")
    reference = ds.iterable(batch_size=5)
    for epoch in range(2):
        batches = list(loader)
        assert len(batches) == len(loader) == 2 * 3
        assert _same(batches, list(reference))  # row for row what the notebook's IterableDataset yields
    assert not torch.equal(batches[0][0], list(ds.iterable(batch_size=5))[0][0])  # a new pass draws new rows


def test_iterable_chunks_workers_draw_each_epochs_rows():
    """Non-persistent workers start from a copy of the iterable: each pass must still be its own epoch."""
    in_process, _ = chunks_loader("loader.variant=no_pinning")
    workers, _ = chunks_loader("loader.variant=no_pinning", "loader.num_workers=2")
    key = lambda batches: sorted((x.sum().item(), y.tolist()) for x, y in batches)  # noqa: E731
    first, second = key(list(in_process)), key(list(in_process))
    assert first != second
    assert key(list(workers)) == first and key(list(workers)) == second


def test_iterable_chunks_pin_chunk_yields_the_first_contiguous_slices_of_each_chunk():
    loader, ds = chunks_loader("loader.variant=pin_chunk")
    batches = list(loader)
    assert len(batches) == len(loader) == 6
    data = ds.materialize()
    starts = [c * 20 + j * 5 for c in range(2) for j in range(3)]  # 3 slices of 5 rows from each chunk of 20
    for (x, y), s in zip(batches, starts):
        assert torch.equal(x, data[s:s + 5]) and torch.equal(y, ds.labels[s:s + 5])
    one_pass, ds = chunks_loader("loader.variant=pin_chunk", "dataset.batches_per_chunk=0")
    assert torch.equal(torch.cat([x for x, _ in one_pass]), ds.materialize())  # 0: every slice, once


@pytest.mark.parametrize("overrides,pattern", [
    (["loader.variant=pin_everything"], r"loader\.variant must be one of no_pinning, copy_in_loader, pin_batches, "
                                        r"pin_chunk \(got 'pin_everything'\): set loader\.variant=pin_batches"),
    (["loader.variant=copy_in_loader", "loader.num_workers=2"], r"loader\.variant=copy_in_loader touches CUDA while "
                                                               r"loading.*\(got loader\.num_workers=2\): set loader\.num_workers=0"),
    (["loader.variant=pin_chunk", "loader.num_workers=1"], r"got loader\.num_workers=1\): set loader\.num_workers=0"),
    (["loader.variant=pin_chunk", "dataset.batches_per_chunk=5"], r"dataset\.batches_per_chunk=5 batches of 5 rows off "
                                                                  r"each chunk, but a chunk has 20: set dataset\.batches_per_chunk=0"),
])
def test_iterable_chunks_rejects_what_cannot_run(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        chunks_loader(*overrides)


def test_iterable_chunks_needs_the_synthetic_chunks(data_root):
    cfg = compose_preset("dataset=mnist", f"dataset.root={data_root}", "dataset.download=false", "loader=iterable_chunks")
    with pytest.raises(ConfigError, match=r"loader=iterable_chunks draws from the synthetic dataset's chunks \(got dataset=mnist\): "
                                          r"set dataset=synthetic"):
        build_loader(cfg.loader, build_dataset(cfg.dataset), torch.device("cpu"))


# ----------------------------------------------------------------------------- docs/results.md
def _results_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("results", PROJECT_ROOT / "benchmarks" / "results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_results_page_has_a_block_for_every_table_and_update_fills_only_those():
    results = _results_module()
    page = (PROJECT_ROOT / "docs" / "results.md").read_text()
    names = [*results.PRESETS, "environment"]
    assert set(results.PRESETS) == set(RESULTS_PRESETS)  # every such preset has its table
    filled = results.update_page(page, {name: f"| table {name} |" for name in names})
    for name in names:
        assert f"<!-- results:{name} -->\n| table {name} |\n<!-- /results:{name} -->" in filled
        assert f"python -m trainer -m experiment={name}" in page or name == "environment"  # the command is on the page
    outside = lambda text: re.sub(r"<!-- results:(\w+) -->.*?<!-- /results:\1 -->", "", text, flags=re.S)  # noqa: E731
    assert outside(filled) == outside(page)  # the prose is left alone
    assert results.update_page(filled, {"limits": "| again |"}).count("| again |") == 1
    with pytest.raises(ConfigError, match=r"no '<!-- results:no_such_preset -->'"):
        results.update_page(page, {"no_such_preset": "| x |"})


def test_results_update_from_some_presets_keeps_the_others_environment_rows():
    """`bash benchmarks/run_results.sh mnist_mlp` refills mnist_mlp's table and row; the other presets keep theirs."""
    results = _results_module()
    head = "| preset | date |\n|---|---|"
    page = ("x\n<!-- results:environment -->\n" + head + "\n| `limits` | old |\n| `mnist_mlp` | old |\n| `dataloader_grid` | old |\n"
            "<!-- /results:environment -->\ny\n")
    merged = results.keep_other_presets(page, head + "\n| `pin_memory_cifar` | new |\n| `mnist_mlp` | new |")
    assert merged.splitlines() == ["| preset | date |", "|---|---|", "| `limits` | old |", "| `pin_memory_cifar` | new |",
                                   "| `mnist_mlp` | new |", "| `dataloader_grid` | old |"]  # in the presets' order
