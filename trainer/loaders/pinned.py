"""`pinned`: DataLoader(pin_memory=True) and `.to(device, non_blocking=True)` on the compute
stream – what Lightning and accelerate do today. The copy is async for the host but still
queued in front of the step on the same stream, so it does not overlap compute."""

from trainer.loaders.base import DeviceLoader


class PinnedLoader(DeviceLoader):
    needs_cuda = True

    def __init__(self, cfg, dataset, device, seed=0):
        super().__init__(cfg, dataset, device, seed)
        self.dataloader = self._dataloader(pin_memory=True)

    def __iter__(self):
        for batch in self.dataloader:
            yield self._copy(batch, non_blocking=True)

    def close(self):
        self.dataloader = None
