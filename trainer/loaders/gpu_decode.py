"""`gpu_decode`: an image folder's files sent to the GPU still compressed, and decoded there.

For an image dataset the feed's cost is rarely the copy: it is the decoding, which the DataLoader
strategies do in their workers at every epoch, and the one-block strategies do once at setup, as
long as the decoded images fit in memory. This strategy does neither:

- host threads (`loader.threads`) read each batch's files, one file per task: from a block of host
  memory holding every file's bytes, read once at setup when they fit `dataset.max_host_mb` and
  half the host's free memory (counted for every rank of the host: each holds its own), or else
  from disk, batch after batch, `loader.depth` batches ahead. (Not page-locked: nvJPEG parses the
  bytes on the host and stages what it sends in buffers of its own.);
- `loader.decoders` (2) decoding threads, each on a side CUDA stream of its own made once, taking
  the batches in turn (torchvision's decoder takes one batch at a time, under a lock of its own:
  while it decodes one thread's batch, the other readies its next and finishes its last), decode
  each batch's JPEGs in one call of
  torchvision's batched `decode_jpeg(..., device="cuda")` (nvJPEG: the compressed bytes cross the
  link, about a tenth of the pixels), decodes the other files (PNG, ...) on the host and copies
  their pixels (a JPEG nvJPEG refuses, too), resizes every image to `dataset.size` on the device
  (bilinear, antialiased) and makes the batch the float image in [0, 1] the model reads
  (`dataset.on_device`). With `dataset.augment=crop_flip` it crops each decoded image instead
  (a random box, as torchvision's RandomResizedCrop draws it), resizes the crop to `dataset.size`
  and flips it half the time, from a generator seeded by the loader's seed, the epoch, the rank
  and the batch: a run is reproducible, whatever `loader.decoders`, and each epoch draws anew;
- the loop's thread waits for nothing but the batch's event: the compute stream waits on it, and
  each batch is `record_stream`-ed on the compute stream before the step reads it (the caching
  allocator may not hand its memory to a later batch meanwhile). Each thread hands its batches
  over in a queue of its own (`loader.depth` // `loader.decoders` places, at least one), which
  the loop's thread takes in turn: the batches come in their order.

The batches hold `baseline`'s samples in `baseline`'s order for the same seed, with the same
labels; the pixels differ from the DataLoader path's (PIL decoding, PIL's resize): the tensor
resize rounds apart by a level (tests/test_gpu_decode.py), and nvJPEG widens the halved chroma of
a 4:2:0 JPEG apart from libjpeg-turbo, by tens of levels at single pixels (tests/test_gpu.py;
docs/image_folders.md). With `dataset.augment=crop_flip` they differ wholly: the DataLoader's workers draw their
crops and flips apart from this strategy's generator. On a CPU the same pipeline decodes on the
host (tagged `degraded=true`).

Figures: `decode_ms_per_batch` (a decoding thread's time per batch, from its files read to the
batch ready on the device: decoding, resizing, converting, waiting its turn at the decoder; the
median over each thread's batches after its first; with two threads a batch is ready about twice
as often), `link_bytes_per_image` (what crossed the link per image: the
compressed bytes, or the pixels of a file decoded on the host, and its label; where nvJPEG
decodes a JPEG in part on the host, it sends more), `gpu_decoded_fraction` (of the images, those
nvJPEG decoded) and `held_file_mb` (the files' bytes held in host memory; 0: read from disk).
"""

from __future__ import annotations

import math
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

from datasets.image_folder import CROP_RATIO, CROP_SCALE
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
CROP_LOG_RATIO = torch.log(torch.tensor(CROP_RATIO)).tolist()  # in float32, as torchvision takes it: the same boxes
# The crop draws' seeds start from it, so that they are not the epoch order's seed (`epoch_order`).
CROP_SEED_SALT = 0x9E3779B97F4A7C15
CROP_CHUNK_BYTES = 256 * 2**20  # the decoded images `_crops_flipped` makes float at once (large photos: a few)


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
        decoders: int = 2  # decoding threads, each on a side stream of its own, taking the batches in turn

        def __post_init__(self):
            super().__post_init__()
            at_least("loader.depth", self.depth, 1, 2)
            at_least("loader.threads", self.threads, 1, 8)
            at_least("loader.decoders", self.decoders, 1, 2)

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
        self.crop_flip = dataset.augment == "crop_flip"
        self.thread_device = self._thread_device()  # resolved here: on a new thread, "cuda" would mean GPU 0
        # Once per loader: a side stream per decoding thread.
        self.streams = [torch.cuda.Stream(self.device) if self.on_cuda else None for _ in range(cfg.decoders)]
        self.block: Optional[torch.Tensor] = None  # every file's bytes, end to end, when they are held
        self.offsets: List[int] = []
        self.held_bytes = 0
        self.decode_s: List[float] = []  # a decoding thread's time per batch
        self.images = self.gpu_images = self.link_bytes = 0
        self.counting = threading.Lock()  # the decoding threads add to the three counts above
        self.workers: List[threading.Thread] = []  # the live pass's decoding threads, their queues and stop
        self.outs: List[queue.Queue] = []
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
        view = self.view = self.block.numpy()

        def read(i: int) -> None:
            with open(self.files[i], "rb") as f:
                got = f.readinto(memoryview(view[self.offsets[i]:self.offsets[i + 1]]))
                grew = f.read(1)
            if got != sizes[i] or grew:
                raise ConfigError(f"{self.files[i]} changed size while it was read ({sizes[i]} bytes, then "
                                  f"{'more' if grew else got}): keep dataset.root unchanged during a run")
        list(self.pool.map(read, range(len(self.files))))

    def _file(self, i: int) -> tuple:
        """File `i`: `(its bytes as a uint8 tensor, whether it is a JPEG)`; a view of the block, or
        read from disk now. (Told from its first bytes here, on a reading thread: on the decoding
        thread two tensor reads a file cost a millisecond a batch.)"""
        if self.block is not None:
            start, end = self.offsets[i], self.offsets[i + 1]
            return self.block[start:end], bytes(self.view[start:min(end, start + 2)]) == JPEG_MAGIC
        with open(self.files[i], "rb") as f:
            data = f.read()
        return torch.frombuffer(bytearray(data), dtype=torch.uint8), data[:2] == JPEG_MAGIC

    # -- decoding -----------------------------------------------------------------------------
    def _on_host(self, encoded: torch.Tensor) -> torch.Tensor:
        """One file decoded on the host, as 3 x H x W uint8 (a 16-bit PNG scaled down to 8 bits)."""
        image = self._decode_image(encoded, mode=self._rgb)
        if image.dtype != torch.uint8:
            from torchvision.transforms.v2 import functional as F
            image = F.to_dtype(image, torch.uint8, scale=True)
        return image

    def _decode(self, rows: List[int], files: List[tuple], crops: Optional[torch.Generator],
                stream: Optional[torch.cuda.Stream] = None) -> tuple:
        """One batch on the device, on `stream` (the calling thread's, current): `(x, y)`, x float
        in [0, 1] (B x 3 x size x size); each image resized whole, or with `crops` (the batch's
        generator) cropped at random and flipped. `files`: each row's `(bytes, is_jpeg)`."""
        size, device = self.size, self.device
        encoded = [data for data, _ in files]
        jpeg = [k for k, (_, is_jpeg) in enumerate(files) if is_jpeg and self.on_cuda]
        pictures: List[Optional[torch.Tensor]] = [None] * len(rows)

        def on_host(ks: List[int]) -> None:
            for k, image in zip(ks, self.pool.map(lambda k: self._on_host(encoded[k]), ks)):
                pictures[k] = image.to(device, non_blocking=False)

        # A copy from pageable memory waits for this stream's work to end: the labels and the images
        # decoded on the host cross first, before nvJPEG's work is queued on the stream.
        y = self.labels[torch.tensor(rows)].to(device, non_blocking=False)
        nvjpeg_rows = set(jpeg)
        others = [k for k in range(len(rows)) if k not in nvjpeg_rows]
        on_host(others)
        if jpeg:
            # nvJPEG writes its images on a stream of its own, into memory allocated on this one
            # (the side stream): memory this stream's earlier work may still read, freed by the
            # batch before. Waiting for this stream first leaves nothing in flight to overwrite.
            # (Another decoding thread's stream allocates from blocks of its own.)
            stream.synchronize()
            try:
                decoded = self._decode_jpeg([encoded[k] for k in jpeg], mode=self._rgb, device=device)
            except torch.OutOfMemoryError:
                raise
            except RuntimeError as e:  # a JPEG nvJPEG will not take (its chroma subsampling, say): all on the host
                if "out of memory" in str(e):
                    raise torch.OutOfMemoryError(str(e)) from e
                # nvJPEG's own stream may still write what it allocated here before it failed.
                torch.cuda.synchronize(device)
                on_host(jpeg)
                others, jpeg, decoded = others + jpeg, [], []
            for k, image in zip(jpeg, decoded):
                pictures[k] = image
        sent = sum(encoded[k].numel() for k in jpeg) + sum(pictures[k].nbytes for k in others) + 8 * len(rows)
        with self.counting:
            self.images += len(rows)
            self.gpu_images += len(jpeg)
            self.link_bytes += sent
        if crops is not None:
            x = _crops_flipped(pictures, size, crops)
        else:
            by_shape = {}
            for k, image in enumerate(pictures):
                by_shape.setdefault(tuple(image.shape[1:]), []).append(k)
            x = None if len(by_shape) == 1 else torch.empty((len(rows), 3, size, size), dtype=torch.uint8, device=device)
            for shape, ks in by_shape.items():  # one resize per size of image found in the batch
                group = torch.stack([pictures[k] for k in ks])
                if shape != (size, size):
                    group = _resize(group, size)
                if x is None:  # one size: the batch itself
                    x = group
                else:  # (a pageable source, staged before the call returns: freeing it is safe)
                    x[torch.tensor(ks).to(device, non_blocking=True)] = group
        return self.dataset.on_device(x), y

    def _named(self, rows: List[int], error: Exception) -> Exception:
        """The first file of a batch that will not decode, named in one line."""
        if isinstance(error, torch.OutOfMemoryError):
            return error  # the run's fault handler says which key to lower
        for i in rows:
            try:
                self._on_host(self._file(i)[0])
            except Exception as e:
                return RunFailed(f"{self.files[i]} could not be decoded ({type(e).__name__}: {_said(e)}): "
                                 f"loader=gpu_decode decodes JPEG, PNG, WebP and GIF files: convert or remove it, or "
                                 f"use loader=prefetch (PIL decodes more formats)")
        return RunFailed(f"loader=gpu_decode could not decode a batch of {self.files[rows[0]]} and {len(rows) - 1} more "
                         f"({type(error).__name__}: {' '.join(str(error).split())[:200]}): try loader=prefetch")

    def _run(self, first: int, batches: List[List[int]], out: queue.Queue, stop: threading.Event,
             crop_seed: int) -> None:
        """A decoding thread of one pass: batches `first`, `first + decoders`, ... of `batches`, each
        one's files read by the pool (one task per file, `depth` of this thread's batches ahead),
        decoded (and cropped, with `dataset.augment=crop_flip`) on this thread's side stream and
        waited for there, its event recorded, handed over in `out`. Ends at `stop`, or with its
        error handed over. (torchvision's decoder takes one batch at a time, under its own lock:
        meanwhile the other thread readies its next batch and finishes its last.)"""
        mine = list(range(first, len(batches), len(self.streams)))
        stream = self.streams[first]
        reads: List[Optional[list]] = []
        try:
            if self.on_cuda:
                torch.cuda.set_device(self.thread_device)
            ahead = self.cfg.depth
            reads = [[self.pool.submit(self._file, i) for i in batches[b]] for b in mine[:ahead]]
            for n, b in enumerate(mine):
                if stop.is_set():
                    break
                if n + ahead < len(mine):
                    reads.append([self.pool.submit(self._file, i) for i in batches[mine[n + ahead]]])
                files = [f.result() for f in reads[n]]
                reads[n] = None
                rows = batches[b]
                # The crops of batch b, whichever thread decodes it: the same seed, the same crops.
                crops = torch.Generator().manual_seed(_mixed(crop_seed, b)) if self.crop_flip else None
                begin = time.perf_counter()
                try:
                    if stream is None:
                        batch, done = self._decode(rows, files, crops), None
                    else:
                        done = torch.cuda.Event()
                        with torch.cuda.stream(stream):
                            batch = self._decode(rows, files, crops, stream)
                            done.record(stream)
                        done.synchronize()  # this thread's own wait: the loop's thread waits for nothing
                except Exception as e:
                    raise self._named(rows, e) from e
                if n:  # a thread's first batch may make the decoder
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
        crop_seed = _mixed(self.seed, self.epoch, self.shard.world_size, self.shard.rank)  # batch b's: mixed with b
        self.epoch += 1
        b = self.cfg.batch_size
        batches = [order[i:i + b] for i in range(0, len(order), b)]
        decoders = len(self.streams)
        # Each thread hands over in its own queue, taken in turn: the batches come in their order.
        outs = [queue.Queue(maxsize=max(1, self.cfg.depth // decoders)) for _ in range(decoders)]
        stop = threading.Event()
        workers = [threading.Thread(target=self._run, args=(k, batches, outs[k], stop, crop_seed), name=f"gpu-decode-{k}",
                                    daemon=True) for k in range(decoders)]
        self.workers, self.outs, self.stop = workers, outs, stop
        for worker in workers:
            worker.start()
        compute = torch.cuda.current_stream(self.device) if self.on_cuda else None
        try:
            for b in range(len(batches)):
                worker, out = workers[b % decoders], outs[b % decoders]
                while True:
                    try:
                        item = out.get(timeout=0.1)
                        break
                    except queue.Empty:
                        if not worker.is_alive() and out.empty():
                            raise RuntimeError("loader=gpu_decode's decoding thread ended without a word") from None
                if item is _DONE:  # (a thread stopped short: only at a stop, which ends the pass)
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
            if self.workers is workers:
                self._end_pass()
            else:  # a newer pass ended this one already
                stop.set()

    def _end_pass(self) -> None:
        """Stop the live pass's decoding threads and wait until they have exited (one may be waiting
        to hand over a batch). An interrupt meanwhile is raised once they have: a thread left
        running would go on decoding into the next pass's time."""
        workers, outs, stop = self.workers, self.outs, self.stop
        if not workers:
            return
        stop.set()
        interrupt = None
        for worker, out in zip(workers, outs):
            while worker.is_alive() and worker is not threading.current_thread():
                try:
                    try:
                        out.get(timeout=0.05)
                    except queue.Empty:
                        pass
                except BaseException as e:  # Ctrl-C or a stop signal: join first
                    interrupt = interrupt or e
        self.workers, self.outs, self.stop = [], [], None
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


def _mixed(*values: int) -> int:
    """A seed of its own for each tuple of values (the run's seed, the epoch, the ranks, the batch):
    each value folded in by SplitMix64's finaliser, so that neighbouring tuples, whose sums or
    low bits would coincide, give unrelated seeds (the CPU generator reads its seed's low 32 bits)."""
    mask, h = 2**64 - 1, CROP_SEED_SALT
    for value in values:
        h = (h ^ (value & mask)) * 0xBF58476D1CE4E5B9 & mask
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & mask
        h ^= h >> 31
    return h


def _crop_box(height: int, width: int, generator: torch.Generator) -> tuple:
    """`(top, left, h, w)`: the box torchvision's `RandomResizedCrop.get_params` draws (with
    `CROP_SCALE` and `CROP_RATIO`), drawn from `generator`: `get_params` takes none, and draws from
    torch's global RNG, which other threads draw from too."""
    area = height * width
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(*CROP_SCALE, generator=generator).item()
        aspect_ratio = torch.exp(torch.empty(1).uniform_(*CROP_LOG_RATIO, generator=generator)).item()
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, (1,), generator=generator))
            left = int(torch.randint(0, width - w + 1, (1,), generator=generator))
            return top, left, h, w
    in_ratio = width / height  # ten misses: the centre crop of the nearest ratio allowed
    if in_ratio < min(CROP_RATIO):
        w, h = width, int(round(width / min(CROP_RATIO)))
    elif in_ratio > max(CROP_RATIO):
        w, h = int(round(height * max(CROP_RATIO))), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def _crops_flipped(pictures: List[torch.Tensor], size: int, generator: torch.Generator) -> torch.Tensor:
    """uint8 images (each 3 x H x W): of each a random box, drawn as torchvision's RandomResizedCrop
    draws it, resized to size x size and flipped left to right half the time (RandomHorizontalFlip),
    the draws made on the host in the images' order (box, then flip). Every box has its own size, so
    the boxes of the images of one size are resized in one call of torchvision's `roi_align`: each
    output pixel the mean of ceil(box / size) x ceil(box / size) bilinear samples of its part of the
    box (an area filter: a shrunken crop is antialiased, if not bit for bit as `resize` does it).
    One image at a time took 128 resizes a batch, slower than the DataLoader's workers."""
    from torchvision.ops import roi_align

    boxes, flips = [], []
    for image in pictures:
        top, left, h, w = _crop_box(image.shape[1], image.shape[2], generator)
        boxes.append((left, top, left + w, top + h))
        flips.append(torch.rand(1, generator=generator).item() < 0.5)
    device = pictures[0].device
    x = torch.empty((len(pictures), 3, size, size), dtype=torch.uint8, device=device)
    by_shape = {}
    for k, image in enumerate(pictures):
        by_shape.setdefault(tuple(image.shape[1:]), []).append(k)
    groups = []
    for (height, width), ks in by_shape.items():  # as floats, at most CROP_CHUNK_BYTES of images at once
        step = max(1, CROP_CHUNK_BYTES // (3 * height * width * 4))
        groups += [ks[i:i + step] for i in range(0, len(ks), step)]
    for ks in groups:
        images = torch.stack([pictures[k] for k in ks]).float()
        # (index in `images`, x1, y1, x2, y2) in pixel edges: aligned=True reads pixel i as [i, i+1).
        rois = torch.tensor([(n, *boxes[k]) for n, k in enumerate(ks)], dtype=torch.float32).to(device, non_blocking=True)
        out = roi_align(images, rois, (size, size), spatial_scale=1.0, sampling_ratio=-1, aligned=True)
        flipped = [n for n, k in enumerate(ks) if flips[k]]
        if flipped:
            at = torch.tensor(flipped).to(device, non_blocking=True)
            out[at] = out[at].flip(-1)
        x[torch.tensor(ks).to(device, non_blocking=True)] = out.round_().clamp_(0, 255).to(torch.uint8)
    return x
