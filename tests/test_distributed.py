"""Several processes: shards of every epoch, results combined over ranks, real torchrun (gloo on the
CPU) with its faults, and the comparison's mark for jobs timed at the same time on one device."""

from __future__ import annotations

import ast
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
import torch
from hydra import compose, initialize_config_dir
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from clirun import LONG, all_runs, steps_csv, wait_for_running
from conftest import CONF_DIR
from datasets import build_dataset
from models import build_model
from trainer.loaders import build_loader, for_any_dataset
from trainer.loaders.order import Shard
from trainer.loop import distributed, limits
from trainer.loop.engine import planned_steps
from trainer.loop.run import run
from trainer.errors import ConfigError, Interrupted, RunFailed
from trainer.launch import LAUNCH_TIME_ENV, launch_time
from trainer.loop.verify import Checksum, combine_ranks
from trainer.tools import scaling
from trainer.validate import resolve, validate
from trainer.tracking import report, sweep

STRATEGIES = for_any_dataset()
SAME_SAMPLES = [s for s in STRATEGIES if s != "iterable_chunks"]  # iterable_chunks draws random rows (with replacement)
# 101 samples over 2 ranks: in batches of 17, 6 batches, 3 each (51 and 50 samples); in batches of
# 25, 5 batches: 3 and 2.
SMALL = ["dataset.num_samples=101", "dataset.shape=[4,4]", "engine.warmup_steps=1",
         "engine.progress=false", "engine.device=cpu", "model=mlp", "model.hidden=8"]


def samples(loader, epochs: int = 2):
    """Each epoch's samples as sorted (bytes, label) pairs, and the batch order, from `loader`."""
    out = []
    for _ in range(epochs):
        seen = [(x.numpy().tobytes(), int(y)) for xb, yb in loader for x, y in zip(xb, yb)]
        out.append(seen)
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_ranks_split_every_epoch_exactly_once(tiny_cfg, strategy):
    """Two ranks' shards of each epoch together hold exactly one process's samples; the same seed
    gives the same split; every strategy takes it from the shared order code."""
    extra = ["dataset.chunks=3", "dataset.num_samples=99"] if strategy != "iterable_chunks" else [
        "dataset.chunks=4", "dataset.num_samples=96", "dataset.batches_per_chunk=2"]
    cfg = tiny_cfg(f"loader={strategy}", *extra)
    ds = build_dataset(cfg.dataset)
    cpu = torch.device("cpu")
    whole = samples(build_loader(cfg.loader, ds, cpu, seed=3))
    parts = []
    for rank in (0, 1):
        loader = build_loader(cfg.loader, ds, cpu, seed=3, shard=Shard(rank, 2))
        assert len(loader) == loader.batches_per_rank()[rank]
        got = samples(loader)
        assert [len(e) for e in got] and all(len(e) < len(w) for e, w in zip(got, whole))
        parts.append(got)
        again = samples(build_loader(cfg.loader, ds, cpu, seed=3, shard=Shard(rank, 2)))
        assert again == got  # same seed, same split
    for epoch in range(2):
        assert sorted(parts[0][epoch] + parts[1][epoch]) == sorted(whole[epoch])
    assert sorted(parts[0][0]) != sorted(parts[1][0])


def test_shard_deals_the_epochs_batches_in_turn():
    """Batch j of the epoch goes to rank j % world_size; drop_last drops the epoch's partial batch once."""
    assert [Shard(r, 4).batches(1000, 64, drop_last=True) for r in range(4)] == [4, 4, 4, 3]  # 15 full batches
    assert [Shard(r, 4).batches(1000, 64, drop_last=False) for r in range(4)] == [4, 4, 4, 4]
    assert [Shard(r, 2).batches(129, 64, drop_last=False) for r in range(2)] == [2, 1]
    assert [Shard(r, 2).batches(129, 64, drop_last=True) for r in range(2)] == [1, 1]
    order = torch.arange(7)
    assert Shard().take(order, 2, drop_last=False).tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert Shard().take(order, 2, drop_last=True).tolist() == [0, 1, 2, 3, 4, 5]
    assert [Shard(r, 2).take(order, 2, drop_last=False).tolist() for r in range(2)] == [[0, 1, 4, 5], [2, 3, 6]]
    assert [Shard(r, 3).take(order, 2, drop_last=False).tolist() for r in range(3)] == [[0, 1, 6], [2, 3], [4, 5]]
    assert [Shard(r, 3).take(order, 2, drop_last=True).tolist() for r in range(3)] == [[0, 1], [2, 3], [4, 5]]
    for n, b, world in ((7, 2, 2), (7, 2, 3), (1000, 64, 4), (3, 4, 2), (8, 4, 2)):
        for drop in (False, True):
            for r in range(world):
                shard = Shard(r, world)
                assert shard.samples(n, b, drop) == len(shard.take(torch.arange(n), b, drop)), (n, b, world, drop, r)


def one_pass(loader) -> list:
    """One pass of `loader`: each batch as a tuple of its samples, (bytes, label)."""
    return [tuple((x.numpy().tobytes(), int(label)) for x, label in zip(xb, yb)) for xb, yb in loader]


@pytest.mark.parametrize("shuffle", ["true", "false"])
def test_ranks_are_dealt_the_one_process_batches_in_turn(tiny_cfg, shuffle):
    """1000 samples, batches of 64, drop_last, 4 ranks: each epoch's order is cut once into one
    process's 15 full batches, and rank r gets batches r, r + 4, ... (4, 4, 4 and 3 of them), for
    every strategy. The ranks together see the 960 distinct samples one process sees, and each
    rank's batches are baseline's (pinned_chunk deals its own shuffled sequence the same way)."""
    world, cpu = 4, torch.device("cpu")
    dealt = {}
    for strategy in SAME_SAMPLES:
        cfg = tiny_cfg(f"loader={strategy}", "dataset.num_samples=1000", "dataset.shape=[2,2]", "dataset.chunks=3",
                       "loader.batch_size=64", "loader.drop_last=true", f"loader.shuffle={shuffle}")
        ds = build_dataset(cfg.dataset)
        with build_loader(cfg.loader, ds, cpu, seed=5) as alone:
            whole = [one_pass(alone) for _ in range(2)]
        ranks = []
        for r in range(world):
            with build_loader(cfg.loader, ds, cpu, seed=5, shard=Shard(r, world)) as loader:
                assert loader.batches_per_rank() == [4, 4, 4, 3] and len(loader) == [4, 4, 4, 3][r]
                ranks.append([one_pass(loader) for _ in range(2)])
        for epoch in range(2):
            assert len(whole[epoch]) == 15 and {len(b) for b in whole[epoch]} == {64}
            for r in range(world):
                assert ranks[r][epoch] == whole[epoch][r::world], (strategy, epoch, r)
            assert len({sample for rank in ranks for batch in rank[epoch] for sample in batch}) == 960
        dealt[strategy] = ranks
    for strategy in SAME_SAMPLES:
        if shuffle == "false" or strategy != "pinned_chunk":
            assert dealt[strategy] == dealt["baseline"], strategy


def test_checksums_of_shards_combine_into_the_whole():
    """Per-epoch sums add up over ranks; the ordered checksum chains the ranks' in rank order."""
    x, y = torch.randn(10, 3, 4), torch.arange(10)
    whole, ranks = Checksum(torch.device("cpu")), [Checksum(torch.device("cpu")) for _ in range(2)]
    for epoch in range(2):
        order = torch.randperm(10, generator=torch.Generator().manual_seed(epoch))
        whole.update(x[order], y[order])
        whole.end_epoch()
        for r, c in enumerate(ranks):
            part = Shard(r, 2).take(order, 2, drop_last=False)
            for b in range(0, len(part), 2):
                c.update(x[part[b:b + 2]], y[part[b:b + 2]])
            c.end_epoch()
    combined = combine_ranks([c.result() for c in ranks])
    assert combined["epoch_checksums"] == whole.result()["epoch_checksums"]
    assert combined["verified_batches"] == 10  # 2 epochs x 5 batches, dealt 3 and 2
    assert combined["data_checksum_by_rank"].split(",") == [c.result()["data_checksum"] for c in ranks]
    swapped = combine_ranks([c.result() for c in reversed(ranks)])
    assert swapped["data_checksum"] != combined["data_checksum"]  # the ranks' own orders count


def test_summaries_combine_into_the_run_figures():
    a = {"throughput_samples_per_s": 100.0, "timed_wall_s": 2.0, "data_wait_fraction": 0.2, "h2d_GBps": 10.0,
         "compute_stream_span_fraction": 0.5, "total_samples": 250.0, "total_steps": 5.0, "pinned_host_mb": 30.0,
         "peak_gpu_mem_mb": 7.0, "timed_start_unix_s": 10.0, "timed_end_unix_s": 12.0, "final_loss": 1.5,
         "h2d_peak_pinned_GBps": 50.0, "median_step_ms": 4.0, "aggregate_h2d_peak_pinned_GBps": 90.0,
         "host_pss_mb": 700.0, "shared_host_mb": 64.0}
    b = dict(a, host_pss_mb=600.0, shared_host_mb=0.0, throughput_samples_per_s=50.0, timed_wall_s=4.0, data_wait_fraction=0.4, h2d_GBps=20.0,
             total_steps=6.0, peak_gpu_mem_mb=9.0, timed_start_unix_s=9.0, timed_end_unix_s=13.0, final_loss=2.0)
    del b["h2d_peak_pinned_GBps"], b["aggregate_h2d_peak_pinned_GBps"]  # measured by rank 0 only
    out = distributed.combine_summaries([a, b])
    assert out["throughput_samples_per_s"] == (100 * 2 + 50 * 4) / 4  # all samples over the longest region
    assert out["aggregate_h2d_GBps"] == 30.0 and out["h2d_GBps"] == 15.0
    assert out["data_wait_fraction"] == pytest.approx(0.3)
    assert (out["total_samples"], out["pinned_host_mb"], out["total_steps"], out["peak_gpu_mem_mb"]) == (500, 60, 6, 9)
    assert (out["timed_start_unix_s"], out["timed_end_unix_s"], out["timed_wall_s"]) == (9.0, 13.0, 4.0)
    assert out["final_loss"] == 1.5 and out["h2d_peak_pinned_GBps"] == 50.0 and out["aggregate_h2d_peak_pinned_GBps"] == 90.0
    assert (out["host_pss_mb"], out["ranks_host_pss_mb"], out["rank1/host_pss_mb"], out["shared_host_mb"]) == (650, 1300, 600, 64)
    assert out["rank1/data_wait_fraction"] == 0.4 and out["rank0/h2d_GBps"] == 10.0
    assert out["rank1/throughput_samples_per_s"] == 50.0


class _Store(dict):
    """The store's calls that `Ranks` makes, in memory (first writer wins, as in TCPStore)."""

    def compare_set(self, key, expected, desired):
        return self.setdefault(key, desired.encode())

    def set(self, key, value):
        self[key] = value.encode()

    def check(self, keys):
        return all(k in self for k in keys)

    def get(self, key):
        return self[key]


def _rank(rank: int, store: _Store) -> distributed.Ranks:
    ranks = distributed.Ranks.__new__(distributed.Ranks)
    ranks.rank, ranks.world_size, ranks.store, ranks.key = rank, 2, store, "run1/stop"
    return ranks


def test_the_all_ranks_copy_ceiling_counts_only_the_time_all_of_them_copied():
    """Two ranks each copying at 1 GB/s, the second starting 0.45 s later (a barrier lets ranks go
    apart): 2 GB/s while both copy, where the span from the first start to the last end reads
    1.6. A group of copies straddling the window's edge counts for its share inside it."""
    first = (0.0, [0.1 * i for i in range(1, 21)], 10**8)
    second = (0.45, [0.45 + 0.1 * i for i in range(1, 21)], 10**8)
    assert limits.shared_rate([first, second]) == pytest.approx(2.0)
    assert limits.shared_rate([first, (0.0, [2.0], 2 * 10**9)]) == pytest.approx(2.0)  # one group each way
    assert limits.shared_rate([first, (5.0, [5.1], 10**8)]) == pytest.approx(21e8 / 5.1e9)  # never at once: the whole span


def test_the_first_rank_to_stop_decides_how_every_rank_closes():
    """A rank's own failure stands (and is recorded); an error that follows another rank's failure
    or interrupt (a lost collective, torchrun's SIGTERM) becomes that rank's verdict."""
    store = _Store()
    own = RunFailed("loss became nan at step 40")
    assert _rank(1, store)._settle(own) is own
    assert store["run1/stop"] == b"failed|1|loss became nan at step 40" and store.check([distributed.STOPPED_KEY])
    for error in (Interrupted(signal.SIGTERM), RuntimeError("Connection reset by peer")):
        settled = _rank(0, store)._settle(error)
        assert isinstance(settled, distributed.PeerStopped)
        assert str(settled) == "rank 1 failed: loss became nan at step 40"
    assert _rank(0, store).stopped_elsewhere() and not _rank(1, store).stopped_elsewhere()

    store = _Store()
    assert isinstance(_rank(1, store)._settle(Interrupted(signal.SIGINT)), Interrupted)
    settled = _rank(0, store)._settle(RuntimeError("Connection reset by peer"))
    assert isinstance(settled, Interrupted) and settled.signum == signal.SIGINT  # Ctrl-C: KILLED, not FAILED
    crash = _rank(0, _Store())._settle(ValueError("bad\nthing"))
    assert isinstance(crash, ValueError)


def test_every_rank_plans_the_steps_of_the_single_process_loop(monkeypatch):
    """DDP's join() only when the ranks' plans differ: with engine.max_steps every rank that has a
    batch takes max_steps steps (as `planned_steps` plans them alone), whatever its shard's size."""
    monkeypatch.setattr(distributed.DistributedModel, "join", lambda self: "join")
    ddp = distributed.DistributedModel.__new__(distributed.DistributedModel)
    ranks = _rank(0, _Store())

    def joins(batches_per_rank, epochs, max_steps, model=ddp) -> bool:
        engine = OmegaConf.create({"epochs": epochs, "max_steps": max_steps})
        context = ranks.uneven(model, batches_per_rank, engine)
        assert (context == "join") == ranks.joined
        return ranks.joined

    assert planned_steps(OmegaConf.create({"epochs": 1, "max_steps": 7}), range(3)) == 7
    assert not joins([3, 2], epochs=1, max_steps=7)  # 7 steps each: 3 passes of rank 1's shard, 4 of rank 2's
    assert not joins([3, 2], epochs=30, max_steps=7)
    assert joins([3, 2], epochs=2, max_steps=0)  # 6 and 4 steps
    assert not joins([3, 3], epochs=2, max_steps=0)
    assert joins([3, 0], epochs=1, max_steps=7)  # a rank without a batch takes no step
    assert not joins([3, 2], epochs=2, max_steps=0, model=torch.nn.Identity())  # nothing to all-reduce


def test_launch_time_names_one_folder_for_every_rank(monkeypatch):
    monkeypatch.setenv(LAUNCH_TIME_ENV, "2026-01-02T03:04:05.678901")
    assert launch_time("%Y-%m-%d/%H-%M-%S-%f") == "2026-01-02/03-04-05-678901"
    monkeypatch.delenv(LAUNCH_TIME_ENV)
    assert launch_time("%Y") == time.strftime("%Y")


def test_jobs_timed_at_once_on_one_device_are_marked(tiny_cfg, tracking_uri):
    """Windows and devices come from the runs: jobs 0 and 1 overlap on the same GPU, job 2 runs
    at the same time on another GPU, job 3 on the first GPU after both."""
    cfg = tiny_cfg()
    parent_id = sweep.start_parent(cfg.tracking, "by hand", ["loader"], {})
    for strategy in ("baseline", "pinned", "prefetch", "gpu_resident"):
        run(tiny_cfg(f"loader={strategy}", f"tracking.parent_run_id={parent_id}"))
    client = MlflowClient(tracking_uri)
    _, rows = report.compare(client, client.get_run(parent_id))
    assert [r["overlap"] for r in rows] == ["", "", "", ""]  # one after another in this process
    for row, (start, end, devices) in zip(rows, [(0, 10, "h:GPU-a"), (5, 15, "h:GPU-a"), (0, 20, "h:GPU-b"),
                                                (16, 30, "h:GPU-a,h:GPU-b")]):
        client.log_metric(row["run_id"], "timed_start_unix_s", start)
        client.log_metric(row["run_id"], "timed_end_unix_s", end)
        client.set_tag(row["run_id"], "device_ids", devices)
    keys, rows = report.compare(client, client.get_run(parent_id))
    assert [r["overlap"] for r in rows] == ["1", "0", "3", "2"]
    assert report.overlap_warning(rows).startswith("warning: jobs 0, 1, 2, 3 were timed at the same time")
    assert "overlap" in report.format_table(keys, rows).splitlines()[0].split()


def test_scaling_table_lines_up_each_job_across_gpu_counts(tiny_cfg, tracking_uri, capsys):
    """The latest sweep of each world size, each job against the same job on one GPU."""
    client = MlflowClient(tracking_uri)
    for size in (1, 2):
        parent_id = sweep.start_parent(tiny_cfg().tracking, f"at {size}", ["loader"], {"world_size": str(size)})
        for strategy in ("baseline", "pinned"):
            run(tiny_cfg(f"loader={strategy}", f"tracking.parent_run_id={parent_id}"))
    sweeps = scaling.latest_sweeps(client, "feedbench")
    assert list(sweeps) == [1, 2]
    for r in report.children(client, sweeps[2]):  # figures of two ranks, as rank 0 logs them
        client.log_metric(r.info.run_id, "throughput_samples_per_s", 3000.0)
        client.log_metric(r.info.run_id, "aggregate_h2d_GBps", 8.0)
        client.log_metric(r.info.run_id, "aggregate_h2d_peak_pinned_GBps", 10.0)
        client.log_metric(r.info.run_id, "grad_allreduce_ms", 0.7)
        client.log_metric(r.info.run_id, "ms_per_step", 1.6)
        client.log_metric(r.info.run_id, "median_step_ms", 0.05)  # the host's launch of a graph: not the step
    for r in report.children(client, sweeps[1]):
        client.log_metric(r.info.run_id, "throughput_samples_per_s", 2000.0)
        client.log_metric(r.info.run_id, "h2d_GBps", 5.0)
        client.log_metric(r.info.run_id, "run_host_pss_mb", 900.0)
    own_id = sweep.start_parent(tiny_cfg("tracking.experiment=feedbench_own_copies").tracking, "own", ["loader"], {"world_size": "2"})
    run(tiny_cfg("loader=pinned", "tracking.experiment=feedbench_own_copies", f"tracking.parent_run_id={own_id}"))
    (copies,) = report.children(client, client.get_run(own_id))
    client.log_metric(copies.info.run_id, "run_host_pss_mb", 1100.0)
    rows = scaling.scaling_rows(client, scaling.latest_sweeps(client, "feedbench"),
                                scaling.latest_sweeps(client, "feedbench_own_copies", required=False))
    assert [(r["loader"], r["gpus"]) for r in rows] == [("baseline", 1), ("baseline", 2), ("pinned", 1), ("pinned", 2)]
    two = rows[1]
    assert (two["× 1 GPU"], two["efficiency"], two["copy × 1 GPU"], two["of ceiling"]) == (1.5, 0.75, 1.6, 0.8)
    assert (rows[2]["run MiB/rank"], rows[3]["… own copies"], two["… own copies"]) == (900.0, 1100.0, None)
    assert rows[0]["× 1 GPU"] == 1.0 and rows[0]["ceiling GB/s"] is None  # no CUDA: no ceiling measured
    assert (two["all-reduce ms"], rows[0]["all-reduce ms"]) == (0.7, None) and rows[0]["ms/step"] > 0
    assert two["ms/step"] == 1.6  # the timed region's wall time per step, not the host's median step
    assert scaling.main(["--uri", tracking_uri, "--experiment", "feedbench", "--markdown", str(Path(tracking_uri[10:]).parent / "s.md")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("feedbench: sweeps at 1, 2 GPU(s)") and out[1].split()[:5] == ["loader", "model", "step", "gpus", "status"]
    assert {r["step"] for r in rows} == {"eager, ddp"}
    assert scaling.main(["--uri", tracking_uri, "--experiment", "nope"]) == 2


def test_the_scaling_table_keeps_graphed_jobs_apart_from_eager_ones(tiny_cfg, tracking_uri):
    """A job graphed with one all-reduce is its own row, against the same graphed job on one GPU;
    a sharded job, run only on two GPUs, against that same one-GPU run (alone, no sync differs),
    and one sharded by the copy engines is a row of its own."""
    client = MlflowClient(tracking_uri)
    for size, thr in ((1, 2000.0), (2, 3600.0)):
        parent_id = sweep.start_parent(tiny_cfg().tracking, f"at {size}", ["engine.cuda_graph"], {"world_size": str(size)})
        for graph in ("false", "true"):
            run(tiny_cfg(f"engine.cuda_graph={graph}", "distributed.sync=allreduce", f"tracking.parent_run_id={parent_id}"))
        if size == 2:
            for exchange in ("nccl", "copy"):
                run(tiny_cfg("engine.cuda_graph=true", "distributed.sync=sharded", f"distributed.exchange={exchange}",
                             f"tracking.parent_run_id={parent_id}"))
    for r in [c for size in (1, 2) for c in report.children(client, scaling.latest_sweeps(client, "feedbench")[size])]:
        client.set_tag(r.info.run_id, "cuda_graph", r.data.params["engine.cuda_graph"].lower())  # as on a GPU
        two = r.data.tags["mlflow.parentRunId"] == scaling.latest_sweeps(client, "feedbench")[2].info.run_id
        graphed = r.data.params["engine.cuda_graph"].lower() == "true"
        sharded = r.data.params["distributed.sync"] == "sharded"
        copied = r.data.params["distributed.exchange"] == "copy"
        client.log_metric(r.info.run_id, "throughput_samples_per_s",
                          (3900.0 if copied else 3800.0 if sharded else 3600.0 if graphed else 3000.0) if two else 2000.0)
    rows = scaling.scaling_rows(client, scaling.latest_sweeps(client, "feedbench"))
    assert sorted((r["step"], r["gpus"], r["efficiency"]) for r in rows) == [
        ("eager, allreduce", 1, 1.0), ("eager, allreduce", 2, 0.75), ("graph, allreduce", 1, 1.0), ("graph, allreduce", 2, 0.9),
        ("graph, sharded", 2, 0.95), ("graph, sharded by copy", 2, 0.975)]


def _ranks(size: int, sync: str, exchange: str = "nccl", device: str = "cpu", on_host: Optional[int] = None) -> distributed.Ranks:
    """A `Ranks` as rank 0 of `size` sees it (`on_host` of them on its host), without joining a process group."""
    ranks = distributed.Ranks.__new__(distributed.Ranks)
    ranks.rank, ranks.world_size, ranks.sync, ranks.grads = 0, size, sync, None
    ranks.exchange_with, ranks.device_, ranks.local_world_size = exchange, torch.device(device), on_host or size
    return ranks


def test_the_copy_exchange_moves_sharded_slices_between_gpus_of_one_host(tiny_cfg):
    """distributed.exchange=copy maps the GPUs' buffers across the ranks: it is refused in one line
    for another sync, on the CPU, with engine.compile and across hosts; a world of one ignores it;
    a bad value is named."""
    with pytest.raises(ConfigError, match=r"^distributed.exchange=copy moves the slices of distributed.sync=sharded \(got "
                                          r"distributed.sync=allreduce\): set distributed.sync=sharded, or distributed.exchange=nccl$"):
        _ranks(2, "allreduce", "copy", "cuda:0").validate(tiny_cfg())
    with pytest.raises(ConfigError, match=r"^distributed.exchange=copy maps each GPU's buffers .*: set engine.device=cuda, "
                                          r"or distributed.exchange=nccl$"):
        _ranks(2, "sharded", "copy").validate(tiny_cfg())
    with pytest.raises(ConfigError, match=r"^distributed.exchange=copy needs every rank on one host \(got 4 ranks, 2 on this "
                                          r"host\): set distributed.exchange=nccl$"):
        _ranks(4, "sharded", "copy", "cuda:0", on_host=2).validate(tiny_cfg())
    with pytest.raises(ConfigError, match=r"^distributed.exchange=copy cannot be used with engine.compile=default: "
                                          r"set engine.compile=off, or distributed.exchange=nccl$"):
        _ranks(2, "sharded", "copy", "cuda:0").validate(tiny_cfg("engine.compile=default"))
    _ranks(2, "sharded", "copy", "cuda:0").validate(tiny_cfg("engine.cuda_graph=true"))
    _ranks(1, "allreduce", "copy").validate(tiny_cfg())
    with pytest.raises(ConfigError, match=r"^distributed.exchange must be one of nccl, copy \(got 'nvlink'\): set distributed.exchange=nccl$"):
        validate(tiny_cfg("distributed.exchange=nvlink"))


def test_a_graph_with_several_ranks_needs_the_all_reduce_it_can_hold(tiny_cfg):
    """DDP's hooks cannot be replayed: engine.cuda_graph=true with several ranks asks for
    distributed.sync=allreduce (or sharded); those syncs are the feedbench loop's; sharded refuses
    fp16's scaler, which would see one rank's slice of the gradients; one rank checks nothing."""
    with pytest.raises(ConfigError, match=r"^engine.cuda_graph=true with several ranks \(got 2\) needs the gradients averaged "
                                          r"inside the graph: set distributed.sync=allreduce \(or engine.cuda_graph=false\)$"):
        _ranks(2, "ddp").validate(tiny_cfg("engine.cuda_graph=true"))
    _ranks(2, "allreduce").validate(tiny_cfg("engine.cuda_graph=true"))
    _ranks(2, "sharded").validate(tiny_cfg("engine.cuda_graph=true", "engine.precision=bf16"))
    _ranks(1, "ddp").validate(tiny_cfg("engine.cuda_graph=true"))
    for sync in ("allreduce", "sharded"):
        with pytest.raises(ConfigError, match=f"^distributed.sync={sync} is the feedbench loop's .*: set distributed.sync=ddp, or engine.loop=feedbench$"):
            _ranks(2, sync).validate(tiny_cfg("engine.loop=lightning"))
    with pytest.raises(ConfigError, match=r"^distributed.sync=sharded cannot be used with engine.precision=fp16 \(.*slice.*\): "
                                          r"set engine.precision=bf16, or distributed.sync=allreduce$"):
        _ranks(2, "sharded").validate(tiny_cfg("engine.precision=fp16"))
    _ranks(2, "allreduce").validate(tiny_cfg("engine.precision=fp16"))
    _ranks(1, "sharded").validate(tiny_cfg("engine.precision=fp16"))
    with pytest.raises(ConfigError, match=r"^distributed.sync must be one of ddp, allreduce, sharded \(got 'nccl'\): set distributed.sync=ddp$"):
        validate(tiny_cfg("distributed.sync=nccl"))


def test_all_reduce_needs_every_rank_to_take_the_same_steps_and_graphs_full_batches(tiny_cfg):
    """Without DDP's join() a rank with fewer steps would leave the others waiting in their
    all-reduce: refused before the run, with the fixes; max_steps evens them out. Graphed, a short
    batch (run eagerly on its rank alone) is refused too. A model without gradients (noop) averages
    nothing and needs neither."""
    engine = tiny_cfg("engine.epochs=2").engine
    flat = _ranks(2, "allreduce")
    flat.grads = object()  # `wrap` made the flat gradients
    with pytest.raises(ConfigError, match=r"^distributed.sync=allreduce needs every rank to take the same number of steps "
                                          r"\(these shards give 6, 4\): set engine.max_steps, loader.drop_last=true, or distributed.sync=ddp"):
        flat.check_plan([3, 2], engine, graphed=False, short_batches=False)
    flat.check_plan([3, 2], tiny_cfg("engine.epochs=2", "engine.max_steps=7").engine, graphed=False, short_batches=True)
    flat.check_plan([3, 3], engine, graphed=True, short_batches=False)
    with pytest.raises(ConfigError, match=r"^engine.cuda_graph=true with distributed.sync=allreduce needs every batch full "
                                          r"\(.*\): set loader.drop_last=true$"):
        flat.check_plan([3, 3], engine, graphed=True, short_batches=True)
    _ranks(2, "ddp").check_plan([3, 2], engine, graphed=False, short_batches=True)
    _ranks(2, "allreduce").check_plan([3, 2], engine, graphed=True, short_batches=True)  # no gradients to average


def test_loaders_say_whether_an_epoch_has_a_short_batch(tiny_cfg):
    """The grid's last batch, unless drop_last drops it; iterable_chunks' random draws are whole
    batches, its pin_chunk slices end short where a chunk is not a multiple of the batch."""
    def short(*overrides):
        cfg = tiny_cfg(*overrides)
        with build_loader(cfg.loader, build_dataset(cfg.dataset), torch.device("cpu"), seed=0) as loader:
            return loader.has_short_batches()
    n = ["dataset.num_samples=100", "loader.batch_size=25"]
    assert not short(*n) and short("dataset.num_samples=101", "loader.batch_size=25")
    assert not short("dataset.num_samples=101", "loader.batch_size=25", "loader.drop_last=true")
    chunks = ["loader=iterable_chunks", "dataset.num_samples=100", "dataset.chunk_samples=30", "loader.batch_size=10"]
    assert not short(*chunks) and not short(*chunks, "loader.variant=pin_chunk", "loader.num_workers=0")
    assert short(*chunks[:-1], "loader.batch_size=20", "loader.variant=pin_chunk", "loader.num_workers=0")


class _TwoDtypes(torch.nn.Module):
    """A float32 layer and a float64 scale: two flat buffers."""

    def __init__(self):
        super().__init__()
        self.layer, self.scale = torch.nn.Linear(3, 4), torch.nn.Parameter(torch.ones(2, dtype=torch.float64))

    def forward(self, x):
        return (self.layer(x).double().sum(1, keepdim=True) * self.scale).sum()


def test_flat_gradients_are_views_averaged_in_one_collective(tmp_path, monkeypatch):
    """Every gradient a view of one flat buffer per dtype, rank 0's weights broadcast, backward adding
    into the views; a gradient replaced behind its back (optimizer.zero_grad()) is caught at the
    first average. (gloo, a world of one: the average is the rank's own gradient.)"""
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = _TwoDtypes()
        grads = distributed.FlatGradients(model, world_size=1)
        # in the parameters' order, the scale's first; each view starting on a 128-byte boundary
        assert grads.buckets() == [128, 2 * 128]  # 2 float64, then 12 and 4 float32, each rounded up to 128 bytes
        assert [p.grad.data_ptr() for p in model.parameters()] == [
            grads.flats[0].data_ptr(), grads.flats[1].data_ptr(), grads.flats[1].data_ptr() + 128]
        x = torch.randn(5, 3)
        collectives = []
        real = torch.distributed.all_reduce
        monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, *a, **k: collectives.append(t.numel()) or real(t, *a, **k))
        for _ in range(2):  # the second step's gradients, not their sum: zero() empties the views
            grads.zero()
            model(x).backward()
            grads.average()
        assert collectives == [16, 64] * 2  # one all-reduce per flat buffer and step
        reference = _TwoDtypes()
        reference.load_state_dict(model.state_dict())
        reference(x).backward()
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
        halved = distributed.FlatGradients(model, world_size=2)  # gloo: a sum over the ranks, then / 2 (here one rank)
        halved.zero()
        model(x).backward()
        halved.average()
        assert all(torch.equal(p.grad, q.grad / 2) for p, q in zip(model.parameters(), reference.parameters()))
        fresh = distributed.FlatGradients(model, world_size=1)
        torch.optim.SGD(model.parameters(), lr=0.1).zero_grad()
        model(x).backward()
        with pytest.raises(RuntimeError, match="optimizer.zero_grad"):
            fresh.average()
    finally:
        torch.distributed.destroy_process_group()


# -- real torchrun ------------------------------------------------------------------------------
_started = []


def torchrun(tmp_path: Path, uri: str, *args: str, nproc: int = 2, entry=("-m", "trainer"), **popen) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--monitor-interval=0.2",
           *entry, *args, f"tracking.uri={uri}"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
    _started.append(proc)
    return proc


@pytest.fixture(autouse=True)
def _no_leftover_processes():
    yield
    while _started:
        proc = _started.pop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its ranks (own session, below)
            proc.communicate(timeout=30)


def ranks_of(pid: int, timeout: float = 60) -> dict:
    """RANK -> pid of the workers torchrun `pid` started."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = {}
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
                rank = [e[5:].decode() for e in env if e.startswith(b"RANK=")]
                if rank:
                    found[int(rank[0])] = int(child)
        if len(found) == 2:
            return found
        time.sleep(0.2)
    raise AssertionError("torchrun started no ranks")


def alive(pids) -> list:
    return [p for p in pids if Path(f"/proc/{p}").exists() and b") Z " not in Path(f"/proc/{p}/stat").read_bytes()]


def test_ranks_leave_the_process_group_together_as_nccl_needs(tmp_path, tracking_uri):
    """NCCL's shutdown may wait for every peer. With gloo made to do the same
    (`tests/shutdown_together.py`), a two-rank run ends FINISHED and every process exits: no rank
    sits in the process group's shutdown while another waits for it to be done."""
    script = str(Path(__file__).with_name("shutdown_together.py"))
    proc = torchrun(tmp_path, tracking_uri, *SMALL, "engine.epochs=1", f"hydra.run.dir={tmp_path}/run",
                    entry=(script,), start_new_session=True)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    (r,) = all_runs(tracking_uri)
    assert r.info.status == "FINISHED" and r.data.tags["world_size"] == "2"


def test_torchrun_sweep_two_ranks_one_run_per_job_equal_to_one_process(tmp_path, tracking_uri, tiny_cfg):
    """`torchrun --nproc_per_node=2 -m trainer -m ...` with gloo: the jobs with a bad value fail
    (printed once each; every rank goes on to the next job); batches of 17 train with DDP and
    finish: one FINISHED run tagged world_size=2 whose epoch checksums equal a single process's.
    With batches of 25 the shards give the ranks different numbers of steps per epoch: over
    `engine.epochs`, DDP's join lets the longer one finish; with `engine.max_steps` every rank
    takes max_steps, as one process would, and no join is needed."""
    proc = torchrun(tmp_path, tracking_uri, "-m", "loader.batch_size=0,17,25", "engine.max_steps=0,7", *SMALL,
                    "engine.epochs=2", "engine.verify=true", f"hydra.sweep.dir={tmp_path}/sweep/${{launch_time:%H-%M-%S-%f}}",
                    start_new_session=True)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode != 0, err  # Hydra reports the failed jobs at the end of the sweep
    assert [line for line in err.splitlines() if line.startswith("error: ")] == [
        "error: loader.batch_size must be >= 1 (got 0): set loader.batch_size=64"] * 2, err
    assert len(list((tmp_path / "sweep").iterdir())) == 1  # one output folder for both ranks

    found = all_runs(tracking_uri)
    (parent,) = [r for r in found if r.data.tags.get("sweep") == "true"]
    jobs = {(int(r.data.params["loader.batch_size"]), int(r.data.params["engine.max_steps"])): r
            for r in found if r is not parent}
    assert parent.data.tags["world_size"] == "2" and len(jobs) == 6
    assert all(r.data.tags["mlflow.parentRunId"] == parent.info.run_id for r in jobs.values())
    for (batch, _), r in jobs.items():
        assert r.info.status == ("FAILED" if batch == 0 else "FINISHED")
    assert "loader.batch_size" in jobs[0, 0].data.tags["error"]
    done, uneven = jobs[17, 0], jobs[25, 0]
    assert uneven.data.tags["steps_per_rank"] == "6,4" and uneven.data.metrics["total_samples"] == 202
    assert (uneven.data.tags["ddp_join"], done.data.tags["ddp_join"]) == ("true", "false")
    # max_steps=7: 3 + 3 + 1 steps of 17, 17, 17 on rank 0 and of 17, 17, 16 on rank 1;
    # 3 passes of 25, 25, 1 on rank 0, 4 of 25, 25 on rank 1
    for batch, samples in ((17, 119 + 117), (25, 127 + 175)):
        r = jobs[batch, 7]
        assert (r.data.tags["steps_per_rank"], r.data.tags["ddp_join"]) == ("7,7", "false")
        assert (r.data.metrics["total_steps"], r.data.metrics["total_samples"]) == (7, samples)
    assert (done.data.tags["world_size"], done.data.tags["backend"], done.data.tags["steps_per_rank"]) == ("2", "gloo", "6,6")
    m = done.data.metrics
    assert m["total_samples"] == 202 and m["total_steps"] == 6
    assert {f"rank{r}/{k}" for r in (0, 1) for k in ("data_wait_fraction", "h2d_GBps", "compute_stream_span_fraction")} <= set(m)
    added = m["rank0/h2d_GBps"] + m["rank1/h2d_GBps"]
    assert m["aggregate_h2d_GBps"] == added or math.isnan(m["aggregate_h2d_GBps"]) and math.isnan(added)  # nan on CPUs
    assert len(steps_csv(tracking_uri, done.info.run_id)) == 6
    # DDP's exchange measured alone after the loop: every gradient, once
    spec = tiny_cfg(*SMALL)
    resolve(spec)
    data = build_dataset(spec.dataset)
    model = build_model(spec.model, data.sample_shape, data.num_classes)
    assert m["grad_mb"] * 2**20 == sum(p.numel() * p.element_size() for p in model.parameters())
    assert m["grad_allreduce_ms"] > 0 and m["allreduce_bus_GBps"] > 0
    assert "steps_rank1.csv" in {a.path for a in MlflowClient(tracking_uri).list_artifacts(done.info.run_id)}

    single = tiny_cfg(*SMALL, "loader.batch_size=17", "engine.epochs=2", "engine.verify=true", "tracking.experiment=single")
    assert run(single)["total_samples"] == 202
    (alone,) = all_runs(tracking_uri, "single")
    assert alone.data.tags["world_size"] == "1"
    epochs = ast.literal_eval(done.data.tags["epoch_checksums"])
    assert epochs == ast.literal_eval(alone.data.tags["epoch_checksums"]) and len(epochs) == 2
    # the ranks trained on exactly one process's batches, dealt in turn
    assert int(done.data.tags["verified_batches"]) == int(alone.data.tags["verified_batches"]) == 12


def test_two_ranks_averaging_in_one_all_reduce_or_sharded_train_as_ddp(tmp_path, tracking_uri):
    """gloo, two ranks: distributed.sync=allreduce trains the same weights as DDP (the final loss,
    exactly: halving a sum of two is exact), and so does sharded (each rank updating half of the
    weights), on the same batches; their exchange is measured; shards that give the ranks
    different numbers of steps are refused in one line."""
    proc = torchrun(tmp_path, tracking_uri, "-m", "distributed.sync=ddp,allreduce,sharded", "loader.batch_size=17,25", *SMALL,
                    "engine.epochs=2", "engine.verify=true", f"hydra.sweep.dir={tmp_path}/sweep", start_new_session=True)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0  # the refused jobs
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert [line.split(" needs")[0] for line in lines] == ["error: distributed.sync=allreduce", "error: distributed.sync=sharded"]
    assert lines[0].startswith(  # refused as the run's parts are built: the run is marked FAILED with it
        "error: distributed.sync=allreduce needs every rank to take the same number of steps (these shards give 6, 4): "
        "set engine.max_steps, loader.drop_last=true, or distributed.sync=ddp (its join() stands in for a rank that has finished)"), err
    jobs = {(r.data.params["distributed.sync"], int(r.data.params["loader.batch_size"])): r
            for r in all_runs(tracking_uri) if r.data.tags.get("sweep") != "true"}
    assert {k: r.info.status for k, r in jobs.items()} == {
        ("ddp", 17): "FINISHED", ("allreduce", 17): "FINISHED", ("sharded", 17): "FINISHED",
        ("ddp", 25): "FINISHED", ("allreduce", 25): "FAILED", ("sharded", 25): "FAILED"}
    ddp = jobs["ddp", 17].data
    for sync in ("allreduce", "sharded"):
        flat = jobs[sync, 17].data
        assert flat.metrics["final_loss"] == pytest.approx(ddp.metrics["final_loss"], rel=1e-6, abs=0), sync
        assert flat.tags["epoch_checksums"] == ddp.tags["epoch_checksums"] and flat.tags["steps_per_rank"] == "6,6"
        assert flat.metrics["grad_allreduce_ms"] > 0
    assert jobs["allreduce", 17].data.metrics["final_loss"] == ddp.metrics["final_loss"]
    # the flat buffers: each parameter at an aligned address, and sharded's cut in two aligned halves
    for sync in ("allreduce", "sharded"):
        assert 0 <= jobs[sync, 17].data.metrics["grad_mb"] * 2**20 - ddp.metrics["grad_mb"] * 2**20 < 4 * 128 + 2 * 128


SHARDED = """
import copy, sys, tempfile, torch, torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from trainer.loop.distributed import FlatGradients, ShardedGradients
from trainer.loop.steps import EagerStep

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        # 300, 60, 120 and 2 weights, at 0, 320, 384 and 512 (128-byte starts): a rank's slice cuts the first in two
        self.net = nn.Sequential(nn.Linear(5, 60), nn.Tanh(), nn.Linear(60, 2))
        self.frozen = nn.Parameter(torch.ones(3), requires_grad=False)

    def loss(self, x, y):
        return F.mse_loss(self.net(x), y)

def batches(r, steps=5):
    data = torch.Generator().manual_seed(10 + r)  # each rank its own batches
    return [(torch.randn(4, 5, generator=data), torch.randn(4, 2, generator=data)) for _ in range(steps)]

def train(r, n, how, make_optimizer):
    torch.manual_seed(r)  # each rank its own initial weights: rank 0's are broadcast
    model = Model()
    grads = {"sharded": lambda: ShardedGradients(model, n, r), "allreduce": lambda: FlatGradients(model, n)}[how]()
    start = [p.detach().clone() for p in model.net.parameters()]
    optimizer = make_optimizer(grads.updated())
    step = EagerStep(model, optimizer, grads=grads)
    for x, y in batches(r):
        step(x, y)
    return model, grads, optimizer, start

def one_process(n, make_optimizer):
    # every rank's batches in one batch: its mean loss is the mean of the ranks' (equal batch sizes)
    torch.manual_seed(0)
    model = Model()
    optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad])
    for steps in zip(*(batches(r) for r in range(n))):
        optimizer.zero_grad()
        model.loss(torch.cat([x for x, _ in steps]), torch.cat([y for _, y in steps])).backward()
        optimizer.step()
    return model

def flat_weights(model):
    return torch.cat([p.detach().reshape(-1) for p in model.net.parameters()])

def rank(r, path, n):
    dist.init_process_group("gloo", store=dist.FileStore(path, n), rank=r, world_size=n)
    sgd = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)  # an update that scales with the gradient
    adamw = lambda params: torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)
    by_sgd = flat_weights(train(r, n, "sharded", sgd)[0])
    flat, _, flat_opt, _ = train(r, n, "allreduce", adamw)
    model, grads, optimizer, start = train(r, n, "sharded", adamw)
    weights = flat_weights(model)
    every = [torch.zeros_like(weights) for _ in range(n)]
    dist.all_gather(every, weights)
    moments = lambda opt: sum(v.numel() for s in opt.state.values() for v in s.values() if v.dim())
    optimizer.zero_grad()  # drops the slice's gradient: the check says so
    try:
        grads.check_views()
        dropped = "not caught"
    except RuntimeError as e:
        dropped = str(e)
    if r == 0:
        print(repr({
            "ranks_equal": all(torch.equal(every[0], w) for w in every),
            "sgd_vs_one_process": (by_sgd - flat_weights(one_process(n, sgd))).abs().max().item(),
            "adamw_vs_allreduce": (weights - flat_weights(flat)).abs().max().item(),
            "moved": (weights - torch.cat([p.reshape(-1) for p in start])).abs().min().item() > 0,
            "views": [p.data_ptr() == grads.weights[0][a:].data_ptr() for p, a in zip(model.net.parameters(), (0, 320, 384, 512))],
            "flat": grads.flats[0].numel(), "shard": grads.shards[0].numel(),
            "state": moments(optimizer), "flat_state": moments(flat_opt), "frozen": model.frozen.grad is None,
            "dropped": dropped}), flush=True)
    dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":
    n = int(sys.argv[1])
    torch.multiprocessing.spawn(rank, args=(tempfile.mktemp(), n), nprocs=n)
"""


@pytest.mark.parametrize("ranks, shard", [(2, 288), pytest.param(3, 192, marks=pytest.mark.slow)])  # three ranks with `-m slow`
def test_sharded_ranks_each_update_a_slice_and_train_as_one_process_on_all_batches(tmp_path, ranks, shard):
    """distributed.sync=sharded over gloo, with a parameter cut between two ranks' slices: with
    SGD (whose update scales with the gradient, so a sum instead of the mean shows) the weights
    are those of one process training on every rank's batches at once; with AdamW every rank ends
    with the same weights as one all-reduce with the whole optimizer on every rank, and each holds
    the optimizer's state of its slice only. Each parameter is a view of the flat buffer at a
    128-byte boundary, a frozen one stays out, and a dropped slice gradient is caught."""
    script = tmp_path / "sharded.py"
    script.write_text(SHARDED)
    out = subprocess.run([sys.executable, str(script), str(ranks)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert out.returncode == 0, out.stderr
    got = ast.literal_eval(out.stdout.strip())
    assert got["ranks_equal"] and got["moved"] and got["views"] == [True] * 4 and got["frozen"]
    assert got["sgd_vs_one_process"] < 1e-6 and got["adamw_vs_allreduce"] < 1e-6
    assert (got["flat"], got["shard"]) == (576, shard)  # 514 weights, aligned, in equal aligned slices
    assert got["flat_state"] == 2 * 482 and got["state"] == 2 * shard  # AdamW's two moments: all weights, or one slice
    assert got["dropped"].startswith("the gradient of this rank's slice was replaced"), got["dropped"]


@pytest.mark.slow  # the two-rank tests run by default; four ranks with `-m slow`
def test_torchrun_four_ranks_with_drop_last_train_on_the_one_process_batches(tmp_path, tracking_uri, tiny_cfg):
    """gloo, 4 ranks, 1000 samples in batches of 64 with drop_last, every strategy: the ranks take
    4, 4, 4 and 3 steps over the 960 samples one process trains on (equal epoch checksums), and
    each rank hashes exactly the batches its shard yields in one process (`data_checksum_by_rank`),
    whatever the strategy. (pinned_chunk shuffles whole batches: it deals its own sequence, and
    drop_last drops the same rows every epoch, not baseline's last 40 of a per-sample shuffle.)"""
    size = ["dataset.num_samples=1000", "dataset.shape=[4,4]", "loader.batch_size=64", "loader.drop_last=true",
            "engine.epochs=1", "engine.verify=true", "engine.warmup_steps=1", "engine.progress=false",
            "engine.device=cpu", "model=mlp", "model.hidden=8"]
    proc = torchrun(tmp_path, tracking_uri, "-m", f"loader={','.join(SAME_SAMPLES)}", *size,
                    f"hydra.sweep.dir={tmp_path}/sweep", nproc=4, start_new_session=True)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    jobs = {r.data.tags["strategy"]: r for r in all_runs(tracking_uri) if r.data.tags.get("sweep") != "true"}
    assert sorted(jobs) == sorted(SAME_SAMPLES)

    for strategy in ("baseline", "pinned_chunk"):
        run(tiny_cfg(*size, f"loader={strategy}", "tracking.experiment=single"))
    alone = {r.data.tags["strategy"]: r.data.tags["epoch_checksums"] for r in all_runs(tracking_uri, "single")}
    cfg = tiny_cfg(*size, "loader=baseline")
    dataset, cpu, by_rank = build_dataset(cfg.dataset), torch.device("cpu"), []
    for rank in range(4):  # each rank's batches, hashed in this process
        checksum = Checksum(cpu)
        with build_loader(cfg.loader, dataset, cpu, seed=cfg.engine.seed, shard=Shard(rank, 4)) as loader:
            for x, y in loader:
                checksum.update(x, y)
        by_rank.append(checksum.result()["data_checksum"])
    for strategy, r in jobs.items():
        assert (r.info.status, r.data.tags["steps_per_rank"]) == ("FINISHED", "4,4,4,3"), strategy
        assert r.data.metrics["total_samples"] == 960
        assert r.data.tags["epoch_checksums"] == alone[strategy if strategy == "pinned_chunk" else "baseline"], strategy
        if strategy != "pinned_chunk":
            assert r.data.tags["data_checksum_by_rank"].split(",") == by_rank, strategy


def test_the_gpu_topology_is_read_from_nvidia_smi():
    """`nvidia-smi topo -m` as a two-H100 host prints it: the link between the GPUs, their NUMA node."""
    from trainer.loop.environment import parse_topology
    text = ("\t\x1b[4mGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
            "GPU0\t X \tNV18\t0-31\t0\t\tN/A\nGPU1\tNV18\t X \t0-31\t0\t\tN/A\n\nLegend:\n\n  X    = Self\n")
    topo = parse_topology(text)
    assert sorted(topo) == ["GPU0", "GPU1"]
    assert (topo["GPU0"]["GPU1"], topo["GPU1"]["NUMA Affinity"], topo["GPU1"]["GPU NUMA ID"]) == ("NV18", "0", "N/A")


def test_multi_gpu_preset_sweeps_every_strategy_of_baselines_samples():
    """The README's multi-GPU table covers every strategy (iterable_chunks draws random rows instead)."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=["experiment=multi_gpu"], return_hydra_config=True)
    assert sorted(cfg.hydra.sweeper.params.loader.split(",")) == sorted(SAME_SAMPLES)


def test_a_failing_rank_fails_the_run_and_every_process_exits(tmp_path, tracking_uri):
    """Rank 1's DataLoader worker dies mid-run: rank 1 fails, torchrun stops rank 0, and rank 0
    closes the run FAILED with rank 1's error and the steps it measured."""
    proc = torchrun(tmp_path, tracking_uri, *LONG, "loader.num_workers=1", f"hydra.run.dir={tmp_path}/run",
                    start_new_session=True)
    (r,) = wait_for_running(tracking_uri, proc)
    ranks = ranks_of(proc.pid)
    deadline = time.monotonic() + 60
    while not (workers := Path(f"/proc/{ranks[1]}/task/{ranks[1]}/children").read_text().split()):
        assert time.monotonic() < deadline, "rank 1 started no DataLoader worker"
        time.sleep(0.1)
    os.kill(int(workers[0]), signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and not alive(ranks.values())
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: rank 1 failed: "), err
    assert f"(run {r.info.run_id} marked FAILED)" in errors[0]
    r = MlflowClient(tracking_uri).get_run(r.info.run_id)
    assert r.info.status == "FAILED" and r.data.tags["error"].startswith("PeerStopped: rank 1 failed: ")
    assert len(steps_csv(tracking_uri, r.info.run_id)) == r.data.metrics["total_steps"] >= 1
    assert len(all_runs(tracking_uri)) == 1  # rank 1 recorded nothing of its own


HOLDING = ["pinned_chunk", "pinned_uva", "pinned_gather"]  # the strategies that hold the whole dataset on the host


def test_the_ranks_of_a_host_hold_one_copy_of_the_dataset(tmp_path, tracking_uri):
    """gloo, 2 ranks, a 128 MiB dataset, each strategy that holds it whole, with one shared host copy
    and with a copy per rank: the ranks train on the same batches either way (equal checksums),
    and the host memory their runs took (`run_host_pss_mb`, proportional shares, added over the
    ranks) is one dataset less with the shared copy, which the rank that made it reports once
    (`shared_host_mb`)."""
    mib = 128
    size = ["dataset.num_samples=512", "dataset.shape=[256,256]", "loader.batch_size=64", "engine.max_steps=6",
            "engine.verify=true", "engine.warmup_steps=1", "engine.progress=false", "engine.device=cpu", "model=noop"]
    # The first strategy twice: a process's first runs take memory once (imports, caches) that
    # would count as theirs; the later run of each pair stands.
    proc = torchrun(tmp_path, tracking_uri, "-m", f"loader={HOLDING[0]},{','.join(HOLDING)}",
                    "loader.shared_host_copy=true,false", *size, f"hydra.sweep.dir={tmp_path}/sweep", start_new_session=True)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    jobs = {(r.data.tags["strategy"], r.data.params["loader.shared_host_copy"]): r
            for r in all_runs(tracking_uri) if r.data.tags.get("sweep") != "true"}  # (in the order they ran)
    assert len(jobs) == 6 and all(r.info.status == "FINISHED" for r in jobs.values())
    for strategy in HOLDING:
        shared, own = jobs[strategy, "True"], jobs[strategy, "False"]
        assert shared.data.tags["data_checksum_by_rank"] == own.data.tags["data_checksum_by_rank"], strategy
        assert shared.data.metrics["shared_host_mb"] == pytest.approx(mib, abs=0.1) and "shared_host_mb" not in own.data.metrics
        took = {k: 2 * r.data.metrics["run_host_pss_mb"] for k, r in (("shared", shared), ("own", own))}  # mean × ranks
        assert took["own"] - took["shared"] == pytest.approx(mib, rel=0.15), (strategy, took)


def _mapping_kib(pid: int, name: str, field: str) -> int:
    """`field` (Rss, Pss, ...) in KiB of the mappings of process `pid` whose file is `name`."""
    total, inside = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0]:  # a mapping's header: address range, ..., path
            inside = name in line
        elif inside and line.startswith(f"{field}:"):
            total += int(line.split()[1])
    return total


def test_a_killed_launch_leaves_no_shared_copy_behind(tmp_path, tracking_uri):
    """Both ranks map the same file (one inode) while they train, and its pages, counted over the
    ranks in proportion (Pss), are one dataset; rank 1 killed, every process exits and no process
    maps the shared copy any more: its memory has gone back to the system (it never had a name in
    /dev/shm or any other filesystem)."""
    from trainer.loaders.host_copy import NAME_PREFIX
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    proc = torchrun(tmp_path, tracking_uri, *LONG, "loader=pinned_uva", f"hydra.run.dir={tmp_path}/run",
                    start_new_session=True)
    (r,) = wait_for_running(tracking_uri, proc)
    ranks = ranks_of(proc.pid)
    inodes = {rank: {line.split()[4] for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if NAME_PREFIX in line}
              for rank, pid in ranks.items()}
    assert len(inodes[0]) == 1 and inodes[0] == inodes[1], inodes
    pss = sum(_mapping_kib(pid, NAME_PREFIX, "Pss") for pid in ranks.values())
    assert pss * 1024 == pytest.approx(100000 * 4 * 4 * 4 + 100000 * 8, rel=0.01)  # LONG's samples and labels, once
    os.kill(ranks[1], signal.SIGKILL)
    proc.communicate(timeout=120)
    assert proc.returncode != 0 and not alive(ranks.values())
    (inode,) = inodes[0]
    holders = []
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            if any(NAME_PREFIX in line and line.split()[4] == inode for line in maps.read_text().splitlines()):
                holders.append(maps.parent.name)
        except OSError:
            pass  # a process that ended meanwhile, or one we may not read
    assert not holders
    shm_after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert not {name for name in shm_after - shm_before if "feedbench" in name}
    assert MlflowClient(tracking_uri).get_run(r.info.run_id).info.status == "KILLED"  # torchrun stopped rank 0


@pytest.mark.slow  # a long case: a failing and a killed rank under torchrun run by default
def test_ctrl_c_under_torchrun_marks_the_run_killed(tmp_path, tracking_uri):
    """torchrun forwards SIGINT to every rank: the run is KILLED with its steps, all ranks exit."""
    proc = torchrun(tmp_path, tracking_uri, *LONG, f"hydra.run.dir={tmp_path}/run", start_new_session=True)
    (r,) = wait_for_running(tracking_uri, proc)
    ranks = ranks_of(proc.pid)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and not alive(ranks.values())
    assert err.count("interrupted by SIGINT") == 1, err  # printed once, by rank 0
    r = MlflowClient(tracking_uri).get_run(r.info.run_id)
    assert r.info.status == "KILLED" and r.data.tags["interrupted_by"] == "SIGINT"
    assert len(steps_csv(tracking_uri, r.info.run_id)) == r.data.metrics["total_steps"] >= 1


# -- the host copy's exchange, in one process (the "other rank" opens this process's file) ---------
def _peers(local_rank: int, store, timeout_s: float = 5.0):
    from trainer.loaders.host_copy import HostPeers
    return HostPeers(local_rank, 2, store, "test/run", timeout_s)


def _fill(x, y):
    x.copy_(torch.arange(x.numel(), dtype=torch.float32).view_as(x))
    y.copy_(torch.arange(len(y)))


def test_the_other_ranks_map_the_first_ranks_copy_and_see_its_bytes():
    from trainer.loaders import host_copy
    from trainer.loaders.host_copy import HostCopy
    store = torch.distributed.HashStore()
    first = HostCopy(10, (3, 4), torch.float32, _fill, pin=False, peers=_peers(0, store))
    host_copy._made["test/run"] -= 1  # the "other rank" makes its copies in the same order
    other = HostCopy(10, (3, 4), torch.float32, lambda x, y: pytest.fail("only the first rank loads"), pin=False,
                     peers=_peers(1, store))
    assert other.shared and not other.filled_here and torch.equal(other.x, first.x) and torch.equal(other.y, first.y)
    first.x[0, 0, 0] = -1.0  # one file: a write is seen through the other mapping
    assert other.x[0, 0, 0] == -1.0
    other.close()
    first.close()


@pytest.mark.parametrize("how", ["fails loading", "fails before", "dies", "another file"])
def test_a_rank_waiting_for_the_copy_stops_when_the_first_rank_cannot_share_it(how):
    """The first rank's own error reaches the others at once (not after distributed.timeout_s), as
    does its death; a file that is not the one announced is refused."""
    from trainer.errors import ConfigError, RunFailed
    from trainer.loaders import host_copy
    store = torch.distributed.HashStore()
    first = _peers(0, store)
    if how == "fails loading":
        def broken(x, y):
            raise OSError("disk gone")
        with pytest.raises(OSError):
            host_copy.HostCopy(10, (3,), torch.float32, broken, pin=False, peers=first)
        host_copy._made["test/run"] -= 1
    elif how == "fails before":
        first.give_up("dataset.num_samples too large")
    elif how == "dies":
        store.set(f"{first.next_key()}/loading", "999999999")  # no such process
    else:
        made = host_copy.HostCopy(10, (3,), torch.float32, _fill, pin=False, peers=first)
        host_copy._made["test/run"] -= 1
        key = f"{first.key}/host_copy{host_copy._made['test/run']}"
        pid, fd, nbytes, _ = store.get(key).decode().split("|")
        store.set(key, f"{pid}|{fd}|{nbytes}|{host_copy.NAME_PREFIX}-other")
    started = time.monotonic()
    error = ConfigError if how == "another file" else RunFailed
    with pytest.raises(error) as raised:
        host_copy.HostCopy(10, (3,), torch.float32, _fill, pin=False, peers=_peers(1, store, timeout_s=60))
    assert time.monotonic() - started < 5
    expected = {"fails loading": "disk gone", "fails before": "num_samples too large", "dies": "ended before",
                "another file": "shared_host_copy=false"}[how]
    assert expected in str(raised.value)


DDP_BUCKETS = """
import sys, tempfile, torch, torch.distributed as dist
from torch import nn
from trainer.loop.distributed import DistributedModel, ddp_buckets

def rank(r, path):
    dist.init_process_group("gloo", store=dist.FileStore(path, 2), rank=r, world_size=2)
    torch.manual_seed(0)
    model = DistributedModel(nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512)), bucket_cap_mb=0.5)
    before = ddp_buckets(model)
    for _ in range(3):  # the buckets are rebuilt at the second step's forward
        model(torch.randn(4, 512)).sum().backward()
    if r == 0:
        print(before, ddp_buckets(model), flush=True)
    dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":
    torch.multiprocessing.spawn(rank, args=(tempfile.mktemp(),), nprocs=2)
"""


def test_the_exchange_is_timed_in_the_buckets_ddp_rebuilt(tmp_path):
    """DDP all-reduces its first step in one bucket, then rebuilds them (`bucket_cap_mb`): the
    exchange measured after the loop uses the rebuilt ones (two gloo ranks)."""
    script = tmp_path / "buckets.py"
    script.write_text(DDP_BUCKETS)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert out.returncode == 0, out.stderr
    before, after = (ast.literal_eval(part + "]") for part in out.stdout.strip().rstrip("]").split("] "))
    whole = 2 * (512 * 512 + 512) * 4
    assert before == [whole] and sum(after) == whole and len(after) > 1


def test_the_hand_written_floor_reads_the_device_time_of_each_kernel_and_of_the_exchange():
    """benchmarks/ddp_floor.py --profile: per step, each kernel's time by name, the device's busy
    time as the union of overlapping kernels (never their sum), and NCCL's kernels apart."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("ddp_floor", Path(__file__).parents[1] / "benchmarks" / "ddp_floor.py")
    floor = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(floor)
    trace = {"traceEvents": [
        {"cat": "kernel", "name": "gemm", "ts": 0, "dur": 100},
        {"cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32", "ts": 50, "dur": 200},  # beside the gemm
        {"cat": "kernel", "name": "gemm", "ts": 400, "dur": 100},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1000},  # the host's: not the device's time
    ]}
    got = floor.kernel_summary(trace, steps=2)
    assert got["kernels_ms_per_step"] == {"gemm": 0.1, "ncclDevKernel_AllReduce_Sum_f32": 0.1}
    assert got["gpu_busy_ms_per_step"] == 0.175  # (250 + 100) µs over 2 steps
    assert got["nccl_kernel_ms_per_step"] == 0.1 and got["kernel_count_per_step"] == 1.5


def test_the_copy_exchange_starts_its_buckets_in_one_order_on_every_rank(monkeypatch):
    """The ranks meet at each bucket's barrier in the order they start the buckets: a bucket
    whose gradients are complete waits for the earlier ones, and the ones backward never reached
    on this rank start after backward, still in order; a gradient accumulated twice in one
    backward is refused in one line (the barriers and copies themselves need GPUs:
    tests/test_gpu.py)."""
    recorded = []
    event = lambda n: type("Event", (), {"record": lambda _: recorded.append(n)})()  # noqa: E731 (no CUDA here)
    shards = distributed.PeerCopyShards.__new__(distributed.PeerCopyShards)
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(4)]
    shards.bucket_list = [{"params": ps, "pending": len(ps), "seen": set(), "ready": event(n), "done": f"done {n}"}
                          for n, ps in enumerate((params[:2], params[2:3], params[3:]))]
    shards.next_bucket, started = 0, []
    shards._reduce = lambda b: started.append(shards.bucket_list.index(b))
    shards._added(params[2], shards.bucket_list[1])  # the second bucket complete first: it waits for the first
    assert started == [] and recorded == [1]
    shards._added(params[0], shards.bucket_list[0])
    with pytest.raises(RuntimeError, match="accumulated twice in one backward .*: set distributed.exchange=nccl$"):
        shards._added(params[0], shards.bucket_list[0])
    shards._added(params[1], shards.bucket_list[0])
    assert started == [0, 1]
    shards.checked, waited = True, []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: type("Stream", (), {"wait_event": lambda _, e: waited.append(e)})())
    shards.average()  # the third bucket, which backward never reached, now
    assert started == [0, 1, 2] and recorded == [1, 0, 2] and waited == ["done 0", "done 1", "done 2"]
    # after the run (`settle`), the model is the user's again: a backward starts no bucket
    model = torch.nn.Linear(1, 1)
    shards.hooks = {id(model): model.register_forward_pre_hook(shards._before_forward)}
    added = []
    shards.grad_hooks = [p.register_post_accumulate_grad_hook(added.append) for p in model.parameters()]
    shards.unhook()
    model(torch.ones(1, 1)).sum().backward()
    assert added == [] and not model._forward_pre_hooks and model.weight.grad is not None


def test_a_module_whose_forward_never_runs_has_its_weights_waited_for_where_they_are_read():
    """nn.MultiheadAttention reads its out_proj's weight without running out_proj: after a real
    forward, the attention module waits for out_proj's bucket; a parameter the model holds itself,
    read outside any forward, is waited for at the start of each step."""
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = torch.nn.MultiheadAttention(8, 2, batch_first=True)
            self.head = torch.nn.Linear(8, 1)
            self.scale = torch.nn.Parameter(torch.ones(1))

        def forward(self, x):
            return self.head(self.attention(x, x, x)[0])

    model = Model()
    params = list(model.parameters())  # scale, attention's in_proj (weight, bias), out_proj (weight, bias), head's
    bucket_of = {id(p): n for n, p in enumerate(params)}
    out_proj = [bucket_of[id(p)] for p in model.attention.out_proj.parameters()]
    own, _ = distributed.bucket_waits(model, bucket_of)
    assert own[id(model.attention.out_proj)] == out_proj and own[id(model)] == [bucket_of[id(model.scale)]]
    fired = set()
    for m in model.modules():
        m.register_forward_pre_hook(lambda m, _: fired.add(id(m)))
    model.forward(torch.zeros(1, 3, 8))  # as `loss` calls it: the model's own hook does not run
    waits, at_start = distributed.bucket_waits(model, bucket_of, fired)
    assert id(model.attention.out_proj) not in fired and id(model) not in fired
    assert waits[id(model.attention)] == sorted([bucket_of[id(model.attention.in_proj_weight)],
                                                 bucket_of[id(model.attention.in_proj_bias)], *out_proj])
    assert at_start == [bucket_of[id(model.scale)]] and id(model) not in waits


def test_the_peer_watch_releases_the_copy_exchanges_barriers_and_signals_its_own_process(monkeypatch):
    """Another rank failed: with distributed.exchange=copy (a barrier kernel that no abort
    reaches) the watch releases the barriers for the group's timeout and sends its own process
    SIGTERM, whose handler raises in the main thread, and leaves NCCL alone (its abort would wait
    for the device, stuck behind the barriers); with DDP or NCCL's exchanges it aborts the
    process group, and sends no signal (the release itself, on GPUs: tests/test_gpu.py, the
    failing-rank test)."""
    import signal
    import threading

    got, released, aborted = threading.Event(), [], []
    monkeypatch.setattr(distributed.dist.distributed_c10d, "_abort_process_group", lambda: aborted.append(True))
    ranks = type("Ranks", (), {"timeout_s": 7.0, "stopped_elsewhere": lambda _: "failed|1|boom",
                               "grads": type("Shards", (), {"release_barriers": lambda _, s: released.append(s)})()})()
    previous = signal.signal(signal.SIGTERM, lambda *_: got.set())
    try:
        watch = distributed._PeerWatch(ranks, every_s=0.01)
        watch._thread.join(10)
        assert got.wait(5)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert released == [7.0] and aborted == [] and not watch._thread.is_alive()
    ranks.grads = None  # DDP, or NCCL's exchanges: the abort alone, no signal
    got.clear()
    previous = signal.signal(signal.SIGTERM, lambda *_: got.set())
    try:
        distributed._PeerWatch(ranks, every_s=0.01)._thread.join(10)
        assert not got.wait(0.2)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert aborted == [True]


def test_the_copy_exchange_keeps_the_host_a_few_steps_ahead_of_the_gpu(monkeypatch):
    """`pace` (once a step): the host waits, sleeping (Python's lock free for the peer watch), for
    the event it recorded `PACE_STEPS` steps before; an event never recorded does not hold it."""
    log = []

    class Event:
        def __init__(self, n):
            self.n, self.pending = n, 0

        def query(self):
            log.append(("query", self.n))
            self.pending -= 1
            return self.pending < 0

        def record(self):
            log.append(("record", self.n))
            self.pending = 2  # the GPU reaches it after two more looks

    shards = distributed.PeerCopyShards.__new__(distributed.PeerCopyShards)
    shards.paces, shards.pace_at = [Event(n) for n in range(distributed.PACE_STEPS)], 0
    monkeypatch.setattr(distributed.time, "sleep", lambda s: log.append(("sleep", s)))
    for _ in range(distributed.PACE_STEPS):
        shards.pace()
    assert [e for e in log if e[0] != "query"] == [("record", n) for n in range(distributed.PACE_STEPS)]
    log.clear()
    shards.pace()  # the event of PACE_STEPS steps back: waited for, then recorded again
    assert log == [("query", 0), ("sleep", distributed.PACE_POLL_S), ("query", 0), ("sleep", distributed.PACE_POLL_S),
                   ("query", 0), ("record", 0)]
