"""`dataset=image_folder`: JPEG or PNG files in one folder per class (`root/cat/1.jpg`), read by
torchvision's `ImageFolder`, each decoded, converted to RGB and resized to `size` x `size`.

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
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from datasets.base import DATASETS, DatasetConfig, to_unit_float
from datasets.samples import SampleDataset
from trainer.errors import ConfigError, at_least
from trainer.memory import host_available_bytes

BATCH_DTYPES = ("float32", "uint8")


@DATASETS.register
class ImageFolderDataset(SampleDataset):
    @dataclass
    class Config(DatasetConfig):
        """torchvision's ImageFolder: `root/<class>/<image>` JPEG or PNG files, decoded and resized to
        3 x size x size; the class is the subfolder."""

        name: str = "image_folder"
        root: str = ""  # the folder holding one subfolder of images per class
        size: int = 224  # every image is resized to size x size pixels
        num_samples: int = 0  # use only the first N images, in ImageFolder's order (0: all)
        read_workers: int = 0  # processes decoding the images into a one-block strategy's block (0: this one)
        max_host_mb: float = 0.0  # host memory the images may take (decoded, or as files for gpu_decode); 0: no limit
        batch_dtype: str = "float32"  # the DataLoader strategies' batches over the link: float32, or uint8 made float on the device

        def __post_init__(self):
            at_least("dataset.size", self.size, 1, 224)
            at_least("dataset.num_samples", self.num_samples, 0, "0 (all the images)")
            at_least("dataset.read_workers", self.read_workers, 0, 0)
            at_least("dataset.max_host_mb", self.max_host_mb, 0, "0 (no limit)")
            if self.batch_dtype not in BATCH_DTYPES:
                raise ConfigError(f"dataset.batch_dtype must be one of {', '.join(BATCH_DTYPES)} (got {self.batch_dtype!r}): "
                                  f"set dataset.batch_dtype=uint8 (made float on the device) or float32")

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
        self.images = _UnitFloat(self.samples)  # guarded: a file that fails to decode is named
        self.size = cfg.size
        self.max_host_mb, self.max_host_bytes = cfg.max_host_mb, int(cfg.max_host_mb * 2**20)  # 0: no limit
        kept = folder.samples[:len(stored)]  # (path, class) in ImageFolder's order: sample i is file i
        self.files = [path for path, _ in kept]
        self.labels = torch.tensor([label for _, label in kept], dtype=torch.int64)

    def check_block(self, what: str) -> None:
        """The decoded images in one block: refused in one line past `dataset.max_host_mb`, or
        past the host's free memory (where the strategy's own check would offer chunks, which
        an image folder does not have)."""
        free = host_available_bytes()
        if self.max_host_bytes and self.nbytes > self.max_host_bytes:
            over = f"over dataset.max_host_mb={self.max_host_mb:g}"
        elif self.nbytes > free:
            over = f"more than the {free / 2**20:.0f} MiB of host memory available"
        else:
            return
        raise ConfigError(f"dataset=image_folder decoded is {self.nbytes / 2**20:.1f} MiB ({len(self)} images of "
                          f"3x{self.size}x{self.size} uint8), {over}, and {what} holds it whole: use loader=gpu_decode "
                          f"(it decodes each batch from the files, streamed from disk when they do not fit either) "
                          f"or a DataLoader strategy (loader=baseline, pinned or prefetch)")

    def per_sample(self) -> torch.utils.data.Dataset:
        return super().per_sample() if self.cfg.batch_dtype == "uint8" else self.images

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
