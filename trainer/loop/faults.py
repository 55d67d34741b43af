"""What stops a run part-way, turned into the exceptions of `trainer.errors`:

- `StopSignals`: SIGINT and SIGTERM raise `Interrupted` while the run builds and trains, and wait
  while it is opened and saved, so an interrupted run is always closed as KILLED with its steps
  (`signals_after`: they wait for the end of a block where Python would drop the exception);
- `LossWatch`: a NaN/inf loss stops the run (`RunFailed` naming the step) without a per-step sync;
- `explain_faults`: GPU or host out-of-memory and DataLoader worker failures become one-line `RunFailed`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import traceback
from typing import Iterator, Optional

import torch

from datasets.samples import SampleError
from trainer.errors import Interrupted, RunFailed
from trainer.loop.losslog import LOSS_BATCH

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
stopped_by: Optional[int] = None  # the signal that stopped this process, for exit hooks (a sweep's parent run)


class StopSignals:
    """While open (a context manager), SIGINT and SIGTERM are handled in two modes:

    - armed (`arm()`: building the parts and training): the signal raises `Interrupted` at once,
      so the `finally` blocks save what was measured and the Tracker marks the run KILLED.
      Without this, SIGTERM would end the process on the spot and save nothing;
    - held (the default, and `hold()`: opening the run, saving it): the signal is noted and
      raised when the run is closed, so bookkeeping is never cut in half; a second signal
      stops at once.

    Signal handlers can only be set from the main thread; elsewhere this does nothing.
    """

    def __init__(self, announce: bool = True, waiting_for: str = "the run's records are written") -> None:
        self.announce = announce  # under torchrun only rank 0 says it (every rank gets the signal)
        self.waiting_for = waiting_for  # what a held signal waits for, as the note names it
        self._previous: dict = {}
        self._armed = False
        self._pending: Optional[int] = None
        self._owner = os.getpid()

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
        if self._pending is not None and exc_type is None:
            raise Interrupted(self._pending)  # the run is saved and closed; now stop
        return False

    def arm(self) -> None:
        """From here on a signal raises `Interrupted` (one noted while held is raised now)."""
        if self._pending is not None:
            signum, self._pending = self._pending, None
            raise Interrupted(signum)
        self._armed = True

    def hold(self) -> None:
        """From here on a signal waits until the run is closed."""
        self._armed = False

    def _handle(self, signum: int, frame) -> None:
        if os.getpid() != self._owner:  # a forked DataLoader worker: behave as by default
            if signum == signal.SIGINT:
                raise KeyboardInterrupt  # torch's worker loop exits quietly on it
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self._armed:
            self._armed = False  # what runs next is saving: hold any further signal
            raise Interrupted(signum)
        if self._pending is None:
            self._pending = signum
            # os.write, not print: a handler may run in the middle of another write to stderr.
            if self.announce:
                os.write(2, f"feedbench: stopping once {self.waiting_for} (signal again to stop at once)\n".encode())
            return
        raise Interrupted(signum)


@contextlib.contextmanager
def signals_after() -> Iterator[None]:
    """SIGINT and SIGTERM that come during the block are noted, and the first is raised again at
    its end, for the handlers in place before. For a garbage collection: a handler run inside one
    of its weakref callbacks raises where Python drops the exception ("Exception ignored in ..."),
    and the run would go on as if no signal had come."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list = []
    before = {s: signal.signal(s, lambda signum, frame: came.append(signum)) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
        if came:
            signal.raise_signal(came[0])  # its handler runs at once, here: outside the collection


class LossWatch:
    """Stops a run whose loss became NaN or inf, without syncing the device in the loop.

    Every `every` steps (the meter's `LOSS_BATCH`, when it writes its loss log) the losses logged
    since the last check are reduced on the device to one flag (all finite?), copied to
    page-locked host memory without blocking, and an event is recorded: three device ops, which
    is all this costs the loop. That verdict is read at a later check, once its event has
    completed (`Event.query()` never blocks), so a bad loss stops the run within about
    2 x `every` steps; only then is the first bad step looked for (the run stops, a sync is
    fine). `final()` checks the rest after the loop. The host flag and the event are made once
    and reused: one verdict is in flight at a time.
    """

    def __init__(self, meter, lr: float, every: int = LOSS_BATCH):
        self.meter, self.lr, self.every = meter, lr, every
        self.cuda = meter.device.type == "cuda"
        self.checked = 0  # steps covered by verdicts already issued
        self.pending: Optional[tuple] = None  # (first, last) step covered by the verdict in flight
        self._host = torch.empty((), dtype=torch.bool, pin_memory=self.cuda)
        self._event = torch.cuda.Event() if self.cuda else None
        if self.cuda:
            # A kernel's first launch in a process loads its module (CUDA's lazy loading: up to
            # ~0.1 s and thousands of page faults). Launch the check's kernels once now, before
            # the loop, so that the first check inside the timed steps costs what the others do.
            held = [torch.zeros((), device=meter.device)] * 2
            self._host.copy_(torch.isfinite(torch.stack(held)).all(), non_blocking=True)
            self._event.record()  # PyTorch creates the CUDA event at its first record: here, not in the loop
            torch.cuda.synchronize(meter.device)

    def after_step(self, step: int) -> None:
        """Called after every step: cheap unless `step` is a multiple of `every`."""
        if step % self.every:
            return
        if self.pending is not None:
            if self.cuda and not self._event.query():
                return  # the device has not got there yet: look again at the next check
            self._read()
        self._issue(step)
        if not self.cuda:  # on the CPU the verdict is already there
            self._read()

    def final(self) -> None:
        """After the loop (the meter syncs there anyway): check every loss not checked yet."""
        if self.pending is not None:
            self._wait_and_read()
        self._issue(self.meter.ended)
        if self.pending is not None:
            self._wait_and_read()

    def _issue(self, upto: int) -> None:
        losses = self.meter.losses(self.checked, upto)
        if not len(losses):
            return
        self._host.copy_(torch.isfinite(losses).all(), non_blocking=self.cuda)
        if self.cuda:
            self._event.record()
        self.pending, self.checked = (self.checked, upto), upto

    def _wait_and_read(self) -> None:
        if self.cuda:
            self._event.synchronize()
        self._read()

    def _read(self) -> None:
        (start, stop), self.pending = self.pending, None
        if bool(self._host):
            return
        losses = self.meter.losses(start, stop)
        step = start + int((~torch.isfinite(losses)).int().argmax()) + 1  # steps are numbered from 1, as in steps.csv
        value = float(losses[step - start - 1])
        raise RunFailed(f"loss became {value} at step {step} (engine.optimizer.lr={self.lr}): lower "
                        f"engine.optimizer.lr or check the input data", step=step)


@contextlib.contextmanager
def explain_faults(cfg) -> Iterator[None]:
    """Turn faults the user can act on into one-line `RunFailed`s: GPU or host out of memory (naming
    the strategy and loader.batch_size) and a DataLoader worker that died or raised."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        b, strategy = cfg.loader.batch_size, cfg.loader.name
        resident = ", or a smaller dataset.num_samples (gpu_resident keeps all of it in GPU memory)"
        raise RunFailed(f"out of GPU memory with loader={strategy} loader.batch_size={b} model={cfg.model.name}: "
                        f"set loader.batch_size={max(1, b // 2)} or smaller{resident * (strategy == 'gpu_resident')}") from e
    except Exception as e:
        text = str(e)
        if isinstance(e, MemoryError) or "DefaultCPUAllocator: can't allocate memory" in text:
            # Host memory the up-front checks could not foresee (they count a lower bound, and a
            # container's memory limit is not in /proc/meminfo).
            b = cfg.loader.batch_size
            if _while_building(e):  # the dataset, or the loader's copy of it: the batch size is no help
                shape = ", or a smaller dataset.shape" if "shape" in cfg.dataset else ""
                raise RunFailed(f"out of host memory building dataset={cfg.dataset.name} for loader={cfg.loader.name}: "
                                f"the dataset does not fit; set a smaller dataset.num_samples{shape}") from e
            raise RunFailed(f"out of host memory with loader={cfg.loader.name} loader.batch_size={b} "
                            f"model={cfg.model.name}: set loader.batch_size={max(1, b // 2)} or smaller, "
                            f"or a smaller dataset.num_samples") from e
        step = getattr(e, "step", None)  # the step that never got its batch (the loop notes it)
        if isinstance(e, SampleError):  # the dataset's own code failed on a sample
            # From a DataLoader worker it arrives as "Caught SampleError in DataLoader worker
            # process N.\nOriginal Traceback ...\ndatasets.samples.SampleError: <the line>".
            line = text.splitlines()[-1].split("SampleError: ", 1)[-1] if "DataLoader worker" in text else text
            raise RunFailed(line, step=step) from e
        if _worker_connection_broke(e):
            # The worker died while sending a batch: the main process's read of it fails before
            # PyTorch's SIGCHLD check can name the worker.
            raise RunFailed(f"a DataLoader worker failed with loader.num_workers={cfg.loader.num_workers}: the "
                            f"connection to a DataLoader worker broke while it sent a batch ({type(e).__name__}: "
                            f"{e}): rerun with loader.num_workers=0 to see the error in the main process", step=step) from e
        if "DataLoader worker" not in text:
            raise
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        # A worker's own exception arrives as "Caught X in DataLoader worker process N.\nOriginal
        # Traceback ...\nX: message": keep the first and the last line.
        what = lines[0].rstrip(".") + (f" ({lines[-1]})" if len(lines) > 1 else "")
        raise RunFailed(f"a DataLoader worker failed with loader.num_workers={cfg.loader.num_workers}: {what}: "
                        f"rerun with loader.num_workers=0 to see the error in the main process", step=step) from e


BUILDERS = ("build_dataset", "build_loader")  # what a run calls to allocate its data before the loop


def _while_building(e: BaseException) -> bool:
    """Whether `e` was raised while the run built its dataset or its loader."""
    return any(frame.name in BUILDERS for frame in traceback.extract_tb(e.__traceback__))


def _worker_connection_broke(e: BaseException) -> bool:
    """A connection error raised while the DataLoader read a batch from a worker process."""
    if not isinstance(e, (ConnectionError, EOFError)):
        return False
    files = [frame.filename.replace(os.sep, "/") for frame in traceback.extract_tb(e.__traceback__)]
    return any("torch/utils/data/" in f for f in files) and any("multiprocessing/" in f for f in files)
