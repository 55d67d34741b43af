"""`pinned`: DataLoader(pin_memory=True) and `.to(device, non_blocking=True)` on the compute
stream – what Lightning and accelerate do today. The copy is async for the host but still
queued in front of the step on the same stream, so it does not overlap compute.

`loader.non_blocking=false` makes the copy blocking, as a plain `.cuda()` is (the
pin_memory_cifar question): the batch is pinned, but the host still waits for every copy."""

from dataclasses import dataclass

from trainer.loaders.base import LOADERS, DeviceLoader, LoaderConfig
from trainer.loaders.order import Shard


@LOADERS.register
class PinnedLoader(DeviceLoader):
    per_sample = True
    needs_cuda = True

    @dataclass
    class Config(LoaderConfig):
        """DataLoader(pin_memory=True), `.to(device, non_blocking=True)` on the compute stream."""

        name: str = "pinned"
        uses_dataloader = True
        non_blocking: bool = True  # false: blocking `.to(device)` of the pinned batch, as a plain `.cuda()`

    def __init__(self, cfg, dataset, device, seed=0, shard=Shard()):
        super().__init__(cfg, dataset, device, seed, shard)
        self.dataloader = self._dataloader(pin_memory=True)

    def __iter__(self):
        for batch in self._batches():
            yield self._finished(self._copy(batch, non_blocking=self.cfg.non_blocking))

    def host_batches(self):
        # Lightning's own copy is non_blocking: a blocking one (non_blocking=false) stays ours.
        return self._batches() if self.cfg.non_blocking and self.finish is None else None
