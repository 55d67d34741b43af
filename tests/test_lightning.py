"""`engine.loop=lightning`: the same run driven by Lightning's Trainer, with the feedbench loop's
contract (metrics, artifacts, checksums, faults, interrupts); the profiler's overlap check; and
`lightning_prefetch` / `FeedbenchDataModule` for Lightning users (docs/lightning.md's snippet, run)."""

from __future__ import annotations

import csv
import io
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient

from clirun import LONG, TINY, check_turns_run, command, steps_csv, wait_for_running
from conftest import compose_config
from test_interrupts import assert_killed_with_steps, signal_when_running
from trainer.config import PROJECT_ROOT
from trainer.loaders import for_any_dataset
from trainer.errors import ConfigError, Interrupted, RunFailed
from trainer.loop.run import run
from trainer.loop.profiling import copy_overlap
from trainer.tracking.runs import PER_STEP_METRICS
from trainer.validate import validate

STRATEGIES = for_any_dataset()
CONTRACT = ["throughput_samples_per_s", "data_wait_fraction", "compute_stream_span_fraction", "h2d_GBps", "h2d_beside_step_fraction",
            "setup_s", "peak_gpu_mem_mb", "pinned_host_mb", "total_steps", "total_samples", "timed_wall_s",
            "median_step_ms", "final_loss"]


def losses(uri: str, run_id: str):
    return [float(r["loss"]) for r in steps_csv(uri, run_id)]


# ----------------------------------------------------------------------------- the contract
def test_lightning_prefetch_12_steps_records_the_contract(tiny_cfg, runs, tracking_uri):
    """`python -m trainer engine.loop=lightning loader=prefetch engine.max_steps=12`, at a small size
    (the CLI's Lightning runs: test_ctrl_c_... below and the presets' sweeps)."""
    run(tiny_cfg("engine.loop=lightning", "loader=prefetch", "engine.max_steps=12", "engine.epochs=3",
                 "dataset.num_samples=256", "dataset.shape=[16,16]", "loader.batch_size=64"))
    (r,) = runs()
    assert r.info.status == "FINISHED"
    assert r.data.tags["loop"] == "lightning" and r.data.tags["strategy"] == "prefetch"
    assert r.data.metrics["total_steps"] == 12 and r.data.metrics["total_samples"] == 12 * 64
    for key in CONTRACT + list(PER_STEP_METRICS) + ["lightning_ms", "lightning_fraction", "median_lightning_ms"]:
        assert key in r.data.metrics, key
    client = MlflowClient(tracking_uri)
    assert {"config.yaml", "steps.csv", "environment.json", "timeline.png"} <= {a.path for a in client.list_artifacts(r.info.run_id)}
    assert sorted(m.step for m in client.get_metric_history(r.info.run_id, "lightning_ms")) == list(range(1, 13))
    rows = steps_csv(tracking_uri, r.info.run_id)
    assert [int(x["step"]) for x in rows] == list(range(1, 13))
    assert "lightning_ms" in rows[0] and all(float(x["lightning_ms"]) >= 0 for x in rows)
    config = yaml.safe_load(Path(client.download_artifacts(r.info.run_id, "config.yaml")).read_text())
    assert config["engine"]["loop"] == "lightning" and config["engine"]["lightning"]["logger"] is False


# ----------------------------------------------------------------------------- the same run under both loops
BOTH_LOOPS = ["engine.verify=true", "engine.epochs=2", "engine.max_steps=9", "loader.shuffle=true", "dataset.chunks=3"]


def test_both_loops_record_the_same_checksums_and_losses(tiny_cfg, runs, tracking_uri):
    """engine.verify=true: the same checksums (every byte, in order, per epoch) in both runs' tags,
    and the same loss at every step. 9 steps of 6 per epoch: the second epoch stops half-way."""
    for loop in ("feedbench", "lightning"):
        assert run(tiny_cfg("loader=pinned", *BOTH_LOOPS, f"engine.loop={loop}"))["total_steps"] == 9
    found = {r.data.tags["loop"]: r for r in runs()}
    ours, theirs = found["feedbench"], found["lightning"]
    for tag in ("data_checksum", "epoch_checksums", "verified_batches"):
        assert ours.data.tags[tag] == theirs.data.tags[tag], tag
    assert len(json.loads(theirs.data.tags["epoch_checksums"].replace("'", '"'))) == 2
    assert losses(tracking_uri, ours.info.run_id) == losses(tracking_uri, theirs.info.run_id)
    assert "lightning_ms" not in ours.data.metrics and theirs.data.metrics["lightning_fraction"] >= 0


def checksums_and_losses(cfg):
    """The loop of `cfg.engine.loop` over the parts run(cfg) builds, without MLflow."""
    from datasets import build_dataset
    from models import build_model
    from trainer.loaders import build_loader
    from trainer.loop import lightning as lightning_loop
    from trainer.loop.engine import train
    from trainer.loop.meter import StepMeter
    from trainer.loop.steps import build_optimizer, make_step
    from trainer.loop.verify import Checksum

    device = torch.device("cpu")
    torch.manual_seed(cfg.engine.seed)
    dataset = build_dataset(cfg.dataset)
    loader = build_loader(cfg.loader, dataset, device, seed=cfg.engine.seed)
    model = build_model(cfg.model, dataset.sample_shape, dataset.num_classes)
    optimizer = build_optimizer(cfg.engine.optimizer, model)
    lightning = cfg.engine.loop == "lightning"
    meter = (lightning_loop.LightningMeter if lightning else StepMeter)(device, cfg.engine.warmup_steps)
    loader.copy_probe, checksum = meter, Checksum(device)
    with loader:
        if lightning:
            lightning_loop.fit(model, optimizer, loader, meter, cfg.engine, checksum)
        else:
            train(make_step(model, optimizer, False), loader, meter, cfg.engine, checksum)
    return checksum.result(), [r["loss"] for r in meter.finish().rows]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_feeds_both_loops_the_same_batches(strategy):
    overrides = [*TINY, f"loader={strategy}", *BOTH_LOOPS]
    ours = checksums_and_losses(compose_config(*overrides, "engine.loop=feedbench"))
    theirs = checksums_and_losses(compose_config(*overrides, "engine.loop=lightning"))
    assert theirs == ours and ours[0]["verified_batches"] == 9 and len(ours[0]["epoch_checksums"]) == 2


def test_step_time_splits_into_wait_compute_and_lightning(tiny_cfg, runs, tracking_uri):
    summary = run(tiny_cfg("engine.loop=lightning", "model=mlp", "engine.epochs=3", "engine.warmup_steps=8",
                           "engine.profile=true"))
    (r,) = runs()
    rows = steps_csv(tracking_uri, r.info.run_id)
    assert len(rows) == 18
    for x in rows:
        parts = float(x["data_wait_ms"]) + float(x["compute_ms"]) + float(x["lightning_ms"])
        assert min(float(x[k]) for k in ("data_wait_ms", "compute_ms", "lightning_ms")) >= 0
        assert parts <= float(x["step_ms"]) * (1 + 1e-9) + 1e-9  # the rest is feedbench's own bookkeeping
    timed = rows[8:]
    # steps follow one another: the timed region holds the timed steps' wall times, end to end
    assert summary["timed_wall_s"] * 1e3 >= sum(float(x["step_ms"]) for x in timed) * (1 - 1e-9)
    assert summary["timed_steps"] == 10
    assert summary["lightning_fraction"] == pytest.approx(sum(float(x["lightning_ms"]) for x in timed) / (summary["timed_wall_s"] * 1e3))
    assert summary["throughput_samples_per_s"] == pytest.approx(10 * 16 / summary["timed_wall_s"])
    # engine.profile=true: the trace covers the last warm-up steps; on the CPU it holds no GPU copy
    trace = Path(MlflowClient(tracking_uri).download_artifacts(r.info.run_id, "trace.json"))
    assert profiled_steps(trace) == [3, 4, 5, 6, 7]
    assert summary["trace_h2d_copies"] == r.data.metrics["trace_h2d_copies"] == 0


def test_zero_warm_up_times_every_lightning_step(tiny_cfg, runs):
    summary = run(tiny_cfg("engine.loop=lightning", "engine.warmup_steps=0", "engine.epochs=2"))
    assert summary["timed_steps"] == summary["total_steps"] == 12
    assert summary["lightning_fraction"] >= 0 and runs()[0].data.metrics["timed_steps"] == 12


def test_lightning_copies_only_what_a_strategy_leaves_to_it(tiny_cfg):
    from datasets import build_dataset
    from trainer.loaders import build_loader

    def host(*overrides):
        cfg = tiny_cfg(*overrides)
        loader = build_loader(cfg.loader, build_dataset(cfg.dataset), torch.device("cpu"))
        batches = loader.host_batches()
        return loader, None if batches is None else list(batches)

    for overrides in (["loader=baseline"], ["loader=pinned"], ["loader=iterable_chunks", "loader.variant=pin_batches"],
                      ["loader=iterable_chunks", "loader.variant=no_pinning"]):
        loader, batches = host(*overrides)
        assert batches is not None and len(batches) == len(loader), overrides
        assert [x.shape for x, _ in batches] == [x.shape for x, _ in loader]
    for overrides in (["loader=pinned", "loader.non_blocking=false"], ["loader=prefetch"], ["loader=pinned_chunk"],
                      ["loader=gpu_resident"], ["loader=iterable_chunks", "loader.variant=pin_chunk"],
                      ["loader=iterable_chunks", "loader.variant=copy_in_loader"]):
        assert host(*overrides)[1] is None, overrides  # they copy (or hold the data on the device) themselves


def test_lightning_features_on_request(tiny_cfg, runs, tmp_path, monkeypatch):
    from trainer.loop import lightning as lightning_loop
    assert lightning_loop.output_dir(tmp_path) == tmp_path / "lightning"  # without Hydra: the run's temporary folder
    monkeypatch.setattr(lightning_loop, "output_dir", lambda tmp: tmp_path / "lightning")
    summary = run(tiny_cfg("engine.loop=lightning", "engine.epochs=2", "engine.lightning.logger=true",
                           "engine.lightning.log_every_n_steps=2", "engine.lightning.checkpointing=true",
                           "engine.lightning.model_summary=true"))
    assert summary["total_steps"] == 12
    (r,) = runs()
    assert r.info.status == "FINISHED"
    logged = tmp_path / "lightning" / "lightning_logs" / "version_0"
    rows = list(csv.DictReader(io.StringIO((logged / "metrics.csv").read_text())))
    steps = [int(x["step"]) for x in rows if x.get("train_loss")]
    assert len(steps) == 6 and {b - a for a, b in zip(steps, steps[1:])} == {2}  # every 2 of the 12 steps
    assert len(list((logged / "checkpoints").glob("*.ckpt"))) == 1  # the last epoch's


# ----------------------------------------------------------------------------- bad values and faults
@pytest.mark.parametrize("overrides,pattern", [
    (["engine.loop=keras"], r"engine\.loop must be one of feedbench, lightning \(got 'keras'\): set engine\.loop=feedbench$"),
    (["engine.loop=lightning", "engine.cuda_graph=true"],
     r"engine\.cuda_graph=true cannot be used with engine\.loop=lightning .*: set engine\.cuda_graph=false, or engine\.loop=feedbench$"),
    (["engine.loop=lightning", "engine.compile=reduce-overhead"],
     r"engine\.compile=reduce-overhead cannot be used with engine\.loop=lightning .*: set engine\.compile=off, or engine\.loop=feedbench$"),
    (["engine.loop=lightning", "engine.lightning.log_every_n_steps=0"],
     r"engine\.lightning\.log_every_n_steps must be >= 1 \(got 0\): set engine\.lightning\.log_every_n_steps=50$"),
])
def test_bad_values_fail_before_the_run_opens(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        validate(compose_config(*TINY, *overrides))


def test_missing_lightning_package_is_one_line(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lightning" else real(name, *a))
    with pytest.raises(ConfigError, match=r"engine\.loop=lightning needs the lightning package: pip install 'feedbench\[lightning\]'"):
        validate(compose_config(*TINY, "engine.loop=lightning"))


def test_a_bad_value_opens_no_run(tiny_cfg, runs):
    with pytest.raises(ConfigError, match=r"^engine\.cuda_graph=true cannot be used with engine\.loop=lightning"):
        run(tiny_cfg("engine.loop=lightning", "engine.cuda_graph=true"))
    assert runs() == []


def test_nan_loss_fails_the_run_at_its_step(tiny_cfg, runs):
    with pytest.raises(RunFailed, match=r"loss became (nan|inf) at step (\d+) \(engine\.optimizer\.lr=[\d.e+]+\)") as failure:
        run(tiny_cfg("engine.loop=lightning", "engine.optimizer.name=sgd", "engine.optimizer.lr=1e10",
                     "dataset.num_samples=800"))
    (r,) = runs()
    step, done = failure.value.step, int(r.data.metrics["total_steps"])
    assert r.info.status == "FAILED" and r.data.tags["failed_step"] == str(step) and r.data.tags["loop"] == "lightning"
    assert step <= done <= step + 40 < 50  # stopped by the lagged check, not at the end


def test_a_failing_step_fails_the_run_with_its_steps(tiny_cfg, runs, monkeypatch):
    """Any exception in the step (here a model that breaks at its 5th call) goes through
    Lightning's error handling and fails the run as in the feedbench loop, keeping the steps before."""
    from models.autoencoder import Autoencoder
    calls = {"n": 0}
    real = Autoencoder.forward_loss

    def breaking(self, x, y):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("the model broke")
        return real(self, x, y)
    monkeypatch.setattr(Autoencoder, "forward_loss", breaking)
    with pytest.raises(RuntimeError, match="the model broke"):
        run(tiny_cfg("engine.loop=lightning"))
    (r,) = runs()
    assert r.info.status == "FAILED" and "the model broke" in r.data.tags["error"]
    assert r.data.metrics["total_steps"] == 4


# ----------------------------------------------------------------------------- interrupts
@pytest.mark.slow  # a long case: Ctrl-C in feedbench's loop runs by default (test_interrupts.py)
def test_ctrl_c_leaves_a_killed_run_with_its_steps(tmp_path, tracking_uri):
    proc = subprocess.Popen(command(tmp_path, tracking_uri, *LONG, "engine.loop=lightning"), cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        (r,) = wait_for_running(tracking_uri, proc)  # steps journaled: Lightning has set up the fit and is in its loop
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "Detected KeyboardInterrupt" not in stdout + stderr
    assert f"interrupted by SIGINT: run {r.info.run_id} marked KILLED, what it measured is saved" in stderr
    assert_killed_with_steps(tracking_uri, r.info.run_id, "SIGINT")
    assert MlflowClient(tracking_uri).get_run(r.info.run_id).data.tags["loop"] == "lightning"


def test_sigterm_mid_fit_is_raised_again_and_leaves_nothing_behind(tiny_cfg, tracking_uri, runs):
    """Lightning catches the interrupt, tears down and exits(1): run(cfg) must still raise it (exit
    status 143) with the run KILLED, workers stopped and the signal handlers as they were."""
    from clirun import children_of
    cfg = tiny_cfg(*[o for o in LONG if o not in TINY], "engine.loop=lightning", "loader.num_workers=2")
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal_when_running(tracking_uri, signal.SIGTERM)
    with pytest.raises(Interrupted) as stop:
        run(cfg)
    assert stop.value.exit_code == 143
    assert {s: signal.getsignal(s) for s in before} == before
    assert multiprocessing.active_children() == [] and children_of(os.getpid()) == []
    (r,) = runs()
    assert_killed_with_steps(tracking_uri, r.info.run_id, "SIGTERM")


# ----------------------------------------------------------------------------- profiler: the overlap check
def _trace(tmp_path: Path, events) -> Path:
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def _gpu(name, cat, ts, dur, stream, device=0):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": device, "tid": stream}


def test_copy_overlap_reads_a_trace(tmp_path):
    kernels = [_gpu("gemm", "kernel", 0, 100, 7), _gpu("relu", "kernel", 50, 100, 7), _gpu("other", "kernel", 400, 100, 9)]
    side = [_gpu("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 100, 100, 20),  # half behind the kernels (100-150)
            _gpu("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 450, 100, 20),  # half behind the one at 400-500
            _gpu("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy", 0, 500, 20),    # not host->device: ignored
            _gpu("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 0, 100, 21, device=1)]  # no kernel on device 1
    cpu = [{"ph": "X", "name": "cudaMemcpyAsync", "cat": "cuda_runtime", "ts": 0, "dur": 1000, "pid": 1234, "tid": 1}]
    result = copy_overlap(_trace(tmp_path, kernels + side + cpu))
    # Device 0: kernels cover 0-150 and 400-500 of the 0-550 its copies and kernels span.
    assert result == {"trace_h2d_copies": 3.0, "trace_h2d_overlap_fraction": pytest.approx(100 / 300),
                      "trace_kernel_busy_fraction": pytest.approx(250 / 550)}
    in_line = [_gpu("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 0, 50, 7), _gpu("k", "kernel", 50, 100, 7)]
    assert copy_overlap(_trace(tmp_path, in_line)) == {"trace_h2d_copies": 1.0, "trace_h2d_overlap_fraction": 0.0,
                                                       "trace_kernel_busy_fraction": pytest.approx(100 / 150)}
    assert copy_overlap(_trace(tmp_path, cpu)) == {"trace_h2d_copies": 0.0}


def profiled_steps(trace: Path):
    """torch.profiler's step numbers (from 0) in a trace."""
    return sorted({int(m.group(1)) for e in json.loads(trace.read_text())["traceEvents"]
                   if (m := re.fullmatch(r"ProfilerStep#(\d+)", str(e.get("name", ""))))})


@pytest.mark.parametrize("warmup,expected,synced", [(8, [3, 4, 5, 6, 7], (3, 8)), (3, [1, 2], (1, 3)), (1, [1], (1,))])
def test_profiler_traces_the_last_warm_up_steps(warmup, expected, synced, tmp_path):
    from trainer.loop.profiling import StepProfiler
    profiler = StepProfiler(True, tmp_path, skip=warmup)
    for _ in range(12):
        torch.ones(8).sum()
        profiler.step()
    assert profiled_steps(profiler.close()) == expected  # only with a warm-up of 1 is a timed step traced
    # On a GPU the device is synced after the step before the first traced one and after the
    # last traced one (steps counted from 1), never after a timed step.
    assert profiler.sync_after == synced and max(synced) <= warmup


# ----------------------------------------------------------------------------- for Lightning users
def docs_snippet(heading: str) -> str:
    text = (PROJECT_ROOT / "docs" / "lightning.md").read_text()
    section = text[text.index(heading):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_docs_lightning_prefetch_snippet_runs():
    snippet = docs_snippet("## GPU prefetching in your own Lightning code")
    assert "lightning_prefetch(loader, depth=2)" in snippet
    namespace: dict = {"__name__": "docs"}
    exec(compile(snippet, "docs/lightning.md", "exec"), namespace)
    trainer = namespace["trainer"]
    assert trainer.state.finished and trainer.global_step == 2 * 2048 // 64
    datamodule = trainer.datamodule
    assert datamodule.prefetcher is not None and datamodule.prefetcher._live is None  # closed at the end


def _recording_module(seen: list):
    import lightning as L

    class Recorder(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(64, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            seen.append((x, y))
            return torch.nn.functional.mse_loss(self.net(x.flatten(1)).squeeze(1), y.float())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)
    return Recorder()


def _fit(module, **data):
    import lightning as L
    trainer = L.Trainer(max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu")
    trainer.fit(module, **data)
    return trainer


def test_lightning_prefetch_hands_the_dataloader_batches_through_unchanged():
    from trainer import lightning_prefetch
    data = torch.utils.data.TensorDataset(torch.randn(40, 64), torch.randn(40))
    batches = list(torch.utils.data.DataLoader(data, batch_size=8))
    seen: list = []
    _fit(_recording_module(seen), datamodule=lightning_prefetch(batches, depth=3))  # any sized iterable of batches
    assert len(seen) == 10
    # on the CPU nothing is copied: the very tensors of the DataLoader reach training_step, in order
    assert all(x is bx and y is by for (x, y), (bx, by) in zip(seen, batches + batches))
    with pytest.raises(ValueError, match=r"depth must be >= 1 \(got 0\): use depth=1"):
        lightning_prefetch(batches, depth=0)


class _Loads(torch.utils.data.Dataset):
    """Batch `i` is `(full(i), i)`; each load is noted in `log` as ("load", i)."""

    def __init__(self, log: list, n: int):
        self.log, self.n = log, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.log.append(("load", i))
        return torch.full((4, 64), float(i)), torch.full((4,), float(i))


class _UnsizedLoads(torch.utils.data.IterableDataset):
    def __init__(self, log: list, n: int):
        self.loads = _Loads(log, n)

    def __iter__(self):
        return (self.loads[i] for i in range(self.loads.n))


@pytest.mark.parametrize("sized", [True, False])
def test_lightning_takes_prefetched_batches_one_step_at_a_time(sized):
    """What the prefetcher's overlap rests on: Lightning takes a batch from it when that batch's
    step is next (its fetcher reads ahead only for data without a length, and then by one batch),
    so the copy of the following batch, queued before `next()` returns, runs beside the step."""
    from trainer import lightning_prefetch
    log: list = []  # ("load", i) from the dataset, (x, y) from training_step
    data = (_Loads if sized else _UnsizedLoads)(log, 4)
    _fit(_recording_module(log), datamodule=lightning_prefetch(torch.utils.data.DataLoader(data, batch_size=None)))
    order = [e if isinstance(e[0], str) else ("step", int(e[0][0, 0])) for e in log]
    # (on the CPU the prefetcher copies nothing, so it reads nothing ahead itself)
    load, step = [("load", i) for i in range(4)], [("step", i) for i in range(4)]
    if sized:
        epoch = [e for pair in zip(load, step) for e in pair]
    else:
        epoch = load[:2] + [step[0], load[2], step[1], load[3], step[2], step[3]]
    assert order == epoch * 2


def test_lightning_prefetch_benchmark_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = subprocess.run([sys.executable, str(PROJECT_ROOT / "benchmarks" / "lightning_prefetch.py")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip() == "error: benchmarks/lightning_prefetch.py needs a CUDA GPU (none found)"


def test_feedbench_data_module_feeds_a_strategy_and_closes_it():
    from datasets import build_dataset
    from trainer import FeedbenchDataModule
    cfg = compose_config(*TINY, "loader=pinned_chunk", "dataset.chunks=2", "loader.shuffle=false")
    seen: list = []
    module = FeedbenchDataModule(cfg.loader, build_dataset(cfg.dataset))
    _fit(_recording_module(seen), datamodule=module)
    assert len(seen) == 2 * 6 and module.loader is None  # torn down with the fit
    data = build_dataset(cfg.dataset)
    expected = torch.cat([data.load_chunk(c)[0] for c in range(data.num_chunks)])
    assert torch.equal(torch.cat([x for x, _ in seen[:6]]), expected)
    assert not [t for t in threading.enumerate() if t.name.startswith("chunk-load")]


# ----------------------------------------------------------------------------- GPU (skipped without CUDA)
def gpu(tiny_cfg, *overrides):
    return tiny_cfg("engine.device=cuda", "dataset.shape=[64,64]", "dataset.num_samples=512", *overrides)


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gpu_lightning_loop_times_copy_compute_and_lightning(strategy, tiny_cfg, runs):
    summary = run(gpu(tiny_cfg, "engine.loop=lightning", f"loader={strategy}", "engine.epochs=2", "engine.warmup_steps=4"))
    (r,) = runs()
    assert r.data.tags["loop"] == "lightning" and r.data.tags["degraded"] == "false"
    assert summary["median_compute_ms"] > 0 and summary["median_lightning_ms"] > 0
    if strategy != "gpu_resident":  # every other copies, Lightning's transfer for baseline/pinned/iterable_chunks
        assert summary["median_h2d_ms"] > 0 and summary["h2d_GBps"] > 0
    else:
        assert summary["median_h2d_ms"] == 0


@pytest.mark.gpu
def test_gpu_checksums_equal_under_both_loops(tiny_cfg, runs):
    for strategy in [s for s in STRATEGIES if s != "iterable_chunks"] + ["iterable_chunks"]:
        for loop in ("feedbench", "lightning"):
            run(gpu(tiny_cfg, f"loader={strategy}", f"engine.loop={loop}", "engine.verify=true", "engine.epochs=3",
                    "dataset.chunks=3", "loader.num_workers=2", "loader.shuffle=true"))
    found = {}
    for r in runs():
        found.setdefault(r.data.tags["strategy"], {})[r.data.tags["loop"]] = (r.data.tags["data_checksum"], r.data.tags["epoch_checksums"])
    for strategy, by_loop in found.items():
        assert by_loop["feedbench"] == by_loop["lightning"], strategy


@pytest.mark.gpu
@pytest.mark.parametrize("loop", ["feedbench", "lightning"])
def test_gpu_trace_side_stream_copies_overlap_and_lightning_does_not_copy_again(loop, tiny_cfg, runs, tracking_uri):
    common = ("model=noop", "model.busy_ms=20", "engine.profile=true", "engine.epochs=2", "engine.warmup_steps=12",
              f"engine.loop={loop}")
    prefetch = run(gpu(tiny_cfg, "loader=prefetch", *common))
    in_line = run(gpu(tiny_cfg, "loader=pinned", *common))
    assert prefetch["trace_h2d_copies"] >= 2 * 5 and in_line["trace_h2d_copies"] >= 2 * 5  # x and y, 5 traced steps
    assert prefetch["trace_h2d_overlap_fraction"] > 0.5  # hidden behind the 20 ms steps (all but the first traced batch)
    assert in_line["trace_h2d_overlap_fraction"] < 0.1  # queued on the compute stream, in line with the steps
    # The meter's CUDA events say the same over the timed steps, in either loop.
    assert prefetch["h2d_beside_step_fraction"] > 0.8 and in_line["h2d_beside_step_fraction"] < 0.1
    r = next(r for r in runs() if r.data.tags["strategy"] == "prefetch")
    events = json.loads(Path(MlflowClient(tracking_uri).download_artifacts(r.info.run_id, "trace.json")).read_text())["traceEvents"]
    # Device-ready batches: no second copy. The only device-to-device copies are the meter's: each
    # step's 4-byte loss into a slot made before the loop.
    dtod = [e for e in events if "Memcpy DtoD" in str(e.get("name", ""))]
    assert [e for e in dtod if e["args"]["bytes"] > 8] == []
    copies = {e["tid"] for e in events if str(e.get("name", "")).startswith("Memcpy HtoD")}
    kernels = {e["tid"] for e in events if e.get("cat") == "kernel"}
    assert copies and copies.isdisjoint(kernels)


@pytest.mark.gpu
def test_gpu_lightning_prefetch_delivers_device_batches_without_a_second_copy():
    from trainer import DevicePrefetcher
    data = torch.utils.data.TensorDataset(torch.randn(64, 64), torch.randn(64))
    loader = torch.utils.data.DataLoader(data, batch_size=8, pin_memory=True)
    yielded: list = []

    class Spy(DevicePrefetcher):
        def _pass(self):
            for batch in super()._pass():
                yielded.append(batch)
                yield batch
    import lightning as L

    class Module(L.LightningDataModule):
        def train_dataloader(self):
            return Spy(loader, self.trainer.strategy.root_device, depth=2)
    seen: list = []
    trainer = L.Trainer(max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="gpu", devices=1)
    trainer.fit(_recording_module(seen), datamodule=Module())
    assert len(seen) == 16 and all(x.is_cuda for x, _ in seen)
    assert [x.data_ptr() for x, _ in seen] == [x.data_ptr() for x, _ in yielded]  # the same memory: not copied again
    host = [x for x, _ in loader] * 2
    assert all(torch.equal(x.cpu(), h) for (x, _), h in zip(seen, host))
    assert trainer.global_step == 16


@pytest.mark.gpu
@pytest.mark.gpu
def test_gpu_lightning_prefetch_hides_its_copies_in_lightnings_loop():
    """benchmarks/lightning_prefetch.py, shortened: 16 MiB pinned batches, a step with 20 ms of
    device work, so that the device, not Lightning's host work, sets the pace (with 2 ms it did
    not, and neither variant's copy ran beside a kernel). Lightning's own copy waits in line with
    the steps; fed by lightning_prefetch, the copies run beside the kernels and no step is slower."""
    proc = subprocess.run([sys.executable, str(PROJECT_ROOT / "benchmarks" / "lightning_prefetch.py"),
                           "--steps", "60", "--warmup", "14", "--busy-ms", "20"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = {r["variant"]: r for r in map(json.loads, [s for s in proc.stdout.splitlines() if s.startswith("{")])}
    default, prefetch = got["lightning_default"], got["lightning_prefetch"]
    assert len(default["ms_per_step"]) == len(prefetch["ms_per_step"]) == 2 and default["copy_ms"] > 0
    assert default["trace_h2d_copies"] >= 10 and prefetch["trace_h2d_copies"] >= 10  # x and y of the traced steps
    assert default["trace_kernel_busy_fraction"] > 0.8 and prefetch["trace_kernel_busy_fraction"] > 0.8  # device-bound
    assert default["trace_h2d_overlap_fraction"] < 0.1
    assert prefetch["trace_h2d_overlap_fraction"] > 0.7  # all but the first traced copy (after the profiler's sync)
    assert prefetch["median_ms_per_step"] <= default["median_ms_per_step"]


@pytest.mark.gpu
def test_gpu_out_of_memory_in_a_lightning_step_is_one_line(tiny_cfg, runs):
    from conftest import batch_that_runs_out_of_gpu_memory
    b = batch_that_runs_out_of_gpu_memory(hidden=2**20)
    with pytest.raises(RunFailed, match=rf"out of GPU memory with loader=gpu_resident loader\.batch_size={b} model=mlp: "
                                        rf"set loader\.batch_size={b // 2} or smaller"):
        run(tiny_cfg("engine.device=cuda", "engine.loop=lightning", "loader=gpu_resident", "model=mlp",
                     "model.hidden=1048576", f"dataset.num_samples={b}", f"loader.batch_size={b}", "engine.max_steps=2"))
    (r,) = runs()
    assert r.info.status == "FAILED" and "out of GPU memory" in r.data.tags["error"]


@pytest.mark.slow  # a long case: runs in turns of both loops; with `-m slow`
def test_versus_times_lightnings_loop_against_ours_in_turns(tmp_path, capsys):
    """docs/lightning.md's `trainer.versus --a engine.loop=lightning --b engine.loop=feedbench`: Lightning's
    run records the per-step host clock that turn-taking needs, so each loop's ms/step counts only
    its own turns, and the table names both sides."""
    from trainer.versus import main
    table = tmp_path / "versus.md"
    main(["--a", "engine.loop=lightning", "--b", "engine.loop=feedbench", "--graph", "eager", "--repeats", "1",
          "--turn-ms", "20", "--settle-ms", "2", "--markdown", str(table), "loader=pinned", "model=noop",
          "engine.device=cpu", "dataset.num_samples=96", "dataset.shape=[8,8]", "loader.batch_size=16",
          "engine.max_steps=1500", "engine.warmup_steps=10"])
    got, cells = check_turns_run(capsys.readouterr().out, table, "`engine.loop=lightning`", max_steps=1500)
    assert cells[1:4] == ["`engine.loop=feedbench`", "no", "turns"]
    assert float(cells[4]) == pytest.approx(got["first"], abs=1e-3)
    assert float(cells[5]) == pytest.approx(got["second"], abs=1e-3)
