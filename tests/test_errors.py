"""Bad input ends in one clear line and exit status 1, never a traceback; a run that had started
is marked FAILED in MLflow with what it measured."""

from __future__ import annotations

import contextlib
import functools
import http.server
import importlib.util
import math
import os
import re
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from clirun import TINY, all_runs, error_line, run_cli, steps_csv
from conftest import batch_that_runs_out_of_gpu_memory
from trainer.errors import ConfigError
from trainer.fake_data import write_mnist
from trainer.loaders import for_any_dataset
from trainer.loop.run import run


# (Hydra's own errors, at compose time: tests/test_hydra_errors.py)


# -- caught by trainer.validate before a run is opened ---------------------------------------------
@pytest.mark.parametrize("overrides,pattern", [
    pytest.param(["loader.batch_size=0"], r"loader\.batch_size must be >= 1 \(got 0\): set loader\.batch_size=64$", id="loader.batch_size=0"),
    pytest.param(["loader.num_workers=-1"], r"loader\.num_workers must be >= 0 \(got -1\): set loader\.num_workers=0$", id="loader.num_workers=-1"),
    pytest.param(["loader=prefetch", "loader.depth=0"], r"loader\.depth must be >= 1 \(got 0\): set loader\.depth=1$", id="loader=prefetch loader.depth=0"),
    pytest.param(["loader=pinned_gather", "loader.threads=0"], r"loader\.threads must be >= 1 \(got 0\): set loader\.threads=4$", id="loader=pinned_gather loader.threads=0"),
    pytest.param(["engine.epochs=0", "engine.max_steps=0"], r"engine\.epochs must be >= 1 \(got 0\): set engine\.epochs=1", id="engine.epochs=0 engine.max_steps=0"),
    pytest.param(["dataset.shape=[0,28]"], r"dataset\.shape must be .*>= 1 \(got \[0, 28\]\): set dataset\.shape=", id="dataset.shape=[0,28]"),
    pytest.param(["model.busy_ms=-5"], r"model\.busy_ms must be >= 0 \(got -5\.0\): set model\.busy_ms=0$", id="model.busy_ms=-5"),
    pytest.param(["model=mlp", "dataset.num_classes=1"], r"model=mlp needs labels of at least 2 classes \(got dataset\.num_classes=1\)", id="model=mlp dataset.num_classes=1"),
    pytest.param(["engine.gpu_timing_every=0"], r"engine\.gpu_timing_every must be >= 1 \(got 0\): set engine\.gpu_timing_every=8$", id="engine.gpu_timing_every=0"),
    pytest.param(["engine.max_steps=-1"], r"engine\.max_steps must be >= 0 \(got -1\): set engine\.max_steps=0 \(run engine\.epochs passes\)$", id="engine.max_steps=-1"),
    pytest.param(["distributed.timeout_s=-1"], r"distributed\.timeout_s must be a finite number of seconds > 0 \(got -1\.0\): set distributed\.timeout_s=300$", id="distributed.timeout_s=-1"),
    pytest.param([f"tracking.experiment={'e' * 600}"], r"tracking\.experiment must be at most 500 characters \(got 600\): set tracking\.experiment=feedbench$", id="tracking.experiment of 600 characters"),
    pytest.param(["dataset.num_samples=${nope}"], r"dataset\.num_samples: its interpolation cannot be resolved \(Interpolation key 'nope' not found\): "
                 r"set dataset\.num_samples to a value, or to \$\{\.\.\.\} of a key that exists$", id="dataset.num_samples=${nope}"),
    pytest.param([f"dataset.shape=[{','.join(['1'] * 40)}]"], r"dataset\.shape must have at most 31 sizes \(got 40\): set dataset\.shape=\[256,256\]$", id="dataset.shape with 40 sizes"),
    pytest.param(["+loader.batchsize=1"], r"loader\.batchsize is not a key of loader \(BaselineLoader\.Config\): did you mean "
                 r"loader\.batch_size\? set loader\.batch_size=1 instead of \+loader\.batchsize=1; its keys are name, batch_size, ",
                 id="+loader.batchsize=1"),
])
def test_out_of_range_values_name_key_value_and_fix(tmp_path, tracking_uri, overrides, pattern):
    proc = run_cli(tmp_path, tracking_uri, *TINY, *overrides)
    error_line(proc, pattern)
    assert all_runs(tracking_uri) == []  # refused before anything was recorded


def test_cuda_without_cuda(tmp_path, tracking_uri):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = run_cli(tmp_path, tracking_uri, *TINY, "engine.device=cuda")
    error_line(proc, r"engine\.device=cuda but no CUDA device is available: use engine\.device=auto")
    assert all_runs(tracking_uri) == []


# -- caught once the run is open: it is marked FAILED ----------------------------------------------
def failed_run(uri: str):
    (r,) = all_runs(uri)
    assert r.info.status == "FAILED"
    return r


def test_batch_larger_than_the_dataset(tmp_path, tracking_uri):
    proc = run_cli(tmp_path, tracking_uri, *TINY, "loader.batch_size=500")
    found = error_line(proc, r"loader\.batch_size must be <= 96, the samples in dataset=synthetic \(got 500\): "
                             r"set loader\.batch_size=64 .*\(run (\w+) marked FAILED\)")
    r = failed_run(tracking_uri)
    assert found.group(1) == r.info.run_id and "loader.batch_size must be <= 96" in r.data.tags["error"]


@pytest.mark.parametrize("strategy,pattern", ids=["pinned_chunk", "pinned_gather", "baseline", "iterable_chunks"], argvalues=[
    ("pinned_chunk", r"loader=pinned_chunk \(1 page-locked buffer.*\) needs ([\d.]+) GiB of host memory but only "
                     r"([\d.]+) GiB is available: set dataset\.chunk_samples=\d+"),
    ("pinned_gather", r"loader=pinned_gather \(the whole dataset in host memory and 6 page-locked batch slots.*\) needs "
                      r"([\d.]+) GiB of host memory but only ([\d.]+) GiB is available: set a smaller dataset\.num_samples, "
                      r"or use loader=pinned_chunk with dataset\.chunk_samples=\d+"),
    ("baseline", r"loader=baseline \(the whole dataset in host memory\) needs ([\d.]+) GiB of host memory but only "
                 r"([\d.]+) GiB is available: use loader=pinned_chunk with dataset\.chunk_samples=\d+"),
    ("iterable_chunks", r"loader=iterable_chunks \(one chunk of dataset\.chunk_samples=1000000 in each of 1 loading process\(es\)\) "
                      r"needs ([\d.]+) GiB of host memory but only ([\d.]+) GiB is available: set dataset\.chunk_samples=\d+"),
])
def test_more_host_memory_than_available_fails_before_allocating(tmp_path, tracking_uri, strategy, pattern):
    # 10^6 samples of 1024 x 1024 float32: 3.8 TiB
    start = time.monotonic()
    proc = run_cli(tmp_path, tracking_uri, *TINY, f"loader={strategy}", "dataset.num_samples=1000000",
                   "dataset.shape=[1024,1024]")
    found = error_line(proc, pattern)
    needed, available = float(found.group(1)), float(found.group(2))
    assert needed == pytest.approx(10**6 * 2**22 / 2**30, rel=0.01) and needed > available
    assert time.monotonic() - start < 120  # nothing was generated
    failed_run(tracking_uri)


@pytest.mark.gpu
def test_more_gpu_memory_than_free_fails_before_allocating(tmp_path, tracking_uri):
    free, _ = torch.cuda.mem_get_info()
    n = int(2 * free / 2**22) + 1  # twice the free GPU memory, in 4 MiB samples
    proc = run_cli(tmp_path, tracking_uri, *TINY, "engine.device=cuda", "loader=gpu_resident",
                   f"dataset.num_samples={n}", "dataset.shape=[1024,1024]")
    error_line(proc, r"loader=gpu_resident needs [\d.]+ GiB of GPU memory but only [\d.]+ GiB of [\d.]+ GiB is free: "
                     r"use loader=pinned_chunk or a smaller dataset\.num_samples")
    failed_run(tracking_uri)


HUGE = "dataset.num_samples=100000000000"  # 10^11 samples: their int64 labels alone are 745 GiB
LABELS = (r"dataset\.num_samples=100000000000 \(one int64 label per sample\) needs 745\.06 GiB of host memory but only "
          r"[\d.]+ GiB is available: set a smaller dataset\.num_samples")


def test_synthetic_labels_larger_than_host_memory_fail_before_allocating(tmp_path, tracking_uri):
    start = time.monotonic()
    proc = run_cli(tmp_path, tracking_uri, *TINY, HUGE)
    error_line(proc, LABELS + r" \(run \w+ marked FAILED\)$")
    assert time.monotonic() - start < 120
    assert "dataset.num_samples=100000000000" in failed_run(tracking_uri).data.tags["error"]


@pytest.mark.parametrize("strategy", for_any_dataset())
def test_synthetic_labels_are_checked_with_every_strategy(tiny_cfg, runs, strategy):
    with pytest.raises(ConfigError, match=LABELS):
        run(tiny_cfg(f"loader={strategy}", HUGE, "dataset.chunk_samples=1000"))
    (r,) = runs()
    assert r.info.status == "FAILED"


def test_a_model_larger_than_host_memory_fails_before_it_is_built(tmp_path, tracking_uri):
    proc = run_cli(tmp_path, tracking_uri, *TINY, "model.hidden=100000000000")
    error_line(proc, r"model=autoencoder \(13,600,000,000,067 parameters with their gradients and adam's state, and the "
                     r"activations of loader\.batch_size=16\) needs [\d.]+ GiB of host memory but only [\d.]+ GiB is "
                     r"available: set a smaller model\.hidden or model\.bottleneck or dataset\.shape \(run \w+ marked FAILED\)$")
    assert "model=autoencoder" in failed_run(tracking_uri).data.tags["error"]


def test_a_batch_whose_activations_exceed_host_memory_fails_before_training(tiny_cfg, runs):
    # 2^20 samples of one value, a 2^20-wide hidden layer: 4 TiB of activations for one batch.
    with pytest.raises(ConfigError, match=r"model=autoencoder \(.* the activations of loader\.batch_size=1048576\) needs "
                                          r"[\d.]+ GiB of host memory .*: set loader\.batch_size=\d+ or smaller$"):
        run(tiny_cfg("loader=gpu_resident", "dataset.num_samples=1048576", "dataset.shape=[1]", "loader.batch_size=1048576",
                     "model.hidden=1048576", "model.bottleneck=1"))
    (r,) = runs()
    assert r.info.status == "FAILED" and r.data.metrics.get("total_steps", 0) == 0


def test_host_out_of_memory_during_a_run_is_one_line(tiny_cfg):
    from trainer.errors import RunFailed
    from trainer.loop.faults import explain_faults
    with pytest.raises(RunFailed, match=r"^out of host memory with loader=baseline loader\.batch_size=16 model=autoencoder: "
                                        r"set loader\.batch_size=8 or smaller"):
        with explain_faults(tiny_cfg()):
            torch.empty(2**62, dtype=torch.uint8)  # more than any address space: the allocator refuses at once


VISION = [o for o in TINY if not o.startswith(("dataset.shape=", "dataset.num_samples="))]


def test_mnist_missing_offline(tmp_path, tracking_uri):
    proc = run_cli(tmp_path, tracking_uri, *VISION, "dataset=mnist", f"dataset.root={tmp_path / 'data'}",
                   "dataset.download=false")
    error_line(proc, r"dataset=mnist: MNIST not found in .*dataset\.root=.*missing train-images-idx3-ubyte.*"
                     r"set dataset\.download=true")
    assert "dataset=mnist" in failed_run(tracking_uri).data.tags["error"]


def test_a_data_folder_that_cannot_be_made_is_named(tmp_path, tracking_uri):
    (tmp_path / "a-file").write_text("in the way\n")
    root = tmp_path / "a-file" / "data"
    proc = run_cli(tmp_path, tracking_uri, *VISION, "dataset=mnist", f"dataset.root={root}", "dataset.download=true")
    error_line(proc, rf"dataset=mnist: cannot make {root}/MNIST/raw \(dataset\.root={root}\) to download MNIST into "
                     r"\(\[Errno 20\] Not a directory: .*\): set dataset\.root to a writable folder \(run \w+ marked FAILED\)$")
    failed_run(tracking_uri)


def test_mnist_corrupt(tmp_path, tracking_uri):
    root = tmp_path / "data"
    write_mnist(root, gz=False)
    images = root / "MNIST" / "raw" / "train-images-idx3-ubyte"
    images.write_bytes(images.read_bytes()[:1000])  # truncated
    proc = run_cli(tmp_path, tracking_uri, *VISION, "dataset=mnist", f"dataset.root={root}", "dataset.download=false")
    error_line(proc, r"dataset=mnist: .*train-images-idx3-ubyte is truncated")
    failed_run(tracking_uri)


def test_cifar_corrupt(tmp_path, tracking_uri):
    folder = tmp_path / "data" / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"]:
        (folder / name).write_bytes(b"not a pickle")
    proc = run_cli(tmp_path, tracking_uri, *VISION, "dataset=cifar10", f"dataset.root={tmp_path / 'data'}",
                   "dataset.download=false")
    error_line(proc, r"dataset=cifar10: .*data_batch_1.*md5")
    failed_run(tracking_uri)


# -- tracking.uri ----------------------------------------------------------------------------------
def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


def test_unreachable_tracking_server_fails_fast(tmp_path):
    uri = f"http://127.0.0.1:{closed_port()}"
    start = time.monotonic()
    proc = run_cli(tmp_path, uri, *TINY)
    error_line(proc, rf"tracking\.uri={uri} is unreachable \(.*\): start the MLflow server there, or set tracking\.uri=null")
    # Not MLflow's minutes of retries (7, each backing off twice as long); the bound leaves room for a
    # loaded machine's slow imports.
    assert time.monotonic() - start < 120


def test_tracking_folder_missing(tmp_path):
    uri = f"sqlite:///{tmp_path / 'nowhere' / 'mlflow.db'}"
    proc = run_cli(tmp_path, uri, *TINY)
    error_line(proc, rf"tracking\.uri={uri}: folder {tmp_path / 'nowhere'} does not exist: create it")
    assert not (tmp_path / "nowhere").exists()


def test_tracking_folder_read_only(tmp_path):
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(0o555)
    if os.access(folder, os.W_OK):  # root ignores permission bits: use a folder nobody can write in
        folder = "/sys"
    uri = f"sqlite:///{folder}/mlflow.db"
    try:
        proc = run_cli(tmp_path, uri, *TINY)
    finally:
        (tmp_path / "locked").chmod(0o755)
    error_line(proc, rf"tracking\.uri={uri}: cannot write in {folder} \(.+\): use a writable folder or set tracking\.uri=null")


def test_a_new_database_adds_no_lines_before_the_error(tmp_path, tracking_uri):
    """MLflow's INFO lines about creating the database's tables stay off stderr."""
    proc = run_cli(tmp_path, tracking_uri, *TINY, "loader.batch_size=500")  # found once the run is open
    line = error_line(proc, r"loader\.batch_size must be <= 96").string
    assert proc.stderr.splitlines() == [line]
    failed_run(tracking_uri)


def mlflow_database(path: Path) -> Path:
    """A real MLflow store: MLflow makes its tables on first use."""
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


def with_schema(path: Path, revision: str) -> Path:
    with contextlib.closing(sqlite3.connect(path)) as con, con:
        con.execute("UPDATE alembic_version SET version_num = ?", (revision,))
    return path


def older_schema() -> str:
    from trainer.tracking.store import mlflow_schemas
    head, known = mlflow_schemas()
    return sorted(known - {head})[0]


def another_programs_database(path: Path) -> Path:
    with contextlib.closing(sqlite3.connect(path)) as con, con:
        con.execute("CREATE TABLE trials (id INTEGER, value REAL)")
    return path


NEW_FILE = r"set tracking\.uri=sqlite:///{folder}/feedbench-mlflow\.db \(a new file\)"


@pytest.mark.parametrize("make,pattern", [
    pytest.param(lambda d: d / "folder.db", r"{db} is a folder, not a database file: set tracking\.uri=sqlite:///{db}/mlflow\.db$",
                 id="a folder"),
    pytest.param(lambda d: d / "notes.db", r"{db} is not an SQLite database: " + NEW_FILE + ", or move that file away$",
                 id="not a database"),
    pytest.param(lambda d: another_programs_database(d / "other.db"),
                 r"{db} is another program's SQLite database \(tables trials\), not an MLflow store: "
                 r"set tracking\.uri=sqlite:///{folder}/feedbench-mlflow\.db \(a file of its own\)$", id="another program's database"),
    pytest.param(lambda d: with_schema(mlflow_database(d / "old.db"), older_schema()),
                 r"holds runs of an older MLflow \(database schema \w+; MLflow [\d.]+ needs \w+\): back the file up and "
                 r"upgrade it \(mlflow db upgrade sqlite:///{db}\), or " + NEW_FILE + "$", id="an older MLflow's database"),
    pytest.param(lambda d: with_schema(mlflow_database(d / "new.db"), "ffffffffffff"),
                 r"was written by a newer MLflow than [\d.]+ \(database schema ffffffffffff\): upgrade MLflow "
                 r"\(pip install -U mlflow\), or " + NEW_FILE + "$", id="a newer MLflow's database"),
])
def test_a_sqlite_file_mlflow_cannot_use_is_refused_untouched(tmp_path, make, pattern):
    (tmp_path / "folder.db").mkdir()
    (tmp_path / "notes.db").write_text("a text file, not a database\n")
    db = make(tmp_path)
    before = None if db.is_dir() else db.read_bytes()
    there = sorted(tmp_path.iterdir())
    uri = f"sqlite:///{db}"
    proc = run_cli(tmp_path, uri, *TINY)
    error_line(proc, rf"^error: tracking\.uri={uri}:? .*" + pattern.format(db=db, folder=tmp_path))
    assert before is None or db.read_bytes() == before  # MLflow did not add its tables to it
    assert sorted(p for p in tmp_path.iterdir() if p.name != "hydra") == there  # no <db>.lock beside it


def test_a_file_that_is_not_a_database_is_refused_with_nothing_made_beside_it(tmp_path):
    """The user's own file, named by a relative path: refused in one line, with no `.lock` left next to it."""
    (tmp_path / "notadb.md").write_text("# notes\n")
    proc = run_cli(tmp_path, "sqlite:///notadb.md", *TINY)
    assert proc.returncode == 1 and proc.stderr.splitlines() == [
        "error: tracking.uri=sqlite:///notadb.md: notadb.md is not an SQLite database: set "
        "tracking.uri=sqlite:///feedbench-mlflow.db (a new file), or move that file away"], proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hydra", "notadb.md"]  # Hydra's run folder, made before the check
    assert (tmp_path / "notadb.md").read_text() == "# notes\n"


def test_a_database_another_program_is_making_is_not_refused(tmp_path):
    """Another program (`mlflow ui`, a test's client) may make MLflow's tables in a new database
    without feedbench's lock: while it does, they look half-made (another program's tables, an
    older schema), and a check must wait, not refuse. (Our own runs make it under the lock.)"""
    from trainer.tracking.store import check_tracking_uri
    db = tmp_path / "mlflow.db"
    uri = f"sqlite:///{db}"
    maker = subprocess.Popen([sys.executable, "-c", f"from mlflow.tracking import MlflowClient; "
                                                    f"MlflowClient({uri!r}).search_experiments()"])
    try:
        while maker.poll() is None and not (db.exists() and db.stat().st_size):
            time.sleep(0.01)  # the file is made: from here on a check only reads it
        while maker.poll() is None:
            check_tracking_uri(uri)
    finally:
        maker.wait(timeout=120)
    assert maker.returncode == 0
    check_tracking_uri(uri)


@pytest.mark.parametrize("uri,pattern", [
    pytest.param("sqlite://", r"tracking\.uri=sqlite:// names no database file \(an in-memory store loses the runs when "
                              r"the run ends\): set tracking\.uri=sqlite:///<folder>/mlflow\.db", id="sqlite in memory"),
    pytest.param("foo://bar", r"tracking\.uri=foo://bar: MLflow has no store for foo:// URIs: set tracking\.uri=sqlite:///"
                              r"<folder>/mlflow\.db, http\(s\)://<an MLflow server>", id="an unknown scheme"),
])
def test_a_tracking_uri_naming_no_store_is_refused(tmp_path, uri, pattern):
    error_line(run_cli(tmp_path, uri, *TINY), pattern)


@pytest.mark.parametrize("form", ["file://{}", "{}"], ids=["file URI", "bare path"])
def test_mlflows_file_store_is_refused_with_the_fix(tmp_path, monkeypatch, form):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    uri = form.format(tmp_path / "mlruns")
    proc = run_cli(tmp_path, uri, *TINY)
    error_line(proc, rf"tracking\.uri={uri} is MLflow's file store, which MLflow 3 refuses unless "
                     rf"MLFLOW_ALLOW_FILE_STORE=true is set: set tracking\.uri=sqlite:///{tmp_path}/mlruns/mlflow\.db "
                     rf"\(or export MLFLOW_ALLOW_FILE_STORE=true\)$")
    assert not (tmp_path / "mlruns").exists()


def test_a_file_store_switch_that_is_neither_true_nor_false_is_named(tmp_path):
    uri = f"file://{tmp_path / 'mlruns'}"
    proc = run_cli(tmp_path, uri, *TINY, env={"MLFLOW_ALLOW_FILE_STORE": "yes please"})
    error_line(proc, rf"tracking\.uri={uri} is MLflow's file store, and MLFLOW_ALLOW_FILE_STORE='yes please' is neither "
                     r"true nor false: unset it and set tracking\.uri=sqlite:///.*/mlruns/mlflow\.db, or export "
                     r"MLFLOW_ALLOW_FILE_STORE=true$")


def test_a_database_without_its_driver_names_the_package(tmp_path):
    if importlib.util.find_spec("psycopg") is not None:
        pytest.skip("psycopg is installed here")
    uri = "postgresql://feedbench:secret@127.0.0.1:1/runs"
    proc = run_cli(tmp_path, uri, *TINY)
    error_line(proc, r"tracking\.uri=postgresql://feedbench:\*\*\*@127\.0\.0\.1:1/runs: the database's Python driver is not "
                     r"installed \(no module psycopg\): pip install 'psycopg\[binary\]', or set tracking\.uri=null$")
    assert "secret" not in proc.stderr


class NotMlflow(http.server.SimpleHTTPRequestHandler):
    """A web server that is not MLflow's: it serves a folder (404 pages for MLflow's API)."""

    def log_message(self, *args):
        pass


class AsksForCredentials(NotMlflow):
    """A server behind a login (an MLflow server with authentication, say): 401 to everything."""

    def do_GET(self):
        self.send_response(401)
        self.send_header("WWW-Authenticate", 'Basic realm="mlflow"')
        self.end_headers()


@pytest.fixture
def web_server(tmp_path, request):
    """A real HTTP server on a free loopback port, for the length of one test."""
    handler = functools.partial(getattr(request, "param", NotMlflow), directory=str(tmp_path))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}"
        finally:
            server.shutdown()
            thread.join(timeout=10)


def test_a_server_that_is_not_mlflow_is_refused(tmp_path, web_server):
    start = time.monotonic()
    proc = run_cli(tmp_path, web_server, *TINY)
    error_line(proc, rf"tracking\.uri={web_server} answers but is not an MLflow tracking server \(GET "
                     r"/api/2\.0/mlflow/experiments/get-by-name: HTTP 404, text/html\): give the address and port "
                     r"`mlflow server` listens on, or set tracking\.uri=null")
    assert time.monotonic() - start < 120  # not MLflow's minutes of retries (see above)


@pytest.mark.parametrize("web_server", [AsksForCredentials], indirect=True)
def test_a_server_that_refuses_our_credentials_says_which_to_set(tmp_path, web_server):
    proc = run_cli(tmp_path, web_server, *TINY, timeout=120)
    error_line(proc, rf"tracking\.uri={web_server} refused feedbench \(HTTP 401\): set MLFLOW_TRACKING_USERNAME and "
                     r"MLFLOW_TRACKING_PASSWORD \(or MLFLOW_TRACKING_TOKEN\) for it, or set tracking\.uri=null$")


def test_a_deleted_experiment_says_how_to_restore_it(tmp_path, tracking_uri):
    client = MlflowClient(tracking_uri)
    client.delete_experiment(client.create_experiment("feedbench"))
    proc = run_cli(tmp_path, tracking_uri, *TINY)
    error_line(proc, rf"tracking\.experiment=feedbench was deleted from {tracking_uri} \(it is in MLflow's trash\): restore it "
                     rf"\(MLFLOW_TRACKING_URI={tracking_uri} mlflow experiments restore --experiment-id \d+\) or set "
                     r"tracking\.experiment=<another name>$")
    assert client.search_runs([client.get_experiment_by_name("feedbench").experiment_id]) == []


def test_what_mlflow_still_refuses_when_it_opens_the_store_is_one_line(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}?timeout=soon"  # SQLite's connect() wants seconds
    proc = run_cli(tmp_path, f"'{uri}'", *TINY)
    error_line(proc, rf"tracking\.uri={re.escape(uri)}: MLflow refused to record the run there \(ValueError: could not convert "
                     r"string to float: 'soon'\): correct what it names, or set tracking\.uri=null")


def test_check_tracking_uri_accepts_a_writable_sqlite_folder(tracking_uri):
    from trainer.tracking.store import check_tracking_uri
    check_tracking_uri(tracking_uri)  # the folder exists and is writable: no error
    with pytest.raises(ConfigError, match="does not exist"):
        check_tracking_uri("sqlite:////nonexistent-feedbench/mlflow.db")


# -- failures during the run -----------------------------------------------------------------------
def test_nan_loss_stops_the_run_failed_at_its_step_keeping_the_data(tmp_path, tracking_uri):
    proc = run_cli(tmp_path, tracking_uri, *TINY, "dataset.num_samples=4000", "engine.optimizer.name=sgd",
                   "engine.optimizer.lr=1e10")
    found = error_line(proc, r"loss became (nan|inf) at step (\d+) \(engine\.optimizer\.lr=[\d.e+]+\): "
                             r"lower engine\.optimizer\.lr")
    step = int(found.group(2))
    r = failed_run(tracking_uri)
    assert r.data.tags["failed_step"] == str(step)
    rows = steps_csv(tracking_uri, r.info.run_id)
    losses = [float(x["loss"]) for x in rows]
    assert all(math.isfinite(v) for v in losses[:step - 1]) and not math.isfinite(losses[step - 1])
    # stopped soon after (checked every 20 steps, lagged), not after all 250 steps
    assert step <= len(rows) <= step + 40 < 250
    assert r.data.metrics["total_steps"] == len(rows)


def test_nan_in_the_last_steps_is_caught_after_the_loop(tiny_cfg, runs):
    # 6 steps: fewer than one lagged check; the final check after the loop finds it.
    from trainer.errors import RunFailed
    with pytest.raises(RunFailed, match=r"loss became (nan|inf) at step \d") as failure:
        run(tiny_cfg("engine.optimizer.name=sgd", "engine.optimizer.lr=1e10"))
    (r,) = runs()
    assert r.info.status == "FAILED" and r.data.tags["failed_step"] == str(failure.value.step)
    assert r.data.metrics["total_steps"] == 6


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda_graph"])
def test_nan_loss_on_gpu_is_found_lagged(tiny_cfg, runs, graph):
    from trainer.errors import RunFailed
    with pytest.raises(RunFailed, match=r"loss became (nan|inf) at step \d+") as failure:
        run(tiny_cfg("engine.device=cuda", "dataset.num_samples=4000", "engine.optimizer.name=sgd",
                     "engine.optimizer.lr=1e10", f"engine.cuda_graph={str(graph).lower()}"))
    (r,) = runs()
    step, done = failure.value.step, int(r.data.metrics["total_steps"])
    assert r.info.status == "FAILED" and r.data.tags["failed_step"] == str(step)
    from trainer.loop.meter import LOSS_BATCH  # the NaN check's period
    assert step <= done <= step + 2 * LOSS_BATCH < 250  # read one check late at most, never at the end


@pytest.mark.gpu
def test_a_batch_larger_than_gpu_memory_fails_before_training(tmp_path, tracking_uri):
    # The first layer's output alone is 65536 x 2^20 floats: 256 GiB.
    proc = run_cli(tmp_path, tracking_uri, *TINY, "engine.device=cuda", "loader=gpu_resident", "model=mlp",
                   "model.hidden=1048576", "dataset.num_samples=65536", "loader.batch_size=65536", "engine.max_steps=2")
    error_line(proc, r"model=mlp \(.* the activations of loader\.batch_size=65536\) needs [\d.]+ GiB of GPU memory but "
                     r"only [\d.]+ GiB of [\d.]+ GiB is free: set loader\.batch_size=\d+ or smaller")
    r = failed_run(tracking_uri)
    assert "model=mlp" in r.data.tags["error"] and r.data.metrics.get("total_steps", 0) == 0


@pytest.mark.gpu
def test_gpu_out_of_memory_names_batch_size_and_strategy(tmp_path, tracking_uri):
    b = batch_that_runs_out_of_gpu_memory(hidden=2**20)
    proc = run_cli(tmp_path, tracking_uri, *TINY, "engine.device=cuda", "loader=gpu_resident", "model=mlp",
                   "model.hidden=1048576", f"dataset.num_samples={b}", f"loader.batch_size={b}", "engine.max_steps=2")
    error_line(proc, rf"out of GPU memory with loader=gpu_resident loader\.batch_size={b} model=mlp: "
                     rf"set loader\.batch_size={b // 2} or smaller")
    assert "out of GPU memory" in failed_run(tracking_uri).data.tags["error"]


# -- HYDRA_FULL_ERROR and sweeps -------------------------------------------------------------------
def test_full_trace_on_request(tmp_path, tracking_uri):
    proc = run_cli(tmp_path, tracking_uri, *TINY, "loader.batch_size=0", env={"HYDRA_FULL_ERROR": "1"})
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "ConfigError: loader.batch_size must be >= 1" in proc.stderr


@pytest.mark.slow  # test_sweep.py lists a sweep's failed jobs by default
def test_a_bad_job_in_a_sweep_fails_alone(tmp_path, tracking_uri):
    tiny = [o for o in TINY if not o.startswith("loader.batch_size=")]
    proc = run_cli(tmp_path, tracking_uri, "-m", "loader.batch_size=0,16", *tiny)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.count("error: loader.batch_size must be >= 1 (got 0)") == 1
    jobs = {r.data.tags.get("sweep.job"): r.info.status for r in all_runs(tracking_uri) if r.data.tags.get("sweep") != "true"}
    assert jobs["1"] == "FINISHED"  # the good job still ran
