"""Every strategy delivers the same samples as `baseline` (CPU paths; the CUDA paths are in test_gpu.py)."""

from __future__ import annotations

import gc
import sys
import threading
import time
from typing import Tuple

import pytest
import torch

from datasets import build_dataset
from trainer.errors import ConfigError, RunFailed
from trainer.loaders import build_loader, for_any_dataset
from trainer.loaders.order import epoch_order
from trainer.loaders.pinned_chunk import PinnedChunkLoader
from trainer.loaders.pinned_gather import THREAD_PREFIX, PinnedGatherLoader
from trainer.memory import chunk_samples_for, host_buffer_bytes
from trainer.loop.run import run
from trainer.loop.verify import Checksum

from conftest import TINY, compose_config

# iterable_chunks draws random rows (with replacement): it reproduces a public notebook's loader rather
# than delivering baseline's samples, and is tested with its presets (test_presets.py).
STRATEGIES = [s for s in for_any_dataset() if s != "iterable_chunks"]


def checksums(tiny_cfg, strategy, *overrides):
    run(tiny_cfg(f"loader={strategy}", "engine.verify=true", "engine.epochs=2", *overrides))


def verified(strategy: str, *overrides: str) -> Tuple[str, Tuple[str, ...]]:
    """The checksums `engine.verify=true` records for 2 epochs of `strategy`, seeded as a run seeds
    its loader: its `data_checksum` (every byte, in batch order) and its `epoch_checksums`. (A
    run's recording of them: test_pinned_gather_shuffled_checksum_equals_baselines.)"""
    cfg = compose_config(*TINY, f"loader={strategy}", *overrides)
    device = torch.device("cpu")
    checksum = Checksum(device)
    with build_loader(cfg.loader, build_dataset(cfg.dataset), device, seed=cfg.engine.seed) as loader:
        for _ in range(2):
            for x, y in loader:
                checksum.update(x, y)
            checksum.end_epoch()
        batches = 2 * len(loader)
    result = checksum.result()
    assert int(result["verified_batches"]) == batches
    return result["data_checksum"], tuple(result["epoch_checksums"])


@pytest.mark.parametrize("chunks", [1, 3, 5])
def test_unshuffled_batches_are_byte_identical_in_order(chunks):
    found = {s: verified(s, "loader.shuffle=false", f"dataset.chunks={chunks}") for s in STRATEGIES}
    assert len({v for v in found.values()}) == 1, found


def test_shuffled_epochs_cover_the_same_samples():
    found = {s: verified(s, "dataset.chunks=3") for s in STRATEGIES}
    assert len({epochs for _, epochs in found.values()}) == 1, found  # same samples each epoch
    # strategies that gather by index follow baseline's order exactly; pinned_chunk orders by slices
    same_order = {s for s in STRATEGIES if s != "pinned_chunk"}
    assert len({found[s][0] for s in same_order}) == 1
    assert found["pinned_chunk"][0] != found["baseline"][0]
    # and the epochs themselves are different permutations of the same data
    assert found["baseline"][1] == found["gpu_resident"][1]


def test_a_strategy_is_a_plain_iterable(tiny_cfg):
    """Usable in any hand-written loop: `for x, y in loader`."""
    cfg = tiny_cfg("loader=prefetch", "loader.shuffle=false")
    ds = build_dataset(cfg.dataset)
    loader = build_loader(cfg.loader, ds, torch.device("cpu"))
    batches = list(loader)
    assert len(batches) == len(loader) == 6
    x = torch.cat([b[0] for b in batches])
    assert x.shape == (96, 8, 8) and x.dtype == torch.float32
    assert torch.equal(x, ds.materialize())


def test_pinned_chunk_yields_contiguous_views_of_one_buffer(tiny_cfg):
    cfg = tiny_cfg("loader=pinned_chunk", "loader.shuffle=false")
    loader = build_loader(cfg.loader, build_dataset(cfg.dataset), torch.device("cpu"))
    buf = loader.buffers[0][0]
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.nbytes
    for (x, _), _buffer in loader._host_slices(epoch=0):
        assert x.is_contiguous() and lo <= x.data_ptr() < hi  # a slice, not a gathered copy


def test_pinned_chunk_loads_chunks_in_the_background_and_keeps_its_buffers(tiny_cfg):
    cfg = tiny_cfg("loader=pinned_chunk", "dataset.chunks=4", "loader.shuffle=false")
    ds = build_dataset(cfg.dataset)
    loader = build_loader(cfg.loader, ds, torch.device("cpu"))
    ptrs = [b[0].data_ptr() for b in loader.buffers]
    for _ in range(3):
        x = torch.cat([b[0] for b in loader])
        assert torch.equal(x, ds.materialize())
    assert [b[0].data_ptr() for b in loader.buffers] == ptrs  # no new buffers per chunk or epoch
    loader.close()


def test_drop_last_drops_the_partial_batch(tiny_cfg):
    for s in STRATEGIES:
        cfg = tiny_cfg(f"loader={s}", "loader.batch_size=40", "loader.drop_last=true", "loader.shuffle=false")
        with build_loader(cfg.loader, build_dataset(cfg.dataset), torch.device("cpu")) as loader:
            sizes = [len(x) for x, _ in loader]
        assert sizes == [40, 40] and len(loader) == 2, s


def test_pinned_chunk_load_thread_selects_the_runs_device(tiny_cfg, monkeypatch):
    """The background load selects the loader's device before it touches CUDA (it waits on copy
    events): without it every rank's load thread would make a context on GPU 0."""
    selected = []
    monkeypatch.setattr(PinnedChunkLoader, "_thread_device", lambda self: 3)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: selected.append((threading.current_thread().name, index)))
    cfg = tiny_cfg("loader=pinned_chunk", "dataset.chunks=3")
    with build_loader(cfg.loader, build_dataset(cfg.dataset), torch.device("cpu")) as loader:
        assert len(list(loader)) == 6
        loader.ready.result()  # the next epoch's chunk 0: closing would cancel it if not yet begun
    assert len(selected) == 3  # chunks 1, 2 and the next epoch's 0, each loaded in the background
    assert all(name.startswith("chunk-load") and index == 3 for name, index in selected), selected


def test_pinned_memory_is_counted_as_the_host_allocator_rounds_it():
    """PyTorch's caching host allocator pins a power of two per request: the memory checks and
    `pinned_host_mb` count that, and a suggested chunk size still fits once rounded."""
    sizes = (0, 1, 2, 3, 4096, 4097, 3 * 2**20)
    assert [host_buffer_bytes(n, pinned=True) for n in sizes] == [0, 1, 2, 4, 4096, 8192, 4 * 2**20]
    assert [host_buffer_bytes(n, pinned=False) for n in sizes] == list(sizes)  # pageable: what was asked
    for sample_bytes, free in ((256 * 256 * 4 + 8, 10 * 2**30), (3 * 32 * 32 + 8, 7 * 2**30 + 5), (100, 1000)):
        rows = chunk_samples_for(sample_bytes, free)
        assert 2 * host_buffer_bytes(rows * sample_bytes, pinned=True) <= free // 2


def test_pinned_chunk_rejects_chunks_smaller_than_a_batch(tiny_cfg):
    cfg = tiny_cfg("loader=pinned_chunk", "dataset.chunks=7")  # 14-sample chunks, batches of 16
    with pytest.raises(ValueError, match="loader.batch_size=16.*got 14"):
        build_loader(cfg.loader, build_dataset(cfg.dataset), torch.device("cpu"))


# -- pinned_gather: per-sample shuffling from a ring of reused slots ----------------------------------
@pytest.fixture
def gather_threads():
    """`gather_threads()`: the live pinned_gather threads started during this test (a loader an
    earlier test left unclosed stops its threads only when it is garbage-collected)."""
    def live():
        return {t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)}
    before = live()
    return lambda: live() - before


def _pair(tiny_cfg, *overrides, threads=4):
    """(baseline, pinned_gather with `threads`) on the CPU over the same data, seeded alike."""
    made = []
    for s, own in (("baseline", []), ("pinned_gather", [f"loader.threads={threads}"])):
        cfg = tiny_cfg(f"loader={s}", *overrides, *own)
        made.append(build_loader(cfg.loader, build_dataset(cfg.dataset), torch.device("cpu"), seed=7))
    return made


def test_pinned_gather_shuffled_checksum_equals_baselines(tiny_cfg, runs, gather_threads):
    """2 epochs, shuffled, 4 threads, data in 3 chunks, batches of 20 (a partial last one)."""
    for s in ("baseline", "pinned_gather"):
        checksums(tiny_cfg, s, "loader.threads=4" if s == "pinned_gather" else "loader.shuffle=true", "dataset.chunks=3",
                  "loader.batch_size=20")
    found = {r.data.tags["strategy"]: (r.data.tags["data_checksum"], r.data.tags["epoch_checksums"],
                                       r.data.tags["verified_batches"]) for r in runs()}
    assert found["pinned_gather"] == found["baseline"] and found["baseline"][2] == "10", found
    assert not gather_threads()  # stopped when the run closed its loader


@pytest.mark.parametrize("dtype", ["float32", "uint8", "bfloat16"])
@pytest.mark.parametrize("shuffle,drop_last", [("true", "false"), ("true", "true"), ("false", "false")])
def test_pinned_gather_yields_baselines_batches_every_epoch(tiny_cfg, dtype, shuffle, drop_last):
    base, gather = _pair(tiny_cfg, f"dataset.dtype={dtype}", f"loader.shuffle={shuffle}", f"loader.drop_last={drop_last}",
                         "loader.batch_size=20", "dataset.chunks=2")
    firsts = []
    with base, gather:
        for _ in range(3):
            expected, got = list(base), list(gather)
            assert len(got) == len(expected) == len(gather)
            for (xe, ye), (xg, yg) in zip(expected, got):
                assert xg.dtype == xe.dtype == torch.float32  # uint8/bfloat16 became model input after the 'copy'
                assert torch.equal(xg, xe) and torch.equal(yg, ye)
            firsts.append(got[0][0])
    if shuffle == "true":  # a fresh per-sample order every epoch: the first batch holds other samples
        assert not torch.equal(firsts[0], firsts[1]) and not torch.equal(firsts[1], firsts[2])


def test_pinned_gather_reuses_its_slots_and_hands_out_copies(tiny_cfg, gather_threads):
    cfg = tiny_cfg("loader=pinned_gather", "loader.threads=2", "loader.depth=1", "loader.batch_size=8")
    ds = build_dataset(cfg.dataset)
    loader = build_loader(cfg.loader, ds, torch.device("cpu"), seed=1)
    ring, slots = loader.num_slots, loader.slots_x
    lo, hi = slots.data_ptr(), slots.data_ptr() + slots.nbytes
    data, labels = ds.materialize(), ds.labels
    seen, host_ptrs = [], set()
    make_host_batches = loader._host_batches

    def recorded(epoch):  # the host batches the loop's thread hands to the copy, as it gets them
        order = epoch_order(len(ds), True, 1, epoch)
        for i, ((x, y), slot) in enumerate(make_host_batches(epoch)):
            rows = order[i * 8:(i + 1) * 8]
            assert torch.equal(x, data[rows]) and torch.equal(y, labels[rows])  # filled in epoch_order
            host_ptrs.add(x.data_ptr())
            yield (x, y), slot
    loader._host_batches = recorded
    with loader:
        for epoch in range(3):
            for x, _ in loader:
                seen.append(x)
                assert not (lo <= x.data_ptr() < hi)  # a copy, not a view of a slot that will be refilled
            assert 1 <= len(gather_threads()) <= 2  # started on demand, up to loader.threads
            # the next epoch's first batches are already being gathered when this one ends
            assert [p[:2] for p in loader.pending] == [(epoch + 1, i) for i in range(ring)]
        assert len(seen) == 3 * 12 > ring
        assert len(host_ptrs) == ring and all(lo <= p < hi for p in host_ptrs)  # 36 batches through 4 slots
        assert loader.slots_x is slots and slots.data_ptr() == lo  # allocated once
    order = torch.cat([epoch_order(len(ds), True, 1, e) for e in range(3)])
    assert torch.equal(torch.cat(seen), data[order])  # nothing overwritten after it was handed out
    assert not gather_threads()


def test_pinned_gather_threads_stop_when_an_unclosed_loader_is_collected(tiny_cfg, gather_threads):
    _, gather = _pair(tiny_cfg, "loader.batch_size=8", threads=3)
    it = iter(gather)
    next(it)
    assert len(gather_threads()) == 3
    del it, gather, _
    gc.collect()
    deadline = time.monotonic() + 60  # generous: a loaded machine schedules the exiting threads late
    while gather_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not gather_threads()


def test_pinned_gather_after_an_abandoned_pass_serves_the_next_epoch(tiny_cfg):
    base, gather = _pair(tiny_cfg, "loader.batch_size=8")
    with base, gather:
        for it in (iter(base), iter(gather)):
            for _ in range(3):
                next(it)
            it.close()  # e.g. engine.max_steps reached mid-epoch
        for (xe, ye), (xg, yg) in zip(list(base), list(gather)):
            assert torch.equal(xg, xe) and torch.equal(yg, ye)


def test_pinned_gather_threads_stop_when_the_consumer_fails(tiny_cfg, gather_threads):
    _, gather = _pair(tiny_cfg, "loader.batch_size=8", threads=3)
    with pytest.raises(ZeroDivisionError):
        with gather:
            for i, _ in enumerate(gather):
                assert 1 <= len(gather_threads()) <= 3
                if i == 2:
                    raise ZeroDivisionError
    assert not gather_threads()


def test_pinned_gather_failed_gather_fails_the_run_in_one_line(tiny_cfg, runs, monkeypatch, gather_threads):
    gather, calls = PinnedGatherLoader._gather, []

    def fails_on_the_fifth(self, *args):
        calls.append(1)
        if len(calls) == 5:
            raise OSError("injected read error")
        return gather(self, *args)
    monkeypatch.setattr(PinnedGatherLoader, "_gather", fails_on_the_fifth)
    with pytest.raises(RunFailed, match=r"a loader=pinned_gather gather thread failed: OSError: injected read error"):
        run(tiny_cfg("loader=pinned_gather", "loader.batch_size=8", "engine.epochs=2"))
    (r,) = runs()
    assert r.info.status == "FAILED" and "injected read error" in r.data.tags["error"]
    assert r.data.metrics["total_steps"] == 4  # the batches before the failed one were trained on
    assert not gather_threads()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_pinned_gather_thread_that_cannot_select_its_device_fails_the_run(tiny_cfg, runs, monkeypatch,
                                                                         gather_threads, device):
    """A gather thread whose `torch.cuda.set_device` raises (here a device index that does not
    exist, on any machine) reports it for the gathers it takes: one line, a FAILED run, every
    thread stopped, nothing left waiting for it."""
    missing = torch.cuda.device_count()
    monkeypatch.setattr(PinnedGatherLoader, "_thread_device", lambda self: missing)
    with pytest.raises(RunFailed, match=r"^a loader=pinned_gather gather thread failed: \w+Error: "):
        run(tiny_cfg("loader=pinned_gather", "loader.batch_size=8", "loader.threads=3", f"engine.device={device}"))
    (r,) = runs()
    assert r.info.status == "FAILED" and "gather thread failed" in r.data.tags["error"]
    assert r.data.metrics["total_steps"] == 0
    assert not gather_threads()


@pytest.mark.parametrize("where", ["fence", "join"])
def test_pinned_gather_close_interrupted_leaves_no_thread_running(tiny_cfg, monkeypatch, gather_threads, where):
    """Ctrl-C inside close(), while it waits for the running gathers (the fence) or for a thread to
    exit (a join): every gather thread has still exited when the interrupt propagates, and the
    loader is closed."""
    _, gather = _pair(tiny_cfg, "loader.batch_size=8", threads=3)
    passing = iter(gather)
    next(passing)
    passing.close()  # the pass is abandoned; the threads live until close()
    assert len(gather_threads()) == 3

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    if where == "fence":
        monkeypatch.setattr(gather, "_drop_gathers", interrupted)
    else:
        join, calls = threading.Thread.join, []

        def join_interrupted_once(thread, timeout=None):
            calls.append(thread)
            return interrupted() if len(calls) == 1 else join(thread, timeout)
        monkeypatch.setattr(threading.Thread, "join", join_interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        gather.close()
    assert not gather_threads() and gather.closed


@pytest.mark.parametrize("key", ["threads", "depth"])
def test_pinned_gather_rejects_no_threads_or_depth(tiny_cfg, key):
    cfg = tiny_cfg("loader=pinned_gather", f"loader.{key}=0")
    with pytest.raises(ConfigError, match=rf"^loader\.{key} must be >= 1 \(got 0\): set loader\.{key}=\d+$"):
        build_loader(cfg.loader, build_dataset(cfg.dataset), torch.device("cpu"))


@pytest.mark.parametrize("strategy", for_any_dataset())
def test_a_pass_left_suspended_ends_quietly_after_close(tiny_cfg, monkeypatch, strategy):
    """A pass left suspended past the strategy's close() (a traceback holding it, say) touches
    nothing close() released when it is garbage-collected: no 'Exception ignored' on stderr."""
    ignored = []
    monkeypatch.setattr(sys, "unraisablehook", ignored.append)
    cfg = tiny_cfg(f"loader={strategy}")
    loader = build_loader(cfg.loader, build_dataset(cfg.dataset), torch.device("cpu"))
    suspended = iter(loader)
    next(suspended)
    loader.close()
    del suspended  # the generator is finalised here
    gc.collect()
    assert [f"{u.exc_type.__name__}: {u.exc_value}" for u in ignored] == []


def test_an_abandoned_pass_stops_only_its_own_workers(tiny_cfg):
    """A pass abandoned, then collected while the next pass runs, leaves that pass's workers alone."""
    cfg = tiny_cfg("loader.num_workers=1")
    with build_loader(cfg.loader, build_dataset(cfg.dataset), torch.device("cpu")) as loader:
        abandoned = iter(loader)
        next(abandoned)
        current = iter(loader)
        batches = [next(current)]
        del abandoned  # finalised while `current` runs
        gc.collect()
        batches += list(current)
        assert len(batches) == len(loader) == 6
