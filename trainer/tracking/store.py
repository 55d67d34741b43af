"""Where runs are stored: the default sqlite store, its artifact folder, and the up-front check
that runs can be recorded at `tracking.uri`. Imported by the run tracker, the sweep and the report alike.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import http.client
import json
import logging
import os
import re
import secrets
import sqlite3
import ssl
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from pathlib import Path
from typing import Dict, FrozenSet, Iterator, Optional, Tuple

import mlflow
from mlflow.environment_variables import MLFLOW_ALLOW_FILE_STORE
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from trainer.config import BASE_DIR
from trainer.errors import ConfigError
from trainer.loop.faults import StopSignals

try:
    import fcntl
except ImportError:  # not POSIX: stores are made without the lock
    fcntl = None

OUTPUTS = BASE_DIR / "outputs"  # the checkout's outputs/, or ./outputs for an installed package
PER_STEP_METRICS = ("data_wait_ms", "h2d_ms", "compute_ms", "step_ms", "loss")
DATABASES = ("postgresql", "mysql", "mssql")  # the SQLAlchemy databases MLflow keeps runs in
HOSTED = ("databricks", "databricks-uc", "uc")  # MLflow checks these itself
SQLITE_HEADER = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite database file
PIP_NAMES = {"MySQLdb": "mysqlclient", "psycopg": "'psycopg[binary]'", "psycopg2": "psycopg2-binary"}

# MLflow logs at INFO when it creates a database's tables, and a database error at ERROR with its
# traceback and SQL before raising it; stderr is kept for what needs reading (a bad input, a
# refused write: one line each, and these would come before it).
logging.getLogger("alembic.runtime.migration").setLevel(logging.WARNING)
logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)


def default_uri() -> str:
    return f"sqlite:///{OUTPUTS / 'mlflow.db'}"


def artifact_root(uri: str) -> Optional[str]:
    """Artifacts beside a local sqlite DB (a relative path is taken from the current folder, as
    SQLite does); a server decides for itself."""
    db = sqlite_path(uri)
    return (db.resolve().parent / "mlartifacts").as_uri() if db is not None else None


def experiment_id(client: MlflowClient, name: str, uri: str) -> str:
    """The experiment's id, created on first use with its artifacts beside a sqlite DB."""
    exp = client.get_experiment_by_name(name)
    if exp is not None and exp.lifecycle_stage == "deleted":  # MLflow refuses new runs in it
        raise ConfigError(f"tracking.experiment={name} was deleted from {shown(uri)} (it is in MLflow's trash): "
                          f"restore it (MLFLOW_TRACKING_URI={shown(uri)} mlflow experiments restore "
                          f"--experiment-id {exp.experiment_id}) or set tracking.experiment=<another name>")
    if exp is not None:
        return exp.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_root(uri))
    except MlflowException as e:  # another run made it a moment ago (runs started at once)
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        return client.get_experiment_by_name(name).experiment_id


@contextlib.contextmanager
def store_errors(uri: str) -> Iterator[None]:
    """Whatever MLflow still refuses when it opens the store (what `check_tracking_uri` cannot
    foresee) becomes one line naming `tracking.uri`."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as e:  # MlflowException, SQLAlchemy's errors, a missing module, OSError
        raise ConfigError(f"tracking.uri={shown(uri)}: MLflow refused to record the run there ({reason(e)}): "
                          f"correct what it names, or set tracking.uri=null to record in {default_uri()}") from None


def reason(error: BaseException) -> str:
    """An error in a few words: the database's own message, not SQLAlchemy's statement dump."""
    cause = getattr(error, "orig", None) or getattr(error.__cause__, "orig", None) or error
    text = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(cause).split("[SQL:")[0]
    return f"{type(cause).__name__}: {' '.join(text.split())[:200]}"


def shown(uri: str) -> str:
    """`uri` with any password in it masked, for messages."""
    return re.sub(r"(//[^/:@]*:)[^/@]*@", r"\1***@", uri)


PREFLIGHT_TIMEOUT_S = 5.0  # MLflow itself retries an unreachable server for minutes


def check_tracking_uri(uri: Optional[str]) -> None:
    """Fail before anything runs, in one line naming `tracking.uri` and the fix, when runs could
    not be recorded there: a server that does not answer or is not MLflow's, a sqlite file in a
    missing or read-only folder or one that is not an MLflow database of this MLflow's schema,
    MLflow's refused file store, a database without its driver, or a scheme MLflow does not know."""
    target = uri or default_uri()
    scheme = urllib.parse.urlsplit(target).scheme.lower()
    scheme = "" if len(scheme) == 1 else scheme  # a Windows drive letter: a path
    if scheme in ("http", "https"):
        _check_server(target)
    elif scheme == "sqlite":
        _check_sqlite(target, uri is None)
    elif scheme in ("", "file"):
        _check_file_store(target)
    elif scheme.split("+")[0] in DATABASES:  # postgresql+psycopg2://...
        _check_database_driver(target)
    elif scheme not in HOSTED:
        raise ConfigError(f"tracking.uri={shown(target)}: MLflow has no store for {scheme}:// URIs: set "
                          f"tracking.uri=sqlite:///<folder>/mlflow.db, http(s)://<an MLflow server> or a database URI "
                          f"({', '.join(s + '://' for s in DATABASES)}), or tracking.uri=null to record in {default_uri()}")


def check_store_to_read(uri: str) -> None:
    """Before runs are read back (`python -m trainer.report --uri`): the trainer's checks, for a
    store that must exist already, in one line naming --uri. Nothing is made or written."""
    scheme = urllib.parse.urlsplit(uri).scheme.lower()
    path = sqlite_path(uri) if scheme == "sqlite" else Path(uri) if len(scheme) <= 1 else None
    if path is not None and path.is_file():  # a bare path too: it may name the database
        _check_mlflow_database(path, uri, key="--uri")
        if scheme != "sqlite":
            raise ConfigError(f"--uri {uri} is a path, not a URI: pass --uri sqlite:///{path.resolve()}")
    elif scheme == "sqlite" or (path is not None and not path.exists()):
        raise ConfigError(f"no MLflow database at {path or uri}: run a sweep first "
                          "(python -m trainer -m loader=baseline,pinned) or pass --uri")
    else:
        try:
            check_tracking_uri(uri)
        except ConfigError as e:
            raise ConfigError(_for_the_report(str(e))) from None


def _for_the_report(message: str) -> str:
    """A message of `check_tracking_uri`, worded for the report's --uri (it reads, and its default
    is the trainer's store)."""
    for trainer, report in (("set tracking.uri=null to record in", "leave --uri out to read"),
                            ("or tracking.uri=null to record in", "or leave --uri out to read"),
                            ("set tracking.uri=null", "leave --uri out"), ("tracking.uri=", "--uri=")):
        message = message.replace(trainer, report)
    return message


# -- an MLflow server ------------------------------------------------------------------------------
PROBE = "/api/2.0/mlflow/experiments/get-by-name?experiment_name=feedbench"  # any MLflow server answers it in JSON


def _check_server(target: str) -> None:
    request = urllib.request.Request(target.rstrip("/") + PROBE, headers=_auth_headers())
    try:
        with urllib.request.urlopen(request, timeout=PREFLIGHT_TIMEOUT_S, context=_tls()) as answer:
            status, kind, body = answer.status, answer.headers.get_content_type(), answer.read(1 << 16)
    except urllib.error.HTTPError as e:  # an answer all the same: an MLflow error is JSON too
        status, kind, body = e.code, e.headers.get_content_type(), e.read(1 << 16)
    except (OSError, http.client.HTTPException) as e:  # refused, timed out, not an HTTP server
        raise ConfigError(f"tracking.uri={shown(target)} is unreachable ({getattr(e, 'reason', e)}): start the MLflow "
                          f"server there, or set tracking.uri=null to record in {default_uri()}") from None
    if status in (401, 403):
        raise ConfigError(f"tracking.uri={shown(target)} refused feedbench (HTTP {status}): set MLFLOW_TRACKING_USERNAME "
                          f"and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) for it, or set tracking.uri=null")
    if not _from_mlflow(body):
        raise ConfigError(f"tracking.uri={shown(target)} answers but is not an MLflow tracking server (GET "
                          f"{PROBE.split('?')[0]}: HTTP {status}, {kind}): give the address and port `mlflow server` "
                          f"listens on, or set tracking.uri=null to record in {default_uri()}")


def _from_mlflow(body: bytes) -> bool:
    """MLflow's REST API answers with a JSON object: the experiment, or an `error_code`."""
    try:
        found = json.loads(body)
    except ValueError:
        return False
    return isinstance(found, dict) and ("experiment" in found or "error_code" in found)


def _auth_headers() -> Dict[str, str]:
    """The credentials MLflow's client would send (its environment variables)."""
    user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
    if user and password:
        return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}
    token = os.environ.get("MLFLOW_TRACKING_TOKEN")
    return {"Authorization": f"Bearer {token}"} if token else {}


def _tls() -> Optional[ssl.SSLContext]:
    """The TLS settings MLflow's client would use (its environment variables); None: Python's default."""
    if os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() == "true":
        return ssl._create_unverified_context()
    cert = os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH")
    return ssl.create_default_context(cafile=cert) if cert else None


# -- a sqlite file ---------------------------------------------------------------------------------
def sqlite_path(uri: str) -> Optional[Path]:
    """The database file of a `sqlite:///<path>` URI (relative to the current folder unless the
    path is absolute: `sqlite:////abs/mlflow.db`); None for any other URI, or one naming no file."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///"):].split("?")[0]  # SQLAlchemy takes options after '?'
    return Path(path) if path not in ("", ":memory:") else None


def _check_sqlite(target: str, default: bool) -> None:
    db = sqlite_path(target)
    if db is None:  # sqlite:// (in memory), sqlite:///:memory:, sqlite://host/...
        raise ConfigError(f"tracking.uri={target} names no database file (an in-memory store loses the runs when "
                          f"the run ends): set tracking.uri=sqlite:///<folder>/mlflow.db (four slashes before an "
                          f"absolute path), or tracking.uri=null to record in {default_uri()}")
    try:
        if default:
            OUTPUTS.mkdir(parents=True, exist_ok=True)
        elif not db.parent.is_dir():
            raise ConfigError(f"tracking.uri={target}: folder {db.parent} does not exist: create it "
                              f"(mkdir -p {db.parent}) or set tracking.uri=null")
        if db.is_dir():
            raise ConfigError(f"tracking.uri={target}: {db} is a folder, not a database file: "
                              f"set tracking.uri=sqlite:///{db / 'mlflow.db'}")
        with tempfile.TemporaryFile(dir=db.parent):  # sqlite also writes a journal beside the file
            pass
        if db.exists() and not os.access(db, os.W_OK):
            raise PermissionError(0, f"{db} is read-only")
    except OSError as e:
        fix = "set tracking.uri=null" if not default else "set tracking.uri=sqlite:////<a writable folder>/mlflow.db"
        raise ConfigError(f"tracking.uri={target}: cannot write in {db.parent} ({e.strerror or e}): "
                          f"use a writable folder or {fix}") from None
    if _in_use(db) and not _lock_path(db).exists():
        # Checked read-only before the lock is made, so a file refused gets no <db>.lock beside it.
        # Only with no lock there: ours make it before they write the file, so this one is not ours
        # half-way through MLflow's migrations (another program's, the check waits out).
        _check_mlflow_database(db, target)
    with store_lock(db):
        half_made = _check_mlflow_database(db, target) if _in_use(db) else None
        if half_made:  # nothing in it to lose: said, and made anew as a new store is
            print(f"feedbench: {db} was left half-made by MLflow's table migrations ({half_made}) and held no "
                  "runs: made it anew", file=sys.stderr)
        if half_made or not _in_use(db):  # a new database (an empty file too), made one process at a time
            _make_store(db, target)


@contextlib.contextmanager
def store_lock(db: Path) -> Iterator[None]:
    """Hold `<db>.lock` (an flock: released when the process ends, however it ends). MLflow makes
    a new database's tables through a series of schema migrations; two processes making them at
    once (two runs started together on a new store) leave the file half-migrated."""
    if fcntl is None:
        yield
        return
    with open(_lock_path(db), "a") as lock:  # "a": made if missing, never truncated
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _lock_path(db: Path) -> Path:
    return db.with_name(db.name + ".lock")


def _in_use(db: Path) -> bool:
    """Whether `db` holds anything (a missing or empty file is a new store, for MLflow to make)."""
    return db.exists() and db.stat().st_size > 0


def _make_store(db: Path, target: str) -> None:
    """Make a new store all at once, under `store_lock`: MLflow's migrations (seconds, dozens of
    them) run on a file of another name beside `db`, moved into place only once they are all
    done. A process stopped half-way (Ctrl-C, a full disk, a kill) leaves no store, never a
    half-made one; a Ctrl-C or SIGTERM meanwhile waits until the store is made (a second one
    stops at once, leaving none), then stops the run as anywhere else."""
    # A name of its own each time: MLflow caches a store (and its connections) by URI for the process.
    new = db.with_name(f".{db.name}.{os.getpid()}-{secrets.token_hex(4)}.new")
    for leftover in db.parent.glob(f".{db.name}.*.new*"):  # a killed maker's: the lock we hold was its
        leftover.unlink(missing_ok=True)
    uri = f"sqlite:///{new.resolve()}"
    try:
        # Held, not raised where it lands: MLflow and SQLAlchemy swallow an exception raised in some
        # of their cleanup code, and the run went on as if no Ctrl-C had come.
        with StopSignals(waiting_for="the new store is made"), store_errors(target), warnings.catch_warnings():
            # Alembic warns about MLflow's own schema while it migrates: nothing a user can act on.
            warnings.simplefilter("ignore")
            try:
                MlflowClient(uri).search_experiments(max_results=1)
            finally:
                _close_engine(uri)
            for side in _side_files(db):  # a half-made store's hot journal would be rolled back into the new one
                side.unlink(missing_ok=True)
            os.replace(new, db)  # atomic: the store is complete, or (as before) absent
    finally:
        for made in (new, *_side_files(new)):
            made.unlink(missing_ok=True)


def _side_files(db: Path) -> Tuple[Path, ...]:
    """The files SQLite keeps beside a database while it writes: its rollback journal, or its WAL."""
    return tuple(db.with_name(db.name + suffix) for suffix in ("-journal", "-wal", "-shm"))


def _close_engine(uri: str) -> None:
    """Close MLflow's cached connections to `uri` (the store's file under its temporary name)."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    engine = getattr(SqlAlchemyStore, "_engine_map", {}).pop(uri, None)  # MLflow's cache: no public API
    if engine is not None:
        engine.dispose()


SETTLE_S = 1.0  # a database whose tables another process is making changes within this
LEFT_ALONE_S = 30.0  # a half-made database unchanged this long is no longer being made


def _check_mlflow_database(db: Path, target: str, key: str = "tracking.uri") -> Optional[str]:
    """An existing file must be an MLflow database of this MLflow's schema. Read only, before
    MLflow opens it: MLflow would add its tables to any SQLite database, another program's too.
    Messages name `key`: the trainer's `tracking.uri`, or the report's `--uri`. Returns how a
    store that MLflow stopped making half-way, and that holds no run, was left (for the trainer
    to make anew); None for a sound one."""
    if key == "tracking.uri":
        other = db.with_name("feedbench-mlflow.db" if db.name != "feedbench-mlflow.db" else "runs.db")
        fix, away = f"set tracking.uri=sqlite:///{other} (a new file)", ", or move that file away"
    else:  # reading runs back: a new file would hold none
        fix, away = f"pass {key} sqlite:///<the MLflow database your runs are in>", ""
    named = f"{key}={target}"
    with db.open("rb") as f:
        if f.read(len(SQLITE_HEADER)) != SQLITE_HEADER:
            raise ConfigError(f"{named}: {db} is not an SQLite database: {fix}{away}")
    # Another program may be making MLflow's tables in a new database right now (ours make them
    # under another name, `_make_store`; a test, `mlflow ui`, do not): between two of MLflow's
    # migrations its tables and schema look like another program's or an older MLflow's. A
    # verdict against the file stands once the file has stopped changing.
    state = _tables_and_schema(db, named, fix)
    problem = _problem(*state, db, target, named, fix)
    deadline = time.monotonic() + 20 * SETTLE_S
    while problem and time.monotonic() < deadline:
        time.sleep(SETTLE_S)
        again = _tables_and_schema(db, named, fix)
        if again == state:
            break
        state, problem = again, _problem(*again, db, target, named, fix)
    half_made = _half_made(*state)
    if half_made and key == "tracking.uri":
        # Another program making MLflow's tables in place (`mlflow ui`) may pause between two
        # migrations: only a file left alone for a while is taken for one given up, and made anew.
        age = time.time() - db.stat().st_mtime
        if age < LEFT_ALONE_S:
            raise ConfigError(f"{named}: {db} is half-made ({half_made}) and changed {age:.0f} s ago: another program "
                              f"may be making it now: rerun in a minute (a half-made store that holds no runs and has "
                              f"not changed for {LEFT_ALONE_S:.0f} s is made anew), or {fix}")
        return half_made
    if problem:
        raise ConfigError(problem)
    return None


def _tables_and_schema(db: Path, named: str, fix: str) -> Tuple[frozenset, Optional[str], int, int]:
    """The database's tables, the schema revision MLflow stamped in it (None: no stamp), and the
    number of runs and of experiments it holds."""
    try:
        with contextlib.closing(sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)) as con:
            tables = frozenset(name for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
                               if not name.startswith("sqlite_"))
            stamp = con.execute("SELECT version_num FROM alembic_version").fetchone() if "alembic_version" in tables else None
            runs, experiments = (con.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0] if table in tables else 0
                                 for table in ("runs", "experiments"))
    except sqlite3.Error as e:  # damaged, encrypted, locked by another program
        raise ConfigError(f"{named}: {db} cannot be read as an SQLite database ({e}): {fix}, or repair that one") from None
    return tables, stamp[0] if stamp else None, runs, experiments


def _half_made(tables: frozenset, revision: Optional[str], runs: int, experiments: int) -> Optional[str]:
    """How MLflow left a store it stopped making half-way, one that holds no run (None: not one):
    runs that opened a new store at once (before feedbench made stores under `store_lock`), or a
    process stopped while MLflow made it in place (before `_make_store` made it under another
    name): an older schema stamped, and leftover `_alembic_tmp_*` tables or not even MLflow's
    first experiment, which it makes once its migrations are done."""
    head, known = mlflow_schemas()
    if not tables or runs or revision == head or head is None:
        return None
    leftovers = sorted(t for t in tables if t.startswith("_alembic_tmp_"))
    mlflows = revision in known or (revision is None and {"experiments", "runs"} <= tables)  # not another program's
    if not (mlflows and (leftovers or not experiments or revision is None)):
        return None
    made = f"schema {revision}" if revision else "no schema stamped"
    return made + (f", leftover tables {', '.join(leftovers)}" if leftovers else "")


def _problem(tables: frozenset, revision: Optional[str], runs: int, experiments: int, db: Path, target: str,
             named: str, fix: str) -> Optional[str]:
    """What keeps MLflow from recording runs in a database of these tables and schema (None: nothing)."""
    if not tables:
        return None  # a new database: MLflow makes its tables
    head, known = mlflow_schemas()
    half_made = _half_made(tables, revision, runs, experiments)
    if half_made:  # the trainer makes it anew (`_check_sqlite`); the report has nothing to read in it
        return (f"{named}: {db} was left half-made by MLflow's table migrations ({half_made}) and holds no runs: "
                f"nothing to read (the next python -m trainer with tracking.uri=sqlite:///{db} makes it anew)")
    if not {"experiments", "runs", "alembic_version"} <= tables:
        listed = ", ".join(sorted(tables)[:5]) + (", ..." if len(tables) > 5 else "")
        return (f"{named}: {db} is another program's SQLite database (tables {listed}), not an MLflow store: "
                f"{fix.replace('(a new file)', '(a file of its own)')}")
    if head is None or revision == head:
        return None  # leftover `_alembic_tmp_*` tables beside the latest schema are harmless
    if revision in known:
        return (f"{named} holds runs of an older MLflow (database schema {revision}; MLflow {mlflow.__version__} "
                f"needs {head}): back the file up and upgrade it (mlflow db upgrade {target}), or {fix}")
    return (f"{named} was written by a newer MLflow than {mlflow.__version__} (database schema {revision}): "
            f"upgrade MLflow (pip install -U mlflow), or {fix}")


@functools.lru_cache(maxsize=1)
def mlflow_schemas() -> Tuple[Optional[str], FrozenSet[str]]:
    """This MLflow's database schema (its latest migration) and every earlier one: read once a
    process (walking MLflow's migration scripts takes 0.1 s, three times a run's check)."""
    try:  # MLflow's migrations have no public API: if these names move, MLflow's own check speaks
        from alembic.script import ScriptDirectory
        from mlflow.store.db.utils import _get_alembic_config

        script = ScriptDirectory.from_config(_get_alembic_config(""))
        return script.get_current_head(), frozenset(r.revision for r in script.walk_revisions())
    except Exception:
        return None, frozenset()


# -- MLflow's file store, other databases ----------------------------------------------------------
def _check_file_store(target: str) -> None:
    folder = Path(urllib.parse.unquote(urllib.parse.urlsplit(target).path) if target.startswith("file:") else target)
    db = f"sqlite:///{(folder if folder.suffix == '.db' else folder / 'mlflow.db').resolve()}"
    try:
        allowed = MLFLOW_ALLOW_FILE_STORE.get()
    except ValueError:  # MLflow itself would fail on it with a traceback
        raise ConfigError(f"tracking.uri={target} is MLflow's file store, and MLFLOW_ALLOW_FILE_STORE="
                          f"{os.environ.get('MLFLOW_ALLOW_FILE_STORE')!r} is neither true nor false: unset it and set "
                          f"tracking.uri={db}, or export MLFLOW_ALLOW_FILE_STORE=true") from None
    if not allowed:
        raise ConfigError(f"tracking.uri={target} is MLflow's file store, which MLflow 3 refuses unless "
                          f"MLFLOW_ALLOW_FILE_STORE=true is set: set tracking.uri={db} (or export MLFLOW_ALLOW_FILE_STORE=true)")
    existing = next(p for p in [folder, *folder.resolve().parents] if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"tracking.uri={target}: cannot write in {existing} (not a writable folder): "
                          f"use a writable folder or set tracking.uri=null")


def _check_database_driver(target: str) -> None:
    import sqlalchemy

    try:
        sqlalchemy.engine.make_url(target).get_dialect().import_dbapi()
    except ModuleNotFoundError as e:
        raise ConfigError(f"tracking.uri={shown(target)}: the database's Python driver is not installed (no module "
                          f"{e.name}): pip install {PIP_NAMES.get(e.name, e.name)}, or set tracking.uri=null") from None
    except sqlalchemy.exc.SQLAlchemyError as e:  # a malformed URI, an unknown driver name
        raise ConfigError(f"tracking.uri={shown(target)} is not a database URI SQLAlchemy can read ({e}): "
                          f"write it as postgresql://user:password@host:port/database, or set tracking.uri=null") from None


def flatten(cfg) -> Dict[str, str]:
    """The composed config as `section.key -> value` params."""
    out: Dict[str, str] = {}

    def walk(node, prefix):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            out[prefix[:-1]] = str(node)

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return out
