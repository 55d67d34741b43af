"""`loader=gpu_decode` on the CPU (its host path, tagged degraded), image folders larger than
`dataset.max_host_mb`, and the bad inputs of both. The GPU path: tests/test_gpu.py."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import compose_config
from datasets import build_dataset
from trainer.errors import ConfigError, RunFailed
from trainer.fake_data import write_image_folder
from trainer.loaders import build_loader
from trainer.loaders.order import epoch_order
from trainer.loop.run import run
from trainer.validate import resolve

QUICK = ["engine.device=cpu", "engine.progress=false", "engine.warmup_steps=1", "model=mlp", "model.hidden=8"]


def write_mixed(root, count: int = 40) -> None:
    """JPEGs and PNGs of several sizes in three class folders, every fifth grey-scale (JPEG and PNG)."""
    rng = np.random.default_rng(0)
    for i in range(count):
        h, w = (24 + 7 * (i % 5), 17 + 5 * (i % 4))
        pixels = rng.integers(0, 256, (h, w) if i % 5 == 0 else (h, w, 3), dtype=np.uint8)
        folder = root / f"class_{i % 3}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(folder / f"{i:03d}.{'png' if i % 2 else 'jpg'}", quality=90)


def write_ramps(root, count: int = 8, suffix: str = "png") -> None:
    """`count` copies of one image that brightens from left to right (64 x 48, 4 levels a column), in
    two class folders: a crop of it, resized, still brightens left to right, unless it was flipped."""
    ramp = np.repeat(np.repeat(np.arange(0, 256, 4, dtype=np.uint8)[None, :, None], 48, axis=0), 3, axis=2)
    for i in range(count):
        folder = root / f"class_{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(ramp).save(folder / f"{i:03d}.{suffix}", quality=95)


def mirrored(x: torch.Tensor) -> torch.Tensor:
    """Which ramp images of a batch (B x 3 x H x W) darken from left to right: the flipped ones."""
    return x[..., 0].mean((1, 2)) > x[..., -1].mean((1, 2))


def job(*overrides):
    cfg = compose_config(*QUICK, *overrides)
    resolve(cfg)
    return cfg


def passes(cfg, epochs: int = 2, device: str = "cpu"):
    """Every batch of `epochs` passes of the strategy `cfg` names, and its figures."""
    dataset = build_dataset(cfg.dataset)
    with build_loader(cfg.loader, dataset, torch.device(device), seed=cfg.engine.seed) as loader:
        batches = [b for _ in range(epochs) for b in loader]
    return batches, loader.figures()


@pytest.mark.parametrize("held", [True, False])
def test_gpu_decode_yields_baselines_images_in_baselines_order(tmp_path, held):
    """40 JPEGs and PNGs of five sizes, some grey-scale, resized to 16 px, shuffled, batches of 16
    (a short last one), two epochs: the same labels in the same order as `baseline`, the same
    shapes, and the pixels of the host path within one level of 255 of PIL's (both decode with
    libjpeg-turbo and libpng; the antialiased resizes round apart: 13% of the values here are one
    level off, none more). With the files held in memory or, past `dataset.max_host_mb`, read from
    disk batch after batch."""
    write_mixed(tmp_path / "images")
    folder = ["dataset=image_folder", f"dataset.root={tmp_path / 'images'}", "dataset.size=16", "loader.batch_size=16"]
    limit = [] if held else ["dataset.max_host_mb=0.001"]
    base, _ = passes(job(*folder, "loader=baseline"))
    mine, figures = passes(job(*folder, *limit, "loader=gpu_decode", "loader.threads=3"))
    assert [len(y) for _, y in mine] == [len(y) for _, y in base] == [16, 16, 8] * 2
    for (x, y), (bx, by) in zip(mine, base):
        assert x.shape == bx.shape and x.dtype == bx.dtype == torch.float32 and torch.equal(y, by)
    levels = (torch.cat([x for x, _ in mine]) - torch.cat([x for x, _ in base])).abs() * 255
    assert levels.max() < 1.001 and 0.05 < (levels > 0.5).float().mean() < 0.2
    assert not torch.equal(base[0][1], base[3][1])  # each epoch shuffled anew
    assert figures["gpu_decoded_fraction"] == 0.0  # a CPU: every image decoded on the host
    assert (figures["held_file_mb"] > 0) == held


def test_a_folder_larger_than_max_host_mb_streams_and_trains(tmp_path, runs, tracking_uri):
    """A generated folder of 300 JPEGs of 48 px (about 0.47 MiB of files, 0.9 MiB decoded at 32 px)
    with `dataset.max_host_mb=0.3`: gpu_decode trains, reading its files from disk; a one-block
    strategy refuses in one line naming what to use instead."""
    folder = write_image_folder(tmp_path, 300, size=48)
    images = ["dataset=image_folder", f"dataset.root={folder}", "dataset.size=32", "dataset.max_host_mb=0.3",
              "loader.batch_size=32", f"tracking.uri={tracking_uri}"]
    summary = run(job(*images, "loader=gpu_decode", "engine.max_steps=12"))
    (r,) = runs()
    assert r.info.status == "FINISHED" and r.data.tags["degraded"] == "true"
    assert summary["total_steps"] == 12 and summary["held_file_mb"] == 0.0
    assert summary["total_samples"] == 9 * 32 + 12 + 2 * 32  # an epoch of 300 ends with a batch of 12
    for strategy in ("pinned_chunk", "gpu_resident", "iterable_chunks"):  # refused before they allocate anything
        with pytest.raises(ConfigError, match=rf"^dataset=image_folder decoded is 0\.9 MiB \(300 images of 3x32x32 uint8\), "
                                              rf"over dataset\.max_host_mb=0\.3, and loader={strategy} holds it whole: "
                                              r"use loader=gpu_decode") as refused:
            run(job(*images, f"loader={strategy}", "tracking.experiment=one_block"))
        assert refused.value.fits == 102  # 0.3 MiB holds 102 images of 3 KiB: the advisor's ceiling reads those


@pytest.mark.parametrize("strategy, where", [
    ("baseline", "host, every epoch (the loop's process)"), ("prefetch", "host, every epoch (2 DataLoader workers)"),
    ("pinned_chunk", "host, once at setup"), ("gpu_decode", "host, every epoch (the strategy's threads)")])
def test_every_image_run_says_where_its_pixels_were_decoded_and_what_one_costs_the_host(tmp_path, runs, tracking_uri,
                                                                                        strategy, where):
    """An image folder's run, whatever its strategy: the tag `pixels_decoded`, and the host's time to
    decode one image as the DataLoader's workers do (on a CPU no link, so no link bytes); other
    datasets have neither."""
    folder = write_image_folder(tmp_path, 48, size=32)
    workers = ["loader.num_workers=2"] if strategy == "prefetch" else []
    summary = run(job("dataset=image_folder", f"dataset.root={folder}", "dataset.size=16", f"loader={strategy}",
                      *workers, "loader.batch_size=8", "engine.max_steps=6", f"tracking.uri={tracking_uri}"))
    (r,) = runs()
    assert r.data.tags["pixels_decoded"] == where
    assert 0 < summary["host_decode_ms_per_image"] < 1000 and "link_bytes_per_image" not in summary
    other = run(job("loader=baseline", "dataset.num_samples=32", "dataset.shape=[4,4]", "loader.batch_size=8",
                    "engine.max_steps=4", f"tracking.uri={tracking_uri}", "tracking.experiment=synthetic"))
    assert "host_decode_ms_per_image" not in other


def test_gpu_decode_needs_an_image_folder():
    with pytest.raises(ConfigError, match=r"^loader=gpu_decode decodes image files and dataset=synthetic has none: "
                                          r"use dataset=image_folder"):
        passes(job("loader=gpu_decode", "dataset.num_samples=32", "dataset.shape=[4,4]"))


def test_a_file_gpu_decode_cannot_decode_is_named_in_one_line(tmp_path, runs, tracking_uri):
    write_mixed(tmp_path / "images", count=12)
    broken = tmp_path / "images" / "class_0" / "005.jpg"
    broken.write_bytes(b"\xff\xd8 not a JPEG after all" * 4)
    cfg = job("dataset=image_folder", f"dataset.root={tmp_path / 'images'}", "dataset.size=8", "loader=gpu_decode",
              "loader.batch_size=4", "loader.shuffle=false", f"tracking.uri={tracking_uri}")
    with pytest.raises(RunFailed, match=rf"^{broken} could not be decoded \(RuntimeError: Unsupported image file\. .*\): "
                                        r"loader=gpu_decode decodes JPEG, PNG, WebP and GIF files: convert or remove it, "
                                        r"or use loader=prefetch \(PIL decodes more formats\)$"):
        run(cfg)
    assert runs()[0].info.status == "FAILED"


def test_a_16_bit_png_is_scaled_to_8_bits_where_pil_clips_it(tmp_path):
    """A 16-bit grey PNG: gpu_decode scales it to 8 bits (torchvision's `to_dtype(..., scale=True)`,
    the value's high byte, within a level), where the DataLoader path's PIL conversion to RGB
    clips every value above 255 to 255: the one image kind on which the two paths differ by more
    than rounding."""
    (tmp_path / "images" / "a").mkdir(parents=True)
    pixels = np.arange(16 * 16, dtype=np.uint16).reshape(16, 16) * 200
    Image.fromarray(pixels).save(tmp_path / "images" / "a" / "deep.png")
    folder = ["dataset=image_folder", f"dataset.root={tmp_path / 'images'}", "dataset.size=16", "loader.batch_size=1"]
    (mine, _), = passes(job(*folder, "loader=gpu_decode"), epochs=1)[0]
    (base, _), = passes(job(*folder, "loader=baseline"), epochs=1)[0]
    high = torch.from_numpy((pixels >> 8).astype(np.float32))
    assert ((mine[0] * 255 - high).abs() <= 1).all() and torch.equal(mine[0][0], mine[0][2])  # grey: R = G = B
    assert torch.equal(base[0] * 255, torch.from_numpy(np.minimum(pixels, 255).astype(np.float32)).expand(3, 16, 16))


def test_a_pass_left_unfinished_and_close_leave_no_thread_and_a_closed_loader_says_so(tmp_path):
    write_mixed(tmp_path / "images", count=24)
    cfg = job("dataset=image_folder", f"dataset.root={tmp_path / 'images'}", "dataset.size=8", "loader=gpu_decode",
              "loader.batch_size=2", "loader.depth=1", "loader.decoders=3")
    loader = build_loader(cfg.loader, build_dataset(cfg.dataset), torch.device("cpu"))
    first = iter(loader)
    next(first)  # the decoding thread now waits to hand over the next batch
    assert len(list(loader)) == 12  # a new pass ends the one left unfinished, and runs whole
    next(iter(loader))
    loader.close()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("gpu-decode")]
    with pytest.raises(RuntimeError, match=r"^loader=gpu_decode is closed: build a new loader to iterate again$"):
        next(iter(loader))


def test_max_host_mb_is_checked():
    with pytest.raises(ConfigError, match=r"^dataset\.max_host_mb must be >= 0 \(got -1.0\): set dataset\.max_host_mb=0 "):
        build_dataset(job("dataset=image_folder", "dataset.root=/tmp", "dataset.max_host_mb=-1").dataset)


def test_fake_data_writes_an_image_folder_once(tmp_path, capsys):
    from trainer import fake_data

    assert fake_data.main(["--images", "23", "--size", "20", "--root", str(tmp_path)]) == 0
    folder = tmp_path / "images-20-23"
    assert capsys.readouterr().out.startswith(f"wrote 23 JPEGs of 20x20 (random shapes, 10 classes) in {folder}")
    files = sorted(folder.glob("class_*/*.jpg"))
    assert len(files) == 23 and len({f.parent for f in files}) == 10 and not list(folder.glob("*/*.part"))
    dataset = build_dataset(job("dataset=image_folder", f"dataset.root={folder}", "dataset.size=20").dataset)
    assert (len(dataset), dataset.num_classes) == (23, 10)
    stamps = [f.stat().st_mtime_ns for f in files]
    assert fake_data.write_image_folder(tmp_path, 23, size=20) == folder  # all there: not written again
    assert [f.stat().st_mtime_ns for f in files] == stamps
    assert fake_data.main(["--images", "-1"]) == 2
    assert capsys.readouterr().err == "error: --images must be >= 0 and --size >= 1 (got -1, 224): use --images 1000 --size 224\n"


@pytest.mark.parametrize("strategy", ["baseline", "pinned", "prefetch"])
def test_uint8_batches_give_the_same_floats_from_a_quarter_of_the_bytes(tmp_path, strategy):
    """`dataset.batch_dtype=uint8`: the DataLoader's batches are the decoded uint8 images, made
    float after the copy (timm's fast_collate): the same floats, bit for bit, in the same order;
    and Lightning may not copy them itself (no host batches: the strategy finishes them)."""
    write_mixed(tmp_path / "images", count=20)
    folder = ["dataset=image_folder", f"dataset.root={tmp_path / 'images'}", "dataset.size=16", "loader.batch_size=8",
              f"loader={strategy}"]
    floats, _ = passes(job(*folder))
    small, _ = passes(job(*folder, "dataset.batch_dtype=uint8"))
    assert len(small) == len(floats) == 6
    for (x, y), (fx, fy) in zip(small, floats):
        assert x.dtype == torch.float32 and torch.equal(x, fx) and torch.equal(y, fy)
    cfg = job(*folder, "dataset.batch_dtype=uint8")
    with build_loader(cfg.loader, build_dataset(cfg.dataset), torch.device("cpu")) as loader:
        (host_x, _), = [next(iter(loader.dataloader))]
        assert host_x.dtype == torch.uint8 and loader.host_batches() is None


def test_a_batch_dtype_that_is_neither_is_one_line():
    with pytest.raises(ConfigError, match=r"^dataset\.batch_dtype must be one of float32, uint8 \(got 'int8'\): "
                                          r"set dataset\.batch_dtype=uint8 \(made float on the device\) or float32$"):
        build_dataset(job("dataset=image_folder", "dataset.root=/tmp", "dataset.batch_dtype=int8").dataset)


def test_uint8_batches_train_under_lightning_copied_by_the_strategy(tmp_path, runs, tracking_uri):
    write_mixed(tmp_path / "images", count=12)
    summary = run(job("dataset=image_folder", f"dataset.root={tmp_path / 'images'}", "dataset.size=8",
                      "dataset.batch_dtype=uint8", "loader=pinned", "loader.batch_size=4", "engine.loop=lightning",
                      "engine.max_steps=4", f"tracking.uri={tracking_uri}"))
    (r,) = runs()
    assert r.info.status == "FINISHED" and r.data.tags["loop"] == "lightning" and summary["total_steps"] == 4


# -- dataset.augment=crop_flip ---------------------------------------------------------------------
CROP_FLIP_PATHS = [["loader=baseline"], ["loader=prefetch", "dataset.batch_dtype=uint8", "loader.num_workers=2"],
                   ["loader=gpu_decode", "loader.threads=2"]]


@pytest.mark.parametrize("strategy", CROP_FLIP_PATHS, ids=lambda s: " ".join(s))
def test_crop_flip_draws_new_crops_each_epoch_in_baselines_order(tmp_path, strategy):
    """40 JPEGs and PNGs of five sizes, shuffled, two epochs, crop_flip: every batch 16 px square
    floats in [0, 1], with baseline's labels (no augmentation) in baseline's order; and each
    image's pixels differ from one epoch to the next (new crops and flips, not the fixed resize)."""
    write_mixed(tmp_path / "images")
    folder = ["dataset=image_folder", f"dataset.root={tmp_path / 'images'}", "dataset.size=16", "loader.batch_size=16"]
    base, _ = passes(job(*folder, "loader=baseline"))
    cfg = job(*folder, "dataset.augment=crop_flip", *strategy)
    mine, _ = passes(cfg)
    assert [y.tolist() for _, y in mine] == [y.tolist() for _, y in base]
    for (x, _), (bx, _) in zip(mine, base):
        assert x.shape == bx.shape and x.dtype == torch.float32 and 0 <= x.min() and x.max() <= 1
    first, second = (torch.cat([x for x, _ in mine[e * 3:e * 3 + 3]]) for e in (0, 1))
    by_sample = [torch.empty_like(first) for _ in range(2)]
    for epoch, (x, out) in enumerate(zip((first, second), by_sample)):
        out[epoch_order(40, True, cfg.engine.seed, epoch)] = x  # back into the folder's order
    assert all(not torch.equal(a, b) for a, b in zip(*by_sample))
    assert not torch.equal(first, torch.cat([x for x, _ in base[:3]]))  # not the fixed resize either


@pytest.mark.parametrize("strategy", [["loader=baseline"], ["loader=gpu_decode"]], ids=lambda s: s[0])
def test_crop_flip_flips_about_half_the_images(tmp_path, strategy):
    """A PNG ramp, brightening left to right, 8 times, over 6 epochs: cropped and resized it still
    brightens or darkens across every row, and both come out (flipped about half the time)."""
    torch.manual_seed(0)  # the DataLoader path draws from torch's global RNG (its workers' when it has some)
    write_ramps(tmp_path / "ramps")
    cfg = job("dataset=image_folder", f"dataset.root={tmp_path / 'ramps'}", "dataset.size=16", "loader.batch_size=8",
              "dataset.augment=crop_flip", *strategy)
    x = torch.cat([x for x, _ in passes(cfg, epochs=6)[0]])
    steps = x.diff(dim=-1)
    flipped = mirrored(x)
    assert ((steps <= 0).flatten(1).all(1) == flipped).all() and ((steps >= 0).flatten(1).all(1) == ~flipped).all()
    assert 8 <= flipped.sum() <= 40  # of 48: about half


def test_crop_flip_on_gpu_decode_is_the_same_for_the_same_seed(tmp_path):
    """Two gpu_decode loaders of one seed draw the same crops and flips, epoch after epoch (their own
    generator, not torch's global one, which is drawn from between them), with one decoding thread
    or three taking the batches in turn; another seed does not."""
    write_mixed(tmp_path / "images", count=20)
    folder = ["dataset=image_folder", f"dataset.root={tmp_path / 'images'}", "dataset.size=16", "loader.batch_size=8",
              "dataset.augment=crop_flip", "loader=gpu_decode"]
    one, _ = passes(job(*folder, "loader.decoders=1"))
    torch.rand(100)
    two, _ = passes(job(*folder, "loader.decoders=3"))
    other, _ = passes(job(*folder, "engine.seed=1"))
    assert len(one) == len(two) == 6
    assert all(torch.equal(x, tx) and torch.equal(y, ty) for (x, y), (tx, ty) in zip(one, two))
    assert not torch.equal(torch.cat([x for x, _ in one]), torch.cat([x for x, _ in other]))


def test_every_batch_of_every_epoch_and_rank_draws_its_crops_from_a_seed_of_its_own():
    """The crop seeds of neighbouring epochs, ranks and batches (whose sums coincide: epoch 1's batch
    0 and epoch 0's batch 1) are all apart, in the low 32 bits the CPU generator reads as well."""
    from trainer.loaders.gpu_decode import _mixed

    seeds = [_mixed(_mixed(0, epoch, 2, rank), batch) for epoch in range(4) for rank in range(2) for batch in range(64)]
    assert len(set(seeds)) == len({s & 0xFFFFFFFF for s in seeds}) == 4 * 2 * 64


def test_gpu_decodes_crop_boxes_are_torchvisions_drawn_from_its_own_generator():
    """The box gpu_decode crops is the one torchvision's RandomResizedCrop (the DataLoader path's)
    draws from the same RNG state: on images where a box fits at once, and on ones so narrow that
    its ten tries miss and it falls back to a centre crop."""
    from datasets.image_folder import CROP_RATIO, CROP_SCALE
    from torchvision.transforms import RandomResizedCrop
    from trainer.loaders.gpu_decode import _crop_box

    for height, width in [(48, 64), (31, 17), (224, 224), (10, 200), (3, 500)]:
        image = torch.zeros(3, height, width)
        for seed in range(200):
            torch.manual_seed(seed)  # torchvision draws from torch's global RNG
            expected = RandomResizedCrop.get_params(image, list(CROP_SCALE), list(CROP_RATIO))
            assert _crop_box(height, width, torch.Generator().manual_seed(seed)) == expected


def test_the_crops_of_a_batch_are_resized_together_as_resize_would_one_by_one():
    """The batch's crops, resized in one call (roi_align, an area filter), against each crop resized
    alone by torchvision's antialiased resize, on smooth images of two sizes: the same boxes and
    flips (drawn in the images' order), the same pixels within a level of 255 (on noise, whose
    detail the two filters weigh apart, they differ by 6.6 levels on average)."""
    from torchvision.transforms.v2 import functional as F
    from trainer.loaders.gpu_decode import _crop_box, _crops_flipped

    def smooth(h, w):
        y, x = torch.meshgrid(torch.linspace(0, 1, h), torch.linspace(0, 1, w), indexing="ij")
        return (torch.stack([x, y, (x + y) / 2]) * 255).round().to(torch.uint8)

    pictures = [smooth(90, 120) if k % 3 else smooth(64, 48) for k in range(12)]
    batch = _crops_flipped(pictures, 32, torch.Generator().manual_seed(7))
    draws, flips = torch.Generator().manual_seed(7), 0
    for image, got in zip(pictures, batch):
        top, left, h, w = _crop_box(image.shape[1], image.shape[2], draws)
        expected = F.resize(image[None, :, top:top + h, left:left + w], [32, 32], antialias=True)[0]
        if torch.rand(1, generator=draws).item() < 0.5:
            expected, flips = expected.flip(-1), flips + 1
        assert (got.int() - expected.int()).abs().max() <= 1
    assert 0 < flips < 12


def test_crop_flip_is_refused_by_a_one_block_strategy(tmp_path):
    write_mixed(tmp_path / "images", count=8)
    folder = ["dataset=image_folder", f"dataset.root={tmp_path / 'images'}", "dataset.size=16", "loader.batch_size=4",
              "dataset.augment=crop_flip"]
    for strategy in ("pinned_chunk", "gpu_resident"):
        with pytest.raises(ConfigError, match=rf"^dataset\.augment=crop_flip crops every image afresh at every epoch, "
                                              rf"and loader={strategy} holds each image decoded once, resized to 16x16: "
                                              r"use loader=gpu_decode or a DataLoader strategy \(loader=baseline, "
                                              r"pinned or prefetch\), or dataset\.augment=none$"):
            passes(job(*folder, f"loader={strategy}"))


def test_an_augment_that_is_neither_is_one_line():
    with pytest.raises(ConfigError, match=r"^dataset\.augment must be one of none, crop_flip \(got 'flip'\): "
                                          r"set dataset\.augment=crop_flip \(random crop and flip\) or none$"):
        build_dataset(job("dataset=image_folder", "dataset.root=/tmp", "dataset.augment=flip").dataset)
