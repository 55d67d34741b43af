"""`run(cfg)`: one experiment, read as a list: build the parts, train, record, close.

    parts = build(cfg, ...)     # dataset, loader strategy, model, optimizer, meter: each from its own section
    parts.loop.train(parts)     # the loop chosen once by `engine.loop`: ours, or Lightning's Trainer
    record(parts, ...)          # what was measured: host-side rows kept whatever the device's state
    (close)                     # the loader, then the MLflow run: FINISHED, FAILED or KILLED

Failure handling wraps the list (`_opened`): stop signals, the MLflow run, the ranks' guard and
one-line faults. Under torchrun this is one rank's part of the run (`trainer.loop.distributed`):
rank 0 records it for all of them.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, Optional, Sequence

import torch

from datasets import build_dataset
from models import build_model
from trainer.config import COMPILE_GRAPH_MODES
from trainer.errors import ConfigError, RunFailed
from trainer.loaders import build_loader
from trainer.loop.distributed import Ranks
from trainer.loop.engine import planned_steps
from trainer.loop.clock import host_load
from trainer.loop.faults import StopSignals, explain_faults
from trainer.loop.meter import StepMeter
from trainer.loop.steps import STEP_COUNTS, build_optimizer
from trainer.loop.summary import GPU_FIGURES
from trainer.loop.verify import Checksum
from trainer.memory import check_model_fits, limit_gpu_memory, process_memory_mb
from trainer.loop.environment import describe
from trainer.loop.heap import steady_heap
from trainer.loop.limits import h2d_bandwidth
from trainer.loop.profiling import KernelWindow, StepProfiler, copy_overlap
from trainer.tracking.journal import JOURNAL, Journal, owner_tags, recover_dead_runs
from trainer.tracking.run_summary import tell
from trainer.tracking.runs import Tracker
from trainer.tracking.store import check_tracking_uri
from trainer.validate import check_against_dataset, validate

# The loops that can drive the steps, by `engine.loop`. Lightning is an optional extra: its module
# is imported only when it is chosen.
LOOPS = {"feedbench": "trainer.loop.engine:FeedbenchLoop", "lightning": "trainer.loop.lightning:LightningLoop"}


@dataclass
class Parts:
    """Everything a loop needs to train, built from the config's own sections."""

    cfg: object
    device: torch.device
    loader: object
    model: torch.nn.Module
    optimizer: Optional[torch.optim.Optimizer]
    meter: StepMeter
    loop: object
    graphed: bool
    checksum: Optional[Checksum]
    profiler: StepProfiler
    tmp: Path
    mem_base: int = 0  # GPU memory allocated before the run (`gpu_memory_baseline`)
    window: Optional[KernelWindow] = None  # steps traced after the timed region (`engine.kernel_window_steps`)
    step: object = None  # the step the loop ran (its graph_replays / eager_steps), set by the loop
    grads: object = None  # several ranks with distributed.sync=allreduce or sharded: the flat gradients the step averages


def select_device(name: str) -> torch.device:
    """`auto` picks CUDA when present; asking for CUDA without it is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("engine.device=cuda but no CUDA device is available: use engine.device=auto or engine.device=cpu")
    if name not in ("cpu", "cuda"):
        raise ConfigError(f"engine.device must be auto, cpu or cuda (got {name!r}): set engine.device=auto")
    return torch.device(name)


def check_precision(precision: str, device: torch.device) -> None:
    """fp16 on the CPU is refused: PyTorch has no fast float16 kernels there, so autocast makes a step
    many times slower than in fp32 (about 8-10x on a 2024 Xeon that has AVX512-FP16), and the run would
    time the emulation, not any training that is done. bf16 is a CPU's mixed precision."""
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError("engine.precision=fp16 needs a GPU: on the CPU PyTorch has no fast float16 kernels and a step "
                          "runs several times slower than in fp32, timing no training anyone runs: set "
                          "engine.precision=bf16 (mixed precision on a CPU) or engine.precision=fp32")


def loop_named(name: str):
    """The loop class registered under `engine.loop=name`."""
    module, cls = LOOPS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def run(cfg, on_timed_start: Sequence[Callable[[], None]] = (), dataset=None, needs_objective: bool = False,
        models: Optional[Callable] = None) -> dict:
    """One experiment: returns the summary metrics (also logged to MLflow). `on_timed_start`: what
    to call where the timed region begins (a harness's pause, `trainer.tools.turns`). `dataset`: a
    harness's dataset already built from `cfg.dataset`, shared by its runs (`trainer.tools.rounds`).
    `models`: a harness's `models.BuiltOnce`, which hands its runs copies of one model's weights.
    `needs_objective`: the run is a study's trial, ranked by `engine.objective`: one that did not
    measure it fails (RunFailed, the run closed FAILED) instead of finishing without it."""
    ranks = Ranks(cfg.distributed)  # a world of one unless started by torchrun
    with ranks.agree():  # several ranks: a bad value on any of them stops them all, printed once
        job = validate(cfg)  # the typed sections each part is built from
        device = ranks.device(select_device(cfg.engine.device))  # this rank's GPU, current from here on
        check_precision(job.engine.precision, device)
        if device.type == "cuda":  # every run sets it: 1.0 lifts what an earlier run in the process set
            limit_gpu_memory(cfg.engine.gpu_memory_fraction, device)
        ranks.validate(cfg)
        check_tracking_uri(cfg.tracking.uri)
    torch.manual_seed(cfg.engine.seed)
    # Before anything is allocated for the run, and undone after it (trainer.loop.heap).
    journal = None
    # The run's scratch folder (profiler traces, a remote store's journal): it outlives the MLflow
    # run, whose files are saved when it closes, and goes with it.
    try:
        with tempfile.TemporaryDirectory(prefix="feedbench-") as tmp, steady_heap(cfg.engine.steady_heap) as heap, \
                _opened(cfg, ranks, device, heap) as (stop, tracker):
            before = process_memory_mb()  # what the process held before this run's data, loader and model
            parts = build(cfg, job, device, ranks, tracker, Path(tmp), on_timed_start, dataset, models)
            journal = _journal(parts, tracker) if ranks.is_main else None
            error, memory = None, {}
            try:
                with ranks.uneven(parts.model, parts.loader.batches_per_rank(), cfg.engine):
                    parts.loop.train(parts)
            except BaseException as e:  # recorded first, raised after (it closes the run FAILED or KILLED)
                error = e
            finally:
                stop.hold()  # from the end of the loop on, a signal waits until the records are written
                if journal is not None:
                    journal.close()
                memory = process_memory_mb()  # while the loader still holds its data
                if "host_pss_mb" in memory and "host_pss_mb" in before:
                    memory["run_host_pss_mb"] = memory["host_pss_mb"] - before["host_pss_mb"]
                if error is None:
                    try:  # a copy the ranks share counts 1/N in each only while every rank maps it
                        ranks.line_up()
                    except BaseException as e:  # another rank failed meanwhile: its error is this run's
                        error = e
                _close(parts.loader, error)
            summary, error = record(parts, tracker, ranks, error, memory)
            if error is None and needs_objective:  # a study's trial: closed FAILED without its objective
                with ranks.agree():
                    check_objective(cfg.engine, summary)
            if error is not None:
                raise error
    except KeyboardInterrupt as stopped:  # closed KILLED: it says what it measured, as a finished run does
        if not getattr(stopped, "refused", None):  # (else the one line says what the store refused, and where it went)
            tell(cfg, getattr(stopped, "run_id", None))
        raise
    finally:
        # The run is closed with its records: the journal was their fallback. Kept when the store
        # refused some of them: a run it could not close is recovered from it (`recover_dead_runs`).
        if journal is not None and not getattr(tracker, "refused", None):
            journal.path.unlink(missing_ok=True)
    tell(cfg, tracker.run_id)  # what it found, on stderr, now that the run is closed (none if it failed)
    return summary


@contextlib.contextmanager
def _opened(cfg, ranks: Ranks, device: torch.device, heap: str) -> Iterator[tuple]:
    """The open run: stop signals, the MLflow run (rank 0), the ranks' guard and one-line faults."""
    tags = {"strategy": cfg.loader.name, "dataset": cfg.dataset.name, "model": cfg.model.name,
            "device": device.type, "loop": cfg.engine.loop, "precision": cfg.engine.precision,
            "torch_version": torch.__version__, "cuda_version": str(torch.version.cuda),
            "gpu_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "none", "steady_heap": heap,
            **ranks.tags(), **owner_tags()}
    with StopSignals(announce=ranks.is_main) as stop, ranks.tracker(lambda: Tracker(cfg, tags)) as tracker, \
            ranks.guard(), explain_faults(cfg):
        if ranks.is_main:  # runs of this store whose process died without closing them: KILLED, from their journals
            recover_dead_runs(tracker.client)
        stop.arm()  # SIGINT/SIGTERM now stop the run (KILLED); while it opens or saves, they wait
        tracker.log_environment(describe(device))
        yield stop, tracker


def build(cfg, job, device: torch.device, ranks: Ranks, tracker, tmp: Path,
          on_timed_start: Sequence[Callable] = (), dataset=None, models: Optional[Callable] = None) -> Parts:
    """The parts, each from its own typed section of `job` (`validate`); checks that need the
    dataset come first. `dataset`: one built from `job.dataset` already (else built here);
    `models(section, sample_shape, num_classes, device)`: where the model comes from (else built here)."""
    mem_base = gpu_memory_baseline(device)
    with ranks.agree():
        dataset = build_dataset(job.dataset) if dataset is None else dataset
        check_against_dataset(job, dataset)
        check_model_fits(cfg, dataset, device)  # before its weights exist, and before the loader's buffers
        loader = build_loader(job.loader, dataset, device, seed=cfg.engine.seed, shard=ranks.shard)
    try:  # from here on a failure closes the loader (its threads, its page-locked memory): no run will
        graphed = cfg.engine.cuda_graph and device.type == "cuda"
        degraded = [f"loader={cfg.loader.name}"] * loader.degraded + ["engine.cuda_graph=true"] * (cfg.engine.cuda_graph and not graphed)
        if cfg.engine.compile == "reduce-overhead" and device.type != "cuda":  # its CUDA graphs are its whole point
            degraded.append("engine.compile=reduce-overhead")
        tracker.set_tags({"degraded": str(bool(degraded)).lower(), "cuda_graph": str(graphed).lower(),
                          "compile": cfg.engine.compile, **decoded_where(loader)})
        if degraded:
            print(f"warning: no CUDA for {' and '.join(degraded)}; running the CPU path (run tagged degraded=true)", file=sys.stderr)
        with ranks.agree():
            if models is None:
                model = build_model(job.model, dataset.sample_shape, dataset.num_classes).to(device)
            else:
                model = models(job.model, dataset.sample_shape, dataset.num_classes, device)
            model.check(*dataset.example(device))  # a user's module against its loss, on one sample, before the run
        model = ranks.wrap(model)  # DDP, or the flat gradients of distributed.sync=allreduce or sharded
        with ranks.agree():
            ranks.check_plan(loader.batches_per_rank(), cfg.engine, graphed, loader.has_short_batches())
        optimizer = build_optimizer(cfg.engine.optimizer, model, capturable=graphed,
                                    params=ranks.grads.updated() if ranks.grads is not None else None)
        planned = planned_steps(cfg.engine, loader)
        warn_untimed(planned, cfg.engine.warmup_steps)
        warn_compile_timed(cfg.engine.compile, cfg.engine.warmup_steps, graphs=device.type == "cuda")
        loop = loop_named(cfg.engine.loop)()
        meter = loop.Meter(device, cfg.engine.warmup_steps, capacity=planned, gpu_timing_every=cfg.engine.gpu_timing_every,
                           # copies run `loader.depth` batches ahead, and one more under Lightning (its fetcher draws one ahead)
                           seed=cfg.engine.seed, copies_ahead=cfg.loader.get("depth", 0) + 1, on_timed_start=on_timed_start)
        meter.setup_s = loader.setup_s
        loader.copy_probe = meter
        tracker.set_tags({"scratch": str(tmp)})  # removed at the close; a killed run's, by its recovery
        return Parts(cfg=cfg, device=device, loader=loader, model=model, optimizer=optimizer, meter=meter, loop=loop,
                     graphed=graphed, grads=ranks.grads, checksum=Checksum(device) if cfg.engine.verify else None,
                     profiler=StepProfiler(cfg.engine.profile, tmp, skip=cfg.engine.warmup_steps), tmp=tmp,
                     mem_base=mem_base, window=KernelWindow(cfg.engine.kernel_window_steps, device, tmp,
                                                            off_because=_no_window(cfg, ranks)))
    except BaseException as e:
        _close(loader, e)
        raise


def _no_window(cfg, ranks: Ranks) -> str:
    """Why this run takes no kernel window whatever its device ("" when nothing forbids it)."""
    if cfg.engine.loop != "feedbench":
        return f"engine.loop={cfg.engine.loop}: the window's steps are the feedbench loop's"
    if ranks.enabled:
        return "several ranks: every rank would have to take the same extra steps"
    return ""


def _journal(parts: Parts, tracker) -> Optional[Journal]:
    """The run's journal, in its artifact folder when that is a local one (else a temporary
    folder), tagged so that `recover_dead_runs` finds it; None when `engine.journal_s=0`."""
    every_s = parts.cfg.engine.journal_s
    if every_s <= 0:
        return None
    uri = tracker.client.get_run(tracker.run_id).info.artifact_uri
    folder = Path(uri[len("file://"):] if uri.startswith("file://") else uri if "://" not in uri else parts.tmp)
    journal = Journal(folder / JOURNAL, parts.meter.journal_rows, every_s)
    tracker.set_tags({"journal": str(journal.path)})  # where it was kept; the file goes once the run is closed
    return journal


def _close(loader, error: Optional[BaseException]) -> None:
    """Close the loader (its workers, threads and page-locked buffers). A failure to close is
    raised only when the run had none of its own: the run's own error is what the user sees."""
    try:
        loader.close()
    except Exception as e:
        if error is None:
            raise
        print(f"warning: closing loader={loader.cfg.name} also failed: {' '.join(str(e).split())}", file=sys.stderr)


def record(parts: Parts, tracker, ranks: Ranks, error: Optional[BaseException], memory: dict) -> tuple:
    """Log what was measured (`memory`: the process's host memory as the loop ended), in the order that keeps the most; returns the summary and the error
    that ends the run (None: it finished). The meter's host-side rows never depend on the device:
    when reading the device fails (a sticky CUDA error), they are saved without the GPU columns,
    and the run's own error, if it had one, stays the one raised."""
    meter = parts.meter
    try:
        result = meter.finish()  # reads the CUDA events: one sync, after the loop
    except Exception as e:
        if error is None:
            error = e
        result = meter.host_result()
        print(f"warning: the GPU timings could not be read ({' '.join(str(e).split())[:200]}): "
              f"steps.csv holds the host's columns only", file=sys.stderr)
    tracker.log_steps(result.rows)
    recompiled = getattr(parts.step, "recompile_warning", str)()
    if recompiled and ranks.is_main:
        print(recompiled, file=sys.stderr)
    summary = dict(result.summary, pinned_host_mb=parts.loader.pinned_bytes / 2**20, **parts.loader.figures(),
                   **_step_counts(parts.step), **_peak_gpu_memory(parts), **host_load(), **memory)
    if parts.device.type != "cuda":  # no copy to a device, no compute stream: not 0, not measured
        summary.update({k: math.nan for k in GPU_FIGURES if k in summary})
    verified = parts.checksum.result() if parts.checksum is not None and error is None else None
    try:
        if error is None:  # after a failure: save, don't probe, and no collective with the other ranks
            summary.update(ranks.ceilings(lambda: ceilings(meter, parts.device), meter.batch_bytes))
            summary.update({k: v for k, v in image_figures(parts.loader, meter.batch_bytes).items() if k not in summary})
            summary.update(ranks.exchange(parts.model))  # several GPUs: what DDP's all-reduce costs a step
            summary, verified = ranks.combine(summary, result.rows, verified, tracker)  # several ranks: on rank 0
    finally:
        if error is None:
            summary.update(_window_figures(parts.window, tracker))
        tracker.log_summary(summary)
        if verified is not None:
            tracker.set_tags(verified)
        trace = _closed_trace(parts.profiler, error)
        if trace is not None:
            tracker.log_artifact(trace)
            overlap = copy_overlap(trace)  # did the copies run while kernels ran?
            tracker.log_summary(overlap)
            summary.update(overlap)
    return summary, error


def _window_figures(window: Optional[KernelWindow], tracker) -> dict:
    """The kernel window's figures (nan when none was taken, and the tag `kernel_window` says why),
    its trace an artifact."""
    if window is None:
        return {}
    figures = window.figures()
    tracker.set_tags({"kernel_window": f"{window.done} steps after the timed region" if window.enabled
                      else f"not taken: {window.reason}"})
    if window.enabled and window.trace.is_file():
        tracker.log_artifact(window.trace)
    return figures


def _step_counts(step) -> dict:
    """How many steps replayed a CUDA graph and how many ran eagerly (a graphed run's batch of
    another shape runs eagerly: said, not hidden); for a compiled step, the seconds it spent
    compiling and how often it compiled again."""
    return {k: getattr(step, k) for k in STEP_COUNTS if hasattr(step, k)}


_LIVE_AFTER_COLLECTION: Dict[int, int] = {}  # per GPU: bytes allocated when garbage was last ruled out


def gpu_memory_baseline(device: torch.device) -> int:
    """Several runs may share one process (a multirun): free what earlier ones left and measure
    this run's peak from here."""
    if device.type != "cuda":
        return 0
    # A full collection takes 0.3-0.4 s in a process of this size: only where more is allocated
    # than the last one left. Some memory outlives every run (cuBLAS's workspaces, a compiled
    # step's constants), so "anything allocated" would collect before every run of the process.
    held, index = torch.cuda.memory_allocated(device), device.index or 0
    if held > _LIVE_AFTER_COLLECTION.get(index, 0):
        gc.collect()
        held = torch.cuda.memory_allocated(device)
    _LIVE_AFTER_COLLECTION[index] = held
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _peak_gpu_memory(parts: Parts) -> dict:
    """This run's peak GPU memory (the allocator's statistics: no device work)."""
    if parts.device.type != "cuda":
        return {"peak_gpu_mem_mb": math.nan}  # no GPU: not measured, not 0
    try:
        return {"peak_gpu_mem_mb": (torch.cuda.max_memory_allocated(parts.device) - parts.mem_base) / 2**20}
    except Exception:  # a broken device: the figure is missing, the rest is saved
        return {}


def _closed_trace(profiler: StepProfiler, error: Optional[BaseException]) -> Optional[Path]:
    try:
        return profiler.close()
    except Exception:
        if error is None:
            raise
        return None


def untimed(planned: int, warmup: int, what: str = "this run") -> Optional[str]:
    """The line saying that the warm-up covers all `planned` steps of `what`, so none is timed; None
    when some step is timed."""
    if planned > warmup:
        return None
    return (f"engine.warmup_steps={warmup} covers all {planned} steps of {what}, so none is timed (timed_steps=0): "
            f"set engine.max_steps above {warmup} or engine.warmup_steps below {planned}")


def warn_untimed(planned: int, warmup: int) -> None:
    """A run whose warm-up covers all of its steps times nothing: say so (it records timed_steps=0)."""
    line = untimed(planned, warmup)
    if line is not None:
        print(f"warning: {line}", file=sys.stderr)


def check_objective(engine, summary: dict) -> None:
    """A study ranks its trials by `engine.objective`: a trial that did not measure it (nan or
    missing: nothing timed, a GPU figure on the CPU) failed, whatever else it recorded. Optuna
    takes no nan as a trial's value."""
    name = engine.objective
    if not math.isnan(summary.get(name, math.nan)):
        return
    why = untimed(summary.get("total_steps", 0), engine.warmup_steps, "this trial")
    raise RunFailed(f"engine.objective={name} was not measured, and a study ranks its trials by it: "
                    + (why or f"this run has no {name} (nan): set engine.objective=throughput_samples_per_s"))


def warn_compile_timed(compile: str, warmup: int, graphs: bool) -> None:
    """torch.compile compiles at the first step (and, in the modes that record CUDA graphs, records
    them at the second): a warm-up shorter than that times the compile as steps. Warned, not refused:
    such a run still measures what its first steps cost, and `compile_s` says how much was compiling."""
    if compile == "off":
        return
    needed = 2 if graphs and compile in COMPILE_GRAPH_MODES else 1
    if warmup < needed:
        work = "compiles the step at the first step" + (" and records its CUDA graphs at the second" if needed == 2 else "")
        print(f"warning: engine.compile={compile} {work}, and engine.warmup_steps={warmup} leaves that in the timed "
              f"steps (compile_s says how long it took): set engine.warmup_steps={max(needed, 5)}", file=sys.stderr)


def decoded_where(loader) -> dict:
    """An image folder's run: the tag `pixels_decoded`, where its images are decoded ({} for other data)."""
    if not getattr(loader.dataset, "image_files", False):
        return {}
    if loader.reads_files:  # gpu_decode: its JPEGs by nvJPEG (`gpu_decoded_fraction`), on a CPU its host path
        where = "gpu, every epoch" if loader.on_cuda else "host, every epoch (the strategy's threads)"
    elif loader.per_sample:
        workers = getattr(loader.cfg, "num_workers", 0)
        where = f"host, every epoch ({workers} DataLoader workers)" if workers else "host, every epoch (the loop's process)"
    else:
        where = "host, once at setup"
    return {"pixels_decoded": where}


def image_figures(loader, batch_bytes: int) -> dict:
    """An image folder's run, after the loop: decoding one image on the host as the DataLoader's
    workers do (`host_decode_ms_per_image`, on one core), and what crossed the link per image in the
    timed steps (`link_bytes_per_image`: a full batch's copies over its images; 0 for batches already
    on the device). `gpu_decode` counts its own link bytes (the compressed files)."""
    dataset = loader.dataset
    if not getattr(dataset, "image_files", False):
        return {}
    out = {"host_decode_ms_per_image": dataset.host_decode_ms()}
    if loader.on_cuda:
        out["link_bytes_per_image"] = batch_bytes / loader.cfg.batch_size
    return out


def ceilings(meter: StepMeter, device: torch.device) -> dict:
    """After the loop: this machine's pinned and pageable copy bandwidth for the run's full batch,
    so `h2d_GBps` can be read against what the link can do."""
    if device.type != "cuda" or not meter.batch_bytes:
        return {}
    nbytes = meter.batch_bytes
    return {"h2d_batch_mb": nbytes / 2**20, "h2d_peak_pinned_GBps": h2d_bandwidth(nbytes, pinned=True, device=device),
            "h2d_peak_pageable_GBps": h2d_bandwidth(nbytes, pinned=False, device=device)}
