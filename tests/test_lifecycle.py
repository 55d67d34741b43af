"""A run's lifecycle: build, train, record, close, and what it leaves behind in the process."""

from __future__ import annotations

import csv
import io
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from conftest import TINY
from trainer.errors import Interrupted, RunFailed
from trainer.loop import run as run_module
from trainer.loop.faults import StopSignals
from trainer.loop.meter import StepMeter
from trainer.loop.run import LOOPS, loop_named, run


def _steps_csv(tracking_uri: str, run_id: str) -> list:
    path = MlflowClient(tracking_uri).download_artifacts(run_id, "steps.csv")
    return list(csv.DictReader(io.StringIO(Path(path).read_text())))


def test_every_loop_is_registered_with_its_meter():
    assert set(LOOPS) == {"feedbench", "lightning"}
    for name in LOOPS:
        loop = loop_named(name)
        assert issubclass(loop.Meter, StepMeter) and callable(loop.train)


# -- the heap setting is the run's own -----------------------------------------------------------
# After a run with engine.steady_heap=true, a 20 MiB malloc must be mmapped again (glibc's default
# threshold), as in a process that never ran one: mallinfo2's hblkhd (bytes in mmapped blocks) grows.
_HEAP_AFTER_RUN = """
import ctypes, sys
from hydra import compose, initialize_config_dir
from trainer.config import CONF_DIR
from trainer.loop.run import run

class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype, libc.malloc.restype = Mallinfo2, ctypes.c_void_p
libc.malloc.argtypes, libc.free.argtypes = [ctypes.c_size_t], [ctypes.c_void_p]

def mmapped_by_malloc(nbytes):
    before = libc.mallinfo2().hblkhd
    p = libc.malloc(nbytes)
    grew = libc.mallinfo2().hblkhd - before
    libc.free(p)
    return grew >= nbytes

with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
    cfg = compose("config", overrides=sys.argv[2:] + [f"tracking.uri={sys.argv[1]}"])
run(cfg)
print(mmapped_by_malloc(20 << 20))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_steady_heap_is_undone_when_the_run_ends(tracking_uri):
    proc = subprocess.run([sys.executable, "-c", _HEAP_AFTER_RUN, tracking_uri, *TINY, "engine.steady_heap=true"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-1] == "True"  # glibc's default threshold again: a 20 MiB block is mmapped


def test_steady_heap_holds_during_the_run(monkeypatch, tiny_cfg):
    """Inside the run the thresholds are fixed (the tag says so), and the helper restores them."""
    from trainer.loop import heap

    calls = []
    monkeypatch.setattr(heap, "_set_thresholds", lambda m, t: calls.append((m, t)) or True)
    with heap.steady_heap(True) as tag:
        assert tag == "true" and calls == [(heap.MMAP_THRESHOLD, heap.TRIM_THRESHOLD)]
    assert calls[-1] == (heap.GLIBC_DEFAULT, heap.GLIBC_DEFAULT)
    with heap.steady_heap(False) as tag:
        assert tag == "false"
    assert len(calls) == 2


# -- records survive a device that cannot be read ------------------------------------------------
def _device_cannot_be_read(self):
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_a_run_whose_device_cannot_be_read_keeps_its_host_rows_and_fails(monkeypatch, tiny_cfg, runs, tracking_uri):
    monkeypatch.setattr(StepMeter, "finish", _device_cannot_be_read)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        run(tiny_cfg("engine.max_steps=6", "engine.warmup_steps=1"))
    (r,) = runs()
    assert r.info.status == "FAILED"
    rows = _steps_csv(tracking_uri, r.info.run_id)
    assert [int(x["step"]) for x in rows] == list(range(1, 7))
    assert all(float(x["data_wait_ms"]) >= 0 and float(x["step_ms"]) > 0 for x in rows)
    assert r.data.metrics["timed_steps"] == 5


def test_the_original_error_survives_a_device_that_cannot_be_read(monkeypatch, tiny_cfg, runs, tracking_uri):
    """A NaN loss, then reading the device fails too: the user sees the NaN, and the steps are saved."""
    monkeypatch.setattr(StepMeter, "finish", _device_cannot_be_read)
    with pytest.raises(RunFailed, match=r"loss became (nan|inf)"):
        run(tiny_cfg("model=mlp", "engine.optimizer.lr=1e10", "engine.optimizer.name=sgd", "engine.epochs=20"))
    (r,) = runs()
    assert r.info.status == "FAILED" and "loss became" in r.data.tags["error"]
    assert len(_steps_csv(tracking_uri, r.info.run_id)) > 0


# -- the run's scratch folder ------------------------------------------------------------------
@pytest.mark.parametrize("fails", [False, True], ids=["finished", "failed"])
def test_a_run_leaves_no_scratch_folder_behind(monkeypatch, tmp_path, tiny_cfg, runs, tracking_uri, fails):
    """The profiler's trace is written to a scratch folder, saved with the run, and the folder goes
    when the run closes, finished or failed: a machine running sweeps does not fill its /tmp."""
    import tempfile
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    overrides = ["engine.profile=true", "engine.max_steps=8", "engine.warmup_steps=2"]
    if fails:
        monkeypatch.setattr(StepMeter, "finish", _device_cannot_be_read)
        with pytest.raises(RuntimeError, match="illegal memory access"):
            run(tiny_cfg(*overrides))
    else:
        run(tiny_cfg(*overrides))
    (r,) = runs()
    assert r.info.status == ("FAILED" if fails else "FINISHED")
    assert [p.name for p in scratch.iterdir() if p.name.startswith("feedbench")] == []  # torch keeps its own caches there
    saved = [a.path for a in MlflowClient(tracking_uri).list_artifacts(r.info.run_id)]
    assert "steps.csv" in saved and (fails or any(p.endswith(".json") or "trace" in p for p in saved)), saved


# -- a signal while the loader closes -----------------------------------------------------------
def test_a_signal_while_the_loader_closes_keeps_the_run_finished(monkeypatch, tiny_cfg, runs, tracking_uri):
    """The loop has ended: a SIGINT while the loader's threads are joined waits until the records are
    written; the run stays FINISHED with every step, and the interrupt is raised afterwards."""
    from trainer.loaders.pinned_gather import PinnedGatherLoader

    close = PinnedGatherLoader.close

    def interrupted_close(self):
        os.kill(os.getpid(), signal.SIGINT)  # delivered at once, in the middle of close()
        close(self)

    monkeypatch.setattr(PinnedGatherLoader, "close", interrupted_close)
    with pytest.raises(Interrupted):
        run(tiny_cfg("loader=pinned_gather", "engine.max_steps=8"))
    (r,) = runs()
    assert r.info.status == "FINISHED" and r.data.metrics["total_steps"] == 8
    assert len(_steps_csv(tracking_uri, r.info.run_id)) == 8
    assert not [t for t in threading.enumerate() if "gather" in t.name.lower()]


def test_stop_signals_announce_only_where_asked(capfd):
    """Under torchrun every rank gets the signal: only rank 0 says it is stopping."""
    for announce, expected in ((False, ""), (True, "stopping once the run's records are written")):
        with pytest.raises(Interrupted):
            with StopSignals(announce=announce):  # held: the signal waits for the block's end
                os.kill(os.getpid(), signal.SIGINT)
        err = capfd.readouterr().err
        assert (expected in err) if expected else err == ""


def test_a_run_uses_the_loop_chosen_by_the_config(monkeypatch, tiny_cfg):
    chosen = []
    real = run_module.loop_named
    monkeypatch.setattr(run_module, "loop_named", lambda name: chosen.append(name) or real(name))
    run(tiny_cfg("engine.max_steps=3", "engine.warmup_steps=1"))
    assert chosen == ["feedbench"]


# -- a run killed outright ----------------------------------------------------------------------
@pytest.mark.parametrize("next_command", [pytest.param("report", marks=pytest.mark.slow), "run"])  # (report: `-m slow`)
def test_a_sigkilled_run_is_recovered_from_its_journal_by_the_next_report_or_run(tmp_path, tracking_uri, next_command):
    """SIGKILL runs no `finally`: the next report or run on the store closes the dead one as KILLED
    with the steps its journal had on disk, within `engine.journal_s` of the kill."""
    from clirun import LONG, all_runs, command, run_cli, steps_csv, wait_for_running

    proc = subprocess.Popen(command(tmp_path, tracking_uri, *LONG, "engine.journal_s=0.5"), cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        (running,) = wait_for_running(tracking_uri, proc, steps=21)  # more than the 20 asserted below
    finally:
        proc.kill()
    journal, scratch = Path(running.data.tags["journal"]), Path(running.data.tags["scratch"])
    proc.wait(timeout=30)
    assert scratch.is_dir()  # the killed run's scratch folder, left behind
    on_disk = len(journal.read_text().splitlines()) - 1
    (dead,) = all_runs(tracking_uri)
    assert dead.info.status == "RUNNING" and dead.data.tags["pid"] == str(proc.pid)

    if next_command == "run":
        after = run_cli(tmp_path, tracking_uri, *TINY)
    else:
        after = subprocess.run([sys.executable, "-m", "trainer.report", "--uri", tracking_uri], cwd=tmp_path,
                               capture_output=True, text=True, timeout=300)
    assert after.returncode == 0, after.stderr
    assert f"run {dead.info.run_id} (pid {proc.pid}) ended without closing: marked KILLED" in after.stderr
    client = MlflowClient(tracking_uri)
    dead = client.get_run(dead.info.run_id)
    assert dead.info.status == "KILLED" and dead.data.tags["recovered"] == "true"
    assert not scratch.exists()  # removed by the recovery
    rows = steps_csv(tracking_uri, dead.info.run_id)
    assert len(rows) == on_disk > 20 and [int(r["step"]) for r in rows] == list(range(1, on_disk + 1))
    assert dead.data.metrics["total_steps"] == on_disk and dead.data.metrics["timed_steps"] == on_disk - 2
    assert dead.data.metrics["ms_per_step"] > 15  # model.busy_ms=20 on the host
    assert [r.info.status for r in all_runs(tracking_uri)] == ["KILLED", "FINISHED"][:1 + (next_command == "run")]


def test_a_dead_sweeps_parent_is_recovered_in_words_true_of_a_parent(tracking_uri):
    from trainer.tracking.journal import owner_tags, recover_dead_runs

    client = MlflowClient(tracking_uri)
    exp = client.create_experiment("e")
    dead = {**owner_tags(), "pid": "999999999"}
    parent = client.create_run(exp, tags={**dead, "sweep": "true"}).info.run_id
    advice = client.create_run(exp, tags={**dead, "advise": "true"}).info.run_id
    early = client.create_run(exp, tags=dead).info.run_id  # died before its loop: no journal
    said = []
    assert sorted(recover_dead_runs(client, log=said.append)) == sorted([parent, advice, early])
    ended = "(pid 999999999) ended without closing: marked KILLED"
    assert sorted(said) == sorted([
        f"feedbench: sweep run {parent} {ended}; a sweep's parent run takes no steps of its own, its jobs are runs "
        "of their own (tag recovered=true)",
        f"feedbench: advice run {advice} {ended}; it takes no steps of its own, its rungs are runs of their own "
        "(tag recovered=true)",
        f"feedbench: run {early} {ended} with no steps (it kept no journal: it died before its loop, or "
        "engine.journal_s=0) (tag recovered=true)"])


def test_a_dead_run_whose_store_refused_the_journal_tag_is_recovered_from_its_artifact_folder(tracking_uri):
    """A store that filled early refused the tag naming the journal: the journal is found where
    runs keep it, in the run's artifact folder, and its steps are kept."""
    from trainer.tracking.journal import HOST_COLUMNS, JOURNAL, owner_tags, recover_dead_runs
    from trainer.tracking.store import experiment_id

    client = MlflowClient(tracking_uri)
    run = client.create_run(experiment_id(client, "e", tracking_uri), tags={**owner_tags(), "pid": "999999999"})
    folder = Path(run.info.artifact_uri[len("file://"):])
    folder.mkdir(parents=True)
    rows = [(s, 0, 8, 10.0 + s, 10.001 + s, 10.01 + s) for s in (1, 2, 3)]  # step, epoch, samples, wait/start/end at
    (folder / JOURNAL).write_text(",".join(HOST_COLUMNS) + "\n" + "".join(",".join(map(str, r)) + "\n" for r in rows))
    said = []
    assert recover_dead_runs(client, log=said.append) == [run.info.run_id]
    assert said == [f"feedbench: run {run.info.run_id} (pid 999999999) ended without closing: marked KILLED with the 3 "
                    "steps of its journal (tag recovered=true)"]
    recovered = client.get_run(run.info.run_id)
    assert recovered.info.status == "KILLED" and recovered.data.metrics["total_steps"] == 3


def test_a_run_of_another_host_or_a_live_process_is_left_alone(tiny_cfg, tracking_uri):
    from trainer.tracking.journal import is_dead_here, owner_tags, recover_dead_runs

    mine = owner_tags()
    assert not is_dead_here(mine)  # this process is alive
    assert not is_dead_here({**mine, "host": "elsewhere", "pid": "999999999"})
    assert is_dead_here({**mine, "pid": "999999999"})
    assert is_dead_here({**mine, "pid_start": "1"})  # the pid now belongs to another process
    client = MlflowClient(tracking_uri)
    exp = client.create_experiment("e")
    for tags in (mine, {**mine, "host": "elsewhere", "pid": "999999999"}):
        client.create_run(exp, tags=tags)
    assert recover_dead_runs(client) == []
    assert {r.info.status for r in client.search_runs([exp])} == {"RUNNING"}
    from trainer.tracking.journal import shown_status
    assert sorted(shown_status(r) for r in client.search_runs([exp])) == [
        "RUNNING", "RUNNING (on elsewhere: running elsewhere?)"]

