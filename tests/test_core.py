"""The core contract: composition, the CPU path of every loader, and what a run leaves in MLflow."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from trainer.config import PROJECT_ROOT
from trainer.loaders import for_any_dataset
from trainer.loop.run import run
from trainer.tracking.runs import PER_STEP_METRICS

from clirun import check_turns_run
from conftest import compose_config

SUMMARIES = ["throughput_samples_per_s", "data_wait_fraction", "compute_stream_span_fraction", "h2d_GBps", "setup_s",
             "peak_gpu_mem_mb", "total_steps", "total_samples", "ms_per_step", "host_page_faults_per_step",
             "host_cpu_ms_per_step"]
TAGS = ["strategy", "dataset", "model", "device", "degraded", "gpu_name", "torch_version", "cuda_version"]


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


@pytest.mark.parametrize("strategy", for_any_dataset())
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
    # Each step began (host monotonic clock) no earlier than the previous one ended.
    clock = [float(x["host_clock_s"]) for x in rows]
    assert all(b >= a + float(x["step_ms"]) / 1e3 - 1e-6 for a, b, x in zip(clock, clock[1:], rows))
    env = json.loads(Path(client.download_artifacts(r.info.run_id, "environment.json")).read_text())
    assert env["torch"] and env["cpu"] and env["python"]


def test_max_steps_caps_across_epochs(tiny_cfg):
    summary = run(tiny_cfg("engine.epochs=5", "engine.max_steps=8"))
    assert summary["total_steps"] == 8


def test_max_steps_is_the_runs_length_past_epochs(tiny_cfg, tracking_uri, runs):
    # 96 samples in batches of 16: one epoch is 6 steps; max_steps=10 runs into a second epoch.
    summary = run(tiny_cfg("engine.epochs=1", "engine.max_steps=10"))
    assert summary["total_steps"] == 10 and summary["total_samples"] == 160 and summary["timed_steps"] == 9
    (r,) = runs()
    rows = list(csv.DictReader(io.StringIO(Path(MlflowClient(tracking_uri).download_artifacts(
        r.info.run_id, "steps.csv")).read_text())))
    assert [int(x["epoch"]) for x in rows] == [0] * 6 + [1] * 4


def test_host_side_of_the_timed_steps_is_recorded(tiny_cfg, runs):
    summary = run(tiny_cfg("engine.epochs=3", "engine.warmup_steps=2"))
    assert summary["timed_steps"] == 16
    assert summary["host_cpu_ms_per_step"] > 0 and summary["host_page_faults_per_step"] >= 0
    assert summary["ms_per_step"] == pytest.approx(summary["timed_wall_s"] * 1e3 / 16)
    (r,) = runs()
    for key in ("host_cpu_ms_per_step", "host_page_faults_per_step", "ms_per_step"):
        assert r.data.metrics[key] == pytest.approx(summary[key]), key


# Three 16 MiB buffers allocated, written and freed 40 times, as pageable batches are at every
# step; prints the minor page faults of the last 30 rounds. With glibc's own thresholds the same
# script faults every page in again in some processes (~370,000 faults) and none in others.
_HEAP_LOOP = """
import resource, sys, torch
from trainer.loop.heap import keep_freed
print(keep_freed() if sys.argv[1] == "steady" else "system")
for i in range(40):
    if i == 10:
        start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    batches = [torch.empty(4 << 20).fill_(1.0) for _ in range(3)]
    del batches
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_steady_heap_reuses_a_freed_batch_instead_of_faulting_it_in_again():
    proc = subprocess.run([sys.executable, "-c", _HEAP_LOOP, "steady"], capture_output=True, text=True, check=True)
    applied, faults = proc.stdout.split()
    assert applied == "True" and int(faults) < 3000  # 30 rounds x 3 x 4096 pages if it faulted them in


def test_a_run_records_its_heap_setting(tiny_cfg, runs):
    run(tiny_cfg())
    run(tiny_cfg("engine.steady_heap=false"))
    tags = [r.data.tags["steady_heap"] for r in runs()]
    assert tags == ["false", "true" if sys.platform.startswith("linux") else "unavailable"]


def test_interpolations_are_resolved_once_before_the_run(tiny_cfg, runs):
    """`limits` sets dataset.num_samples=${loader.batch_size}: resolved before anything is built,
    not parsed again whenever a loader asks the dataset its length (every epoch)."""
    cfg = tiny_cfg("loader=pinned_chunk", "loader.batch_size=8", "dataset.num_samples=${loader.batch_size}", "engine.epochs=3")
    run(cfg)
    assert not OmegaConf.is_interpolation(cfg.dataset, "num_samples") and cfg.dataset.num_samples == 8
    (r,) = runs()
    assert r.data.params["dataset.num_samples"] == "8"
    assert (r.data.metrics["total_steps"], r.data.metrics["total_samples"]) == (3, 24)  # three one-batch epochs


@pytest.mark.parametrize("warmup", [50, 18])  # past the last step, or ending with it (a timed region of no step)
def test_a_run_that_is_all_warm_up_says_so_and_times_nothing(tiny_cfg, runs, capsys, warmup):
    summary = run(tiny_cfg("engine.epochs=3", f"engine.warmup_steps={warmup}"))
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(err) == 1 and f"engine.warmup_steps={warmup}" in err[0] and "18 steps" in err[0] and "timed_steps=0" in err[0]
    assert summary["timed_steps"] == 0 and summary["total_steps"] == 18
    assert "throughput_samples_per_s" not in summary and "ms_per_step" not in summary
    (r,) = runs()
    assert r.info.status == "FINISHED" and r.data.metrics["timed_steps"] == 0
    assert "throughput_samples_per_s" not in r.data.metrics  # warm-up steps are never summarised


def test_the_meter_keeps_no_step_tensor_alive():
    import weakref
    import torch
    from trainer.loop.meter import StepMeter
    meter = StepMeter(torch.device("cpu"), warmup_steps=1, capacity=2)  # grows past its capacity
    refs = []
    for i in range(5):
        meter.wait_begin()
        meter.step_begin(4)
        loss = torch.tensor(float(i)) * 2
        refs.append(weakref.ref(loss))
        meter.step_end(loss)
        del loss
        if i == 0:
            meter.start_timed()
    assert all(ref() is None for ref in refs)
    assert meter.losses(0, 5).tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]
    result = meter.finish()
    assert [row["step"] for row in result.rows] == [1, 2, 3, 4, 5] and result.summary["timed_steps"] == 4


def test_gpu_summaries_are_taken_over_the_steps_timed_on_the_gpu():
    import math
    from trainer.loop.summary import stream_span_fraction, median_of_timed
    rows = [{"compute_ms": v} for v in (2.0, math.nan, 4.0, math.nan)]
    assert median_of_timed(rows, "compute_ms") == 3.0
    assert stream_span_fraction(rows, wall_ms=16.0) == pytest.approx(3.0 * 4 / 16.0)  # mean of the timed, for every step
    assert stream_span_fraction(rows, wall_ms=11.0) == 1.0  # a sample above the wall time: a stream is never busier than always
    assert math.isnan(median_of_timed([{"compute_ms": math.nan}], "compute_ms")) and median_of_timed([], "x") == 0.0


def _steps(meter, values, watch=None, mid=None):
    """Feed `values` as the losses of consecutive steps; `mid(meter, step)` is called after each."""
    import torch
    for i, v in enumerate(values):
        meter.wait_begin()
        meter.step_begin(4)
        meter.step_end(torch.tensor(float(v)) * 1.0)
        if watch is not None:
            watch.after_step(i + 1)
        if mid is not None:
            mid(meter, i + 1)


def test_the_loss_log_holds_every_step_across_batches_blocks_and_early_reads():
    import torch
    from trainer.loop import meter as m
    meter = m.StepMeter(torch.device("cpu"), warmup_steps=0, capacity=40)  # room for 64, then grows
    early = {}
    # Reads in the middle of a batch of held losses (the NaN check may ask at any step) must see them.
    _steps(meter, range(5000), mid=lambda mt, s: early.setdefault(s, mt.losses(s - 3, s).tolist()) if s in (7, 33, 64, 4097) else None)
    assert early == {7: [4.0, 5.0, 6.0], 33: [30.0, 31.0, 32.0], 64: [61.0, 62.0, 63.0], 4097: [4094.0, 4095.0, 4096.0]}
    assert meter.losses(0, 5000).tolist() == [float(v) for v in range(5000)]
    rows = meter.finish().rows
    assert [r["loss"] for r in rows[-3:]] == [4997.0, 4998.0, 4999.0] and len(rows) == 5000
    # On the host every loss is copied at once: a held CPU tensor would keep a small block of the
    # heap alive across the next batches (hundreds of page faults a step for a pageable batch).
    assert meter.loss_log.held == [None] * m.LOSS_BATCH


@pytest.mark.parametrize("bad_step", [1, 31, 32, 33, 70, 95])
def test_loss_watch_names_the_first_bad_step(bad_step):
    import torch
    from trainer.errors import RunFailed
    from trainer.loop.faults import LossWatch
    from trainer.loop.meter import StepMeter
    meter = StepMeter(torch.device("cpu"), warmup_steps=0, capacity=100)
    watch = LossWatch(meter, lr=0.5)
    values = [1.0] * 100
    values[bad_step - 1], values[min(bad_step + 2, 99)] = float("nan"), float("inf")  # the first one is named
    with pytest.raises(RunFailed, match=rf"loss became nan at step {bad_step} \(engine.optimizer.lr=0.5\)"):
        _steps(meter, values, watch)
        watch.final()


def test_loss_watch_passes_finite_losses():
    import torch
    from trainer.loop.faults import LossWatch
    from trainer.loop.meter import StepMeter
    meter = StepMeter(torch.device("cpu"), warmup_steps=0, capacity=10)
    watch = LossWatch(meter, lr=0.5)
    _steps(meter, [float(i) for i in range(77)], watch)
    watch.final()
    assert watch.checked == 77 and watch.pending is None


def test_the_engine_holds_batches_as_a_plain_for_loop_does():
    """As `for x, y in loader`: the pair is unpacked at once, and each batch lives until the next
    one is made, across passes too, and no longer. The host allocator then sees frees in the same
    order as in a plain loop (with pageable batches, anything else moves where they land)."""
    import weakref
    import torch
    from omegaconf import OmegaConf
    from trainer.loop.engine import train
    from trainer.loop.meter import StepMeter

    class Pair:  # a batch that can be referred to weakly, unpacked like a tuple
        def __init__(self, x, y):
            self.items = (x, y)

        def __iter__(self):
            return iter(self.items)

        def __getitem__(self, i):
            return self.items[i]

    xs, pairs, at_make, at_step = [], [], [], []

    def make():
        at_make.append([r() is not None for r in xs])  # which earlier batches are still alive
        x = torch.zeros(4)
        pair = Pair(x, torch.zeros(4))
        xs.append(weakref.ref(x))
        pairs.append(weakref.ref(pair))
        return pair

    class Loader:
        def __len__(self):
            return 3

        def __iter__(self):
            for _ in range(3):
                yield make()  # no local keeps the batch while the pass is suspended

    def step(x, y):
        at_step.append(sum(r() is not None for r in pairs))
        return x.sum()

    cfg = OmegaConf.create({"max_steps": 8, "epochs": 1, "warmup_steps": 2, "progress": False, "optimizer": {"lr": 0.1}})
    assert train(step, Loader(), StepMeter(torch.device("cpu"), 2, capacity=8), cfg) == 8
    # Batch k is made while batch k-1 (and only it) is alive: at passes' starts (batches 4 and 7) too.
    assert at_make[0] == [] and at_make[1:] == [[False] * (k - 1) + [True] for k in range(1, 8)]
    assert at_step == [0] * 8  # the pair was unpacked: nothing holds it during the step


def test_the_timed_region_ends_with_the_last_step_not_with_the_teardown():
    # Closing the pass (a loader stopping its threads, returning buffers) and the last loss check
    # come after the steps: a plain `for x, y in loader` loop does not time them, nor does the meter.
    import time
    import torch
    from trainer.loop.engine import train
    from trainer.loop.meter import StepMeter

    class Loader:
        def __len__(self):
            return 100

        def __iter__(self):
            try:
                for _ in range(100):
                    yield torch.ones(2, 3), torch.zeros(2)
            finally:
                time.sleep(1.0)  # a slow close, after max_steps stops the pass half-way

    cfg = OmegaConf.create({"max_steps": 12, "epochs": 1, "warmup_steps": 2, "progress": False, "optimizer": {"lr": 0.1}})
    meter = StepMeter(torch.device("cpu"), 2, capacity=12)
    start = time.perf_counter()
    assert train(lambda x, y: x.sum(), Loader(), meter, cfg) == 12
    summary = meter.finish().summary
    assert time.perf_counter() - start >= 1.0 and summary["timed_steps"] == 10
    assert summary["timed_wall_s"] < 1.0  # the close not timed; 10 tiny steps stay far below it on a loaded machine


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


def _overhead_sh(tmp_path, *args):
    """benchmarks/overhead.sh run in a copy of the project's layout, with `python` answering for
    `trainer.overhead` (which needs a GPU): each call's arguments are logged and its --markdown
    table written with one row naming the call's strategies and graph mode."""
    (tmp_path / "benchmarks").mkdir(exist_ok=True)
    shutil.copy(PROJECT_ROOT / "benchmarks" / "overhead.sh", tmp_path / "benchmarks")
    shim = tmp_path / "bin" / "python"
    shim.parent.mkdir(exist_ok=True)
    shim.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import sys
        args = sys.argv[1:]
        open({str(tmp_path / "calls.log")!r}, "a").write(" ".join(args) + "\\n")
        value = lambda flag: args[args.index(flag) + 1]
        open(value("--markdown"), "w").write("| loader | graph |\\n|---|---|\\n| " + value("--loaders") + " | " + value("--graph") + " |\\n")
        """))
    shim.chmod(0o755)
    env = dict(os.environ, PATH=f"{shim.parent}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.run(["bash", str(tmp_path / "benchmarks" / "overhead.sh"), *args], capture_output=True, text=True,
                          env=env, timeout=60)
    calls = (tmp_path / "calls.log").read_text().splitlines() if (tmp_path / "calls.log").exists() else []
    return proc, calls


def test_overhead_script_by_default_is_one_call_of_every_strategy_in_rounds(tmp_path):
    """`bash benchmarks/overhead.sh`: one `trainer.overhead` call, in rounds, every registered
    strategy (`--loaders all`, expanded from the registry by the tool), eager and graphed, against
    both references on the reference workload, under its own time limit; its total time printed."""
    proc, calls = _overhead_sh(tmp_path)
    assert proc.returncode == 0, proc.stderr
    (call,) = calls
    args = call.split()
    assert args[:2] == ["-m", "trainer.overhead"] and "--reference both" in call and "--method rounds" in call
    assert "--loaders all" in call and "--graph both" in call and "--repeats 4" in call
    assert "experiment=bench_strategies" in args and "engine.device=cuda" in args
    assert proc.stdout.splitlines()[-1].startswith("total: ")
    assert (tmp_path / "outputs" / "overhead.md").read_text().splitlines()[2] == "| all | both |"
    proc, calls = _overhead_sh(tmp_path / "outputs", "--part", "eager")
    assert proc.returncode == 2 and calls == []
    assert proc.stderr.strip() == "error: --part and --quick are options of --processes: add --processes, or leave them out"


def test_overhead_script_in_processes_covers_every_strategy_eager_and_graphed(tmp_path):
    """`--processes`: the same table part by part from fresh processes, joined into one."""
    proc, calls = _overhead_sh(tmp_path, "--processes", "--quick")
    assert proc.returncode == 0, proc.stderr
    covered = set()
    for call in calls:
        args = call.split()
        assert args[:2] == ["-m", "trainer.overhead"] and "--reference both" in call
        assert "experiment=bench_strategies" in args and "engine.device=cuda" in args
        graph = args[args.index("--graph") + 1]
        for loader in args[args.index("--loaders") + 1].split(","):
            covered |= {(loader, g) for g in (("eager", "graphed") if graph == "both" else (graph,))}
    assert covered == {(name, g) for name in for_any_dataset() for g in ("eager", "graphed")}
    table = (tmp_path / "outputs" / "overhead_quick.md").read_text().splitlines()
    assert table[:2] == ["| loader | graph |", "|---|---|"] and len(table) == 2 + len(calls)


def test_overhead_script_runs_one_part_and_refuses_an_unknown_one(tmp_path):
    proc, calls = _overhead_sh(tmp_path, "--processes", "--quick", "--part", "graphed", "--repeats", "2")
    assert proc.returncode == 0, proc.stderr
    (call,) = calls
    assert "--graph graphed" in call and "--loaders pinned_chunk,gpu_resident,pinned_uva" in call and "--repeats 2" in call
    assert (tmp_path / "outputs" / "overhead_quick.md").read_text().splitlines()[2] == "| pinned_chunk,gpu_resident,pinned_uva | graphed |"
    proc, calls = _overhead_sh(tmp_path / "outputs", "--processes", "--part", "graph")
    assert proc.returncode == 2 and calls == []
    assert proc.stderr.strip() == "error: --part graph is not a part: use one of dataloader, eager, gather, graphed"


def test_overhead_rounds_put_every_side_in_every_process_and_every_place():
    """A round runs each side once; over as many rounds as sides, each side has run in every worker
    process and in every place of the round's order."""
    from trainer.tools.overhead import plan_round
    sides = ["engine", "plain", "hand"]
    plans = [plan_round(r, sides) for r in range(6)]
    for plan in plans:
        assert sorted(s for s, _ in plan) == sorted(sides) and sorted(w for _, w in plan) == [0, 1, 2]
    for side in sides:
        for first in (0, 3):
            workers = [w for plan in plans[first:first + 3] for s, w in plan if s == side]
            places = [[s for s, _ in plan].index(side) for plan in plans[first:first + 3]]
            assert sorted(workers) == [0, 1, 2] and sorted(places) == [0, 1, 2], (side, workers, places)
    assert [plan_round(r, ["engine", "plain"]) for r in range(2)] == [[("engine", 0), ("plain", 1)],
                                                                      [("plain", 0), ("engine", 1)]]


class _FakeWorker:
    """Answers as a worker would, with ms/step from `figures(side, n)` for its n-th run of that side."""

    def __init__(self, figures, runs):
        self.figures, self.runs = figures, runs

    def ask(self, side, overrides):
        self.runs.append((side, overrides[-1]))
        ms = self.figures(side, sum(1 for s, _ in self.runs if s == side))
        common = {"host_page_faults_per_step": 0.0, "host_cpu_ms_per_step": ms}
        if side == "engine":
            return {"ms_per_step": ms, **common}
        return {"plain_ms_per_step": ms, "plain_host_page_faults_per_step": 0.0, "plain_host_cpu_ms_per_step": ms}


def test_overhead_rounds_stop_once_the_intervals_are_tight_and_not_before_every_process():
    from trainer.tools.overhead import measure_rounds
    runs = []
    steady = [_FakeWorker(lambda side, n: {"engine": 1.01, "plain": 1.0, "hand": 1.0}[side], runs) for _ in range(3)]
    lines = []
    rows = measure_rounds(steady, ["loader=pinned"], ["plain", "hand"], rounds=9, turn_s=0.5, warmup=10, log=lines.append)
    assert len(lines) == 3  # every side in every process once, then the intervals are a point: done
    assert len(runs) == 9 and {o for _, o in runs[:3]} == {"engine.max_steps=40"}  # the first round: 30 timed steps
    assert {o for _, o in runs[3:]} == {"engine.max_steps=510"}  # 0.5 s at 1 ms/step, after the 10 warm-up steps
    assert [(r["reference"], r["ratio"], r["method"]) for r in rows] == [("plain", pytest.approx(1.01), "rounds"),
                                                                         ("hand", pytest.approx(1.01), "rounds")]
    runs.clear()
    noisy = [_FakeWorker(lambda side, n: 1.0 + 0.2 * (n % 2) * (side == "engine"), runs) for _ in range(3)]
    lines.clear()
    rows = measure_rounds(noisy, ["loader=pinned"], ["plain", "hand"], rounds=5, turn_s=0.5, warmup=10, log=lines.append)
    assert len(lines) == 5 and rows[0]["ratio_min"] == pytest.approx(1.0) and rows[0]["ratio_max"] == pytest.approx(1.2)


def test_overhead_loaders_all_is_every_registered_strategy(monkeypatch, capsys):
    from trainer.tools import overhead
    asked = []
    monkeypatch.setattr(overhead, "_main_rounds", lambda args, base, loaders, warmup, rows: asked.append(loaders))
    overhead.main(["--method", "rounds", "--loaders", "all", "engine.device=cpu"])
    assert asked == [for_any_dataset()]
    assert capsys.readouterr().out.splitlines()[-1].startswith("total: ")


@pytest.mark.slow  # the rounds' other cases run by default; the whole table with `-m slow` (and benchmarks/overhead.sh)
def test_overhead_in_rounds_times_the_engine_and_both_references_in_warm_processes(tmp_path, capsys):
    """`--method rounds` for real, on the CPU: three warm processes, one run of each side a round."""
    from trainer.overhead import main
    table = tmp_path / "overhead.md"
    main(["--method", "rounds", "--repeats", "3", "--turn-ms", "50", "--reference", "both", "--loaders", "pinned",
          "--markdown", str(table), "engine.device=cpu", "dataset.num_samples=96", "dataset.shape=[8,8]",
          "loader.batch_size=16", "engine.warmup_steps=5"])
    out = capsys.readouterr().out
    rounds = [line.split() for line in out.splitlines() if line.strip().startswith("round")]
    assert len(rounds) == 3
    # "round 1: engine E ms/step, plain P (E/P), hand H (E/H); N timed steps a run, ..."
    for words in rounds:
        engine, plain, hand = float(words[3]), float(words[6]), float(words[9])
        assert engine > 0 and plain > 0 and hand > 0
        assert float(words[7].strip("(),")) == pytest.approx(engine / plain, rel=0.01)  # printed to 0.001 ms
        assert float(words[10].strip("();")) == pytest.approx(engine / hand, rel=0.01)
    cells = {line.split("|")[4].strip(): [c.strip() for c in line.strip("|").split("|")]
             for line in table.read_text().splitlines() if line.startswith("| `pinned`")}
    assert set(cells) == {"plain loop, engine's step", "hand-written step"}
    for row in cells.values():
        assert row[1:3] == ["no", "rounds"] and float(row[4]) > 0 and float(row[5]) > 0 and row[7] != "–"


def test_overhead_in_rounds_a_side_that_fails_is_one_line_naming_it(tmp_path):
    """The hand-written step needs a model with parameters: the worker's reason, in one line, exit 1."""
    proc = subprocess.run([sys.executable, "-m", "trainer.overhead", "--method", "rounds", "--reference", "hand",
                           "--loaders", "baseline", "model=noop", "engine.device=cpu", "dataset.num_samples=32",
                           "dataset.shape=[4,4]", "loader.batch_size=8"], capture_output=True, text=True, cwd=tmp_path,
                          timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: hand, ") and "the hand-written step trains a model with parameters" in proc.stderr


def test_overhead_tool_compares_the_cli_with_a_plain_loop(tmp_path, capsys):
    """`python -m trainer.overhead ...` (its main, here: it starts the two processes it compares)."""
    from trainer.overhead import main
    table = tmp_path / "overhead.md"
    main(["--repeats", "1", "--method", "pairs", "--loaders", "pinned", "--markdown", str(table), "engine.device=cpu",
          "dataset.num_samples=96", "dataset.shape=[8,8]", "loader.batch_size=16", "engine.max_steps=12",
          "engine.warmup_steps=2"])
    stdout = capsys.readouterr().out
    (words,) = [line.split() for line in stdout.splitlines() if line.strip().startswith("repeat")]
    # "repeat 1: engine E ms/step, plain P ms/step, ratio R"
    engine, plain, ratio = float(words[3]), float(words[6]), float(words[9])
    assert engine > 0 and plain > 0 and ratio == pytest.approx(engine / plain, rel=1e-2)  # printed rounded
    (row,) = [line for line in table.read_text().splitlines() if line.startswith("| `pinned`")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:4] == ["no", "pairs", "plain loop, engine's step"]
    assert float(cells[4]) == pytest.approx(engine, abs=1e-3) and float(cells[5]) == pytest.approx(plain, abs=1e-3)


@pytest.mark.slow  # turn-taking runs by default in test_turns.py; the overhead tool in turns with `-m slow`
def test_overhead_tool_in_turns_counts_each_side_inside_its_own_turns(tmp_path, capsys):
    """`--method turns` (the default for an eager step): the CLI and the plain loop at once,
    taking turns from where their timed regions begin; each side timed over its own turns."""
    from trainer.overhead import main
    table = tmp_path / "overhead.md"
    main(["--repeats", "1", "--turn-ms", "20", "--settle-ms", "2", "--markdown", str(table), "model=noop",
          "engine.device=cpu", "dataset.num_samples=96", "dataset.shape=[8,8]", "loader.batch_size=16",
          "engine.max_steps=4000", "engine.warmup_steps=10"])
    _, cells = check_turns_run(capsys.readouterr().out, table, "`baseline`", max_steps=4000)
    assert cells[1:3] == ["no", "turns"] and cells[7] != "–"  # adjacent turns give an interval


def test_overhead_tool_alternates_its_repeats_and_takes_medians(tmp_path, monkeypatch):
    """`--repeats N`: N engine/plain pairs, one process after the other, the side that goes first
    alternating from pair to pair; each pair's ratio, the medians."""
    from trainer.tools import overhead
    started = []

    def engine_run(overrides, tmp):
        started.append("engine")
        return {"ms_per_step": [2.0, 4.0, 3.0][started.count("engine") - 1], "host_page_faults_per_step": 1.0,
                "host_cpu_ms_per_step": 1.0}

    def plain_run(overrides, tmp, reference):
        started.append("plain")
        return {"plain_ms_per_step": 1.0, "plain_host_page_faults_per_step": 0.0, "plain_host_cpu_ms_per_step": 0.5}
    monkeypatch.setattr(overhead, "engine_run", engine_run)
    monkeypatch.setattr(overhead, "plain_run", plain_run)
    lines = []
    out = overhead.measure(["loader=pinned"], 3, tmp_path, log=lines.append)
    assert started == ["engine", "plain", "plain", "engine", "engine", "plain"]
    assert [line.split()[:2] for line in lines] == [["repeat", "1:"], ["repeat", "2:"], ["repeat", "3:"]]
    assert (out["engine_ms"], out["plain_ms"], out["ratio"], out["ratio_min"], out["ratio_max"]) == (3.0, 1.0, 3.0, 2.0, 4.0)
    assert out["engine_spread"] == 2.0
    assert 1.0 < out["ratio_ci_low"] < 3.0 < out["ratio_ci_high"]  # three pairs, all slower: the interval excludes 1


def test_overhead_interval_says_whether_the_pairs_tell_the_ratio_from_one():
    from trainer.tools.overhead import ratio_interval
    assert ratio_interval([1.1, 1.1, 1.1]) == pytest.approx((1.1, 1.1))  # pairs that agree: no doubt left
    # Two pairs, 10% apart each way: the t interval (12.71 for one degree of freedom) is wide.
    assert ratio_interval([math.exp(0.1), math.exp(-0.1)]) == pytest.approx((math.exp(-1.271), math.exp(1.271)))
    low, high = ratio_interval([1.02, 0.98, 1.03, 0.99, 1.01])
    assert 0.97 < low < 1.0 < high < 1.04
    assert all(math.isnan(v) for v in ratio_interval([1.2]))  # one pair says nothing about its spread


@pytest.mark.parametrize("module", ["trainer.tools.plain_loop", "trainer.overhead"])
def test_overhead_tools_refuse_a_bad_override_in_one_line(module):
    """A key the model does not have: one line naming it, exit 1, as `python -m trainer` does."""
    proc = subprocess.run([sys.executable, "-m", module, "model=noop", "model.hidden=64"],
                          capture_output=True, text=True, cwd=PROJECT_ROOT)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("error: ") and "model.hidden" in proc.stderr and "Traceback" not in proc.stderr
