"""`engine.loop=lightning`: the same run driven by Lightning's `Trainer`, timed by the same meter.

`run(cfg)` builds the dataset, the loader strategy, the model and its optimizer exactly as for the
feedbench loop and hands them to `fit`. The model becomes a thin LightningModule (`training_step`
is the model's loss; Lightning's automatic optimization runs zero_grad, backward and the optimizer
step); the strategy is the Trainer's training data. Lightning's logger, checkpointing, progress bar
and model summary stay off unless `engine.lightning.*` turns them on.

Who copies the batch to the device: every batch goes through Lightning's transfer
(`LightningModule.transfer_batch_to_device`, via the accelerator strategy's `batch_to_device` and
`move_data_to_device`), which calls `tensor.to(device, non_blocking=True)`:
- a strategy that yields batches already on the device (`prefetch`, `pinned_chunk`,
  `gpu_resident`, ...): `.to()` of a tensor already on that device returns the tensor itself, so
  nothing is copied twice;
- a strategy whose copy is just that call after a DataLoader (`baseline`, `pinned`, the DataLoader
  variants of `iterable_chunks`; see `DeviceLoader.host_batches`): Lightning gets the host batches
  and makes the copy, as it does for any user's DataLoader. This is Lightning's default path.

Where a step's time goes (the columns of steps.csv, one row per step):
- `data_wait_ms`: host time in `next()` on the strategy (called by Lightning's fetcher), plus, when
  Lightning makes the copy, the host time of its transfer;
- `h2d_ms`: CUDA events around each copy, on the stream that made it;
- `compute_ms`: CUDA events from the start of `training_step` to the end of the optimizer's update
  (on the CPU: host time of forward, zero_grad, backward and update);
- `step_ms`: host time from one `next()` on the strategy to the next (to the end of training, for
  the last step);
- `lightning_ms`: the part of `step_ms` spent in Lightning's own code: its fetcher, its hooks and
  callbacks, the transfer of a batch already on the device, logging, loop bookkeeping, epoch ends.
Nothing here synchronizes the device inside the loop.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Iterator, List, Optional

import lightning as L
import torch
from tqdm import tqdm

from trainer.errors import ConfigError
from trainer.lightning import EpochPasses
from trainer.loaders.stream import tensors
from trainer.loop.faults import LossWatch
from trainer.loop.engine import planned_steps
from trainer.loop.meter import StepMeter

LIGHTNING_PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}  # engine.precision -> Trainer's


class LightningMeter(StepMeter):
    """The one meter, told two more things by the Lightning loop: when the strategy handed the batch
    over (Lightning runs hooks between that and the step, so the data wait ends there, not at
    `step_begin`), and how much host time of a step was our own code (the step itself, and
    feedbench's bookkeeping). The rest of the step's wall time is Lightning's: `lightning_ms`."""

    # a step's host marks: when its wait began, when the batch arrived, and seconds of data wait
    # after that (Lightning's copy), of the step's own code, of feedbench's bookkeeping
    WAIT, RECEIVED, COPY_S, STEP_S, BOOKS_S = range(5)

    def __init__(self, device: torch.device, warmup_steps: int, capacity: int = 4096, **options):
        super().__init__(device, warmup_steps, capacity, **options)
        self.marks: List[list] = []  # one per started step
        self._mark: Optional[list] = None  # the current step's, from the start of its wait
        self._loop_end: Optional[float] = None

    @property
    def steps_started(self) -> int:
        return len(self.marks)

    @property
    def timing(self) -> bool:
        """Whether the timed region has begun."""
        return self.clock.t0 is not None

    def wait_begin(self) -> None:
        super().wait_begin()
        self._mark = [time.perf_counter(), None, 0.0, 0.0, 0.0]

    def batch_received(self) -> None:
        self._mark[self.RECEIVED] = time.perf_counter()

    def add(self, slot: int, seconds: float) -> None:
        """Book `seconds` of the current step's host time to `slot` (COPY_S, STEP_S or BOOKS_S)."""
        if self._mark is not None:
            self._mark[slot] += seconds

    def step_begin(self, samples: int) -> None:
        super().step_begin(samples)
        if self._mark is None or (self.marks and self._mark is self.marks[-1]):
            now = time.perf_counter()  # a batch that did not come through `wait_begin`: no wait
            self._mark = [now, now, 0.0, 0.0, 0.0]
        self.marks.append(self._mark)

    def end_loop(self, sync: bool = True) -> None:
        """Training ended (or broke): the last step's wall time ends here; with `sync`, the timed
        region ends once the device has finished, before Lightning's teardown."""
        if self._loop_end is not None:
            return
        self._loop_end = time.perf_counter()
        if sync:
            self.end_timed()  # the timed steps' host side, without Lightning's teardown

    def _host_rows(self) -> List[dict]:
        """The host columns by Lightning's marks: a step lasts from one `next()` on the strategy to
        the next, its data wait ends when the batch is on the device, and `lightning_ms` is the rest
        of it that was neither the step's own code nor feedbench's bookkeeping."""
        rows = super()._host_rows()
        loop_end = self._loop_end or time.perf_counter()
        starts = [m[self.WAIT] for m in self.marks]
        if self._mark is not None and (not self.marks or self._mark is not self.marks[-1]):
            starts.append(self._mark[self.WAIT])  # a wait that never became a step ends the step before it
        for i, row in enumerate(rows):
            wait, received, copy_s, step_s, books_s = self.marks[i]
            end = starts[i + 1] if i + 1 < len(starts) else loop_end
            row["step_ms"] = (end - wait) * 1e3
            row["host_clock_s"] = wait
            row["data_wait_ms"] = ((received or wait) - wait + copy_s) * 1e3
            if not self.cuda:
                row["compute_ms"] = step_s * 1e3
            row["lightning_ms"] = max(0.0, row["step_ms"] - row["data_wait_ms"] - (step_s + books_s) * 1e3)
        return rows


def _timed_pass(batches: Iterator, meter: LightningMeter, warmup_steps: int) -> Iterator:
    """One pass over `batches`, as Lightning's fetcher draws it: each `next()` timed as data wait."""
    try:
        while True:
            if meter.steps_started == warmup_steps and not meter.timing:
                meter.start_timed()  # one sync, after the warm-up (before the first step when there is none)
            meter.wait_begin()
            try:
                batch = next(batches)  # data_wait: the host blocks here until the strategy has a batch
            except StopIteration:
                return
            meter.batch_received()
            yield batch
    finally:
        if hasattr(batches, "close"):  # stop this pass's workers and copies now, not at garbage collection
            batches.close()


class FeedbenchModule(L.LightningModule):
    """The composed model as a LightningModule: `training_step` is its loss, and Lightning's
    automatic optimization makes zero_grad, backward and the optimizer step (a model without
    parameters has nothing to step: manual optimization, forward only, as in the feedbench loop).

    Its hooks only report to the meter; each does what Lightning's default does."""

    def __init__(self, model, optimizer, meter: LightningMeter, lightning_copies: bool, log_loss: bool = False,
                 prog_bar: bool = False):
        super().__init__()
        self.model = model
        self.automatic_optimization = optimizer is not None
        self._optimizer, self._meter = optimizer, meter
        self._lightning_copies = lightning_copies and meter.cuda
        self._count_copy_as_wait = lightning_copies
        self._log_loss, self._prog_bar = log_loss, prog_bar
        self._loss = None
        self._t_transfer = self._t_update = 0.0

    def configure_optimizers(self):
        return self._optimizer

    def on_before_batch_transfer(self, batch, dataloader_idx):
        self._t_transfer = time.perf_counter()
        if self._lightning_copies:  # Lightning's copy runs on the compute stream: time it there
            self._meter.copy_begin(torch.cuda.current_stream(self._meter.device))
        return batch

    def on_after_batch_transfer(self, batch, dataloader_idx):
        if self._lightning_copies:
            self._meter.copy_end(torch.cuda.current_stream(self._meter.device), sum(t.nbytes for t in tensors(batch)))
        if self._count_copy_as_wait:  # the batch is ready only now; a no-op transfer is Lightning's time
            self._meter.add(LightningMeter.COPY_S, time.perf_counter() - self._t_transfer)
        return batch

    def training_step(self, batch, batch_idx):
        x, y = batch
        meter = self._meter
        meter.step_begin(x.shape[0])  # not len(x): a Python method, 1-4 us a call
        start = time.perf_counter()
        loss = self.model.loss(x, y)
        meter.add(LightningMeter.STEP_S, time.perf_counter() - start)
        if self._optimizer is None:
            meter.step_end(loss)
        else:
            self._loss = loss  # the step ends after the optimizer's update: `after_update`
        if self._log_loss:
            self.log("train_loss", loss, on_step=True, prog_bar=self._prog_bar)
        return loss

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        start = time.perf_counter()
        optimizer.zero_grad()
        self._meter.add(LightningMeter.STEP_S, time.perf_counter() - start)

    def backward(self, loss, *args, **kwargs):
        start = time.perf_counter()
        super().backward(loss, *args, **kwargs)
        self._meter.add(LightningMeter.STEP_S, time.perf_counter() - start)

    def on_before_optimizer_step(self, optimizer):
        self._t_update = time.perf_counter()  # called right before the optimizer updates the weights

    def after_update(self, optimizer, args, kwargs):
        """The optimizer's step post-hook: the update is done, and so is the step."""
        self._meter.add(LightningMeter.STEP_S, time.perf_counter() - self._t_update)
        self._meter.step_end(self._loss)


class _Loop(L.Callback):
    """What the feedbench loop does around each step, at Lightning's hooks: count steps and stop
    after `total`, checksums, the NaN watch, the profiler, the progress bar; and it notes the
    exception that ended the fit (Lightning catches KeyboardInterrupt itself)."""

    def __init__(self, meter: LightningMeter, total: int, watch: LossWatch, bar, checksum=None, profiler=None):
        self.meter, self.total, self.watch, self.bar = meter, total, watch, bar
        self.checksum, self.profiler = checksum, profiler
        self.steps = 0
        self.exception: Optional[BaseException] = None

    def on_train_epoch_start(self, trainer, pl_module):
        self.meter.epoch = trainer.current_epoch

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.checksum is not None:
            start = time.perf_counter()
            self.checksum.update(*batch)  # device-side hash, read after the loop
            self.meter.add(LightningMeter.BOOKS_S, time.perf_counter() - start)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        start = time.perf_counter()
        self.steps += 1
        self.bar.update()
        self.watch.after_step(self.steps)
        if self.profiler is not None:
            self.profiler.step()
        if self.steps >= self.total:
            trainer.should_stop = True  # Lightning ends the epoch here (its max_steps counts optimizer steps only)
        self.meter.add(LightningMeter.BOOKS_S, time.perf_counter() - start)

    def on_train_epoch_end(self, trainer, pl_module):
        if self.checksum is not None:
            self.checksum.end_epoch()

    def on_train_end(self, trainer, pl_module):
        self.meter.end_loop()  # as in our loop: the last loss check is after the timed region
        self.watch.final()

    def on_exception(self, trainer, pl_module, exception):
        self.exception = exception
        self.meter.end_loop(sync=False)


def fit(model, optimizer, loader, meter: LightningMeter, cfg, checksum=None, profiler=None,
        tmp: Optional[Path] = None) -> int:
    """Run `planned_steps(cfg, loader)` steps over `loader` with Lightning's Trainer, as the
    feedbench loop does (`engine.max_steps`, when set, over as many epochs as it takes); `cfg` is
    the `engine` section. Returns the steps done."""
    if cfg.precision == "fp16" and not meter.cuda:  # Lightning would run bf16 instead, and say so only in a warning
        raise ConfigError("engine.loop=lightning runs engine.precision=fp16 only on a GPU: set engine.precision=bf16, "
                          "or engine.loop=feedbench")
    out_dir = output_dir(tmp)
    total = planned_steps(cfg, loader)
    host = loader.host_batches()  # an unstarted generator (nothing has run yet), or None
    lightning_copies = host is not None
    if host is not None:
        host.close()
    one_pass = loader.host_batches if lightning_copies else lambda: iter(loader)
    passes = EpochPasses(lambda: _timed_pass(one_pass(), meter, cfg.warmup_steps), loader)
    lc = cfg.lightning
    module = FeedbenchModule(model, optimizer, meter, lightning_copies, log_loss=lc.logger or lc.progress_bar,
                             prog_bar=lc.progress_bar)
    bar = tqdm(total=total, file=sys.stderr, mininterval=0.5, unit="step", leave=False,
               disable=lc.progress_bar or not (cfg.progress and sys.stderr.isatty()))
    loop = _Loop(meter, total, LossWatch(meter, cfg.optimizer.lr), bar, checksum, profiler)
    hook = optimizer.register_step_post_hook(module.after_update) if optimizer is not None else None
    handlers = _signal_handlers()
    try:
        with _quiet_lightning(lc.model_summary):
            trainer = L.Trainer(
                accelerator="gpu" if meter.cuda else "cpu",
                devices=[meter.device.index if meter.device.index is not None else torch.cuda.current_device()]
                if meter.cuda else 1,
                # the callback stops the fit after `total` steps; Lightning's own max_steps counts
                # optimizer steps only (a parameter-free model has none)
                max_epochs=-1 if cfg.max_steps else cfg.epochs, max_steps=-1,
                precision=LIGHTNING_PRECISION[cfg.precision],
                logger=_csv_logger(out_dir) if lc.logger else False, log_every_n_steps=lc.log_every_n_steps,
                enable_checkpointing=lc.checkpointing, enable_progress_bar=lc.progress_bar,
                enable_model_summary=lc.model_summary, num_sanity_val_steps=0, limit_val_batches=0,
                use_distributed_sampler=False, default_root_dir=str(out_dir),
                callbacks=[loop])
            try:
                trainer.fit(module, train_dataloaders=passes)
            except SystemExit:
                # Lightning answers a KeyboardInterrupt (Ctrl-C, or SIGTERM, which StopSignals raises as
                # one) by tearing down and calling sys.exit(1); older versions return instead (below).
                if not isinstance(loop.exception, KeyboardInterrupt):
                    raise
            if isinstance(loop.exception, KeyboardInterrupt):
                raise loop.exception  # the run is then closed as KILLED, with its steps, exit status 130/143
    finally:
        # Lightning ignores SIGINT while it shuts down after one and restores what it found only
        # if it had got as far as installing its own handlers: leave them as they were.
        for signum, handler in handlers.items():
            if signal.getsignal(signum) is not handler:
                signal.signal(signum, handler)
        bar.close()
        passes.close()
        if hook is not None:
            hook.remove()
    return loop.steps


def _signal_handlers() -> dict:
    if threading.current_thread() is not threading.main_thread():
        return {}  # handlers can only be set (and so only changed) from the main thread
    return {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) is not None}


def output_dir(tmp: Optional[Path]) -> Path:
    """Where Lightning writes its logs and checkpoints when asked to: `lightning/` in the job's
    Hydra output folder (outputs/hydra/...), or in the run's temporary folder without Hydra."""
    from hydra.core.hydra_config import HydraConfig

    base = Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else Path(tmp or ".")
    return base / "lightning"


def _csv_logger(out_dir: Path):
    from lightning.pytorch.loggers import CSVLogger

    return CSVLogger(str(out_dir), name="lightning_logs")


@contextlib.contextmanager
def _quiet_lightning(model_summary: bool):
    """Lightning's INFO lines (which devices it found, 'Detected KeyboardInterrupt, attempting
    graceful shutdown', ...) and its advice warnings stay out of a run's output, which keeps its
    one-line errors; the model summary is shown when asked for."""
    from lightning.fabric.utilities.warnings import PossibleUserWarning

    names = ["lightning.pytorch", "lightning.fabric"]
    if model_summary:
        names.append("lightning.pytorch.callbacks.model_summary")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.INFO if lg.name.endswith("model_summary") else logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=PossibleUserWarning)
            warnings.filterwarnings("ignore", message=r".*configure_optimizers.*returned `None`")
            warnings.filterwarnings("ignore", message=r".*GPU available but not used")
            warnings.filterwarnings("ignore", message=r".*Detected KeyboardInterrupt")
            # Lightning's fetcher on newer torch (its pytree helper); nothing a user can act on
            warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


class LightningLoop:
    """`engine.loop=lightning`: the same parts, driven by Lightning's Trainer (`fit`)."""

    Meter = LightningMeter

    def train(self, parts) -> int:
        return fit(parts.model, parts.optimizer, parts.loader, parts.meter, parts.cfg.engine, parts.checksum,
                   parts.profiler, parts.tmp)
