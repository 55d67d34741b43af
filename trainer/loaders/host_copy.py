"""One host copy of the dataset for every rank of a host, page-locked for each rank's GPU.

`pinned_uva`, `pinned_gather` and `pinned_chunk` (with one chunk) hold the whole dataset in host
memory. Under torchrun each rank is its own process, and each used to load and pin its own copy:
N GPUs of one host held N copies. With `loader.shared_host_copy=true` (the default) the ranks of
a host hold one:

- the host's first rank (`LOCAL_RANK` 0) makes an anonymous shared-memory file
  (`memfd_create`: no name in any filesystem, so nothing can be left behind in /dev/shm), sizes
  it, maps it, loads the dataset into it and tells the others, through the process group's store,
  its pid and file descriptor;
- every other rank of the host opens that descriptor through `/proc/<pid>/fd/<fd>` (checking it is
  the file it was told of), maps it, and finds the dataset loaded;
- on a CUDA run each rank page-locks the mapping for its own GPU (`cudaHostRegister`): the
  physical pages are the same, pinned once, addressable by every GPU.

The memory goes back to the system when the last rank that maps it lets it go or exits, however it
exits (a killed launch included): the kernel counts the mappings, and no file names it. Each rank
unlocks its registration when the loader closes, or when a loader that failed to build is dropped.

In a world of one, across hosts, or with `loader.shared_host_copy=false`, each rank makes its own
copy, as a single process does (page-locked by PyTorch's host allocator).
"""

from __future__ import annotations

import math
import mmap
import os
import time
import uuid
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

import torch

from trainer.errors import ConfigError, RunFailed

NAME_PREFIX = "feedbench-host-copy"  # the shared files' name (as /proc/<pid>/maps shows it: /memfd:<name>)
_ALIGN = 64  # the labels start on a cache line after the samples
_made: Counter = Counter()  # copies made so far per run key: every rank makes them in the same order


@dataclass(frozen=True)
class HostPeers:
    """The ranks of this run that share this host, as a loader sees them: `local_rank` and
    `local_size` (torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE), the process group's `store`, the
    run's own `key` prefix in it, and how long a rank waits for the host's first rank."""

    local_rank: int = 0
    local_size: int = 1
    store: Any = None
    key: str = ""
    timeout_s: float = 300.0

    @property
    def alone(self) -> bool:
        return self.local_size <= 1 or self.store is None

    def next_key(self) -> str:
        """The store key of the next copy this run makes (every rank makes them in the same order)."""
        return f"{self.key}/host_copy{_made[self.key]}"

    def give_up(self, why: str) -> None:
        """The host's first rank failed before it made the copy the others may be waiting for:
        tell them, so they stop now instead of after `timeout_s`."""
        if self.alone or self.local_rank != 0:
            return
        try:
            self.store.set(self.next_key(), f"failed|{' '.join(why.split())[:300]}")
        except Exception:
            pass  # the store is gone with torchrun: the others are ending too


class HostCopy:
    """Samples `(n, *shape)` of `dtype` and their int64 labels in host memory, filled once by
    `fill(x, y)`: shared by the ranks of the host when `share` (see the module's docstring), else
    this process's own. Page-locked for this process's current GPU when `pin`.

    `x`, `y`: the tensors. `shared`: whether they are the host's one copy. `filled_here`: whether
    this process loaded them (and so counts their bytes as its own)."""

    def __init__(self, n: int, shape: Tuple[int, ...], dtype: torch.dtype, fill: Callable[[torch.Tensor, torch.Tensor], None],
                 pin: bool, peers: HostPeers = HostPeers(), share: bool = True):
        self.shared = share and not peers.alone
        self.filled_here, self._unlock = True, None
        self._closer = None  # closes the shared file's descriptor (its maker's), once
        if fill is None:  # `of`
            return
        if not self.shared:
            self.x = torch.empty((n, *shape), dtype=dtype, pin_memory=pin)  # straight into page-locked memory
            self.y = torch.empty((n,), dtype=torch.int64)
            fill(self.x, self.y)
            return
        sample_bytes = torch.empty((), dtype=dtype).element_size() * math.prod(shape)
        labels_at = -(-n * sample_bytes // _ALIGN) * _ALIGN
        self.nbytes = labels_at + 8 * n
        key = peers.next_key()
        _made[peers.key] += 1
        if peers.local_rank == 0:
            buffer = self._make(peers, key, fill, n, shape, dtype, labels_at)
        else:
            buffer = self._open(peers, key)
            self.filled_here = False
        self.x, self.y = _views(buffer, n, shape, dtype, labels_at)
        if pin:
            self._register()

    @classmethod
    def of(cls, x: torch.Tensor, y: torch.Tensor) -> "HostCopy":
        """This process's own copy, already loaded (e.g. a dataset's one chunk, held as it is)."""
        copy = cls(len(x), tuple(x.shape[1:]), x.dtype, None, pin=False, share=False)
        copy.x, copy.y = x, y
        return copy

    def _make(self, peers: HostPeers, key: str, fill, n, shape, dtype, labels_at) -> mmap.mmap:
        """The host's first rank: make the shared file, fill it, and say where it is."""
        name = f"{NAME_PREFIX}-{uuid.uuid4().hex[:12]}"
        peers.store.set(f"{key}/loading", str(os.getpid()))  # the others wait as long as this process loads
        try:
            if not hasattr(os, "memfd_create"):
                raise ConfigError("this system has no memfd_create, which a host copy shared by the ranks needs: "
                                  "set loader.shared_host_copy=false")
            fd = os.memfd_create(name, os.MFD_CLOEXEC)
            self._closer = weakref.finalize(self, _close_quietly, fd)  # also if the loader fails before close()
            os.ftruncate(fd, self.nbytes)
            buffer = mmap.mmap(fd, self.nbytes)
            fill(*_views(buffer, n, shape, dtype, labels_at))
        except BaseException as e:
            peers.store.set(key, f"failed|{' '.join(str(e).split())[:300]}")  # the others stop waiting
            raise
        peers.store.set(key, f"{os.getpid()}|{fd}|{self.nbytes}|{name}")
        return buffer

    def _open(self, peers: HostPeers, key: str) -> mmap.mmap:
        """Another rank of the host: wait for the first one's copy, then map the same file. The
        first rank has `timeout_s` to begin (or to say it failed), then as long as it lives to
        load the dataset: a large dataset from a slow disk may take longer than any bound."""
        loading, deadline = f"{key}/loading", time.monotonic() + peers.timeout_s
        while not peers.store.check([key]):
            if peers.store.check([loading]):
                pid = int(peers.store.get(loading).decode())
                if not _alive(pid):
                    raise RunFailed(f"the first rank of this host (pid {pid}) ended before it shared the dataset")
            elif time.monotonic() > deadline:
                raise RunFailed(f"rank {peers.local_rank} of this host waited {peers.timeout_s:g} s "
                                f"(distributed.timeout_s) for its first rank to load the dataset's shared host copy")
            time.sleep(0.05)
        told = peers.store.get(key).decode().split("|", 3)
        if told[0] == "failed":
            raise RunFailed(f"the first rank of this host could not load the dataset's shared host copy: {told[1]}")
        pid, fd, nbytes, name = told
        path = f"/proc/{pid}/fd/{fd}"
        try:
            if os.readlink(path) != f"/memfd:{name} (deleted)":
                raise OSError(f"{path} is not {name}")
            fd_here = os.open(path, os.O_RDWR)
        except OSError as e:
            raise ConfigError(f"this rank cannot open the dataset's shared host copy ({e}): "
                              f"set loader.shared_host_copy=false (each rank loads its own)") from e
        try:
            if os.fstat(fd_here).st_size != int(nbytes):
                raise ConfigError(f"the dataset's shared host copy is {os.fstat(fd_here).st_size} bytes, not {nbytes}: "
                                  f"set loader.shared_host_copy=false")
            # Every page mapped now, not at its first read inside the timed region (a page fault each).
            return mmap.mmap(fd_here, int(nbytes), flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd_here)  # the mapping keeps the memory

    def _register(self) -> None:
        """Page-lock the mapping for this process's GPU: copies from it are then true DMA, and a
        kernel can read it (unified virtual addressing), as from PyTorch's own pinned memory."""
        ptr = self.x.data_ptr()
        error = int(torch.cuda.cudart().cudaHostRegister(ptr, self.nbytes, 0))
        if error:
            raise ConfigError(f"could not page-lock the dataset's shared host copy (cudaHostRegister: CUDA error "
                              f"{error}; a limit on locked memory, `ulimit -l`?): set loader.shared_host_copy=false")
        # Unlocked at close(), or when the copy is dropped without it (a loader whose build failed):
        # still mapped then, since the copy holds its views until the finalizer has run.
        self._unlock = weakref.finalize(self, _unregister, ptr)

    def close(self, after: Optional["torch.cuda.Stream"] = None) -> None:
        """Unlock (once the work queued on `after`, which may read the copy, is done) and let go:
        this process's mapping goes with the last view of it, and the memory when no process maps
        it any more. Safe to call twice."""
        if self._unlock is not None and self._unlock.alive:
            if after is not None:
                after.synchronize()
            self._unlock()
        if self._closer is not None:
            self._closer()  # the others have mapped it (or will not: the run is over)
        self.x = self.y = None  # the mapping goes with the last view of it


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except PermissionError:
        return True  # it exists, under another user
    except OSError:
        return False


def _unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:
        pass  # the device has failed (a sticky CUDA error the run reports): the process's end unlocks it


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass  # closed already


def _views(buffer, n: int, shape, dtype, labels_at: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The samples and the labels, as tensors over the shared file's mapping (which they keep alive)."""
    x = torch.frombuffer(buffer, dtype=dtype, count=n * math.prod(shape)).view(n, *shape)
    return x, torch.frombuffer(buffer, dtype=torch.int64, count=n, offset=labels_at)


def holds_copy(peers: HostPeers, share: bool) -> bool:
    """Whether this rank allocates a copy of the dataset (for the host's memory check): with a
    shared copy only the host's first rank does."""
    return not share or peers.alone or peers.local_rank == 0


def whole_dataset(dataset, pin: bool, peers: HostPeers = HostPeers(), share: bool = True) -> HostCopy:
    """The whole dataset, in its storage dtype, with its int64 labels, loaded chunk by chunk
    straight into the copy (page-locked when `pin`): one per host when `share` (see `HostCopy`).
    A dataset of one chunk that this process alone reads on the host is held as it loads it."""
    if not pin and dataset.num_chunks == 1 and (not share or peers.alone):
        x, y = dataset.load_chunk(0)
        return HostCopy.of(x.contiguous(), y.to(torch.int64).contiguous())

    def fill(x: torch.Tensor, y: torch.Tensor) -> None:
        for c in range(dataset.num_chunks):
            lo, hi = dataset.chunk_range(c)
            _, labels = dataset.load_chunk(c, out=x[lo:hi])
            y[lo:hi].copy_(labels)
    return HostCopy(len(dataset), dataset.sample_shape, dataset.storage_dtype, fill, pin, peers, share)


def shared_figures(copy: Optional[HostCopy]) -> dict:
    """`shared_host_mb`: the size of a host copy shared by the host's ranks, reported by the rank
    that made it (so that adding the ranks' figures counts it once per host)."""
    if copy is None or not copy.shared:
        return {}
    return {"shared_host_mb": copy.nbytes / 2**20 * copy.filled_here}
