"""`baseline`: DataLoader in pageable memory, blocking `.to(device)` – what most loops do."""

from dataclasses import dataclass

from trainer.loaders.base import LOADERS, DeviceLoader, LoaderConfig
from trainer.loaders.order import Shard


@LOADERS.register
class BaselineLoader(DeviceLoader):
    per_sample = True
    @dataclass
    class Config(LoaderConfig):
        """DataLoader batches in pageable memory, blocking `.to(device)`: what most loops do."""

        name: str = "baseline"
        uses_dataloader = True

    def __init__(self, cfg, dataset, device, seed=0, shard=Shard()):
        super().__init__(cfg, dataset, device, seed, shard)
        self.dataloader = self._dataloader(pin_memory=False)

    def __iter__(self):
        for batch in self._batches():
            # Pageable source: CUDA stages it through a driver buffer and the host waits.
            yield self._finished(self._copy(batch, non_blocking=False))

    def host_batches(self):
        # A pageable batch copied with non_blocking=True (as Lightning does) still waits on the host.
        return self._batches() if self.finish is None else None
