"""MNIST and CIFAR-10 through torchvision's own dataset classes.

Two paths to the same normalised images:
- `per_sample()`: torchvision's dataset with `ToTensor()` + `Normalize()` run per sample (a PIL
  image each time), exactly what the seed notebooks measured;
- the tensor path: the whole split kept as one uint8 `N x C x H x W` tensor plus labels;
  `on_device()` does ToTensor's `/255` and Normalize's `(x - mean) / std` after the copy, with
  the same ops in the same order, so both paths give identical values.

Missing, damaged or undownloadable files surface as one `ConfigError` line naming `dataset.root`,
the files expected there and the fix.

torchvision (a second of imports) is imported when one of these datasets is built, not when the
package registers them, so a run on the synthetic data does not pay for it.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import http.client
import math
import os
import pickle
import socket
import sys
import urllib.error
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from datasets.base import DATASETS, DatasetConfig, FeedDataset, to_unit_float
from trainer.config import BASE_DIR
from trainer.errors import ConfigError, at_least

DOWNLOAD_SOCKET_TIMEOUT_S = 30  # urllib waits forever on a stalled connection without one


def _torchvision():
    """torchvision, imported on first use (see the module's docstring)."""
    import torchvision

    return torchvision


class _Vision(FeedDataset):
    title: str  # how the dataset is named in messages
    mean: Tuple[float, ...]
    std: Tuple[float, ...]

    @dataclass
    class Config(DatasetConfig):
        """A torchvision dataset read from `root` (downloaded there first when `download=true`)."""

        root: str = str(BASE_DIR / "data")  # folder holding MNIST/raw/ or cifar-10-batches-py/
        download: bool = True  # fetch the files when they are missing (needs internet)
        train: bool = True  # true: the training split; false: the test split
        num_samples: int = 0  # use only the first N samples of the split (0 = all of it)

        def __post_init__(self):
            at_least("dataset.num_samples", self.num_samples, 0, "0 (the whole split)")

    @property
    def tv_class(self) -> type:
        """torchvision's class for this dataset."""
        raise NotImplementedError

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.root = Path(cfg.root).expanduser().absolute()
        self.tv = self._open()
        x = torch.as_tensor(self.tv.data)
        y = torch.as_tensor(self.tv.targets)
        if len(x) != len(y):
            raise ConfigError(f"dataset={cfg.name}: {len(x)} images but {len(y)} labels in {self.folder}: "
                              f"the files are damaged; delete them and set dataset.download=true, or copy intact files there")
        split = "train" if cfg.train else "test"
        if cfg.num_samples > len(x):
            raise ConfigError(f"dataset.num_samples={cfg.num_samples} but the {self.title} {split} split has {len(x)} samples: "
                              f"set dataset.num_samples=0 (all of them) or fewer")
        n = cfg.num_samples or len(x)
        x = x.unsqueeze(1) if x.ndim == 3 else x.permute(0, 3, 1, 2)  # N x C x H x W
        self.x = x[:n].contiguous()
        self.y = y[:n].long()
        self.num_classes = 10
        self._check_labels()
        self.sample_shape = tuple(self.x.shape[1:])
        self.storage_dtype = torch.uint8
        self.chunk_samples = n  # the whole split is one chunk
        transforms = _torchvision().transforms
        self.tv.transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize(self.mean, self.std)])
        self._stats: Dict[torch.device, Tuple[torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self.x)

    # -- per-sample path -----------------------------------------------------------------------
    def per_sample(self) -> torch.utils.data.Dataset:
        if len(self) == len(self.tv):
            return self.tv  # torchvision's own dataset, as the seeds iterated it
        return torch.utils.data.Subset(self.tv, range(len(self)))

    # -- tensor path ---------------------------------------------------------------------------
    def load_chunk(self, i: int, out: Optional[torch.Tensor] = None):
        start, stop = self.chunk_range(i)
        x = self.x[start:stop]
        if out is not None:
            out[: len(x)].copy_(x)
            x = out[: len(x)]
        return x, self.y[start:stop]

    def on_device(self, x: torch.Tensor) -> torch.Tensor:
        # Same ops, same order as ToTensor (`.float().div(255)`) + Normalize (`.sub_(mean).div_(std)`).
        mean, std = self._stats_on(x.device)
        return to_unit_float(x).sub_(mean).div_(std)

    def _stats_on(self, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        # Made once per device: a fresh host->device copy per batch would sync the loop.
        if device not in self._stats:
            self._stats[device] = tuple(torch.tensor(v, dtype=torch.float32, device=device).view(-1, 1, 1)
                                        for v in (self.mean, self.std))
        return self._stats[device]

    # -- files ---------------------------------------------------------------------------------
    @property
    def folder(self) -> Path:
        """Where torchvision keeps (or puts) the files, under `dataset.root`."""
        raise NotImplementedError

    def expected_files(self) -> List[str]:
        """Every file torchvision needs in `folder` (both splits, whichever is used)."""
        raise NotImplementedError

    def problems(self) -> Tuple[List[str], List[str]]:
        """`(missing, damaged)`: what is wrong with the files in `folder`, one phrase each."""
        raise NotImplementedError

    def _torchvision(self, download: bool):
        return self.tv_class(root=str(self.root), train=self.cfg.train, download=download)

    def _open(self):
        try:
            with _socket_timeout(DOWNLOAD_SOCKET_TIMEOUT_S):
                return self._torchvision(download=self.cfg.download)
        # torchvision reports missing or damaged files and failed downloads with all of these.
        except (OSError, RuntimeError, ValueError, TypeError, AssertionError, EOFError, KeyError, IndexError,
                pickle.UnpicklingError, http.client.HTTPException) as e:
            raise ConfigError(self._explain(e)) from e

    def _explain(self, error: BaseException) -> str:
        """One line: what is wrong in `dataset.root`, the files expected there, and the fix."""
        missing, damaged = self.problems()
        name, where = self.cfg.name, f"{self.folder} (dataset.root={self.root})"
        if self.cfg.download and _cannot_write(error, self.root):
            return (f"dataset={name}: cannot make {where} to download {self.title} into ({_last_line(error)}): "
                    f"set dataset.root to a writable folder")
        if self.cfg.download and _is_download_error(error):
            found = "; ".join(damaged + ([f"missing {', '.join(missing)}"] if missing else []))
            return (f"dataset={name}: {found + '; ' if found else ''}downloading {self.title} into {where} failed "
                    f"({_last_line(error)}): rerun with internet access, or copy {', '.join(self.expected_files())} "
                    f"there and set dataset.download=false{self.md5_hint(damaged)}")
        if missing and not damaged and self.cfg.download:
            # CIFAR-10: torchvision downloads only when a data batch is missing or damaged.
            return (f"dataset={name}: {self.title} in {where}: missing {', '.join(missing)}, which dataset.download=true "
                    f"did not fetch (torchvision downloads only when the data files are missing or damaged): copy "
                    f"those files there, or delete {self.folder} and rerun to download all of {self.title} again")
        if missing and not damaged:
            return (f"dataset={name}: {self.title} not found in {where}: missing {', '.join(missing)}: "
                    f"set dataset.download=true (needs internet), or copy those files there")
        found = damaged + ([f"missing {', '.join(missing)}"] if missing else [])
        if not found:  # nothing we can point at: pass torchvision's own reason on
            found = [f"torchvision could not load it ({_last_line(error)})"]
        return (f"dataset={name}: {self.title} in {where}: {'; '.join(found)}: delete the damaged files "
                f"and rerun with dataset.download=true, or copy intact files there{self.md5_hint(damaged)}")

    def md5_hint(self, damaged: List[str]) -> str:
        """The extra fix for files that only fail a checksum (none by default)."""
        return ""

    def _check_labels(self) -> None:
        """A label outside the 10 classes would fail at the first step (an IndexError on the CPU, a
        device-side assert on a GPU): name the file that holds it now."""
        bad = ((self.y < 0) | (self.y >= self.num_classes)).nonzero()
        if len(bad):
            i = int(bad[0])
            path, j = self.labels_file(i)
            raise ConfigError(f"dataset={self.cfg.name}: {path} gives sample {j} the label {int(self.y[i])}, not one "
                              f"of {self.title}'s {self.num_classes} classes (0 to {self.num_classes - 1}): the file is "
                              f"damaged or not {self.title}'s; delete it and rerun with dataset.download=true, or copy "
                              f"the intact file there")

    def labels_file(self, i: int) -> Tuple[Path, int]:
        """The file holding the label of sample `i` of the split, and the sample's place in it."""
        raise NotImplementedError


@DATASETS.register
class Mnist(_Vision):
    title = "MNIST"
    mean, std = (0.1307,), (0.3081,)
    _MAGIC = {"images": 0x0803, "labels": 0x0801}  # IDX: uint8 with 3 / 1 dimensions

    @dataclass
    class Config(_Vision.Config):
        """torchvision.datasets.MNIST: 1x28x28 uint8 images, 10 classes. Files live in
        `<root>/MNIST/raw/`; offline, copy the four *-ubyte files there and set download=false."""

        name: str = "mnist"

    @property
    def tv_class(self) -> type:
        return _torchvision().datasets.MNIST

    @property
    def folder(self) -> Path:
        return self.root / "MNIST" / "raw"

    def expected_files(self) -> List[str]:
        return [gz[: -len(".gz")] for gz, _ in self.tv_class.resources]

    def labels_file(self, i: int) -> Tuple[Path, int]:
        return self.folder / f"{'train' if self.cfg.train else 't10k'}-labels-idx1-ubyte", i

    def problems(self):
        missing, damaged = [], []
        for gz, md5 in self.tv_class.resources:
            name = gz[: -len(".gz")]
            path, archive = self.folder / name, self.folder / gz
            if path.is_file():
                trouble = _idx_trouble(path, self._MAGIC["images" if "images" in name else "labels"])
                if trouble:
                    damaged.append(f"{name} is {trouble}")
            elif archive.is_file() and _md5(archive) != md5:
                missing.append(f"{name} ({gz} is there but incomplete or not the official file)")
            elif archive.is_file():
                missing.append(f"{name} ({gz} is there, not extracted: dataset.download=true extracts it offline)")
            else:
                missing.append(name)
        return missing, damaged


@DATASETS.register
class Cifar10(_Vision):
    title = "CIFAR-10"
    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)

    @dataclass
    class Config(_Vision.Config):
        """torchvision.datasets.CIFAR10: 3x32x32 uint8 images, 10 classes. Files live in
        `<root>/cifar-10-batches-py/`."""

        name: str = "cifar10"
        verify_md5: bool = True  # false: skip the md5 check of the batch files (re-packed or generated files)

    @property
    def tv_class(self) -> type:
        return _torchvision().datasets.CIFAR10

    def __init__(self, cfg):
        super().__init__(cfg)
        if not cfg.verify_md5:
            print(f"warning: dataset.verify_md5=false: the CIFAR-10 files in {self.folder} were not checked "
                  f"against the official md5 sums", file=sys.stderr)

    @property
    def folder(self) -> Path:
        return self.root / self.tv_class.base_folder

    def _official(self) -> List[Tuple[str, str]]:
        tv = self.tv_class
        return [tuple(f) for f in tv.train_list + tv.test_list] + [(tv.meta["filename"], tv.meta["md5"])]

    def expected_files(self) -> List[str]:
        return [name for name, _ in self._official()]

    def labels_file(self, i: int) -> Tuple[Path, int]:
        # torchvision reads the split's batches in this order, one after another.
        batches = self.tv_class.train_list if self.cfg.train else self.tv_class.test_list
        for name, _ in batches:
            with open(self.folder / name, "rb") as f:
                n = len(pickle.load(f, encoding="latin1")["labels"])
            if i < n:
                return self.folder / name, i
            i -= n
        raise AssertionError("the label's sample is not in the split's files")

    def _torchvision(self, download: bool):
        cls = self.tv_class if self.cfg.verify_md5 else _unchecked_cifar10()
        return cls(root=str(self.root), train=self.cfg.train, download=download)

    def problems(self):
        missing, unofficial, unreadable = [], [], []
        for name, md5 in self._official():
            path = self.folder / name
            if not path.is_file():
                missing.append(name)
            elif self.cfg.verify_md5 and _md5(path) != md5:
                unofficial.append(name)
            elif not _unpickles(path):
                unreadable.append(name)
        archive = self.root / self.tv_class.filename
        if missing and archive.is_file():
            missing[-1] += f" ({archive.name} is in dataset.root, not extracted: dataset.download=true extracts it)"
        damaged = []
        if unofficial:
            damaged.append(f"{', '.join(unofficial)} fail torchvision's md5 check (incomplete, corrupt, or not the official files)")
        if unreadable:
            damaged.append(f"{', '.join(unreadable)} cannot be unpickled (truncated or corrupt)")
        return missing, damaged

    def md5_hint(self, damaged: List[str]) -> str:
        if self.cfg.verify_md5 and any("md5" in d for d in damaged):
            return "; or, for re-packed or generated files, set dataset.verify_md5=false"
        return ""


@functools.lru_cache(maxsize=None)
def _unchecked_cifar10() -> type:
    """CIFAR10 that only checks that its files exist (`dataset.verify_md5=false`): torchvision
    compares every batch file with the official md5 otherwise, so re-packed files fail."""
    cifar10 = _torchvision().datasets.CIFAR10

    class UncheckedCIFAR10(cifar10):
        train_list = [[name, None] for name, _ in cifar10.train_list]
        test_list = [[name, None] for name, _ in cifar10.test_list]
        meta = {**cifar10.meta, "md5": None}

    return UncheckedCIFAR10


def _md5(path: Path) -> str:
    return _torchvision().datasets.utils.calculate_md5(path)


# ----------------------------------------------------------------------------- helpers
@contextlib.contextmanager
def _socket_timeout(seconds: float):
    """A default socket timeout while torchvision downloads, unless one is set already."""
    previous = socket.getdefaulttimeout()
    if previous is None:
        socket.setdefaulttimeout(seconds)
    try:
        yield
    finally:
        socket.setdefaulttimeout(previous)


def _is_download_error(error: Optional[BaseException]) -> bool:
    """True when `error` (or what caused it) is a failed download rather than a bad file."""
    while error is not None:
        if isinstance(error, (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException)):
            return True
        text = str(error)
        # MNIST wraps each mirror's failure in "Error downloading ..."; download_url's own md5
        # check of what it fetched raises "File not found or corrupted."
        if isinstance(error, RuntimeError) and text.startswith(("Error downloading", "File not found or corrupted")):
            return True
        error = error.__cause__ or error.__context__
    return False


def _cannot_write(error: BaseException, root: Path) -> bool:
    """True when `error` is the file system refusing to make or write something under `root`
    (a read-only or missing parent, a file in the way): no download can help."""
    refused = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.ENOTDIR, errno.EEXIST)
    if not (isinstance(error, OSError) and error.errno in refused and error.filename):
        return False
    return Path(os.path.abspath(error.filename)).is_relative_to(os.path.abspath(root))


def _last_line(error: BaseException) -> str:
    """The most specific line of a (possibly multi-line) error message."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def _idx_trouble(path: Path, magic: int) -> Optional[str]:
    """What is wrong with an IDX file (None if its header and size agree)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(4)
        if len(head) < 4:
            return f"truncated ({size} bytes)"
        found = int.from_bytes(head, "big")
        if found != magic:
            return f"not an MNIST IDX file of this kind (magic {found:#010x}, expected {magic:#010x})"
        ndim = magic & 0xFF
        dims_bytes = f.read(4 * ndim)
    if len(dims_bytes) < 4 * ndim:
        return f"truncated ({size} bytes)"
    dims = [int.from_bytes(dims_bytes[4 * k: 4 * k + 4], "big") for k in range(ndim)]
    expected = 4 + 4 * ndim + math.prod(dims)
    if size != expected:
        return f"truncated or corrupt ({size} bytes; its header {'x'.join(map(str, dims))} needs {expected})"
    return None


def _unpickles(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            pickle.load(f, encoding="latin1")
        return True
    except Exception:  # any failure to unpickle means the file is not usable
        return False
