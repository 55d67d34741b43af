"""`prefetch`: pinned batches copied on a side CUDA stream `depth` batches ahead, so the copy
of batch k+1 runs while the step on batch k computes (seed 001's request, done with streams)."""

from trainer.loaders.base import DeviceLoader
from trainer.loaders.order import Shard
from trainer.loaders.stream import SideStreamCopier


class PrefetchLoader(DeviceLoader):
    needs_cuda = True

    def __init__(self, cfg, dataset, device, seed=0, shard=Shard()):
        super().__init__(cfg, dataset, device, seed, shard)
        if cfg.depth < 1:
            raise ValueError(f"loader.depth must be >= 1 (got {cfg.depth}): set loader.depth=1")
        self.dataloader = self._dataloader(pin_memory=True)
        self.copier = SideStreamCopier(self, cfg.depth)  # one stream for the loader's lifetime

    def __iter__(self):
        return self.copier.run((batch, None) for batch in self._batches())
