"""Write MNIST and CIFAR-10 files in their real on-disk formats, filled with seeded random data.

torchvision's own `datasets.MNIST` / `datasets.CIFAR10` read what this writes, so tests (and a
benchmark on a machine without internet) exercise the real loading code:

- MNIST: `<root>/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte` (big-endian IDX files),
  plus the `.gz` copies a real download leaves next to them;
- CIFAR-10: `<root>/cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}` (pickled
  dicts: `data` is `N x 3072` uint8, the R, G and B planes of each image row by row).

The files differ from the official ones, so CIFAR-10 needs `dataset.verify_md5=false`.

    python tests/fake_data.py mnist /data/fake --n 60000      # full-size MNIST training split
    python tests/fake_data.py cifar10 /data/fake --n 50000
"""

from __future__ import annotations

import argparse
import gzip
import pickle
import struct
from pathlib import Path
from typing import Dict, Tuple

import numpy as np

Split = Tuple[np.ndarray, np.ndarray]  # images (N x C x H x W uint8), labels (N int64)

CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def _random_split(rng: np.random.Generator, n: int, shape: Tuple[int, ...]) -> Split:
    return rng.integers(0, 256, size=(n, *shape), dtype=np.uint8), rng.integers(0, 10, size=n).astype(np.int64)


def _write_idx(path: Path, array: np.ndarray, gz: bool) -> None:
    """IDX: magic (0x08 = uint8, then the number of dimensions), each size as big-endian uint32, the bytes."""
    payload = struct.pack(">I", 0x0800 | array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    payload += np.ascontiguousarray(array, dtype=np.uint8).tobytes()
    path.write_bytes(payload)
    if gz:
        with gzip.open(path.with_name(path.name + ".gz"), "wb", compresslevel=1) as f:
            f.write(payload)


def write_mnist(root, n_train: int = 60, n_test: int = 20, seed: int = 0, gz: bool = True) -> Dict[str, Split]:
    """MNIST files under `root`; returns `{"train": (x, y), "test": (x, y)}` as written (x is N x 1 x 28 x 28)."""
    raw = Path(root) / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    written = {}
    for split, prefix, n in (("train", "train", n_train), ("test", "t10k", n_test)):
        x, y = _random_split(rng, n, (1, 28, 28))
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", x[:, 0], gz)
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", y.astype(np.uint8), gz)
        written[split] = (x, y)
    return written


def write_cifar10(root, n_train: int = 50, n_test: int = 20, seed: int = 0) -> Dict[str, Split]:
    """CIFAR-10 files under `root`; returns `{"train": (x, y), "test": (x, y)}` as written (x is N x 3 x 32 x 32).
    The training split is spread over the five `data_batch_*` files, as in the official archive."""
    folder = Path(root) / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    written = {}
    for split, n in (("train", n_train), ("test", n_test)):
        x, y = _random_split(rng, n, (3, 32, 32))
        written[split] = (x, y)
        names = [f"data_batch_{k}" for k in range(1, 6)] if split == "train" else ["test_batch"]
        for name, idx in zip(names, np.array_split(np.arange(n), len(names))):
            batch = {"batch_label": f"{name} (generated)", "labels": y[idx].tolist(),
                     "data": x[idx].reshape(len(idx), 3 * 32 * 32), "filenames": [f"{name}_{i}.png" for i in idx]}
            with open(folder / name, "wb") as f:
                pickle.dump(batch, f, protocol=2)
    meta = {"num_cases_per_batch": max(1, -(-n_train // 5)), "label_names": CIFAR10_CLASSES, "num_vis": 3 * 32 * 32}
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump(meta, f, protocol=2)
    return written


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Write MNIST / CIFAR-10 files of random data in their real formats.")
    parser.add_argument("kind", choices=["mnist", "cifar10"])
    parser.add_argument("root", help="the folder to pass as dataset.root")
    parser.add_argument("--n", type=int, default=None, help="training samples (default: the official size)")
    parser.add_argument("--n-test", type=int, default=None, help="test samples (default: the official size)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.kind == "mnist":
        n, n_test = args.n or 60000, args.n_test or 10000
        write_mnist(args.root, n, n_test, args.seed)
        print(f"wrote MNIST ({n} train, {n_test} test) under {Path(args.root).absolute() / 'MNIST' / 'raw'}: "
              f"use dataset=mnist dataset.root={Path(args.root).absolute()} dataset.download=false")
    else:
        n, n_test = args.n or 50000, args.n_test or 10000
        write_cifar10(args.root, n, n_test, args.seed)
        print(f"wrote CIFAR-10 ({n} train, {n_test} test) under {Path(args.root).absolute() / 'cifar-10-batches-py'}: "
              f"use dataset=cifar10 dataset.root={Path(args.root).absolute()} dataset.download=false dataset.verify_md5=false")


if __name__ == "__main__":
    main()
