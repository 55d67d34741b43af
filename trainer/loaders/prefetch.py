"""`prefetch`: pinned batches copied on a side CUDA stream `depth` batches ahead, so the copy
of batch k+1 runs while the step on batch k computes (PyTorch Lightning issue #1316's request, done with streams)."""

import contextlib
from dataclasses import dataclass

from trainer.errors import at_least
from trainer.loaders.base import LOADERS, DeviceLoader, LoaderConfig
from trainer.loaders.order import Shard
from trainer.loaders.stream import SideStreamCopier


@LOADERS.register
class PrefetchLoader(DeviceLoader):
    per_sample = True
    needs_cuda = True

    @dataclass
    class Config(LoaderConfig):
        """Pinned DataLoader batches copied on a side CUDA stream, `depth` batches ahead of the step."""

        name: str = "prefetch"
        uses_dataloader = True
        depth: int = 1  # batches copied ahead on the side stream

        def __post_init__(self):
            super().__post_init__()
            at_least("loader.depth", self.depth, 1, 1)

    def __init__(self, cfg, dataset, device, seed=0, shard=Shard()):
        super().__init__(cfg, dataset, device, seed, shard)
        self.dataloader = self._dataloader(pin_memory=True)
        self.copier = SideStreamCopier(self, cfg.depth)  # one stream for the loader's lifetime

    def __iter__(self):
        batches = self.copier.run((batch, None) for batch in self._batches())
        return batches if self.finish is None else self._each_finished(batches)

    def _each_finished(self, batches):
        """Each batch made the model input on the compute stream, after its wait for the copy."""
        with contextlib.closing(batches):  # a pass left early stops its copies and workers at once
            for batch in batches:
                yield self._finished(batch)
