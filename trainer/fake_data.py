"""`python -m trainer.fake_data`: MNIST and CIFAR-10 files of random pixels, to try the presets offline.

    python -m trainer.fake_data                      # small files in data/random_pixels/
    python -m trainer.fake_data --full --root DIR    # the official sizes (60000 / 50000 training images)
    python -m trainer.fake_data --images 50000 --size 224 --root DIR   # a folder of JPEGs instead

The files have the real on-disk formats, so torchvision's own `datasets.MNIST` / `datasets.CIFAR10`
read them and the per-sample path (PIL image, ToTensor, Normalize) costs what it costs on the real
data; but every pixel and label is random, so losses and accuracies mean nothing. A README.txt
beside them says so, and the folder is not the presets' default `dataset.root` (data/): a run uses
them only when told to, and a later download of the real datasets is not shadowed by them.

- MNIST: `<root>/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte` (big-endian IDX files),
  plus the `.gz` copies a real download leaves next to them;
- CIFAR-10: `<root>/cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}` (pickled
  dicts: `data` is `N x 3072` uint8, the R, G and B planes of each image row by row). They are not
  the official files, so CIFAR-10 needs `dataset.verify_md5=false`.
- an image folder (`--images N`): `<root>/images-<size>-<N>/class_<k>/<i>.jpg`, N JPEGs of
  size x size pixels (quality 90) in 10 classes, for `dataset=image_folder`. Smooth shapes and a
  little noise, so that each file has about the bytes a photo of that many pixels has (about 14 kB
  at 224 px), written by one process per core.
"""

from __future__ import annotations

import argparse
import gzip
import pickle
import struct
import sys
from pathlib import Path
from typing import Dict, Tuple

import numpy as np

Split = Tuple[np.ndarray, np.ndarray]  # images (N x C x H x W uint8), labels (N int64)

CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
DEFAULT_ROOT = Path("data") / "random_pixels"
SMALL = {"mnist": (6000, 1000), "cifar10": (5000, 1000)}  # (train, test) images: a few seconds per CPU job
FULL = {"mnist": (60000, 10000), "cifar10": (50000, 10000)}  # the official splits
MARKER = "README.txt"
NOTICE = """These files are NOT MNIST or CIFAR-10.

They hold random pixels and random labels, written in the real file formats by
`python -m trainer.fake_data` so that feedbench's MNIST and CIFAR-10 presets can be tried without
network access. Loading them costs what loading the real files costs (torchvision reads them with
its own classes, image by image), so timings are meaningful; losses and accuracies are not.

Use them with dataset.root={root} dataset.download=false (and dataset.verify_md5=false for
CIFAR-10). Delete this folder to get rid of them.
"""


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
            batch = {"batch_label": f"{name} (random pixels)", "labels": y[idx].tolist(),
                     "data": x[idx].reshape(len(idx), 3 * 32 * 32), "filenames": [f"{name}_{i}.png" for i in idx]}
            with open(folder / name, "wb") as f:
                pickle.dump(batch, f, protocol=2)
    meta = {"num_cases_per_batch": max(1, -(-n_train // 5)), "label_names": CIFAR10_CLASSES, "num_vis": 3 * 32 * 32}
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump(meta, f, protocol=2)
    return written


def write_both(root: Path, full: bool = False, seed: int = 0) -> str:
    """Write both datasets and the README.txt that names them random; return what to tell the user."""
    sizes = FULL if full else SMALL
    root = Path(root)
    real = [sub for sub in ("MNIST", "cifar-10-batches-py") if (root / sub).exists()]
    if real and not (root / MARKER).is_file():  # never overwrite files this command did not write
        raise FileExistsError(f"{root} already holds {' and '.join(real)} that this command did not write "
                              f"(no {MARKER}): choose another folder with --root")
    write_mnist(root, *sizes["mnist"], seed=seed)
    write_cifar10(root, *sizes["cifar10"], seed=seed)
    (root / MARKER).write_text(NOTICE.format(root=root))
    mnist = f"dataset.root={root} dataset.download=false"
    return "\n".join([
        f"wrote RANDOM PIXELS in the MNIST and CIFAR-10 file formats under {root} (see its {MARKER}):",
        f"  MNIST     {sizes['mnist'][0]} train / {sizes['mnist'][1]} test images   {root / 'MNIST' / 'raw'}",
        f"  CIFAR-10  {sizes['cifar10'][0]} train / {sizes['cifar10'][1]} test images   {root / 'cifar-10-batches-py'}",
        "timings are real, losses mean nothing. Use them with:",
        f"  python -m trainer dataset=mnist model=mlp {mnist}",
        f"  python -m trainer dataset=cifar10 model=mlp {mnist} dataset.verify_md5=false",
    ])


def _write_image(job: Tuple[Path, int, int, int]) -> int:
    """One JPEG of the folder (a process of `write_image_folder`'s pool); its bytes."""
    folder, i, size, seed = job
    from PIL import Image

    rng = np.random.default_rng((seed, i))
    coarse = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).resize((size, size), Image.BICUBIC)
    pixels = np.asarray(coarse, dtype=np.int16) + rng.integers(-12, 13, (size, size, 3))
    path = folder / f"class_{i % 10}" / f"{i:06d}.jpg"
    part = path.with_name(path.name + ".part")  # a writer killed half-way leaves no .jpg the count would take
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(part, format="JPEG", quality=90)
    part.replace(path)
    return path.stat().st_size


def write_image_folder(root, count: int, size: int = 224, seed: int = 0, workers: int = 0) -> Path:
    """`count` JPEGs of `size` x `size` in 10 class folders under `root/images-<size>-<count>`
    (written again only when the folder does not hold exactly that many); the folder."""
    import multiprocessing
    import os

    folder = Path(root) / f"images-{size}-{count}"
    if sum(1 for _ in folder.glob("class_*/*.jpg")) == count:
        return folder
    for k in range(min(10, count)):
        (folder / f"class_{k}").mkdir(parents=True, exist_ok=True)
    jobs = [(folder, i, size, seed) for i in range(count)]
    processes = workers or min(len(os.sched_getaffinity(0)), max(1, count // 64))
    if processes <= 1:
        for job in jobs:
            _write_image(job)
    else:
        with multiprocessing.get_context("spawn").Pool(processes) as pool:
            for _ in pool.imap_unordered(_write_image, jobs, chunksize=64):
                pass
    return folder


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.fake_data", description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT, help=f"the folder to write into (default: {DEFAULT_ROOT})")
    parser.add_argument("--full", action="store_true", help="the official sizes (60000 + 10000 MNIST, 50000 + 10000 "
                                                            "CIFAR-10 images) instead of a tenth of them")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random pixels and labels")
    parser.add_argument("--images", type=int, default=0, metavar="N",
                        help="write an image folder of N JPEGs (dataset=image_folder) instead of MNIST and CIFAR-10")
    parser.add_argument("--size", type=int, default=224, help="with --images: width and height in pixels (default 224)")
    args = parser.parse_args(argv)
    if args.images < 0 or args.size < 1:
        print(f"error: --images must be >= 0 and --size >= 1 (got {args.images}, {args.size}): use --images 1000 --size 224",
              file=sys.stderr)
        return 2
    try:
        if args.images:
            folder = write_image_folder(args.root, args.images, args.size, args.seed)
            print(f"wrote {args.images} JPEGs of {args.size}x{args.size} (random shapes, 10 classes) in {folder}; use them with:\n"
                  f"  python -m trainer dataset=image_folder dataset.root={folder} dataset.size={args.size} model=torchvision")
            return 0
        print(write_both(args.root, args.full, args.seed))
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
