"""The MLflow UI, in headless Chromium, shows a sweep: the parent run, and its jobs nested under it.

Needs Debian's `chromium` (`apt-get install chromium`; .ci/run installs it). Playwright drives
that binary; it never downloads a browser of its own. Without it the test is skipped on a
developer's machine and fails under CI (CI=true), so a missing install cannot pass unnoticed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from trainer.loop.run import run
from trainer.tracking import sweep

pytestmark = pytest.mark.browser

CHROMIUM = os.environ.get("FEEDBENCH_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
RUN_NAME_CELL = '[col-id="attributes.`Run Name`"]'
SERVER_START_S = 120  # a cold `mlflow server` on a busy 2-core machine
UI_WAIT_MS = 60_000


def require(condition: bool, what: str) -> None:
    if condition:
        return
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{what}: CI must install it (see .ci/run)")
    pytest.skip(what)


@pytest.fixture
def chromium():
    """Playwright's sync API and Debian's Chromium binary, checked before anything is started."""
    require(Path(CHROMIUM).is_file(), f"{CHROMIUM} is not installed (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        require(False, "the playwright package is not installed (pip install -e '.[test]')")
    return sync_playwright, CHROMIUM


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def small_sweep(tiny_cfg, tracking_uri):
    """A 2-job sweep, recorded as `python -m trainer -m loader=baseline,pinned` records it (the
    command's own sweeps: test_sweep.py): (experiment id, parent run, child runs)."""
    parent_id = sweep.start_parent(tiny_cfg().tracking, "sweep loader=baseline,pinned", ["loader"], {})
    for strategy in ("baseline", "pinned"):
        run(tiny_cfg(f"loader={strategy}", "engine.max_steps=4", f"tracking.parent_run_id={parent_id}"))
    sweep.finish_parent(tracking_uri, parent_id)
    client = MlflowClient(tracking_uri)
    exp_id = client.get_experiment_by_name("feedbench").experiment_id
    found = client.search_runs([exp_id])
    (parent,) = [r for r in found if r.data.tags.get("sweep") == "true"]
    children = [r for r in found if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert parent.info.status == "FINISHED" and len(children) == 2
    return exp_id, parent, children


@pytest.fixture
def mlflow_server(tracking_uri, tmp_path):
    """`mlflow server` on 127.0.0.1 and a free port against the test's store; always stopped."""
    port = free_port()
    log = (tmp_path / "mlflow-server.log").open("w")
    # No background job runner: the UI does not need it, and it starts a dozen processes.
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri", tracking_uri,
                             "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"mlflow server exited with {proc.returncode}:\n{(tmp_path / 'mlflow-server.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"mlflow server did not answer on {url} within {SERVER_START_S}s")
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and the workers it started
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()


def test_ui_shows_the_sweep_with_its_jobs_nested(chromium, small_sweep, mlflow_server, tmp_path):
    sync_playwright, executable = chromium
    exp_id, parent, children = small_sweep

    def row(run_id: str) -> str:
        return f'[role=row][row-id="{run_id}"]'

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 900})
            page.set_default_timeout(UI_WAIT_MS)
            # The runs table of the experiment, in the UI's model-training view.
            page.goto(f"{mlflow_server}/#/experiments/{exp_id}/runs?workflowType=machine_learning")
            parent_cell = page.locator(f"{row(parent.info.run_id)} {RUN_NAME_CELL}")
            parent_cell.wait_for(state="visible")
            assert parent.info.run_name in parent_cell.inner_text()
            # Nested: the jobs are not top-level rows; they appear when the parent is expanded.
            assert [page.locator(row(c.info.run_id)).count() for c in children] == [0, 0]
            parent_cell.locator("button").click()
            parent_index = int(page.locator(row(parent.info.run_id)).first.get_attribute("row-index"))
            for c in children:
                cell = page.locator(f"{row(c.info.run_id)} {RUN_NAME_CELL}")
                cell.wait_for(state="visible")
                assert c.info.run_name in cell.inner_text()
                assert int(page.locator(row(c.info.run_id)).first.get_attribute("row-index")) > parent_index
            shot = tmp_path / "mlflow-ui-sweep.png"
            page.screenshot(path=str(shot))
        finally:
            browser.close()
    assert shot.read_bytes().startswith(b"\x89PNG")
