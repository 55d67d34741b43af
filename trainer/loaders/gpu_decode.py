"""`gpu_decode`: an image folder's files sent to the GPU still compressed, and decoded there.

For an image dataset the feed's cost is rarely the copy: it is the decoding, which the DataLoader
strategies do in their workers at every epoch, and the one-block strategies do once at setup, as
long as the decoded images fit in memory. This strategy does neither:

- host threads (`loader.threads`) read each batch's files, one file per task: from a block of host
  memory holding every file's bytes, read once at setup when they fit `dataset.max_host_mb` and
  half the host's free memory (counted for every rank of the host: each holds its own), or else
  from disk, batch after batch, `loader.depth` batches ahead. (Not page-locked: nvJPEG parses the
  bytes on the host and stages what it sends in buffers of its own.);
- one decoding thread, on a side CUDA stream made once, decodes each batch's JPEGs in one call of
  torchvision's batched `decode_jpeg(..., device="cuda")` (nvJPEG: the compressed bytes cross the
  link, about a tenth of the pixels), decodes the other files (PNG, ...) on the host and copies
  their pixels (a JPEG nvJPEG refuses, too), resizes every image to `dataset.size` on the device
  (bilinear, antialiased) and makes the batch the float image in [0, 1] the model reads
  (`dataset.on_device`);
- the loop's thread waits for nothing but the batch's event: the compute stream waits on it, and
  each batch is `record_stream`-ed on the compute stream before the step reads it (the caching
  allocator may not hand its memory to a later batch meanwhile). At most `loader.depth` decoded
  batches wait ahead of the step.

The batches hold `baseline`'s samples in `baseline`'s order for the same seed, with the same
labels; the pixels differ from the DataLoader path's (PIL decoding, PIL's resize) in their last
bits: nvJPEG's IDCT and the tensor resize round differently (tests/test_gpu_decode.py says by how
much). On a CPU the same pipeline decodes on the host (tagged `degraded=true`).

Figures: `decode_ms_per_batch` (the decoding thread's time per batch, from its files read to the
batch ready on the device: decoding, resizing, converting; the median over the batches after the
first, which makes the decoder), `link_bytes_per_image` (what crossed the link per image: the
compressed bytes, or the pixels of a file decoded on the host, and its label; where nvJPEG
decodes a JPEG in part on the host, it sends more), `gpu_decoded_fraction` (of the images, those
nvJPEG decoded) and `held_file_mb` (the files' bytes held in host memory; 0: read from disk).
"""

from __future__ import annotations

import os
import queue
import re
import statistics
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import List, Optional

import torch

from trainer.errors import ConfigError, RunFailed, at_least
from trainer.loaders.base import LOADERS, DeviceLoader, LoaderConfig
from trainer.loaders.order import Shard
from trainer.memory import host_available_bytes

JPEG_MAGIC = b"\xff\xd8"
# torchvision 0.29 warns at every decode that TorchCodec will take its decoders over: once per
# image, from the reading threads. Its decoders are what this strategy measures, as they are.
warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities of TorchVision are deprecated",
                        category=DeprecationWarning)
_DONE = object()  # the decoding thread's last item of a pass


@LOADERS.register
class GpuDecodeLoader(DeviceLoader):
    needs_cuda = True
    reads_files = True
    per_sample = True  # (its own: batch after batch from the files, no block of decoded images)

    @dataclass
    class Config(LoaderConfig):
        """Image files sent compressed and decoded, resized and made float on the GPU (nvJPEG), `depth` batches ahead on a side stream."""

        name: str = "gpu_decode"
        depth: int = 2  # decoded batches waiting ahead of the step (files read ahead as many batches more)
        threads: int = 8  # host threads reading the files (and, on a CPU, decoding them)

        def __post_init__(self):
            super().__post_init__()
            at_least("loader.depth", self.depth, 1, 2)
            at_least("loader.threads", self.threads, 1, 8)

    def __init__(self, cfg, dataset, device, seed=0, shard=Shard()):
        super().__init__(cfg, dataset, device, seed, shard)
        if getattr(dataset, "files", None) is None:
            name = getattr(getattr(dataset, "cfg", None), "name", type(dataset).__name__)
            raise ConfigError(f"loader=gpu_decode decodes image files and dataset={name} has "
                              f"none: use dataset=image_folder, or another loader (loader=pinned_chunk) for this dataset")
        start = time.perf_counter()
        from torchvision.io import ImageReadMode, decode_image, decode_jpeg  # imported with the strategy that uses them

        self._decode_jpeg, self._decode_image, self._rgb = decode_jpeg, decode_image, ImageReadMode.RGB
        self.files, self.labels, self.size = dataset.files, dataset.labels, dataset.size
        self.thread_device = self._thread_device()  # resolved here: on a new thread, "cuda" would mean GPU 0
        self.stream = torch.cuda.Stream(self.device) if self.on_cuda else None  # once per loader
        self.block: Optional[torch.Tensor] = None  # every file's bytes, end to end, when they are held
        self.offsets: List[int] = []
        self.held_bytes = 0
        self.decode_s: List[float] = []  # the decoding thread's time per batch
        self.images = self.gpu_images = self.link_bytes = 0
        self.worker: Optional[threading.Thread] = None  # the live pass's decoding thread, its queue and stop
        self.out: Optional[queue.Queue] = None
        self.stop: Optional[threading.Event] = None
        self.closed = False
        self.epoch = 0
        self.pool = ThreadPoolExecutor(cfg.threads, thread_name_prefix="gpu-decode-read")
        try:
            self._hold()
        except BaseException:  # the reads still queued are not waited for
            self.pool.shutdown(wait=False, cancel_futures=True)
            raise
        self.setup_s = time.perf_counter() - start

    # -- the files' bytes ---------------------------------------------------------------------
    def _hold(self) -> None:
        """Read every file once into one block when the files fit the dataset's `max_host_mb` and
        half the host's free memory (every rank of the host holding its own); else leave them on disk."""
        sizes = list(self.pool.map(lambda f: os.stat(f).st_size, self.files))
        total, limit = sum(sizes), self.dataset.max_host_bytes
        if (limit and total > limit) or total * self.shard.peers.local_size > host_available_bytes() // 2:
            return  # streamed from disk, batch after batch
        self.offsets = [0]
        for n in sizes:
            self.offsets.append(self.offsets[-1] + n)
        self.block = torch.empty(total, dtype=torch.uint8)
        self.held_bytes = total
        view = self.block.numpy()

        def read(i: int) -> None:
            with open(self.files[i], "rb") as f:
                got = f.readinto(memoryview(view[self.offsets[i]:self.offsets[i + 1]]))
                grew = f.read(1)
            if got != sizes[i] or grew:
                raise ConfigError(f"{self.files[i]} changed size while it was read ({sizes[i]} bytes, then "
                                  f"{'more' if grew else got}): keep dataset.root unchanged during a run")
        list(self.pool.map(read, range(len(self.files))))

    def _file(self, i: int) -> torch.Tensor:
        """File `i`'s bytes as a uint8 tensor (a view of the block, or read from disk now)."""
        if self.block is not None:
            return self.block[self.offsets[i]:self.offsets[i + 1]]
        with open(self.files[i], "rb") as f:
            return torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)

    # -- decoding -----------------------------------------------------------------------------
    def _on_host(self, encoded: torch.Tensor) -> torch.Tensor:
        """One file decoded on the host, as 3 x H x W uint8 (a 16-bit PNG scaled down to 8 bits)."""
        image = self._decode_image(encoded, mode=self._rgb)
        if image.dtype != torch.uint8:
            from torchvision.transforms.v2 import functional as F
            image = F.to_dtype(image, torch.uint8, scale=True)
        return image

    def _decode(self, rows: List[int], encoded: List[torch.Tensor]) -> tuple:
        """One batch on the device: `(x, y)`, x float in [0, 1] (B x 3 x size x size)."""
        size, device = self.size, self.device
        jpeg = [k for k, t in enumerate(encoded) if self.on_cuda and len(t) > 2 and t[0] == 0xFF and t[1] == 0xD8]
        pictures: List[Optional[torch.Tensor]] = [None] * len(rows)
        if jpeg:
            # nvJPEG writes its images on a stream of its own, into memory allocated on this one
            # (the side stream): memory this stream's earlier work may still read, freed by the
            # batch before. Waiting for this stream first leaves nothing in flight to overwrite.
            self.stream.synchronize()
            try:
                decoded = self._decode_jpeg([encoded[k] for k in jpeg], mode=self._rgb, device=device)
            except torch.OutOfMemoryError:
                raise
            except RuntimeError as e:  # a JPEG nvJPEG will not take (its chroma subsampling, say): all on the host
                if "out of memory" in str(e):
                    raise torch.OutOfMemoryError(str(e)) from e
                jpeg, decoded = [], []
            for k, image in zip(jpeg, decoded):
                pictures[k] = image
        others = [k for k in range(len(rows)) if pictures[k] is None]
        for k, image in zip(others, self.pool.map(lambda k: self._on_host(encoded[k]), others)):
            pictures[k] = image.to(device, non_blocking=False)
        self.images += len(rows)
        self.gpu_images += len(jpeg)
        self.link_bytes += sum(encoded[k].numel() for k in jpeg) + sum(pictures[k].nbytes for k in others) + 8 * len(rows)
        x = torch.empty((len(rows), 3, size, size), dtype=torch.uint8, device=device)
        by_shape = {}
        for k, image in enumerate(pictures):
            by_shape.setdefault(tuple(image.shape[1:]), []).append(k)
        for shape, ks in by_shape.items():  # one resize per size of image found in the batch
            group = torch.stack([pictures[k] for k in ks])
            if shape != (size, size):
                group = _resize(group, size)
            x[torch.tensor(ks, device=device)] = group
        y = self.labels[torch.tensor(rows)].to(device, non_blocking=False)
        return self.dataset.on_device(x), y

    def _named(self, rows: List[int], error: Exception) -> Exception:
        """The first file of a batch that will not decode, named in one line."""
        if isinstance(error, torch.OutOfMemoryError):
            return error  # the run's fault handler says which key to lower
        for i in rows:
            try:
                self._on_host(self._file(i))
            except Exception as e:
                return RunFailed(f"{self.files[i]} could not be decoded ({type(e).__name__}: {_said(e)}): "
                                 f"loader=gpu_decode decodes JPEG, PNG, WebP and GIF files: convert or remove it, or "
                                 f"use loader=prefetch (PIL decodes more formats)")
        return RunFailed(f"loader=gpu_decode could not decode a batch of {self.files[rows[0]]} and {len(rows) - 1} more "
                         f"({type(error).__name__}: {' '.join(str(error).split())[:200]}): try loader=prefetch")

    def _run(self, batches: List[List[int]], out: queue.Queue, stop: threading.Event) -> None:
        """The decoding thread of one pass: each batch's files (read by the pool, one task per
        file, `depth` batches ahead), decoded on the side stream and waited for there, its event
        recorded, handed to the loop's thread. Ends at `stop`, or with its error handed over."""
        reads: List[Optional[list]] = []
        try:
            if self.on_cuda:
                torch.cuda.set_device(self.thread_device)
            ahead = self.cfg.depth
            reads = [[self.pool.submit(self._file, i) for i in rows] for rows in batches[:ahead]]
            for b, rows in enumerate(batches):
                if stop.is_set():
                    break
                if b + ahead < len(batches):
                    reads.append([self.pool.submit(self._file, i) for i in batches[b + ahead]])
                encoded = [f.result() for f in reads[b]]
                reads[b] = None
                begin = time.perf_counter()
                try:
                    if self.stream is None:
                        batch, done = self._decode(rows, encoded), None
                    else:
                        done = torch.cuda.Event()
                        with torch.cuda.stream(self.stream):
                            batch = self._decode(rows, encoded)
                            done.record(self.stream)
                        done.synchronize()  # this thread's own wait: the loop's thread waits for nothing
                except Exception as e:
                    raise self._named(rows, e) from e
                if b:  # the first batch makes the decoder
                    self.decode_s.append(time.perf_counter() - begin)
                while not stop.is_set():
                    try:
                        out.put((batch, done), timeout=0.05)
                        break
                    except queue.Full:
                        pass
        except BaseException as e:  # handed to the loop's thread, which raises it
            out.put(e)
            return
        finally:
            for futures in reads:  # reads queued for batches this pass will not decode
                for f in futures or ():
                    f.cancel()
        out.put(_DONE)

    def __iter__(self):
        if self.closed:
            raise RuntimeError("loader=gpu_decode is closed: build a new loader to iterate again")
        self._end_pass()  # a pass left unfinished (a loop that broke out of it) ends here
        order = self._epoch_rows(self.epoch).tolist()
        self.epoch += 1
        b = self.cfg.batch_size
        batches = [order[i:i + b] for i in range(0, len(order), b)]
        out, stop = queue.Queue(maxsize=self.cfg.depth), threading.Event()
        worker = threading.Thread(target=self._run, args=(batches, out, stop), name="gpu-decode", daemon=True)
        self.worker, self.out, self.stop = worker, out, stop
        worker.start()
        compute = torch.cuda.current_stream(self.device) if self.on_cuda else None
        try:
            while True:
                try:
                    item = out.get(timeout=0.1)
                except queue.Empty:
                    if not worker.is_alive() and out.empty():
                        raise RuntimeError("loader=gpu_decode's decoding thread ended without a word") from None
                    continue
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                batch, done = item
                if compute is not None:
                    compute.wait_event(done)
                    for t in batch:
                        t.record_stream(compute)
                yield batch
        finally:
            if self.worker is worker:
                self._end_pass()
            else:  # a newer pass ended this one already
                stop.set()

    def _end_pass(self) -> None:
        """Stop the live pass's decoding thread and wait until it has exited (it may be waiting to
        hand over a batch). An interrupt meanwhile is raised once it has: a thread left running
        would go on decoding into the next pass's time."""
        worker, out, stop = self.worker, self.out, self.stop
        if worker is None:
            return
        stop.set()
        interrupt = None
        while worker.is_alive() and worker is not threading.current_thread():
            try:
                try:
                    out.get(timeout=0.05)
                except queue.Empty:
                    pass
            except BaseException as e:  # Ctrl-C or a stop signal: join first
                interrupt = interrupt or e
        self.worker = self.out = self.stop = None
        if interrupt is not None:
            raise interrupt

    # -- figures and close --------------------------------------------------------------------
    def figures(self) -> dict:
        out = {"gpu_decoded_fraction": self.gpu_images / self.images if self.images else float("nan"),
               "held_file_mb": self.held_bytes / 2**20}
        if self.on_cuda and self.images:
            out["link_bytes_per_image"] = self.link_bytes / self.images
        if self.decode_s:
            out["decode_ms_per_batch"] = statistics.median(self.decode_s) * 1e3
        return out

    def _release(self) -> None:
        self.closed = True
        self._end_pass()
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.block = None


def _said(error: Exception) -> str:
    """An error's message on one line, without the `function, source.cpp:line, ` torchvision puts first."""
    return re.sub(r"^\w+, \S+:\d+, ", "", " ".join(str(error).split()))[:160]


def _resize(images: torch.Tensor, size: int) -> torch.Tensor:
    """uint8 images (N x 3 x H x W) to size x size, bilinear and antialiased as PIL's resize, rounded back to uint8."""
    from torchvision.transforms.v2 import functional as F

    return F.resize(images, [size, size], antialias=True)
