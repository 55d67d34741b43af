"""`pinned_uva`: baseline's per-sample order, gathered by the GPU straight out of page-locked memory.

On the CPU: the order (baseline's batches, every epoch, shards, drop_last, no shuffle), the
checksums of a run, the config checks, the ring of device slots driven through stand-ins for the
CUDA calls, and the kernel itself under Triton's interpreter. On a GPU (marked `gpu`): the kernel
against `X[idx]`, and the loader against baseline with slow, jittered and graphed steps.
"""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from datasets import build_dataset
from trainer.errors import ConfigError
from trainer.loaders import build_loader, pinned_uva
from trainer.loaders.order import Shard, epoch_shard
from trainer.loop.run import run
from trainer.loop.verify import Checksum

from conftest import TINY, compose_config


def loaders(*overrides, seed=0, shard=Shard(), device="cpu"):
    """(baseline on the CPU, pinned_uva on `device`) over the same data, seeded alike."""
    made = []
    for strategy, where in (("baseline", "cpu"), ("pinned_uva", device)):
        cfg = compose_config(*TINY, f"loader={strategy}", *overrides)
        made.append(build_loader(cfg.loader, build_dataset(cfg.dataset), torch.device(where), seed=seed, shard=shard))
    return made


def assert_same_batches(base, uva, epochs: int = 3) -> int:
    """Every epoch of `uva` equals `base`'s, batch for batch, bit for bit; returns the batches seen."""
    seen = 0
    for _ in range(epochs):
        expected = list(base)
        count = 0
        for (xe, ye), (xu, yu) in zip(expected, uva):
            assert xu.dtype == xe.dtype == torch.float32  # uint8 became model input after the gather
            assert torch.equal(xu.cpu(), xe) and torch.equal(yu.cpu(), ye), count
            count += 1
        assert count == len(expected) == len(uva)
        seen += count
    return seen


# -- the order, on the CPU (the degraded path) -------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 7])
@pytest.mark.parametrize("dtype", ["float32", "uint8"])
@pytest.mark.parametrize("shuffle,drop_last", [("true", "false"), ("true", "true"), ("false", "false")])
def test_yields_baselines_batches_every_epoch(seed, dtype, shuffle, drop_last):
    base, uva = loaders(f"dataset.dtype={dtype}", f"loader.shuffle={shuffle}", f"loader.drop_last={drop_last}",
                        "loader.batch_size=20", "dataset.chunks=3", seed=seed)
    with base, uva:
        assert uva.degraded  # no CUDA here: the CPU path, tagged degraded by the run
        assert assert_same_batches(base, uva) == 3 * (4 if drop_last == "true" else 5)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_each_rank_yields_baselines_share(world_size):
    shares = []
    for rank in range(world_size):
        base, uva = loaders("loader.batch_size=7", seed=3, shard=Shard(rank, world_size))
        with base, uva:
            assert uva.batches_per_rank() == base.batches_per_rank()
            assert_same_batches(base, uva, epochs=2)
            shares += [x for x, _ in uva]  # epoch 2 of this rank
    # the ranks together cover epoch 2 once: every sample exactly once
    data = build_dataset(compose_config(*TINY).dataset).materialize()
    rows = sorted(torch.cat(shares).flatten(1).tolist())
    assert rows == sorted(data[epoch_shard(96, True, 3, 2, Shard(), 7, False)].flatten(1).tolist())


def test_run_checksums_equal_baselines(tiny_cfg, runs):
    """Through `run`: 2 epochs, shuffled, a partial last batch, data in 3 chunks."""
    for strategy in ("baseline", "pinned_uva"):
        run(tiny_cfg(f"loader={strategy}", "engine.verify=true", "engine.epochs=2", "dataset.chunks=3",
                     "loader.batch_size=20"))
    found = {r.data.tags["strategy"]: (r.data.tags["data_checksum"], r.data.tags["epoch_checksums"],
                                       r.data.tags["verified_batches"]) for r in runs()}
    assert found["pinned_uva"] == found["baseline"] and found["baseline"][2] == "10", found
    degraded = {r.data.tags["strategy"]: r.data.tags["degraded"] for r in runs()}
    assert degraded == {"baseline": "false", "pinned_uva": "true"}


@pytest.mark.parametrize("key, value, message", [
    ("depth", 0, r"^loader\.depth must be >= 1 \(got 0\): set loader\.depth=2$"),
    ("ctas", -1, r"^loader\.ctas must be >= 0 \(got -1\): set loader\.ctas=0 \(chosen from the row size and the step\)$")])
def test_rejects_no_depth_or_negative_ctas(key, value, message):
    cfg = compose_config(*TINY, "loader=pinned_uva", f"loader.{key}={value}")
    with pytest.raises(ConfigError, match=message):
        build_loader(cfg.loader, build_dataset(cfg.dataset), torch.device("cpu"))


def test_gather_blocks_follow_the_row_size():
    """`loader.ctas=0` (the default): enough blocks for 128 KiB of reads in flight, 4 to 32."""
    pytest.importorskip("triton")
    from trainer.loaders.uva_gather import auto_ctas
    assert auto_ctas(256 << 10) == 4  # the reference workload's rows: the link's rate with 4 (H100)
    assert auto_ctas(32 << 10) == 4  # a block reads 32 KiB at a time: bigger rows need no more blocks
    assert auto_ctas(16 << 10) == 8
    assert auto_ctas(3 * 32 * 32) == 32  # CIFAR's uint8 images: 43 wanted, the most is 32
    assert auto_ctas(28 * 28 * 4) == 32 and auto_ctas(1) == 32
    assert compose_config(*TINY, "loader=pinned_uva").loader.ctas == 0


def test_an_iterator_never_read_leaves_the_epoch_alone():
    """Lightning makes iterators it never reads: only a pass that yields a batch is an epoch."""
    base, uva = loaders()
    with base, uva:
        iter(uva)
        assert_same_batches(base, uva, epochs=1)


def test_after_an_abandoned_pass_serves_the_next_epoch():
    base, uva = loaders("loader.batch_size=8")
    with base, uva:
        for it in (iter(base), iter(uva)):
            for _ in range(3):
                next(it)
            it.close()  # e.g. engine.max_steps reached mid-epoch
        assert_same_batches(base, uva, epochs=1)


# -- the ring of device slots, driven through stand-ins for the CUDA calls ----------------------------------
class _Clock:
    """Steps the consumer has 'queued' on the compute stream so far."""

    def __init__(self):
        self.stepped = 0


class _Stream:
    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass

    def synchronize(self):
        pass


class _Event:
    def __init__(self, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def query(self):
        return True

    def elapsed_time(self, end):
        return 0.0

    def synchronize(self):
        pass


class _Consumed(_Event):
    """A slot's `consumed` event: recording it says the step on the slot's last batch is queued."""

    def __init__(self, slot, clock, handed):
        self.slot, self.clock, self.handed = slot, clock, handed

    def record(self, stream=None):
        last = self.handed.get(self.slot)
        assert last is None or last < self.clock.stepped, (self.slot, last, self.clock.stepped)


class _EagerGather:
    """The kernel's stand-in: writes the rows at once, as a GPU that runs ahead of everything would."""

    ctas = 4

    def __init__(self, x, y):
        self.x, self.y = x, y

    def lanes(self, t):
        return t

    def __call__(self, idx, out, out_labels):
        out[:len(idx)] = self.x[idx]
        out_labels[:len(idx)] = self.y[idx]


def _fake_device_loader(monkeypatch, *overrides, seed=0):
    """pinned_uva's CUDA path on the CPU: streams and events are stand-ins, the kernel writes at once.
    Returns (loader, clock, handed: slot -> the last batch number handed out of it)."""
    cfg = compose_config(*TINY, "loader=pinned_uva", *overrides)
    loader = build_loader(cfg.loader, build_dataset(cfg.dataset), torch.device("cpu"), seed=seed)
    compute = _Stream()
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _Stream())
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(pinned_uva, "check_gpu_fits", lambda *args: None)
    monkeypatch.setattr(pinned_uva, "_kernel", lambda x, y, *args: (_EagerGather(x, y), None))
    loader._setup_device(min(cfg.loader.batch_size, len(loader.x)))
    loader._upload = lambda order: order
    loader.on_cuda = True
    clock, handed = _Clock(), {}
    if loader.graph_feed is None:  # the ring
        loader.consumed = [_Consumed(s, clock, handed) for s in range(loader.num_slots)]
    return loader, clock, handed


@pytest.mark.parametrize("depth", [1, 2, 4])
@pytest.mark.parametrize("ahead", [0, 1])
def test_ring_never_refills_a_slot_whose_step_is_not_queued(monkeypatch, depth, ahead):
    """A consumer that asks for `ahead` batches before queuing the step on one (Lightning's fetcher:
    1) reads every batch intact when its step runs, over epochs, an abandoned pass and a partial
    last batch; no slot's `consumed` event is recorded before that step is queued."""
    base, _ = loaders("loader.batch_size=12", seed=5)
    loader, clock, handed = _fake_device_loader(monkeypatch, "loader.batch_size=12", f"loader.depth={depth}", seed=5)
    assert loader.num_slots == depth + 2
    slots = [x.data_ptr() for x, _ in loader.slots]
    expected = []
    for epoch in range(4):
        batches = list(base)
        expected += batches[:3] if epoch == 1 else batches
    got, held = [], []

    def step(batch, number):  # the step reads its batch: compare now, when the 'device' would run it
        x, y = batch
        got.append((x.clone(), y.clone()))
        clock.stepped = number + 1

    number = 0
    for epoch in range(4):
        it = iter(loader)
        for i, batch in enumerate(it):
            slot = loader.held[-1]
            handed[slot] = number
            assert batch[0].data_ptr() == slots[slot]  # a view of its slot, not a copy
            held.append((batch, number))
            if len(held) > ahead:
                step(*held.pop(0))
            number += 1
            if epoch == 1 and i == 2:
                break
        if epoch == 1:
            it.close()
    for batch in held:
        step(*batch)
    assert len(got) == len(expected)
    for (xg, yg), (xe, ye) in zip(got, expected):
        assert torch.equal(xg, xe) and torch.equal(yg, ye)
    assert [x.data_ptr() for x, _ in loader.slots] == slots  # 4 epochs through depth + 2 slots made once


def test_ring_gathers_the_next_epoch_ahead(monkeypatch):
    loader, _, _ = _fake_device_loader(monkeypatch, "loader.batch_size=16", "loader.depth=2")
    batches = list(loader)
    assert len(batches) == 6
    # the last batch is handed out with the next epoch's first two already gathered
    assert [p[:2] for p in loader.pending] == [(1, 0), (1, 1)]


# -- the gather inside the step's graph (loader.gather_in_graph), driven through the same stand-ins ---------
def test_graph_feed_yields_baselines_batches_whether_a_replay_or_the_loader_places_them(monkeypatch):
    """The feed's work run eagerly, as a replay runs it (`beside()` then `replayed()`) or as the
    loader places a batch no replay did, at random, over epochs and an abandoned pass: every batch
    is `baseline`'s, in order, and x, y are the same two tensors throughout (what a graph reads)."""
    over = ("loader.batch_size=12", "loader.drop_last=true", "dataset.dtype=uint8")
    base = build_loader(compose_config(*TINY, "loader=baseline", *over).loader,
                        build_dataset(compose_config(*TINY, *over).dataset), torch.device("cpu"), seed=5)
    loader, _, _ = _fake_device_loader(monkeypatch, *over, "loader.gather_in_graph=true", seed=5)
    feed, pick = loader.graph_feed, random.Random(0)
    assert feed is not None and not hasattr(loader, "slots")  # no ring
    expected, got = [], []
    for epoch in range(5):
        batches = list(base)
        expected += batches[:3] if epoch == 2 else batches
        it = iter(loader)
        for i, (x, y) in enumerate(it):
            assert x is feed.x and y is feed.y and x.dtype == torch.float32
            got.append((x.clone(), y.clone()))  # what the step reads
            if pick.random() < 0.7:  # a replay: the step, and the next batch gathered beside it
                with feed.beside():
                    pass
                feed.replayed()
            if epoch == 2 and i == 2:
                it.close()  # abandoned: the next pass starts its epoch anew
                break
    assert len(got) == len(expected) == 4 * 8 + 3
    for n, ((xg, yg), (xe, ye)) in enumerate(zip(got, expected)):
        assert torch.equal(xg, xe) and torch.equal(yg, ye), n


def test_gather_in_graph_refuses_a_partial_batch_and_an_eager_step(tiny_cfg):
    cfg = compose_config(*TINY, "loader=pinned_uva", "loader.gather_in_graph=true", "loader.batch_size=20")
    with pytest.raises(ConfigError, match=r"^loader\.gather_in_graph=true captures the gather of full batches, but an "
                                          r"epoch of this run ends with a batch of 16 samples, not 20: set "
                                          r"loader\.drop_last=true, or loader\.gather_in_graph=false$"):
        build_loader(cfg.loader, build_dataset(cfg.dataset), torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"^loader\.gather_in_graph=true captures the next batch's gather in the step's "
                                          r"CUDA graph, and this step has none: set engine\.cuda_graph=true, or "
                                          r"loader\.gather_in_graph=false$"):
        run(tiny_cfg("loader=pinned_uva", "loader.gather_in_graph=true", "loader.drop_last=true"))


class _SimEvent:
    """A timing event whose time is set when it is recorded, by its stream's clock."""

    def __init__(self, **kwargs):
        self.t = 0.0

    def record(self, stream):
        self.t = stream.now()

    def query(self):
        return True

    def elapsed_time(self, end):
        return end.t - self.t


class _SimStreams:
    """A side stream that gathers a batch in `gather_ms(blocks)` and a compute stream whose step
    takes `step_ms`, `depth` batches apart, as the ring queues them: when each batch's gather ends
    and when the step is ready for it."""

    def __init__(self, gather, step_ms, gather_ms, depth=2):
        self.gather, self.step_ms, self.gather_ms, self.depth = gather, step_ms, gather_ms, depth
        self.ready, self.needed = [], []  # per batch

    def gathered(self):  # batch len(ready) gathered after the one before it, and after its slot was free
        k = len(self.ready)
        free = self.needed[k - self.depth - 1] + self.step_ms if k > self.depth else 0.0
        start = max(self.ready[-1] if self.ready else 0.0, free)
        self.ready.append(start + self.gather_ms(self.gather.ctas))
        return self.ready[-1]

    def wants(self):  # the step is ready for batch len(needed) when the one before it is done
        k = len(self.needed)
        self.needed.append(max(self.needed[-1], self.ready[k - 1]) + self.step_ms if k else 0.0)
        return self.needed[-1]


@pytest.mark.parametrize("step_ms, expected", [(0.0, 8), (0.6, 4), (0.2, 8), (0.1, 8)])
def test_block_tuning_doubles_the_blocks_while_the_step_waits_for_its_gather(monkeypatch, step_ms, expected):
    """A gather of 16.8 MB at min(50, 10 * blocks) GB/s (near what an H100 measured with 256 KiB
    rows: 39 GB/s on 2 blocks, 50 on 4 or more) beside a step of `step_ms`. A 0.6 ms step never
    waits for 4 blocks' gather (0.42 ms): they stay. A copy-only step (0 ms), or one of 0.1 or 0.2
    ms, waits for any gather: 8 blocks (the link's rate, 0.34 ms) are faster than 4; 16 are not,
    and are taken back."""
    monkeypatch.setattr(torch.cuda, "Event", _SimEvent)
    gather = _EagerGather(None, None)
    sim = _SimStreams(gather, step_ms, lambda blocks: 16.8 / min(50.0, 10.0 * blocks))
    side, compute = type("Side", (), {"now": lambda self: sim.ready[-1] if sim.ready else 0.0})(), \
        type("Compute", (), {"now": lambda self: sim.needed[-1] if sim.needed else 0.0})()
    tuning = pinned_uva.BlockTuning(gather, side, compute)
    chosen = None
    for k in range(400):
        while len(sim.ready) < k + 3:  # the ring gathers `depth` batches ahead of the step
            sim.gathered()
            tuning.gathered(side)
        sim.wants()
        if tuning.needed(compute):
            chosen = k
            break
    assert gather.ctas == expected and chosen is not None


def test_more_blocks_only_when_the_step_waited():
    assert pinned_uva.more_blocks(4, 32, [0.2] * 5, [0.5] * 5, 0.1) == 8
    assert pinned_uva.more_blocks(16, 32, [0.2] * 5, [0.5] * 5, 0.1) == 32
    assert pinned_uva.more_blocks(32, 32, [0.2] * 5, [0.5] * 5, 0.1) == 32
    assert pinned_uva.more_blocks(4, 32, [0.01] * 5, [0.5] * 5, 0.1) == 4  # waits of 2%: the step sets the pace
    assert pinned_uva.more_blocks(4, 32, [0.0] * 5, [0.0] * 5, 0.1) == 4


# -- the kernel under Triton's interpreter (CPU) ----------------------------------------------------------
_INTERPRETED = textwrap.dedent("""
    import torch
    from trainer.loaders.uva_gather import RowGather
    n = 29
    for dtype, shape in [(torch.float32, (5, 7)), (torch.uint8, (3, 5)), (torch.float32, (4, 8))]:
        x = (torch.rand(n, *shape) * 200).to(dtype)
        y = torch.randint(0, 10, (n,))
        for ctas in (1, 4, 32):
            g = RowGather(x, y, ctas)
            idx = torch.randperm(n)[:11]
            out, out_y = torch.zeros(12, *shape, dtype=dtype), torch.zeros(12, dtype=torch.int64)
            g(idx, g.lanes(out), out_y)
            assert torch.equal(out[:11], x[idx]) and torch.equal(out_y[:11], y[idx]), (dtype, shape, ctas)
            assert not out[11:].any() and not out_y[11:].any()
            print(dtype, shape, ctas, g.dtype, "ok")
""")


def test_kernel_gathers_rows_bit_for_bit_under_the_interpreter():
    """Rows of 140, 15 and 128 bytes (int32, byte and int64 lanes), 1, 4 and 32 blocks."""
    triton = pytest.importorskip("triton")
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 8):
        pytest.skip("the interpreter of Triton < 3.8 cannot loop from a program id (its compiler can)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("ok") == 9
    assert "torch.int32" in proc.stdout and "torch.uint8" in proc.stdout and "torch.int64" in proc.stdout


# -- on a GPU ---------------------------------------------------------------------------------------------
gpu = pytest.mark.gpu


def _gpu_cfg(tiny_cfg, *overrides):
    return tiny_cfg("engine.device=cuda", "dataset.shape=[64,64]", "dataset.num_samples=512", *overrides)


@gpu
@pytest.mark.parametrize("dtype,shape", [(torch.float32, (256, 256)), (torch.float32, (5, 7)), (torch.uint8, (3, 5)),
                                         (torch.uint8, (28, 28)), (torch.bfloat16, (3, 3))])
@pytest.mark.parametrize("ctas", [1, 4, 32])
def test_gpu_kernel_equals_index_select_from_pinned_memory(dtype, shape, ctas):
    from trainer.loaders.uva_gather import RowGather
    n = 301
    x = torch.empty((n, *shape), dtype=dtype, pin_memory=True)
    x.copy_((torch.rand(n, *shape) * 255).to(dtype))
    y = torch.randint(0, 10, (n,))
    gather = RowGather(x, y.cuda(), ctas)
    for m in (64, 1, 37):
        idx = torch.randperm(n)[:m]
        out = torch.full((64, *shape), 7, dtype=dtype, device="cuda")
        out_y = torch.full((64,), -1, dtype=torch.int64, device="cuda")
        gather(idx.cuda(), gather.lanes(out), out_y)
        assert torch.equal(out[:m].cpu(), x[idx]) and torch.equal(out_y[:m].cpu(), y[idx]), m
        assert (out[m:] == 7).all() and (out_y[m:] == -1).all()  # nothing written past the batch


@gpu
@pytest.mark.parametrize("dtype", ["float32", "uint8"])
def test_gpu_batches_equal_baselines_in_order(dtype):
    base, uva = loaders(f"dataset.dtype={dtype}", "loader.batch_size=20", "dataset.chunks=3", seed=4, device="cuda")
    with base, uva:
        assert not uva.degraded and uva.gather is not None
        assert assert_same_batches(base, uva) == 15


@gpu
@pytest.mark.parametrize("loop", ["feedbench", "lightning"])
def test_gpu_a_slow_step_never_sees_its_slot_refilled(tiny_cfg, runs, loop):
    """model.busy_ms: each step holds the GPU for 3 ms after the gathers ahead of it were queued;
    Lightning's fetcher asks for the next batch before queuing the step."""
    common = ("engine.verify=true", "engine.epochs=3", "loader.batch_size=24", "model=noop", "model.busy_ms=3")
    run(_gpu_cfg(tiny_cfg, "loader=baseline", *common))
    run(_gpu_cfg(tiny_cfg, "loader=pinned_uva", "loader.depth=1", *common, f"engine.loop={loop}"))
    found = {r.data.tags["strategy"]: (r.data.tags["data_checksum"], r.data.tags["epoch_checksums"]) for r in runs()}
    assert found["pinned_uva"] == found["baseline"], found


@gpu
def test_gpu_jittered_consumer_reads_every_batch_intact():
    """3000 batches, a random device delay before each step reads its batch: hashes equal the CPU's."""
    rng = random.Random(0)
    hashes = {}
    for device in ("cpu", "cuda"):
        cfg = compose_config(*TINY, "loader=pinned_uva", "dataset.num_samples=2000", "dataset.shape=[32,32]",
                             "loader.batch_size=16", "loader.depth=3")
        loader = build_loader(cfg.loader, build_dataset(cfg.dataset), torch.device(device), seed=3)
        ck, out = Checksum(loader.device), []
        for _ in range(24):
            for x, y in loader:
                if device == "cuda":
                    torch.cuda._sleep(int(rng.random() * 200_000))  # the 'step' reads x only after this
                h = ck._sample_hashes(x, y)
                out.append((h * torch.arange(1, len(h) + 1, device=h.device)).sum())
        hashes[device] = torch.stack(out).cpu()
        loader.close()
    assert len(hashes["cuda"]) == 24 * 125
    assert int((hashes["cuda"] != hashes["cpu"]).sum()) == 0


@gpu
def test_gpu_graphed_matches_baseline_and_trains_like_eager(tiny_cfg, runs):
    """Shuffled, batches of 60 over 512 samples: the partial last batch (32) runs outside the graph."""
    common = ("loader.batch_size=60", "engine.epochs=3", "engine.verify=true", "model.hidden=32")
    run(_gpu_cfg(tiny_cfg, "loader=baseline", *common))
    eager = run(_gpu_cfg(tiny_cfg, "loader=pinned_uva", *common))
    graphed = run(_gpu_cfg(tiny_cfg, "loader=pinned_uva", *common, "engine.cuda_graph=true"))
    assert graphed["final_loss"] == pytest.approx(eager["final_loss"], rel=1e-4)
    assert graphed["total_steps"] == eager["total_steps"] == 3 * 9
    assert eager["h2d_GBps"] > 0 and eager["pinned_host_mb"] > 0
    found = [(r.data.tags["strategy"], r.data.tags["degraded"], r.data.tags["data_checksum"]) for r in runs()]
    assert len({checksum for _, _, checksum in found}) == 1, found  # byte-identical batches, same order
    assert {d for _, d, _ in found} == {"false"}


@gpu
@pytest.mark.parametrize("dtype", ["float32", "uint8"])
def test_gpu_gather_in_graph_is_baselines_batches_and_trains_as_the_graph_outside(tiny_cfg, runs, dtype):
    """One replay a step: the step, and the next batch's gather captured beside it. The same
    batches as `baseline` (checksums), the same training as the gathers outside the graph, every
    step a replay; across the epochs and through the kernel window after the timed region."""
    common = ("loader.batch_size=64", "loader.drop_last=true", "engine.epochs=3", "engine.verify=true", "model.hidden=32",
              f"dataset.dtype={dtype}", "engine.kernel_window_steps=5")
    run(_gpu_cfg(tiny_cfg, "loader=baseline", *common))
    outside = run(_gpu_cfg(tiny_cfg, "loader=pinned_uva", *common, "engine.cuda_graph=true"))
    inside = run(_gpu_cfg(tiny_cfg, "loader=pinned_uva", *common, "engine.cuda_graph=true", "loader.gather_in_graph=true"))
    assert inside["final_loss"] == pytest.approx(outside["final_loss"], rel=1e-4)
    assert inside["graph_replays"] == inside["total_steps"] == 3 * 8 and inside["eager_steps"] == 0
    found = [r.data.tags["data_checksum"] for r in runs()]
    assert len(found) == 3 and len(set(found)) == 1, found


@gpu
def test_gpu_block_tuning_raises_too_few_blocks_while_that_makes_the_copy_faster(tiny_cfg, monkeypatch):
    """`model=noop`, rows of 256 KiB, starting from one block (where the row size asks for 4): a
    step that only copies waits for every gather, so the blocks are doubled while that makes the
    steps faster, and the copy is faster than with one block fixed."""
    from trainer.loaders import uva_gather
    common = ("model=noop", "dataset.shape=[256,256]", "dataset.num_samples=1024", "engine.max_steps=300",
              "engine.warmup_steps=20")
    fixed = run(_gpu_cfg(tiny_cfg, "loader=pinned_uva", *common, "loader.ctas=1"))
    monkeypatch.setattr(uva_gather, "auto_ctas", lambda row_bytes: 1)
    tuned = run(_gpu_cfg(tiny_cfg, "loader=pinned_uva", *common))
    assert fixed["gather_blocks"] == 1 and tuned["gather_blocks"] >= 2, (fixed, tuned)
    assert tuned["h2d_GBps"] > 1.3 * fixed["h2d_GBps"], (fixed["h2d_GBps"], tuned["h2d_GBps"])


@gpu
def test_gpu_without_triton_gathers_on_the_host_and_is_tagged_degraded(tiny_cfg, runs, monkeypatch, capsys):
    monkeypatch.setattr(pinned_uva, "_kernel", lambda *args: (None, "Triton is not available: test"))
    common = ("engine.verify=true", "engine.epochs=2", "loader.batch_size=24", "model.busy_ms=1")
    run(_gpu_cfg(tiny_cfg, "loader=baseline", *common))
    run(_gpu_cfg(tiny_cfg, "loader=pinned_uva", *common))
    assert "loader=pinned_uva gathers on the host (Triton is not available: test)" in capsys.readouterr().err
    found = {r.data.tags["strategy"]: (r.data.tags["data_checksum"], r.data.tags["degraded"]) for r in runs()}
    assert found["pinned_uva"] == (found["baseline"][0], "true"), found


@gpu
def test_gpu_a_dataset_larger_than_its_share_of_the_gpu_trains_through_pinned_uva(tiny_cfg, runs):
    """`engine.gpu_memory_fraction` below the dataset's size: `gpu_resident` is refused in one line
    naming the key; `pinned_uva` trains on the same data, every batch `baseline`'s."""
    total = torch.cuda.mem_get_info()[1]
    common = ("dataset.num_samples=4096", "dataset.shape=[256,256]", "loader.batch_size=64", "engine.epochs=1",
              "engine.verify=true", "model=noop", f"engine.gpu_memory_fraction={(768 << 20) / total:.6f}")  # 1 GiB of data, 768 MiB allowed
    with pytest.raises(ConfigError, match=r"^loader=gpu_resident needs 1\.00 GiB of GPU memory but only .* GiB is free "
                                          r"to this run \(engine\.gpu_memory_fraction=.*\): use loader=pinned_chunk"):
        run(_gpu_cfg(tiny_cfg, "loader=gpu_resident", *common))
    run(_gpu_cfg(tiny_cfg, "loader=baseline", *common))
    summary = run(_gpu_cfg(tiny_cfg, "loader=pinned_uva", *common))
    assert summary["total_steps"] == 64 and summary["h2d_GBps"] > 0
    found = {r.data.tags["strategy"]: r.data.tags["data_checksum"] for r in runs() if r.info.status == "FINISHED"}
    assert found["pinned_uva"] == found["baseline"], found
    run(_gpu_cfg(tiny_cfg, "loader=gpu_resident", *common[:-1]))  # the next run in the process has the whole GPU again


def test_gpu_memory_fraction_is_a_share(tiny_cfg):
    for bad in ("0", "1.5", "-0.1"):
        with pytest.raises(ConfigError, match=rf"^engine\.gpu_memory_fraction must be above 0 and at most 1 \(got {bad}\): "
                                              r"set engine\.gpu_memory_fraction=1\.0"):
            run(tiny_cfg(f"engine.gpu_memory_fraction={bad}"))
