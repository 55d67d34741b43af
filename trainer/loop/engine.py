"""The training loop: fetch a device-ready batch, forward, loss, backward, step – timed by one meter."""

from __future__ import annotations

import gc
import sys

from tqdm import tqdm

from trainer.loop.faults import LossWatch, signals_after
from trainer.loop.meter import StepMeter
from trainer.loop.steps import STEP_COUNTS, make_step


def planned_steps(cfg, loader) -> int:
    """Steps the run will take. `engine.max_steps`, when set, is the run's length: the loop goes
    on for as many epochs as that takes (`engine.epochs` counts only when `max_steps=0`)."""
    return cfg.max_steps if cfg.max_steps > 0 else cfg.epochs * len(loader)


def train(step_fn, loader, meter: StepMeter, cfg, checksum=None, profiler=None, window=None) -> int:
    """Run `planned_steps(cfg, loader)` steps over `loader`, epoch after epoch; returns steps done.
    `window` (`trainer.loop.profiling.KernelWindow`): steps traced after the timed region."""
    # Read the config once: an OmegaConf attribute costs ~10 us, more than a small graphed step's budget.
    total, warmup = planned_steps(cfg, loader), cfg.warmup_steps
    bar = tqdm(total=total, file=sys.stderr, mininterval=0.5, unit="step", leave=False,
               disable=not (cfg.progress and sys.stderr.isatty()))
    watch = LossWatch(meter, cfg.optimizer.lr)  # NaN/inf loss: checked lagged, never with a sync
    step, epoch, batches = 0, 0, None
    # The objects built so far (configs, MLflow, Hydra) live for the whole run: freeze them out of
    # the cyclic garbage collector, so its passes in the loop cost what they would in a bare script.
    # The young generations only: a full collection takes 0.3-0.4 s in a process that has imported
    # the compiler, once a rung for the advisor's dozen; older garbage waits out the run frozen.
    with signals_after():  # Ctrl-C during the collection is raised after it, not dropped in a callback
        gc.collect(1)
    gc.freeze()
    try:
        if warmup == 0:
            meter.start_timed()  # no warm-up: every step is timed
        while step < total:
            meter.epoch = epoch
            batches = iter(loader)
            start = step
            while step < total:
                meter.wait_begin()
                # Exactly what `for x, y in loader` does, for the host allocator's sake: the batch
                # is unpacked at once (no tuple kept), and the pass's last batch stays referenced
                # until the next pass's first one is made. Keeping the tuple, or dropping the last
                # batch early, changes the order in which freed batches meet the heap, and
                # pageable batches then wander over ten addresses instead of reusing two.
                try:
                    x, y = next(batches)  # data_wait: the host blocks here until a batch is ready
                except StopIteration:
                    break
                except Exception as e:
                    e.step = step + 1  # the step whose batch never came: the run's failed_step
                    raise
                if checksum is not None:
                    checksum.update(x, y)  # device-side hash, read after the loop
                # x.shape[0], not len(x): Tensor.__len__ is a Python method, 1-4 us a call (benchmarks/loop_cost.py)
                meter.step_begin(x.shape[0])
                # The loop keeps no reference to the loss past the step; the meter keeps what it
                # needs without splitting the host heap (see trainer.loop.meter).
                meter.step_end(step_fn(x, y))
                step += 1
                bar.update()  # tqdm redraws at most every `mininterval` seconds
                watch.after_step(step)
                if profiler is not None:
                    profiler.step()
                if step == warmup:
                    meter.start_timed()
            if step == start:  # an empty pass: nothing more to come
                break
            if checksum is not None:
                checksum.end_epoch()
            epoch += 1
        meter.end_timed()  # before the last loss check: the timed region is the steps alone
        watch.final()
        if window is not None and window.enabled:
            _trace_window(window, step_fn, loader, batches)
    finally:
        gc.unfreeze()
        bar.close()
        if hasattr(batches, "close"):  # stop this pass's DataLoader workers and copies now, even on error
            batches.close()
    return step


def _trace_window(window, step_fn, loader, batches) -> None:
    """The kernel window's steps, after the timed region: the loader goes on where the run left
    it (the rest of this pass, then more), its copies unmetered, and the step's counts of graph
    replays and eager steps stay the run's own."""
    def more():
        if batches is not None:
            yield from batches
        while len(loader) > 0:
            yield from iter(loader)
    probe, loader.copy_probe = getattr(loader, "copy_probe", None), None
    counts = {k: getattr(step_fn, k) for k in STEP_COUNTS if hasattr(step_fn, k)}
    following = more()
    try:
        window.run(step_fn, following)
    finally:
        following.close()  # stops the workers of a pass the window began
        loader.copy_probe = probe
        for k, v in counts.items():
            setattr(step_fn, k, v)


class FeedbenchLoop:
    """`engine.loop=feedbench`: the loop above, over the engine's own step (eager, CUDA-graphed or compiled)."""

    Meter = StepMeter

    def train(self, parts) -> int:
        parts.step = make_step(parts.model, parts.optimizer, parts.graphed, parts.cfg.engine.precision,
                               compile=parts.cfg.engine.compile, feed=parts.loader.graph_feed, grads=parts.grads)
        return train(parts.step, parts.loader, parts.meter, parts.cfg.engine, parts.checksum, parts.profiler,
                     parts.window)
