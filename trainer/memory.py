"""Memory checks made before an allocation that an input sizes: the dataset's labels, a strategy's
buffers, the model's weights and a batch's activations. Each fails with one `ConfigError` saying
what needs how much, what is available and which key to change, instead of a MemoryError or the
OOM killer half-way through the run.
"""

from __future__ import annotations

import math
import os
from typing import Callable, Optional, Union

import torch

from trainer.errors import ConfigError

OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd": 0}  # tensors the optimizer keeps per parameter


def host_available_bytes() -> int:
    """Host memory that can be allocated without swapping: MemAvailable, else free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def process_memory_mb() -> dict:
    """This process's host memory now, in MiB: `host_rss_mb`, its resident pages (a page it shares
    with other processes counted whole, in each of them), and `host_pss_mb`, its proportional
    share (each shared page divided among the processes that map it: the ranks' figures add up to
    what they hold together). Linux; elsewhere, the peak resident size only."""
    try:
        _trim_heap()
        found = {}
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("Rss", "Pss"):
                    found[f"host_{key.lower()}_mb"] = int(value.split()[0]) / 1024
        return found
    except OSError:
        import resource
        return {"host_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _trim_heap() -> None:
    """Give the C heap's free pages back to the system first (glibc's `malloc_trim`): memory an
    earlier run freed would otherwise still count, and a later run reuse it without counting
    (`engine.steady_heap` keeps freed pages on purpose, for the steps). Called before a run is
    built and after its loop, never inside the timed region."""
    global _libc
    if _libc is None:
        try:
            import ctypes
            _libc = ctypes.CDLL("libc.so.6")
        except OSError:
            _libc = False
    if _libc:
        _libc.malloc_trim(0)


_libc = None


def check_host_fits(needed: int, what: str, fix: Union[str, Callable[[int], str]]) -> None:
    """Fail before allocating `needed` bytes of host memory the machine does not have (page-locked
    memory cannot be swapped out, and a pageable overcommit ends in the OOM killer mid-run)."""
    free = host_available_bytes()
    if needed > free:
        raise ConfigError(f"{what} needs {needed / 2**30:.2f} GiB of host memory but only {free / 2**30:.2f} GiB "
                          f"is available: {fix(free) if callable(fix) else fix}")


_FRACTION: dict = {}  # CUDA device index -> the share of its memory this process may use (engine.gpu_memory_fraction)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def limit_gpu_memory(fraction: float, device: torch.device) -> None:
    """Let this process allocate at most `fraction` of `device`'s memory, as a card that much smaller
    would (PyTorch's caching allocator refuses past it), and `check_gpu_fits` count with that share.
    1.0: the whole card, which also lifts a limit an earlier run of the process set."""
    index = _index(device)  # PyTorch takes an index here, not a bare torch.device("cuda")
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    _FRACTION[index] = fraction


def check_gpu_fits(needed: int, device: torch.device, what: str, fix: Union[str, Callable[[int], str]]) -> None:
    """Fail before allocating `needed` bytes on `device` when they are not free there (within the
    share `limit_gpu_memory` allows, when it allows less than the card)."""
    free, total = torch.cuda.mem_get_info(device)
    fraction, limited = _FRACTION.get(_index(device), 1.0), ""
    if fraction < 1.0:
        free = max(0, min(free, int(fraction * total) - torch.cuda.memory_reserved(device)))
        limited = f" to this run (engine.gpu_memory_fraction={fraction:g})"
    if needed > free:
        raise ConfigError(f"{what} needs {needed / 2**30:.2f} GiB of GPU memory but only {free / 2**30:.2f} GiB "
                          f"of {total / 2**30:.2f} GiB is free{limited}: {fix(free) if callable(fix) else fix}")


def host_buffer_bytes(nbytes: int, pinned: bool) -> int:
    """Host bytes a buffer of `nbytes` takes. Page-locked, it comes from PyTorch's caching host
    allocator, which rounds every request up to a power of two (its default): up to twice the size."""
    if not pinned or nbytes <= 0:
        return max(nbytes, 0)
    return 1 << (nbytes - 1).bit_length()


def release_pinned_cache(after: Optional["torch.cuda.Stream"] = None) -> None:
    """Give back to the system the page-locked blocks no tensor uses any more, once the copies
    queued on `after` (which may still read them) are done. PyTorch's caching host allocator keeps
    every freed block pinned for reuse until the process exits: a sweep in one process would hold
    every size it ever pinned."""
    if not torch.cuda.is_available():
        return
    try:
        if after is not None:
            after.synchronize()  # a freed block is released only once the copies reading it are done
        torch._C._host_emptyCache()
    except RuntimeError:
        pass  # the device has failed (a sticky CUDA error the run already reports): nothing to release


def chunk_samples_for(sample_bytes: int, free: int) -> int:
    """`dataset.chunk_samples` that keeps two chunks (what `pinned_chunk` holds), each rounded up
    as the host allocator pins it (`host_buffer_bytes`), within half of `free`."""
    block = 1 << max(0, (free // 4).bit_length() - 1)  # the largest power of two within a quarter of `free`
    return max(1, block // sample_bytes)


def check_model_fits(cfg, dataset, device: torch.device) -> None:
    """Before the model is built: its float32 weights, their gradients and the optimizer's state,
    plus one batch's activations (a lower bound: the input and every layer's output), must fit in
    the memory of `device` (and the weights in host memory, where they are made first)."""
    from models import layer_sizes  # the model registry imports torch.nn: only when a run needs it

    params, widths = layer_sizes(cfg.model, dataset.sample_shape, dataset.num_classes)
    if not params:
        return  # model=noop: nothing is allocated per parameter or per layer
    batch = min(cfg.loader.batch_size, len(dataset))
    optimizer = cfg.engine.optimizer.name
    weights = 4 * params * (2 + OPTIMIZER_STATES.get(optimizer, 2))
    per_sample = 4 * (math.prod(dataset.sample_shape) + widths)  # float32 model input and layer outputs
    what = (f"model={cfg.model.name} ({params:,} parameters with their gradients and {optimizer}'s state, and "
            f"the activations of loader.batch_size={batch})")

    def fix(free: int) -> str:
        if weights < free // 2 and batch > 1:  # the weights fit: the batch is too large
            return f"set loader.batch_size={max(1, (free // 2 - weights) // per_sample)} or smaller"
        return f"set a smaller {' or '.join(_size_keys(cfg))}"

    if device.type == "cuda":
        check_gpu_fits(weights + batch * per_sample, device, what, fix)
        check_host_fits(4 * params, f"model={cfg.model.name} ({params:,} parameters, made on the host first)", fix)
    else:
        check_host_fits(weights + batch * per_sample, what, fix)


def _size_keys(cfg) -> list:
    """The keys that size the model: its own widths, and the input and output sizes the dataset sets."""
    keys = [f"model.{k}" for k in ("hidden", "bottleneck") if k in cfg.model]
    if cfg.model.name == "mlp" and "num_classes" in cfg.dataset:
        keys.append("dataset.num_classes")
    return keys + ["dataset.shape"] * ("shape" in cfg.dataset)
