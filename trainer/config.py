"""Typed config schemas, registered in Hydra's ConfigStore.

Every YAML option in `conf/<group>/` starts from the schema stored at `schema/<group>/<name>`,
so a typo (`loader.pin_memroy=true`) or a wrong type (`loader.batch_size=abc`) fails when Hydra
composes the config, before anything runs. Each component later receives only its own section.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from types import SimpleNamespace

from omegaconf import MISSING, DictConfig, OmegaConf

PROJECT_ROOT = Path(__file__).resolve().parent.parent  # a checkout's root (site-packages once installed)
# A wheel carries the checkout's conf/ inside the package (pyproject.toml maps it to trainer/conf);
# in a checkout (an editable install) that folder does not exist and conf/ is read where it is.
_PACKAGED_CONF = Path(__file__).resolve().parent / "conf"
INSTALLED = _PACKAGED_CONF.is_dir()
CONF_DIR = _PACKAGED_CONF if INSTALLED else PROJECT_ROOT / "conf"
# Where outputs/ (runs, Hydra's folders) and data/ go: the checkout's root, wherever you launch
# from; for an installed package, the current directory (Hydra >= 1.2 does not change it).
BASE_DIR = Path.cwd() if INSTALLED else PROJECT_ROOT


# ----------------------------------------------------------------------------- datasets
@dataclass
class DatasetConfig:
    """Common to every dataset."""

    name: str = MISSING
    seed: int = 0  # seeds data generation (synthetic) and fixed labels


@dataclass
class SyntheticConfig(DatasetConfig):
    """Seed 000's random 'big chunk': `num_samples` samples, 'loaded from disk' one chunk at a time.

    The chunking is set by `chunks` or by `chunk_samples`, not both: `chunk_samples=0` splits
    `num_samples` into `chunks` loads; `chunk_samples=N` loads N samples at a time (and `chunks`
    follows: leave it at 1). Seed 000 is `num_samples=2000 chunk_samples=1000 batches_per_chunk=4`.
    """

    name: str = "synthetic"
    num_samples: int = 1000  # samples in the whole dataset (all chunks together)
    shape: List[int] = field(default_factory=lambda: [256, 256])  # one sample's shape
    dtype: str = "float32"  # storage dtype: float32 | float16 | bfloat16 | uint8 (model input is float32)
    chunks: int = 1  # the data is 'loaded from disk' in this many chunks
    chunk_samples: int = 0  # samples per chunk (0 = num_samples / chunks, rounded up)
    batches_per_chunk: int = 0  # iterable view: random batches drawn per loaded chunk (0 = one pass)
    load_ms: float = 0.0  # simulated disk-read time per chunk
    num_classes: int = 10  # a fixed random label per sample (for the MLP)


@dataclass
class VisionConfig(DatasetConfig):
    """A torchvision dataset read from `root` (downloaded there first when `download=true`)."""

    root: str = str(BASE_DIR / "data")  # folder holding MNIST/raw/ or cifar-10-batches-py/
    download: bool = True  # fetch the files when they are missing (needs internet)
    train: bool = True  # true: the training split; false: the test split
    num_samples: int = 0  # use only the first N samples of the split (0 = all of it)


@dataclass
class MnistConfig(VisionConfig):
    """torchvision.datasets.MNIST: 1x28x28 uint8 images, 10 classes."""

    name: str = "mnist"


@dataclass
class Cifar10Config(VisionConfig):
    """torchvision.datasets.CIFAR10: 3x32x32 uint8 images, 10 classes."""

    name: str = "cifar10"
    verify_md5: bool = True  # false: skip the md5 check of the batch files (re-packed or generated files)


# ----------------------------------------------------------------------------- loaders
@dataclass
class LoaderConfig:
    """Common to every loader strategy."""

    name: str = MISSING
    batch_size: int = 64
    shuffle: bool = True
    drop_last: bool = False
    num_workers: int = 0  # DataLoader worker processes (DataLoader-based strategies)
    prefetch_factor: Optional[int] = None  # batches each worker loads ahead (None = torch default)
    persistent_workers: bool = False  # keep workers alive between epochs


@dataclass
class BaselineConfig(LoaderConfig):
    name: str = "baseline"


@dataclass
class PinnedConfig(LoaderConfig):
    name: str = "pinned"
    non_blocking: bool = True  # false: blocking `.to(device)` of the pinned batch (seeds 002 and 004)


@dataclass
class PrefetchConfig(LoaderConfig):
    name: str = "prefetch"
    depth: int = 1  # batches copied ahead on the side stream


@dataclass
class PinnedChunkConfig(LoaderConfig):
    name: str = "pinned_chunk"
    depth: int = 1  # slices copied ahead on the side stream
    shuffle_rows: bool = False  # also permute the rows of each chunk once, when it is loaded


@dataclass
class PinnedGatherConfig(LoaderConfig):
    """Rows gathered in `epoch_order` by worker threads into page-locked slots, copied on a side stream."""

    name: str = "pinned_gather"
    depth: int = 1  # batches copied ahead on the side stream
    threads: int = 4  # threads gathering rows into the page-locked slots (depth + threads + 1 slots)


@dataclass
class PinnedUvaConfig(LoaderConfig):
    """The dataset in page-locked memory; each batch's rows read by the GPU itself (one kernel per batch)."""

    name: str = "pinned_uva"
    depth: int = 2  # batches gathered ahead on the side stream (loader.depth + 2 device slots)
    # Thread blocks of the gather kernel: each holds an SM while it waits on PCIe. 4 leave the SMs
    # to a GPU-bound step (1% slower beside it on an H100); 16-32 for a transfer-bound run (model=noop).
    ctas: int = 4


@dataclass
class GpuResidentConfig(LoaderConfig):
    name: str = "gpu_resident"


@dataclass
class SeedIterableConfig(LoaderConfig):
    """Seed 000's own DataLoader over its IterableDataset (dataset=synthetic only)."""

    name: str = "seed_iterable"
    variant: str = "pin_batches"  # no_pinning | copy_in_loader | pin_batches | pin_chunk: the seed's four


# ----------------------------------------------------------------------------- models
@dataclass
class ModelConfig:
    name: str = MISSING
    busy_ms: float = 0.0  # extra fixed device-side work per step (compute emulation)


@dataclass
class AutoencoderConfig(ModelConfig):
    """Seed 000's autoencoder: input -> hidden -> bottleneck -> hidden -> input."""

    name: str = "autoencoder"
    hidden: int = 64
    bottleneck: int = 3


@dataclass
class MlpConfig(ModelConfig):
    """Seed 003's classifier: flatten -> hidden -> classes."""

    name: str = "mlp"
    hidden: int = 512


@dataclass
class NoopConfig(ModelConfig):
    """Forward and backward do nothing: only the data feed is measured."""

    name: str = "noop"


# ----------------------------------------------------------------------------- run
@dataclass
class OptimizerConfig:
    name: str = "adam"  # adam | sgd | adamw
    lr: float = 1e-3


@dataclass
class LightningConfig:
    """Lightning's own features under `engine.loop=lightning`: all off by default, so the two loops
    do the same work; turn one on to see what it costs."""

    logger: bool = False  # CSVLogger, and the loss sent through `self.log` at every step
    log_every_n_steps: int = 50  # how often the logger writes (Trainer's log_every_n_steps)
    checkpointing: bool = False  # ModelCheckpoint at the end of every epoch
    progress_bar: bool = False  # Lightning's progress bar (in place of feedbench's)
    model_summary: bool = False  # the model summary printed when fitting starts


@dataclass
class EngineConfig:
    loop: str = "feedbench"  # feedbench | lightning: the loop that drives the steps (lightning: Lightning's Trainer)
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0  # model init and shuffling
    epochs: int = 3  # passes over the data when max_steps=0
    max_steps: int = 0  # the run's length in steps, over as many epochs as it takes (0: `epochs` passes)
    warmup_steps: int = 5  # excluded from the summaries
    verify: bool = False  # checksum every batch on the device (tag data_checksum)
    progress: bool = True  # tqdm bar on stderr (only on a terminal)
    cuda_graph: bool = False  # capture forward+backward+step once, replay it every step
    profile: bool = False  # torch.profiler trace of the last warm-up steps (and whether its copies overlapped kernels)
    steady_heap: bool = True  # keep freed host buffers in the process (glibc), so no run's batches fault in anew (trainer.tools.heap)
    gpu_timing_every: int = 8  # CUDA events time the steps (and copies) of one run of 32 in every N; 1: all (trainer.loop.meter)
    journal_s: float = 2.0  # seconds between writes of the measured steps to the run's journal (0: none; trainer.tracking.journal)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lightning: LightningConfig = field(default_factory=LightningConfig)  # engine.loop=lightning only


@dataclass
class TrackingConfig:
    uri: Optional[str] = None  # MLflow tracking URI (None = sqlite outputs/mlflow.db)
    experiment: str = "feedbench"
    run_name: Optional[str] = None  # None: MLflow's random name, or the swept values in a sweep
    system_metrics: bool = False  # MLflow system metrics (CPU, memory; GPU with nvidia-ml-py); needs psutil
    system_metrics_interval_s: float = 1.0  # seconds between system-metric samples
    parent_run_id: Optional[str] = None  # nest the run under this MLflow run (a sweep sets it per job)
    sweep_name: Optional[str] = None  # name of a multirun's parent run (None = the swept overrides)


@dataclass
class DistributedConfig:
    """Runs under torchrun (`torchrun --nproc_per_node=N -m trainer ...`); ignored in one process."""

    timeout_s: float = 300.0  # how long the ranks' own collectives (errors, results after the loop) wait for a rank


@dataclass
class Config:
    dataset: Any = MISSING
    loader: Any = MISSING
    model: Any = MISSING
    engine: EngineConfig = field(default_factory=EngineConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)


SCHEMAS = {
    "dataset": {"synthetic": SyntheticConfig, "mnist": MnistConfig, "cifar10": Cifar10Config},
    "loader": {
        "baseline": BaselineConfig,
        "pinned": PinnedConfig,
        "prefetch": PrefetchConfig,
        "pinned_chunk": PinnedChunkConfig,
        "pinned_gather": PinnedGatherConfig,
        "pinned_uva": PinnedUvaConfig,
        "gpu_resident": GpuResidentConfig,
        "seed_iterable": SeedIterableConfig,
    },
    "model": {"autoencoder": AutoencoderConfig, "mlp": MlpConfig, "noop": NoopConfig},
}


def plain(section):
    """A component's config section as a plain object (its schema's dataclass), for code that reads
    it per batch: an OmegaConf attribute lookup costs ~10 us, a dataclass attribute ~50 ns."""
    if not isinstance(section, DictConfig):
        return section
    obj = OmegaConf.to_object(section)
    return SimpleNamespace(**obj) if isinstance(obj, dict) else obj


def register() -> None:
    """Store every schema; YAML options pull theirs in with `- /schema/<group>/<name>@_here_`."""
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    for group, options in SCHEMAS.items():
        for name, node in options.items():
            cs.store(group=f"schema/{group}", name=name, node=node)
    if not OmegaConf.has_resolver("base_dir"):
        OmegaConf.register_new_resolver("base_dir", lambda: str(BASE_DIR))  # Hydra's folders: under outputs/ there
    if not OmegaConf.has_resolver("launch_time"):
        # `${now:}` as rank 0 read it: under torchrun every rank composes its own config, and
        # Hydra's output folder would otherwise differ from rank to rank. Cached, like `now`.
        OmegaConf.register_new_resolver("launch_time", _launch_time, use_cache=True)


def _launch_time(pattern: str) -> str:
    from trainer.loop.distributed import launch_time

    return launch_time(pattern)


register()
