"""Any map-style dataset of samples as a `FeedDataset`: what `dataset=custom` and
`dataset=image_folder` are made of.

A sample is `x`, `(x,)` or `(x, y)`: tensors, numpy arrays or Python numbers, `y` a class number
(samples without one are all class 0). Two paths to the same samples, as for every dataset:
- `per_sample()`: the dataset as it is, for the DataLoader strategies (their workers and collate);
- the tensor path: the strategies that hold the data in one block (pinned_chunk, pinned_gather,
  pinned_uva, gpu_resident) read it once, sample by sample, into their own buffer (`load_chunk`),
  after their host-memory check and inside their `setup_s`, with a progress bar on a terminal.
  Every sample must then be shaped and typed as sample 0, and its `y` be a class number: the first
  sample that is not is named in one `ConfigError` line.
"""

from __future__ import annotations

import numbers
import sys
from typing import List, Optional, Tuple

import numpy as np
import torch
from tqdm import tqdm

from datasets.base import FeedDataset
from trainer.errors import ConfigError

READ_BATCH = 64  # samples turned into rows of the block at a time (by each reading worker)
ONE_BLOCK = "loader=pinned_chunk, pinned_gather, pinned_uva and gpu_resident hold the data in one block"
PER_SAMPLE = "loader=baseline, pinned or prefetch (DataLoader strategies: samples as they come)"


class SampleDataset(FeedDataset):
    """A map-style dataset of samples (see the module's docstring); subclasses make `samples`."""

    def __init__(self, samples, what: str, num_classes: Optional[int], read_workers: int = 0,
                 block: Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]] = None):
        """`samples`: the dataset as the block stores it; `what`: how messages name it
        (`dataset._target_=my_data.make`); `block`: the samples already as `(x, y)` tensors, if so."""
        self.samples, self.what, self.read_workers, self.block = Guarded(samples, what), what, read_workers, block
        self.length = len(samples)
        if self.length < 1:
            raise ConfigError(f"{what} has no samples: give it at least one (and at least loader.batch_size)")
        self.first = split(self.samples[0], 0, what)  # guarded: a sample 0 that raises is named, not traced
        x, y = self.first
        self.has_labels = y is not None
        self.sample_shape, self.storage_dtype = tuple(x.shape), x.dtype
        self.num_classes = num_classes
        self.chunk_samples = self.length  # one chunk: the block is read once

    def __len__(self) -> int:
        return self.length

    # -- per-sample path -----------------------------------------------------------------------
    def per_sample(self) -> torch.utils.data.Dataset:
        return _Batchable(self.samples, self.sample_shape, self.has_labels, self.what)

    @property
    def per_sample_bytes(self) -> int:
        return 0  # its samples are read when asked for, or are in memory already

    def example(self, device: torch.device):
        x, y = self.first
        return self.on_device(x.unsqueeze(0).to(device)), None if y is None else y.unsqueeze(0).to(device)

    # -- tensor path ---------------------------------------------------------------------------
    def load_chunk(self, i: int, out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        start, stop = self.chunk_range(i)
        n = stop - start
        x = out[:n] if out is not None else torch.empty((n, *self.sample_shape), dtype=self.storage_dtype)
        y = torch.zeros(n, dtype=torch.int64)
        if self.block is not None:
            bx, by = self.block
            x.copy_(bx[start:stop])
            if by is not None:
                _check_labels(by, self.what)
                y.copy_(by[start:stop])
            return x, y
        rows = _Rows(self.sample_shape, self.storage_dtype, self.has_labels, self.what)
        # Its own generator: a DataLoader draws its workers' seed from the global one at every pass,
        # which would change the model's initial weights after a one-block strategy read the data.
        reader = torch.utils.data.DataLoader(_Indexed(self.samples), batch_size=READ_BATCH, sampler=range(start, stop),
                                             num_workers=self.read_workers, collate_fn=rows,
                                             generator=torch.Generator())
        bar = tqdm(total=n, desc=f"reading {self.what} into one block", unit="sample", file=sys.stderr,
                   mininterval=0.5, leave=False, disable=not sys.stderr.isatty())
        batches, done = iter(reader), 0
        try:
            for batch in batches:
                if isinstance(batch, str):  # the first sample unlike sample 0, found by a reader
                    raise ConfigError(batch)
                bx, by = batch
                x[done:done + len(bx)].copy_(bx)
                y[done:done + len(by)].copy_(by)
                done += len(bx)
                bar.update(len(bx))
        finally:
            bar.close()
            shutdown = getattr(batches, "_shutdown_workers", None)  # now, not when the error's traceback goes
            if shutdown is not None:
                shutdown()
        return x, y


def split(sample, index: int, what: str) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`(x, y)` of one sample as tensors (`y` None when the sample has none)."""
    if isinstance(sample, (tuple, list)):
        if len(sample) not in (1, 2):
            raise ConfigError(f"{what}: sample {index} has {len(sample)} items, and the loop takes x or (x, y): "
                              f"return (x, y) from __getitem__")
        x, y = sample[0], sample[1] if len(sample) == 2 else None
    else:
        x, y = sample, None
    return _tensor(x, "x", index, what), None if y is None else _tensor(y, "y", index, what)


def _tensor(value, name: str, index: int, what: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (np.ndarray, np.generic, numbers.Number)):
        return torch.as_tensor(value)
    raise ConfigError(f"{what}: sample {index}'s {name} is a {type(value).__module__}.{type(value).__name__}: return "
                      f"tensors, numpy arrays or numbers (an image: torchvision.transforms.PILToTensor())")


def _describe(t: torch.Tensor) -> str:
    return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def _label_problem(y: Optional[torch.Tensor], index: int, labelled: bool, what: str) -> Optional[str]:
    """Why `y` cannot be one int64 class number in the block (None: it can)."""
    if (y is not None) != labelled:
        return (f"{what}: sample {index} {'has a y' if y is not None else 'has no y'} but sample 0 "
                f"{'has one' if labelled else 'has none'}: return (x, y) from every sample, or x alone from all")
    if y is None or (y.ndim == 0 and not (y.is_floating_point() or y.is_complex())):
        return None
    return (f"{what}: sample {index}'s y is {_describe(y)}, and {ONE_BLOCK} with one int64 class number per sample: "
            f"use {PER_SAMPLE}, or return class numbers")


def _check_labels(y: torch.Tensor, what: str) -> None:
    """The labels of a block given as tensors must be N class numbers."""
    if y.ndim != 1 or y.is_floating_point() or y.is_complex():
        raise ConfigError(f"{what}: its y is {_describe(y)}, and {ONE_BLOCK} with one int64 class number per "
                          f"sample: use {PER_SAMPLE}, or make y N class numbers")


class _Rows:
    """Turns a list of `(index, sample)` into rows of the block, `(x, y)`, or into the one-line message
    that names the first sample unlike sample 0 (it runs in the reading workers: an exception raised
    there would come back with their traceback)."""

    def __init__(self, shape, dtype, labelled: bool, what: str):
        self.shape, self.dtype, self.labelled, self.what = tuple(shape), dtype, labelled, what

    def __call__(self, items: List[tuple]):
        xs, ys = [], []
        for index, sample in items:
            try:
                x, y = split(sample, index, self.what)
            except ConfigError as e:
                return str(e)
            if tuple(x.shape) != self.shape or x.dtype != self.dtype:
                return (f"{self.what}: sample {index}'s x is {_describe(x)} but sample 0's is "
                        f"{list(self.shape)} {str(self.dtype).removeprefix('torch.')}, and {ONE_BLOCK}, which "
                        f"needs every sample alike: make the samples one shape and dtype (resize or pad them in "
                        f"__getitem__)")
            problem = _label_problem(y, index, self.labelled, self.what)
            if problem:
                return problem
            xs.append(x)
            ys.append(0 if y is None else int(y))
        return torch.stack(xs), torch.tensor(ys, dtype=torch.int64)


class SampleError(RuntimeError):
    """A sample that the dataset's own code failed to give, named in one line (with its file when
    the dataset keeps one per sample, as torchvision's ImageFolder does)."""


class Guarded(torch.utils.data.Dataset):
    """`samples[i]`, where an exception raised by the dataset's code becomes a `SampleError` naming
    the sample: in a DataLoader worker or in the run's process, the user learns which sample of
    which dataset failed, and how, without a traceback through the loader."""

    def __init__(self, samples, what: str):
        self.samples, self.what = samples, what

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        try:
            return self.samples[i]
        except Exception as e:
            file = _file_of(self.samples, i)
            fix = "replace or remove that file" if file else "fix that sample, or leave it out of the dataset"
            raise SampleError(f"{self.what}: sample {i}{file} raised {type(e).__name__}: "
                              f"{' '.join(str(e).split())[:300]}: {fix}") from e


def _file_of(samples, i: int) -> str:
    """` (path)` of sample `i` when the dataset keeps a file per sample (ImageFolder's `samples`)."""
    if isinstance(samples, Guarded):
        samples = samples.samples
    while isinstance(samples, torch.utils.data.Subset):
        samples, i = samples.dataset, samples.indices[i]
    files = getattr(samples, "samples", None)
    try:
        return f" ({files[i][0]})" if isinstance(files[i][0], str) else ""
    except (TypeError, IndexError, KeyError):
        return ""


class _Indexed(torch.utils.data.Dataset):
    """Item `i` is `(i, samples[i])`: a reader can name the sample it refuses."""

    def __init__(self, samples):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        return i, self.samples[i]


class _Batchable(torch.utils.data.Dataset):
    """The samples as the DataLoader strategies take them: `(x, y)`, a sample without a label as
    `(x, 0)`, and every x shaped as sample 0's. The DataLoader's collate stacks a batch's samples:
    one of another shape would fail there, in a trace through its code that names no sample, so
    the sample is named here instead (a `SampleError`). A shape read per sample: no copy, no sync."""

    def __init__(self, samples, shape, labelled: bool, what: str):
        self.samples, self.shape, self.labelled, self.what = samples, tuple(shape), labelled, what

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        sample = self.samples[i]
        x = sample[0] if isinstance(sample, (tuple, list)) else sample
        shape = tuple(getattr(x, "shape", ()))
        if shape != self.shape:
            raise SampleError(f"{self.what}: sample {i}{_file_of(self.samples, i)}'s x has shape {list(shape)} but "
                              f"sample 0's has {list(self.shape)}, and a batch stacks its samples into one tensor: "
                              f"make every sample one shape (resize or pad it in __getitem__)")
        return sample if self.labelled else (x, 0)
