"""CUDA paths, measured on a GPU machine (skipped elsewhere): timing, async-copy safety, memory."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import random
import threading
import time
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from conftest import TINY
from datasets import build_dataset
from trainer.loaders import build_loader, for_any_dataset
from trainer.loaders.pinned_gather import THREAD_PREFIX
from trainer.loop.run import run
from trainer.loop.verify import Checksum

pytestmark = pytest.mark.gpu
STRATEGIES = for_any_dataset()
COPYING = [s for s in STRATEGIES if s != "gpu_resident"]
SAME_SAMPLES = [s for s in STRATEGIES if s != "iterable_chunks"]  # iterable_chunks draws random rows (with replacement)


def gpu(tiny_cfg, *overrides):
    return tiny_cfg("engine.device=cuda", "dataset.shape=[64,64]", "dataset.num_samples=512", *overrides)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_cuda_path_times_copy_and_compute(strategy, tiny_cfg, runs):
    summary = run(gpu(tiny_cfg, f"loader={strategy}", "engine.epochs=2", "engine.warmup_steps=4"))
    (r,) = runs()
    assert r.data.tags["degraded"] == "false" and r.data.tags["device"] == "cuda"
    assert r.data.tags["gpu_name"] != "none"
    assert summary["median_compute_ms"] > 0 and summary["peak_gpu_mem_mb"] > 0
    if strategy in COPYING:
        assert summary["median_h2d_ms"] > 0 and summary["h2d_GBps"] > 0
        assert summary["h2d_peak_pinned_GBps"] > 0
    else:
        assert summary["median_h2d_ms"] == 0 and summary["setup_s"] > 0
    if strategy in ("pinned_chunk", "pinned_gather"):
        assert summary["pinned_host_mb"] > 0 and summary["setup_s"] > 0


@pytest.mark.parametrize("every", [1, 4])
def test_cuda_events_time_the_steps_and_copies_of_the_sampled_runs(every, tiny_cfg, runs, tracking_uri):
    """`engine.gpu_timing_every`: compute and copy times on the warm-up steps and on one run of 32
    steps in each block of N after it (at the seeded places); nan (and no metric) elsewhere; the
    summaries from those."""
    import math
    from clirun import steps_csv
    from trainer.loop.sampler import Schedule
    cfg = gpu(tiny_cfg, "loader=pinned_chunk", "engine.warmup_steps=4", "engine.max_steps=204",
              f"engine.gpu_timing_every={every}")
    summary = run(cfg)
    (r,) = runs()
    rows = steps_csv(tracking_uri, r.info.run_id)
    sampled = Schedule(4, every, seed=cfg.engine.seed)
    expect = [sampled.timed(i) for i in range(204)]
    assert [not math.isnan(float(x["compute_ms"])) for x in rows] == expect
    assert [not math.isnan(float(x["h2d_ms"])) for x in rows] == expect  # pinned_chunk copies every batch
    assert all(float(x["compute_ms"]) > 0 for x, e in zip(rows, expect) if e)
    history = MlflowClient(tracking_uri).get_metric_history(r.info.run_id, "compute_ms")
    assert sorted(m.step for m in history) == [i + 1 for i, e in enumerate(expect) if e]
    assert summary["median_compute_ms"] > 0 and summary["h2d_GBps"] > 0 and 0 < summary["compute_stream_span_fraction"]
    assert 0 <= summary["h2d_beside_step_fraction"] <= 1


@pytest.mark.parametrize("shuffle", ["false", "true"])
def test_cuda_strategies_deliver_the_same_samples(shuffle, tiny_cfg, runs):
    for s in SAME_SAMPLES:
        run(gpu(tiny_cfg, f"loader={s}", "engine.verify=true", "engine.epochs=3", "dataset.chunks=3",
                f"loader.shuffle={shuffle}", "loader.num_workers=2"))
    found = {r.data.tags["strategy"]: (r.data.tags["data_checksum"], r.data.tags["epoch_checksums"]) for r in runs()}
    assert len({epochs for _, epochs in found.values()}) == 1, found
    ordered = {s for s in SAME_SAMPLES if shuffle == "false" or s != "pinned_chunk"}
    assert len({found[s][0] for s in ordered}) == 1, found


class _Delayed(torch.utils.data.Dataset):
    """Producer-side jitter: some samples take a little longer to load."""

    def __init__(self, inner, rng):
        self.inner, self.rng = inner, rng

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        if self.rng.random() < 0.05:
            time.sleep(self.rng.random() * 2e-4)
        return self.inner[i]


def _batch_hashes(loader, epochs, consumer_jitter: bool, rng):
    """Per-batch order-dependent hash, computed on the consumer's stream after a random delay:
    if the loader let a copy overwrite memory the step still reads, the hash would change."""
    ck, out = Checksum(loader.device), []
    for _ in range(epochs):
        for x, y in loader:
            if consumer_jitter:
                if rng.random() < 0.1:
                    time.sleep(rng.random() * 2e-4)
                torch.cuda._sleep(int(rng.random() * 200_000))  # the 'step' reads x only after this
            h = ck._sample_hashes(x, y)
            out.append((h * torch.arange(1, len(h) + 1, device=h.device)).sum())
    return torch.stack(out).cpu() if loader.device.type == "cuda" else torch.stack(out)


def _jitter_gathers_and_copies(loader, rng):
    """pinned_gather: some gathers start late (worker threads) and some copies read their slot
    late (device time queued on the side stream first), so a slot refilled before the copy that
    reads it completed would change what reaches the device."""
    gather, copy = loader._gather, loader._copy

    def late_gather(*args):
        if rng.random() < 0.05:
            time.sleep(rng.random() * 2e-4)
        return gather(*args)

    def late_copy(batch, non_blocking):
        if rng.random() < 0.2:
            torch.cuda._sleep(int(rng.random() * 1_000_000))  # on the copier's stream: delays this copy
        return copy(batch, non_blocking)
    loader._gather, loader._copy = late_gather, late_copy


@pytest.mark.parametrize("strategy", ["pinned", "prefetch", "pinned_chunk", "pinned_gather"])
def test_stress_random_delays_10k_batches_no_mismatch(strategy, tiny_cfg):
    cfg = tiny_cfg(f"loader={strategy}", "dataset.num_samples=2000", "dataset.shape=[32,32]", "dataset.chunks=4",
                   "loader.batch_size=16", "loader.depth=3" if strategy != "pinned" else "loader.shuffle=true")
    rng = random.Random(0)
    results = {}
    for device in ("cpu", "cuda"):
        ds = build_dataset(cfg.dataset)
        if device == "cuda":
            per_sample, load_chunk = ds.per_sample, ds.load_chunk
            ds.per_sample = lambda: _Delayed(per_sample(), rng)

            def slow_load(i, out=None):
                time.sleep(rng.random() * 5e-3)
                return load_chunk(i, out)
            ds.load_chunk = slow_load
        loader = build_loader(cfg.loader, ds, torch.device(device), seed=3)
        if device == "cuda" and strategy == "pinned_gather":
            _jitter_gathers_and_copies(loader, rng)
        results[device] = _batch_hashes(loader, epochs=80, consumer_jitter=device == "cuda", rng=rng)
        loader.close()
    assert len(results["cuda"]) >= 10_000
    mismatches = int((results["cuda"] != results["cpu"]).sum())
    assert mismatches == 0


def _host_pinned_bytes() -> int:
    """Page-locked bytes PyTorch's caching host allocator holds: its blocks in use and those it keeps cached."""
    stats = torch.cuda.host_memory_stats()
    if "allocated_bytes.current" not in stats:
        pytest.skip("this torch reports no pinned-memory statistics")
    return stats["allocated_bytes.current"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_memory_growth_over_20_epochs(strategy, tiny_cfg):
    cfg = gpu(tiny_cfg, f"loader={strategy}", "dataset.chunks=2", "loader.num_workers=2", "loader.persistent_workers=true")
    loader = build_loader(cfg.loader, build_dataset(cfg.dataset), torch.device("cuda"))
    reserved, pinned = [], []
    for _ in range(20):
        for x, y in loader:
            x.sum()
        torch.cuda.synchronize()
        reserved.append(torch.cuda.memory_reserved())
        pinned.append(_host_pinned_bytes())
    loader.close()
    assert reserved[2:] == [reserved[2]] * 18, reserved
    if strategy in ("pinned", "prefetch"):
        # The DataLoader's pin thread holds however many batches are in flight when the epoch is
        # sampled (a block or two more or less): bounded, not growing.
        assert max(pinned[10:]) <= max(pinned[2:10]) + (512 << 10), pinned
    else:
        assert pinned[2:] == [pinned[2]] * 18, pinned


_PINNED_BYTES = """
import sys, torch
import trainer.components  # noqa: F401
from hydra import compose, initialize_config_dir
from trainer.config import CONF_DIR
from datasets import build_dataset
from trainer.loaders import build_loader

def held():
    return torch.cuda.host_memory_stats()["allocated_bytes.current"]

with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
    cfg = compose("config", overrides=sys.argv[2:] + ["loader=" + sys.argv[1]])
torch.empty(1, device="cuda"); torch.cuda.synchronize(); torch._C._host_emptyCache()
before = held()
loader = build_loader(cfg.loader, build_dataset(cfg.dataset), torch.device("cuda"))
buffers = [t for pair in loader.buffers for t in pair] if sys.argv[1] == "pinned_chunk" else [loader.slots_x, loader.slots_y]
print(loader.pinned_bytes, held() - before, sum(t.nbytes for t in buffers))
for _ in range(2):
    for x, _y in loader:
        x.sum()
for i, (x, _y) in enumerate(loader):  # a pass abandoned with copies in flight
    if i == 3:
        break
loader.close()
print(held() - before)
"""


@pytest.mark.parametrize("strategy", ["pinned_chunk", "pinned_gather"])
def test_pinned_bytes_are_what_the_host_allocator_reserves_and_close_gives_them_back(strategy):
    """Buffers of sizes that are no power of two: `pinned_bytes` (the run's `pinned_host_mb`) is the
    allocator's growth, rounding included; after close() it holds what it held before (nothing
    kept cached for the rest of the process). In a process of its own: the allocator's counts are
    the process's, whatever earlier tests left pinned."""
    overrides = [o.replace("engine.device=cpu", "engine.device=cuda") for o in TINY] + ["dataset.chunks=3"]
    proc = subprocess.run([sys.executable, "-c", _PINNED_BYTES, strategy, *overrides], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    (counted, grew, exact), (after,) = [list(map(int, line.split())) for line in proc.stdout.split("\n")[:2]]
    assert counted == grew > exact
    assert after == 0


@pytest.mark.parametrize("strategy", ["prefetch", "pinned_chunk", "pinned_gather"])
def test_side_stream_strategies_make_every_cuda_event_before_the_first_batch(strategy, tiny_cfg, monkeypatch):
    """PyTorch creates a CUDA event at its first record: every event a loader uses is made and
    recorded once when it is built, and none is made per batch or per epoch."""
    made = []

    class Counted(torch.cuda.Event):
        def __new__(cls, *args, **kwargs):
            made.append(cls)
            return super().__new__(cls, *args, **kwargs)
    monkeypatch.setattr(torch.cuda, "Event", Counted)
    cfg = gpu(tiny_cfg, f"loader={strategy}", "dataset.chunks=3", "loader.depth=2")
    with build_loader(cfg.loader, build_dataset(cfg.dataset), torch.device("cuda")) as loader:
        owned = loader.copier.ring + (getattr(loader, "slot_events", None) or getattr(loader, "buffer_events", None) or [])
        assert len(made) == len(owned) and all(e.cuda_event for e in owned)  # real CUDA events already
        for _ in range(2):
            for x, _y in loader:
                x.sum()
        torch.cuda.synchronize()
    assert len(made) == len(owned)


def test_pinned_chunk_load_thread_sleeps_on_the_runs_gpu_while_a_copy_reads_its_buffer(tiny_cfg):
    """The load thread selects the loader's device (the last GPU here) and, while the copies that
    read the buffer it is to refill are still queued (each delayed on the side stream), waits
    asleep on a blocking event rather than spinning a core."""
    device = torch.device(f"cuda:{torch.cuda.device_count() - 1}")
    cfg = gpu(tiny_cfg, "loader=pinned_chunk", "dataset.chunks=4", "loader.shuffle=false")
    loader = build_loader(cfg.loader, build_dataset(cfg.dataset), device)
    wait_free, copy, waits = loader._wait_free, loader._copy, []

    def timed_wait(buffer):
        if not threading.current_thread().name.startswith("chunk-load"):
            return wait_free(buffer)
        wall, cpu = time.perf_counter(), time.thread_time()
        wait_free(buffer)
        waits.append((torch.cuda.current_device(), time.perf_counter() - wall, time.thread_time() - cpu))

    def late_copy(batch, non_blocking):
        torch.cuda._sleep(50_000_000)  # tens of ms on the side stream before this copy reads its buffer
        return copy(batch, non_blocking)
    loader._wait_free, loader._copy = timed_wait, late_copy
    with loader:
        assert len(list(loader)) == 32
        torch.cuda.synchronize(device)
    assert waits and {d for d, _, _ in waits} == {device.index}
    long = [(wall, cpu) for _, wall, cpu in waits if wall > 0.02]
    assert long and all(cpu < 0.5 * wall for wall, cpu in long), long


def test_graphed_step_trains_like_the_eager_one(tiny_cfg):
    """The same loss; and the capture's backward found no AccumulateGrad node of the warm-up's
    stream still alive (PyTorch warns of it: the capture would wait on that stream)."""
    import warnings
    common = ("loader=prefetch", "loader.shuffle=false", "engine.epochs=3", "model.hidden=32")
    eager = run(gpu(tiny_cfg, *common))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.set_warn_always(True)  # PyTorch warns of it once per process: an earlier test's graph would hide it
        try:
            graphed = run(gpu(tiny_cfg, *common, "engine.cuda_graph=true"))
        finally:
            torch.set_warn_always(False)
    assert graphed["final_loss"] == pytest.approx(eager["final_loss"], rel=1e-4)
    assert not [w for w in caught if "AccumulateGrad node's stream" in str(w.message)]


def test_pinned_gather_graphed_matches_baseline_and_trains_like_eager(tiny_cfg, runs):
    """Shuffled, batches of 60 over 512 samples: the partial last batch (32) runs outside the graph."""
    common = ("loader.batch_size=60", "engine.epochs=3", "engine.verify=true", "model.hidden=32")
    run(gpu(tiny_cfg, "loader=baseline", *common))
    eager = run(gpu(tiny_cfg, "loader=pinned_gather", *common))
    graphed = run(gpu(tiny_cfg, "loader=pinned_gather", *common, "engine.cuda_graph=true"))
    assert graphed["final_loss"] == pytest.approx(eager["final_loss"], rel=1e-4)
    assert graphed["total_steps"] == eager["total_steps"] == 3 * 9
    found = [(r.data.tags["strategy"], r.data.tags["cuda_graph"], r.data.tags["data_checksum"]) for r in runs()]
    assert len({checksum for _, _, checksum in found}) == 1, found  # byte-identical batches, same order


def test_pinned_gather_returns_its_pinned_memory_and_threads_on_close(tiny_cfg):
    def held_pinned() -> int:
        gc.collect()
        torch.cuda.synchronize()
        getattr(torch._C, "_host_emptyCache", lambda: None)()  # check the copies' events now
        stats = getattr(torch.cuda, "host_memory_stats", dict)()
        if "allocated_bytes.current" not in stats:
            pytest.skip("this torch reports no pinned-memory statistics")
        return stats["allocated_bytes.current"]

    torch.empty(1, device="cuda")
    before = held_pinned()
    cfg = gpu(tiny_cfg, "loader=pinned_gather", "dataset.chunks=2", "loader.threads=3")
    loader = build_loader(cfg.loader, build_dataset(cfg.dataset), torch.device("cuda"))
    assert held_pinned() - before >= loader.pinned_bytes > 0
    for x, _ in loader:
        x.sum()
    for i, (x, _) in enumerate(loader):  # a pass abandoned with copies and gathers in flight
        if i == 3:
            break
    assert [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]
    loader.close()
    del loader, x
    assert not [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]
    assert held_pinned() == before


def test_profile_trace_shows_side_stream_copies(tiny_cfg, runs, tracking_uri):
    run(gpu(tiny_cfg, "loader=prefetch", "engine.profile=true", "engine.epochs=3", "engine.warmup_steps=2"))
    (r,) = runs()
    path = MlflowClient(tracking_uri).download_artifacts(r.info.run_id, "trace.json")
    events = json.loads(Path(path).read_text())["traceEvents"]
    copies = [e for e in events if "Memcpy HtoD" in e.get("name", "")]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert copies and kernels
    assert {c["tid"] for c in copies}.isdisjoint({k["tid"] for k in kernels})  # copies on their own stream


def test_busy_ms_adds_device_time(tiny_cfg):
    summary = run(gpu(tiny_cfg, "model=noop", "model.busy_ms=2", "loader=gpu_resident", "engine.epochs=2"))
    assert 1.8 < summary["median_compute_ms"] < 2.6


# -- several GPUs of one host under torchrun (NCCL) -----------------------------------------------
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def _torchrun(tmp_path, uri, *args, **popen):
    import subprocess
    import sys
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--monitor-interval=0.2",
           "-m", "trainer", *args, f"tracking.uri={uri}", f"hydra.run.dir={tmp_path}/run"]
    return subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


@two_gpus
@pytest.mark.parametrize("strategy", SAME_SAMPLES)
def test_two_gpus_one_run_with_nccl_equal_to_one_gpu(strategy, tmp_path, tiny_cfg, tracking_uri, runs):
    """Each rank on its own GPU: one FINISHED run tagged world_size=2 and backend=nccl, on two
    devices, with the aggregate figures, and epoch checksums equal to a one-GPU run's."""
    size = ["engine.device=cuda", "dataset.shape=[64,64]", "dataset.num_samples=512", "dataset.chunks=2",
            f"loader={strategy}", "engine.epochs=2", "engine.verify=true", "engine.progress=false"]
    proc = _torchrun(tmp_path, tracking_uri, *size, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # a launch that hangs fails this test, not the whole call
    assert proc.returncode == 0, err
    (r,) = runs()
    assert (r.info.status, r.data.tags["world_size"], r.data.tags["backend"]) == ("FINISHED", "2", "nccl")
    assert len(r.data.tags["device_ids"].split(",")) == 2  # two GPUs, by UUID
    m = r.data.metrics
    if strategy != "gpu_resident":
        assert m["aggregate_h2d_GBps"] > 0 and m["aggregate_h2d_peak_pinned_GBps"] > 0
        assert m["rank1/h2d_GBps"] > 0
    assert m["grad_mb"] > 0 and m["grad_allreduce_ms"] > 0 and m["allreduce_bus_GBps"] > 0  # DDP's exchange over NCCL
    run(tiny_cfg(*size, "tracking.experiment=single"))
    (alone,) = runs("single")
    assert r.data.tags["epoch_checksums"] == alone.data.tags["epoch_checksums"]


@two_gpus
def test_two_gpus_average_in_one_allreduce_or_sharded_as_ddp_does_eager_and_graphed(tmp_path, tracking_uri, runs):
    """distributed.sync=allreduce and sharded over NCCL train as DDP does (two ranks: averaging
    halves a sum, exactly; sharded updates each half of the weights on its own rank), eager and
    with the exchange replayed inside the step's CUDA graph; DDP with a graph is refused in one
    line, and so is a graph over shards with a short batch."""
    size = ["engine.device=cuda", "dataset.shape=[64,64]", "dataset.num_samples=512", "loader=gpu_resident",
            "engine.epochs=2", "engine.progress=false", "model.hidden=32"]
    outputs = []
    for extra in (["-m", "distributed.sync=ddp,allreduce,sharded"], ["-m", "distributed.sync=allreduce,sharded", "engine.cuda_graph=true"],
                  ["engine.cuda_graph=true"],
                  # 10 batches, 5 a rank, rank 1's last of 20 samples: it would run eagerly beside rank 0's replay
                  ["distributed.sync=allreduce", "engine.cuda_graph=true", "dataset.num_samples=596"]):
        proc = _torchrun(tmp_path, tracking_uri, *size, *extra, f"hydra.sweep.dir={tmp_path}/sweep", start_new_session=True)
        try:
            outputs.append((proc.communicate(timeout=180)[1], proc.returncode))
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert [code for _, code in outputs] == [0, 0, 1, 1], outputs
    assert [line for line in outputs[2][0].splitlines() if line.startswith("error: ")] == [
        "error: engine.cuda_graph=true with several ranks (got 2) needs the gradients averaged inside the graph: "
        "set distributed.sync=allreduce (or engine.cuda_graph=false)"], outputs[2][0]
    (short,) = [line for line in outputs[3][0].splitlines() if line.startswith("error: ")]
    assert short.startswith("error: engine.cuda_graph=true with distributed.sync=allreduce needs every batch full"), short
    found = {(r.data.params["distributed.sync"], r.data.tags["cuda_graph"]): r for r in runs()
             if r.data.tags.get("sweep") != "true" and r.info.status == "FINISHED"}
    flat = [(sync, graph) for sync in ("allreduce", "sharded") for graph in ("false", "true")]
    assert sorted(found) == sorted([("ddp", "false"), *flat])
    ddp = found["ddp", "false"].data.metrics
    for key in flat:
        m = found[key].data.metrics
        assert m["final_loss"] == pytest.approx(ddp["final_loss"], rel=1e-5), key
        assert m["grad_mb"] == pytest.approx(ddp["grad_mb"], abs=1e-3) and m["grad_allreduce_ms"] > 0, key  # aligned views
        if key[1] == "true":
            assert m["graph_replays"] == 8, key  # 4 steps a rank per epoch, every one replayed


@two_gpus
def test_two_gpus_sharded_by_copy_engines_trains_as_nccls_sharded_eager_and_graphed(tmp_path, tracking_uri, runs):
    """distributed.exchange=copy (the ranks' buffers mapped into each other, each bucket's slice
    copied by the copy engines while backward runs; a bucket a parameter here): the same losses as
    NCCL's reduce-scatter and all-gather, eager and replayed in the step's graph."""
    size = ["engine.device=cuda", "dataset.shape=[64,64]", "dataset.num_samples=512", "loader=gpu_resident",
            "engine.epochs=2", "engine.progress=false", "model.hidden=32", "distributed.sync=sharded",
            "distributed.bucket_cap_mb=0.1", "-m", "distributed.exchange=nccl,copy", "engine.cuda_graph=false,true"]
    proc = _torchrun(tmp_path, tracking_uri, *size, f"hydra.sweep.dir={tmp_path}/sweep", start_new_session=True)
    try:
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    found = {(r.data.params["distributed.exchange"], r.data.tags["cuda_graph"]): r.data.metrics for r in runs()
             if r.data.tags.get("sweep") != "true" and r.info.status == "FINISHED"}
    assert sorted(found) == [("copy", "false"), ("copy", "true"), ("nccl", "false"), ("nccl", "true")]
    for graph in ("false", "true"):
        copy, nccl = found["copy", graph], found["nccl", graph]
        assert copy["final_loss"] == pytest.approx(nccl["final_loss"], rel=1e-5), graph
        assert copy["grad_mb"] >= nccl["grad_mb"]  # the same gradients, each bucket padded to the ranks' slices
    assert found["copy", "true"]["graph_replays"] == 8


@two_gpus
@pytest.mark.parametrize("sync", [[], ["distributed.sync=sharded", "distributed.exchange=copy"]], ids=["ddp", "sharded-copy"])
def test_a_failing_rank_ends_an_nccl_run_failed(sync, tmp_path, tracking_uri):
    """Rank 1's DataLoader worker is killed while rank 0 waits for it (in NCCL's all-reduce, or in
    the copy exchange's barrier kernel): the run ends FAILED with rank 1's error, and every process
    exits well before torchrun's SIGKILL."""
    from clirun import steps_csv, wait_for_running
    proc = _torchrun(tmp_path, tracking_uri, "engine.device=cuda", "model=mlp", "model.busy_ms=5",
                     "dataset.num_samples=200000", "dataset.shape=[8,8]", "loader.batch_size=8", "engine.epochs=1",
                     "engine.progress=false", "loader.num_workers=1", *sync, start_new_session=True)
    try:
        (r,) = wait_for_running(tracking_uri, proc, settle=10)
        rank1 = [int(c) for t in Path(f"/proc/{proc.pid}/task").iterdir() for c in (t / "children").read_text().split()
                 if b"RANK=1" in Path(f"/proc/{c}/environ").read_bytes().split(b"\0")]
        (worker,) = [int(c) for c in Path(f"/proc/{rank1[0]}/task/{rank1[0]}/children").read_text().split()][:1]
        started = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
        assert time.monotonic() - started < 25, f"ended by torchrun's SIGKILL, not by the peer watch: {err[-3000:]}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    r = MlflowClient(tracking_uri).get_run(r.info.run_id)
    assert r.info.status == "FAILED" and "rank 1 failed" in r.data.tags["error"], err
    assert len(steps_csv(tracking_uri, r.info.run_id)) >= 1


class _DictStore:
    """The two calls of a torch.distributed store that a host copy's maker uses."""

    def __init__(self):
        self.values = {}

    def set(self, key, value):
        self.values[key] = value


def test_a_shared_host_copy_is_page_locked_for_copies_and_the_gather_kernel():
    """The host's first rank's copy (its shared file, registered with cudaHostRegister): PyTorch
    sees it as page-locked, an asynchronous copy from it and the pinned_uva gather kernel read the
    bytes that were loaded, and closing it unregisters it."""
    from trainer.loaders import uva_gather
    from trainer.loaders.host_copy import HostCopy, HostPeers

    def fill(x, y):
        x.copy_(torch.arange(x.numel(), dtype=torch.int32).view_as(x))
        y.copy_(torch.arange(len(y)))

    copy = HostCopy(256, (64, 16), torch.int32, fill, pin=True, peers=HostPeers(0, 2, _DictStore(), "test"))
    assert copy.shared and copy.x.is_pinned()
    out = copy.x.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), copy.x)
    labels = copy.y.to("cuda")
    gather = uva_gather.RowGather(copy.x, labels, 4)
    rows = torch.tensor([255, 3, 100], device="cuda")
    target = torch.empty((3, 64, 16), dtype=torch.int32, device="cuda")
    target_y = torch.empty(3, dtype=torch.int64, device="cuda")
    gather(rows, gather.lanes(target), target_y)
    torch.cuda.synchronize()
    assert torch.equal(target.cpu(), copy.x[rows.cpu()]) and target_y.tolist() == [255, 3, 100]
    x = copy.x
    copy.close()
    assert not x.is_pinned()


# -- an image folder decoded on the GPU ---------------------------------------------------------
def test_gpu_decode_decodes_jpegs_with_nvjpeg_in_baselines_order(tmp_path, runs, tracking_uri):
    """JPEGs and PNGs of several sizes, some grey-scale: gpu_decode yields baseline's labels in
    baseline's order, its JPEGs decoded by nvJPEG (the PNGs on the host), its pixels near PIL's:
    nvJPEG's IDCT and its widening of the halved chroma planes round apart from libjpeg-turbo's, by
    tens of levels at single pixels of these noise images, whose colour changes from pixel to pixel
    (40 of 255 seen on an H200); a generated folder of JPEGs is all decoded on the GPU, and trains."""
    from test_gpu_decode import job, passes, write_mixed
    from trainer.fake_data import write_image_folder

    write_mixed(tmp_path / "mixed")
    folder = ["engine.device=cuda", "dataset=image_folder", f"dataset.root={tmp_path / 'mixed'}", "dataset.size=16",
              "loader.batch_size=16"]
    base, _ = passes(job(*folder, "loader=baseline"), device="cuda")
    mine, figures = passes(job(*folder, "loader=gpu_decode"), device="cuda")
    assert [y.tolist() for _, y in mine] == [y.tolist() for _, y in base]
    levels = (torch.cat([x for x, _ in mine]) - torch.cat([x for x, _ in base])).abs().cpu() * 255
    print(f"gpu_decode against PIL: at most {levels.max():.0f} levels of 255, {levels.mean():.3f} on average, "
          f"{(levels > 0.5).float().mean():.1%} of the values apart")
    assert levels.max() <= 64 and levels.mean() < 3.0
    assert figures["gpu_decoded_fraction"] == 0.5 and figures["decode_ms_per_batch"] > 0
    jpegs = write_image_folder(tmp_path, 256, size=64)
    summary = run(job("engine.device=cuda", "dataset=image_folder", f"dataset.root={jpegs}", "dataset.size=64",
                      "loader=gpu_decode", "loader.batch_size=32", "engine.max_steps=16", "engine.warmup_steps=4",
                      f"tracking.uri={tracking_uri}"))
    (r,) = runs()
    assert r.info.status == "FINISHED" and r.data.tags["degraded"] == "false"
    assert summary["gpu_decoded_fraction"] == 1.0 and summary["held_file_mb"] > 0
    assert 0 < summary["link_bytes_per_image"] < 3 * 64 * 64  # compressed: fewer bytes than its pixels


def test_gpu_decode_crops_and_flips_on_the_gpu_in_baselines_order(tmp_path):
    """`dataset.augment=crop_flip` on the GPU: JPEGs and PNGs of several sizes come in baseline's
    order with baseline's labels, as 16 px square floats in [0, 1]; a JPEG ramp, brightening left to
    right, decoded by nvJPEG and cropped and resized on the device, comes out darkening about half
    the time (flipped), and every crop of it still a ramp one way or the other."""
    from test_gpu_decode import job, mirrored, passes, write_mixed, write_ramps

    write_mixed(tmp_path / "mixed")
    folder = ["engine.device=cuda", "dataset=image_folder", f"dataset.root={tmp_path / 'mixed'}", "dataset.size=16",
              "loader.batch_size=16"]
    base, _ = passes(job(*folder, "loader=baseline"), device="cuda")
    mine, figures = passes(job(*folder, "loader=gpu_decode", "dataset.augment=crop_flip"), device="cuda")
    assert [y.tolist() for _, y in mine] == [y.tolist() for _, y in base]
    for (x, _), (bx, _) in zip(mine, base):
        assert x.shape == bx.shape and x.is_cuda and x.dtype == torch.float32 and 0 <= x.min() and x.max() <= 1
    assert figures["gpu_decoded_fraction"] == 0.5
    write_ramps(tmp_path / "ramps", suffix="jpg")
    ramps, figures = passes(job("engine.device=cuda", "dataset=image_folder", f"dataset.root={tmp_path / 'ramps'}",
                                "dataset.size=16", "loader.batch_size=8", "loader=gpu_decode",
                                "dataset.augment=crop_flip"), epochs=6, device="cuda")
    x = torch.cat([x for x, _ in ramps]).cpu()
    assert figures["gpu_decoded_fraction"] == 1.0 and 8 <= mirrored(x).sum() <= 40  # of 48: about half
    assert ((x[..., -1] - x[..., 0]).mean((1, 2)).abs() > 0.1).all()  # a crop spans 13 columns or more: 50 levels
