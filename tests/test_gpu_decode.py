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
                                              r"use loader=gpu_decode"):
            run(job(*images, f"loader={strategy}", "tracking.experiment=one_block"))


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
              "loader.batch_size=2", "loader.depth=1")
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
