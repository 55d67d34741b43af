"""`dataset=image_folder`: JPEG or PNG files in one folder per class (`root/cat/1.jpg`), read by
torchvision's `ImageFolder`, each decoded, converted to RGB and resized to `size` x `size`; or,
with `augment=crop_flip`, cropped at random and resized to `size` x `size`, flipped half the time
(ImageNet's training augmentation), afresh at every epoch.

Where the decoding happens is what this dataset measures:
- the DataLoader strategies decode every image at every epoch, in the loader's workers
  (`loader.num_workers`), and hand the model float images in [0, 1]: made on the host and copied
  as float32 (`dataset.batch_dtype=float32`, as torchvision's ToTensor does), or copied as the
  decoded uint8 and made float on the device (`dataset.batch_dtype=uint8`, as timm's
  `fast_collate` does: 4x fewer bytes over the link, the same floats);
- the strategies that hold the data in one block decode every image once, at setup (in
  `dataset.read_workers` processes), keep it as 3 x size x size uint8, copy it as uint8 and make it
  the same float image on the device (`on_device`): 4x fewer bytes over PCIe. Only while the
  decoded images fit `dataset.max_host_mb` (when set): past it they refuse in one line;
- `loader=gpu_decode` sends each batch's files, still compressed, and decodes them on the GPU
  (`files`, `labels`): it holds the files' bytes in host memory when they fit `dataset.max_host_mb`,
  and otherwise reads them from disk batch after batch, so a folder of any size trains.

With `augment=crop_flip` the DataLoader strategies crop and flip each PIL image in the worker
(torchvision's RandomResizedCrop and RandomHorizontalFlip, from the worker's RNG), and gpu_decode
each decoded image on the device (the same distribution, from a generator seeded by the loader's
seed, the epoch and the rank): the same samples in the same order with the same labels, but not the same
pixels, as the two draw their crops apart. The one-block strategies, which hold each image decoded
once, refuse it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from datasets.base import DATASETS, DatasetConfig, to_unit_float
from datasets.samples import Guarded, SampleDataset
from trainer.errors import ConfigError, DoesNotFit, at_least, one_of
from trainer.memory import host_available_bytes

BATCH_DTYPES = ("float32", "uint8")
AUGMENTS = ("none", "crop_flip")
# torchvision's RandomResizedCrop defaults, as ImageNet training uses them: a crop of 8% to all of
# the image's area, of aspect ratio 3/4 to 4/3.
CROP_SCALE = (0.08, 1.0)
CROP_RATIO = (3 / 4, 4 / 3)


@DATASETS.register
class ImageFolderDataset(SampleDataset):
    image_files = True  # its samples are image files that loader=gpu_decode can decode (`files`, `labels`)

    @dataclass
    class Config(DatasetConfig):
        """torchvision's ImageFolder: `root/<class>/<image>` JPEG or PNG files, decoded and resized to
        3 x size x size (or cropped at random and flipped: `augment`); the class is the subfolder."""

        name: str = "image_folder"
        root: str = ""  # the folder holding one subfolder of images per class
        size: int = 224  # every image is resized to size x size pixels
        num_samples: int = 0  # use only the first N images, in ImageFolder's order (0: all)
        read_workers: int = 0  # processes decoding the images into a one-block strategy's block (0: this one)
        max_host_mb: float = 0.0  # host memory the images may take (decoded, or as files for gpu_decode); 0: no limit
        batch_dtype: str = "float32"  # the DataLoader strategies' batches over the link: float32, or uint8 made float on the device
        augment: str = "none"  # none (resized whole), or crop_flip: a random crop resized to size, flipped half the time, anew each epoch

        def __post_init__(self):
            at_least("dataset.size", self.size, 1, 224)
            at_least("dataset.num_samples", self.num_samples, 0, "0 (all the images)")
            at_least("dataset.read_workers", self.read_workers, 0, 0)
            at_least("dataset.max_host_mb", self.max_host_mb, 0, "0 (no limit)")
            one_of("dataset.batch_dtype", self.batch_dtype, BATCH_DTYPES, "uint8 (made float on the device) or float32")
            one_of("dataset.augment", self.augment, AUGMENTS, "crop_flip (random crop and flip) or none")

    def __init__(self, cfg: Config):
        from torchvision import datasets, transforms  # a second of imports: only when this dataset is used

        self.cfg = cfg
        root = _root(cfg.root)
        decode = transforms.Compose([transforms.Resize((cfg.size, cfg.size)), transforms.PILToTensor()])
        folder = _open(datasets.ImageFolder, root, decode)
        if cfg.num_samples > len(folder):
            raise ConfigError(f"dataset.num_samples={cfg.num_samples} but {root} holds {len(folder)} images: "
                              f"set dataset.num_samples=0 (all of them) or fewer")
        stored = torch.utils.data.Subset(folder, range(cfg.num_samples)) if cfg.num_samples else folder
        super().__init__(stored, f"dataset=image_folder (dataset.root={root})", len(folder.classes), cfg.read_workers)
        self.size, self.augment = cfg.size, cfg.augment
        self.max_host_mb, self.max_host_bytes = cfg.max_host_mb, int(cfg.max_host_mb * 2**20)  # 0: no limit
        kept = folder.samples[:len(stored)]  # (path, class) in ImageFolder's order: sample i is file i
        # `samples` (what a block and the model's example are read from) keeps the fixed resize; only
        # the DataLoader strategies' workers crop, where a new draw per sample and epoch is free.
        if cfg.augment == "crop_flip":
            crop_flip = transforms.Compose([
                transforms.RandomResizedCrop((cfg.size, cfg.size), scale=CROP_SCALE, ratio=CROP_RATIO, antialias=True),
                transforms.RandomHorizontalFlip(0.5), transforms.PILToTensor()])
            self.served = Guarded(_Cropped(kept, folder.loader, crop_flip), self.what)  # a failing file is named
        else:
            self.served = self.samples
        self.files = [path for path, _ in kept]
        self.labels = torch.tensor([label for _, label in kept], dtype=torch.int64)

    def check_block(self, what: str) -> None:
        """The decoded images in one block: refused in one line with `dataset.augment=crop_flip`
        (a block holds each image resized once, and cannot crop it afresh), past
        `dataset.max_host_mb`, or past the host's free memory (where the strategy's own check
        would offer chunks, which an image folder does not have)."""
        if self.augment != "none":
            raise ConfigError(f"dataset.augment={self.augment} crops every image afresh at every epoch, and {what} "
                              f"holds each image decoded once, resized to {self.size}x{self.size}: use "
                              f"loader=gpu_decode or a DataLoader strategy (loader=baseline, pinned or prefetch), or "
                              f"dataset.augment=none")
        free = host_available_bytes()
        if self.max_host_bytes and self.nbytes > self.max_host_bytes:
            over, room = f"over dataset.max_host_mb={self.max_host_mb:g}", self.max_host_bytes
        elif self.nbytes > free:
            over, room = f"more than the {free / 2**20:.0f} MiB of host memory available", free
        else:
            return
        raise DoesNotFit(f"dataset=image_folder decoded is {self.nbytes / 2**20:.1f} MiB ({len(self)} images of "
                         f"3x{self.size}x{self.size} uint8), {over}, and {what} holds it whole: use loader=gpu_decode "
                         f"(it decodes each batch from the files, streamed from disk when they do not fit either) "
                         f"or a DataLoader strategy (loader=baseline, pinned or prefetch)",
                         fits=int(room // (3 * self.size * self.size)))

    def host_decode_ms(self, count: int = 32) -> float:
        """ms to decode one image on the host as the DataLoader strategies' workers do it (PIL:
        decoded, resized or cropped, made a tensor), on the calling thread's core: the mean over
        the first `count` images (their files likely in the page cache: decoding, not reading)."""
        n = min(count, len(self))
        start = time.perf_counter()
        for i in range(n):
            self.served[i]
        return (time.perf_counter() - start) * 1e3 / n if n else float("nan")

    def per_sample(self) -> torch.utils.data.Dataset:
        # Every image comes out 3 x size x size (RGB, resized or cropped to size): nothing for the
        # per-sample shape check of `SampleDataset.per_sample` to find.
        return self.served if self.cfg.batch_dtype == "uint8" else _UnitFloat(self.served)

    @property
    def per_sample_finish(self):
        return to_unit_float if self.cfg.batch_dtype == "uint8" else None  # the floats `_UnitFloat` makes, on the device

    def on_device(self, x: torch.Tensor) -> torch.Tensor:
        return to_unit_float(x)  # bit for bit what the DataLoader strategies' images are (`_UnitFloat`)


class _UnitFloat(torch.utils.data.Dataset):
    """The decoded uint8 images as float32 in [0, 1], made where they are decoded (a worker)."""

    def __init__(self, images):
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        x, y = self.images[i]
        return to_unit_float(x), y


class _Cropped(torch.utils.data.Dataset):
    """Each image decoded as ImageFolder decodes it (PIL, RGB), then `transform`ed (a random crop and
    flip), with the RNG of the worker that reads it: new draws at every epoch."""

    def __init__(self, samples, load, transform):
        self.samples, self.load, self.transform = samples, load, transform  # `samples`: the files errors name

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        path, label = self.samples[i]
        return self.transform(self.load(path)), label


def _root(root: str) -> Path:
    if not root:
        raise ConfigError("dataset.root is not set: set dataset.root=/path/to/images (one subfolder of JPEG or PNG "
                          "files per class)")
    path = Path(root).expanduser().absolute()
    if not path.is_dir():
        raise ConfigError(f"dataset.root={path} is not a folder: set dataset.root to the folder holding one subfolder "
                          f"of images per class")
    return path


def _open(image_folder: type, root: Path, transform):
    try:
        return image_folder(str(root), transform=transform)
    except FileNotFoundError as e:  # no class folder, or no image file in any of them
        raise ConfigError(f"dataset.root={root} holds no images ({' '.join(str(e).split())[:160]}): set dataset.root to "
                          f"a folder of class subfolders holding JPEG or PNG files (root/cat/1.jpg)") from None
