"""Ctrl-C, SIGTERM and dying workers: the run is closed (KILLED or FAILED) with the steps it
measured, workers and loader threads stop, and the exit status says what happened."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import socket
import subprocess
import threading
import time
import weakref

import pytest
import torch
from mlflow.tracking import MlflowClient

from clirun import (LONG, TINY, all_runs, children_of, error_line, has_steps, start, steps_csv, stop_leftovers,
                    wait_for_running)
from trainer.errors import Interrupted, RunFailed
from trainer.loaders.pinned_gather import THREAD_PREFIX, PinnedGatherLoader
from trainer.loop.faults import StopSignals, explain_faults
from trainer.loop.run import run
from trainer.tracking.run_summary import describe, figures


@pytest.fixture(autouse=True)
def _no_leftover_processes():
    yield
    stop_leftovers()


def workers_of(pid: int, count: int = 1, timeout: float = 60) -> list:
    """The DataLoader workers of `pid`, once `count` exist (they start with each pass)."""
    deadline = time.monotonic() + timeout
    while len(found := children_of(pid)) < count and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def assert_killed_with_steps(uri: str, run_id: str, signame: str) -> int:
    r = MlflowClient(uri).get_run(run_id)
    assert r.info.status == "KILLED" and r.data.tags["interrupted_by"] == signame
    rows = steps_csv(uri, run_id)
    assert len(rows) >= 1 and [int(x["step"]) for x in rows] == list(range(1, len(rows) + 1))
    history = MlflowClient(uri).get_metric_history(run_id, "step_ms")
    assert sorted(m.step for m in history) == list(range(1, len(rows) + 1))  # per-step series up to the stop
    assert r.data.metrics["total_steps"] == len(rows)
    return len(rows)


@pytest.mark.parametrize("sig,code,overrides", [
    # SIGINT: the DataLoader path; SIGTERM: pinned_chunk, its loader thread busy reading the next chunk.
    pytest.param(signal.SIGINT, 130, [], id="SIGINT"),
    pytest.param(signal.SIGTERM, 143, ["loader=pinned_chunk", "dataset.chunks=4", "dataset.load_ms=300"], id="SIGTERM"),
    # pinned_gather: its gather threads must not keep the process alive.
    pytest.param(signal.SIGINT, 130, ["loader=pinned_gather", "loader.threads=4"], id="SIGINT-pinned_gather"),
])
def test_signal_mid_run_marks_the_run_killed_and_keeps_its_steps(tmp_path, tracking_uri, sig, code, overrides):
    proc = start(tmp_path, tracking_uri, *LONG, *overrides)
    (r,) = wait_for_running(tracking_uri, proc)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)  # returns only once every thread has stopped
    assert proc.returncode == code, stderr
    assert "Traceback" not in stderr
    closed = MlflowClient(tracking_uri).get_run(r.info.run_id)
    assert stderr.endswith(f"{describe(closed, tracking_uri)}\n"  # its summary, as a finished run's, then how it ended
                           f"interrupted by {sig.name}: run {r.info.run_id} marked KILLED, what it measured is saved\n")
    assert_killed_with_steps(tracking_uri, r.info.run_id, sig.name)


def test_ctrl_c_in_a_terminal_stops_the_workers_too(tmp_path, tracking_uri):
    """A terminal's Ctrl-C signals the whole process group, DataLoader workers included."""
    proc = start(tmp_path, tracking_uri, *LONG, "loader.num_workers=2", start_new_session=True)
    (r,) = wait_for_running(tracking_uri, proc)
    assert len(workers_of(proc.pid, count=2)) >= 2
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr
    assert_killed_with_steps(tracking_uri, r.info.run_id, "SIGINT")
    deadline = time.monotonic() + 60  # generous: on a loaded machine the workers are scheduled late
    while time.monotonic() < deadline:  # every process of the group is gone
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        raise AssertionError("processes of the run are still alive")


def test_a_dead_worker_fails_the_run_in_one_line_keeping_its_steps(tmp_path, tracking_uri):
    proc = start(tmp_path, tracking_uri, *LONG, "loader.num_workers=2")
    (r,) = wait_for_running(tracking_uri, proc)
    (worker, *_) = workers_of(proc.pid)
    os.kill(worker, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=60)
    error_line(subprocess.CompletedProcess(proc.args, proc.returncode, "", stderr),
               # PyTorch names the dead worker, unless the read of a batch it was sending broke first
               rf"a DataLoader worker failed with loader\.num_workers=2: (?:DataLoader worker \(pid(?:\(s\))? {worker}\) "
               rf"|the connection to a DataLoader worker broke while it sent a batch ).*: rerun with loader\.num_workers=0 .*\(run {r.info.run_id} marked FAILED\)")
    r = MlflowClient(tracking_uri).get_run(r.info.run_id)
    assert r.info.status == "FAILED" and "DataLoader worker" in r.data.tags["error"]
    assert len(steps_csv(tracking_uri, r.info.run_id)) >= 1


class _DialsNobody(torch.utils.data.Dataset):
    """Each sample opens a multiprocessing connection to a port nothing listens on (loopback)."""

    def __init__(self, port: int):
        self.port = port

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i):
        from multiprocessing.connection import Client
        return Client(("127.0.0.1", self.port))


def test_a_connection_broken_while_reading_a_batch_is_one_line(tiny_cfg):
    # What a worker killed while it sends a batch looks like to the main process: a connection
    # error from multiprocessing, raised inside the DataLoader's iteration.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before the dataset dials it
    with pytest.raises(RunFailed, match=r"^a DataLoader worker failed with loader\.num_workers=2: the connection to a "
                                        r"DataLoader worker broke while it sent a batch \(ConnectionRefusedError: .*\): "
                                        r"rerun with loader\.num_workers=0"):
        with explain_faults(tiny_cfg("loader.num_workers=2")):
            next(iter(torch.utils.data.DataLoader(_DialsNobody(port))))


def test_ctrl_c_stops_a_sweep_and_keeps_the_finished_jobs(tmp_path, tracking_uri):
    proc = start(tmp_path, tracking_uri, "-m", "engine.max_steps=4,100000,4", *LONG)
    first, second = wait_for_running(tracking_uri, proc, count=2)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr
    assert MlflowClient(tracking_uri).get_run(first.info.run_id).info.status == "FINISHED"
    assert len(steps_csv(tracking_uri, first.info.run_id)) == 4
    assert_killed_with_steps(tracking_uri, second.info.run_id, "SIGINT")
    jobs = [r for r in all_runs(tracking_uri) if r.data.tags.get("sweep") != "true"]
    assert len(jobs) == 2  # the third job never started
    parents = [r.info.status for r in all_runs(tracking_uri) if r.data.tags.get("sweep") == "true"]
    assert parents == ["KILLED"]  # the sweep's parent run


# -- in one process ----------------------------------------------------------------------------------
def signal_when_running(uri: str, sig: int, steps: int = 1) -> threading.Thread:
    """Send `sig` to this process once a run is RUNNING at its loop with at least `steps` steps in
    its journal (`has_steps`): however slow the machine, the signal finds the loop taking steps."""
    def watch():
        MlflowClient(uri).search_experiments()
        while not [r for r in all_runs(uri) if has_steps(r, steps)]:
            time.sleep(0.2)
        os.kill(os.getpid(), sig)
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("overrides", [
    pytest.param(["loader=baseline", "loader.num_workers=2"], id="workers"),
    pytest.param(["loader=pinned_chunk", "dataset.chunks=4", "dataset.load_ms=200"], id="loader-thread"),
])
def test_interrupted_run_leaves_no_workers_threads_or_handlers(tiny_cfg, tracking_uri, runs, overrides):
    cfg = tiny_cfg(*[o for o in LONG if o not in TINY], *overrides)
    before = signal.getsignal(signal.SIGTERM)
    signal_when_running(tracking_uri, signal.SIGTERM)
    with pytest.raises(Interrupted) as stop:
        run(cfg)
    assert stop.value.exit_code == 143
    assert signal.getsignal(signal.SIGTERM) is before  # handlers restored
    assert multiprocessing.active_children() == [] and children_of(os.getpid()) == []  # no live or zombie workers
    assert not [t for t in threading.enumerate() if t.name.startswith("chunk-load")]
    (r,) = runs()
    assert_killed_with_steps(tracking_uri, r.info.run_id, "SIGTERM")


@pytest.mark.parametrize("warmup,steps", [pytest.param(2, 5, id="timed"), pytest.param(100000, 3, id="in-warm-up")])
def test_an_interrupted_run_prints_the_summary_of_what_it_measured(tiny_cfg, tracking_uri, runs, capsys, warmup, steps):
    cfg = tiny_cfg(*[o for o in LONG if o not in TINY], f"engine.warmup_steps={warmup}")
    signal_when_running(tracking_uri, signal.SIGINT, steps=steps)
    with pytest.raises(Interrupted):
        run(cfg)
    (r,) = runs()
    summary = describe(r, tracking_uri)  # what `python -m trainer.report --run` prints too
    assert capsys.readouterr().err.endswith(summary + "\n")
    lines, m = summary.splitlines(), r.data.metrics
    assert lines[0] == (f"run {r.info.run_id} (KILLED): loader=baseline dataset=synthetic model=noop on cpu, eager, "
                        "feedbench loop")
    if warmup == 2:  # the figures of the steps timed before the interrupt
        assert m["timed_steps"] >= 3 and lines[1] == f"  {figures(m)}" and lines[2].startswith("  bound by: ")
    else:
        assert lines[1] == (f"  no timed steps: interrupted (SIGINT) after {int(m['total_steps'])} of its 100000 "
                            "warm-up steps, before its timed region began")


def test_ctrl_c_stops_the_gather_threads_mid_gather(tiny_cfg, tracking_uri, runs, monkeypatch):
    """SIGINT while pinned_gather's threads are busy: the run is KILLED and every thread has exited."""
    gather = PinnedGatherLoader._gather

    def slow_gather(self, *args):
        time.sleep(0.01)  # each gather takes a while, so the signal finds threads in the middle of one
        return gather(self, *args)
    monkeypatch.setattr(PinnedGatherLoader, "_gather", slow_gather)
    gather_threads = lambda: {t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)}  # noqa: E731
    before = gather_threads()  # any of a loader another test left to the garbage collector
    cfg = tiny_cfg(*[o for o in LONG if o not in TINY], "loader=pinned_gather", "loader.threads=4", "model.busy_ms=2")
    signal_when_running(tracking_uri, signal.SIGINT, steps=11)  # more than the 10 steps asserted below
    with pytest.raises(Interrupted) as stop:
        run(cfg)
    assert stop.value.exit_code == 130
    assert not gather_threads() - before
    (r,) = runs()
    assert assert_killed_with_steps(tracking_uri, r.info.run_id, "SIGINT") > 10


def test_a_held_signal_is_raised_once_the_run_is_saved():
    done = []
    with pytest.raises(Interrupted) as stop:
        with StopSignals():  # held: opening or saving a run is not cut in half
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)
            done.append("saved")
    assert done == ["saved"] and stop.value.exit_code == 143


def test_an_armed_signal_is_raised_at_once_and_a_second_held_one_too():
    with pytest.raises(Interrupted) as stop:
        with StopSignals() as signals:
            signals.arm()
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
    assert stop.value.exit_code == 130
    with pytest.raises(Interrupted):
        with StopSignals():
            os.kill(os.getpid(), signal.SIGINT)  # held
            time.sleep(0.1)
            os.kill(os.getpid(), signal.SIGINT)  # again: stop now
            time.sleep(5)
            pytest.fail("the second signal did not stop")


def test_a_signal_during_the_loops_garbage_collection_stops_the_run(tiny_cfg, runs):
    """The loop collects the garbage before it starts; a signal handled inside a weakref callback
    of that collection raised where Python drops the exception, and the run went on to its end."""
    class Cycle:
        pass

    garbage = Cycle()
    garbage.cycle = garbage  # only the cyclic collector frees it: at the loop's gc.collect()
    weakref.finalize(garbage, os.kill, os.getpid(), signal.SIGINT)
    del garbage
    gc.disable()  # no automatic collection before the loop's own
    try:
        with pytest.raises(Interrupted) as stop:
            run(tiny_cfg("engine.max_steps=1000", "engine.warmup_steps=1"))
    finally:
        gc.enable()
    assert stop.value.exit_code == 130
    (killed,) = runs()
    assert killed.info.status == "KILLED" and killed.data.metrics["total_steps"] < 1000


# -- GPU ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_pinned_memory_returns_to_baseline_between_strategies(tiny_cfg):
    """Strategies run back to back in one process hand back every page-locked block they took."""
    def held_pinned() -> int:
        """Page-locked bytes held by live allocations (blocks cached for reuse are not counted)."""
        gc.collect()
        torch.cuda.synchronize()
        # A freed block stays counted until the allocator sees its copy's event complete, which it
        # checks lazily; emptying the cache makes it check them all now.
        getattr(torch._C, "_host_emptyCache", lambda: None)()
        stats = getattr(torch.cuda, "host_memory_stats", dict)()
        if "allocated_bytes.current" not in stats:
            pytest.skip("this torch reports no pinned-memory statistics")
        return stats["allocated_bytes.current"]

    torch.empty(1, device="cuda")  # CUDA initialised before the baseline is read
    baseline = held_pinned()
    for _ in range(2):
        for strategy in ["pinned", "prefetch", "pinned_chunk", "pinned_gather", "gpu_resident", "iterable_chunks"]:
            summary = run(tiny_cfg("engine.device=cuda", f"loader={strategy}", "dataset.chunks=2", "loader.num_workers=2"))
            assert summary["total_steps"] > 0
            assert held_pinned() == baseline, strategy
