"""A regular install runs: the wheel built from this checkout, installed into a fresh virtual
environment, runs `python -m trainer` from another folder and records a FINISHED run there.

How, and why so:
- the wheel is built by pip, as `pip install .` builds it, from a copy of the checkout's sources
  (an in-tree build would leave build/ and egg-info in the checkout);
- the fresh environment gets the wheel alone (`--no-deps`) and reaches the dependencies already
  installed here (torch, MLflow, ...) through a .pth file that adds this interpreter's
  site-packages after its own, as `--system-site-packages` would, but also when the tests run
  in a virtual environment (`--system-site-packages` would reach the base interpreter's instead).
  Downloading torch again would take minutes;
- this environment also holds the editable install of the checkout (`pip install -e .`, its
  import hook, and PYTHONPATH when set), which could import the checkout instead of the wheel:
  the new environment's own site-packages comes first on sys.path, `-E` ignores PYTHONPATH, and
  the test checks that `trainer`, `datasets` and `models` are imported from inside it.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from trainer.config import PROJECT_ROOT


SOURCES = ("pyproject.toml", "README.md", "conf", "trainer", "datasets", "models")
PACKAGES = ("trainer", "datasets", "models")


def build_wheel(tmp: Path) -> Path:
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        path = PROJECT_ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    # An absolute path: pip reads a bare name as a package to fetch from the index.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp / "dist"), str(src.resolve())],
                   check=True, capture_output=True, text=True, timeout=300)
    (wheel,) = (tmp / "dist").glob("feedbench-*.whl")
    return wheel


def fresh_environment(tmp: Path) -> Path:
    """A virtual environment that sees this interpreter's packages after its own; its python."""
    env = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    python = env / "bin" / "python"
    own = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True).stdout.strip()
    outer = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
    # addsitedir, not bare paths: the .pth files there (packages' own import hooks) are run too.
    Path(own, "zz_outer_environment.pth").write_text("".join(f"import site; site.addsitedir({p!r})\n" for p in outer))
    return python


def clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "HYDRA_FULL_ERROR")}


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(the wheel, the python of a fresh environment holding it), made once for this file's tests."""
    tmp = tmp_path_factory.mktemp("install")
    wheel = build_wheel(tmp)
    python = fresh_environment(tmp)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed", str(wheel)],
                   check=True, capture_output=True, text=True, timeout=300, env=clean_env())
    return wheel, python


def test_the_wheel_holds_every_module_and_config(installed):
    wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    for package in PACKAGES:
        assert {p.relative_to(PROJECT_ROOT).as_posix() for p in (PROJECT_ROOT / package).rglob("*.py")} <= names
    configs = {"trainer/conf/" + p.relative_to(PROJECT_ROOT / "conf").as_posix() for p in (PROJECT_ROOT / "conf").rglob("*.yaml")}
    assert configs and configs <= names


def test_wheel_installed_in_a_fresh_environment_runs_from_elsewhere(installed, tmp_path):
    wheel, python = installed
    venv = python.parent.parent
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run([str(python), "-E", "-c", "import json, trainer, datasets, models; "
                            "print(json.dumps([m.__file__ for m in (trainer, datasets, models)]))"],
                           cwd=elsewhere, check=True, capture_output=True, text=True, env=clean_env())
    for file in json.loads(where.stdout):
        assert Path(file).is_relative_to(venv), file  # the wheel's copy, not the checkout

    proc = subprocess.run([str(python), "-E", "-m", "trainer", "engine.max_steps=3"], cwd=elsewhere,
                          capture_output=True, text=True, timeout=600, env=clean_env())
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    # An installed run writes outputs/ in the current folder: runs and Hydra's folders.
    db = elsewhere / "outputs" / "mlflow.db"
    assert db.is_file() and list((elsewhere / "outputs" / "hydra").iterdir())
    client = MlflowClient(f"sqlite:///{db}")
    (run,) = client.search_runs([client.get_experiment_by_name("feedbench").experiment_id])
    assert run.info.status == "FINISHED" and run.data.metrics["total_steps"] == 3
    env = json.loads(Path(client.download_artifacts(run.info.run_id, "environment.json")).read_text())
    assert env["feedbench"] == wheel.name.split("-")[1] and env["git_commit"] is None  # the wheel's version, no checkout
    assert not any(venv.rglob("outputs"))  # nothing written inside the installed package


def test_an_installed_run_from_a_folder_it_cannot_write_in_is_one_line(installed, tmp_path):
    _, python = installed
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    # root ignores permission bits: then a folder of a read-only file system, or one of the kernel's
    locked = next((p for p in (locked, Path("/sys"), Path("/proc/1")) if not os.access(p, os.W_OK)), None)
    if locked is None:
        pytest.skip("no folder here that this user cannot write in")
    try:
        proc = subprocess.run([str(python), "-E", "-m", "trainer", "engine.max_steps=3"], cwd=locked,
                              capture_output=True, text=True, timeout=300, env=clean_env())
    finally:
        (tmp_path / "locked").chmod(0o755)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines() == [f"error: hydra.run.dir: outputs/ goes in the current folder, and {locked} is not "
                                        f"writable: run from a writable folder, or set hydra.run.dir=<a writable folder> "
                                        f"and tracking.uri=sqlite:///<a writable folder>/mlflow.db"]
