"""`python -m trainer [overrides]`: the Hydra entry point; the work is in `trainer.loop.run.run`.

Bad input and failed runs end in one line on stderr and exit status 1 (set HYDRA_FULL_ERROR=1
for the full trace). Ctrl-C and SIGTERM close the run as KILLED, keeping what it measured, and
exit with 130 and 143. Under torchrun every rank runs this; rank 0 prints (`trainer.loop.distributed`).
"""

import os
import signal
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException
from hydra.types import RunMode

import trainer.components  # noqa: F401  (registers every dataset, loader and model option, before Hydra composes)
from trainer.config import BASE_DIR, CONF_DIR, INSTALLED
from trainer.loop import distributed, faults
from trainer.errors import EXIT_FAILED, ConfigError, Interrupted, RunFailed
from trainer.loop.run import run
from trainer.tools.turns import pause_if_asked


NO_RUN = ("-h", "--help", "--hydra-help", "-i", "--info", "-c", "--cfg", "-sc", "--shell-completion")  # Hydra's: nothing is written


class JobFailed(CompactHydraException):
    """A sweep job's one-line error: Hydra marks the job FAILED, runs the remaining jobs, and
    reports it at the end without a traceback."""


def one_line(err: BaseException) -> str:
    """The error's message on one line, naming the MLflow run it closed (if one was open)."""
    text = " ".join(str(err).split())
    run_id = getattr(err, "run_id", None)
    return f"{text} (run {run_id} marked FAILED)" if run_id else text


# The checkout's conf/, or the copy a wheel carries (trainer.config.CONF_DIR): an absolute path,
# so an installed package finds its configs wherever it is run from.
@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg) -> None:
    try:
        run(cfg, on_timed_start=[pause_if_asked])  # under trainer.tools.turns: stop where the timed region begins
    except (ConfigError, RunFailed) as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        if distributed.is_main_process():  # under torchrun every rank has the error: print it once
            print(f"error: {one_line(err)}", file=sys.stderr)
        # Several ranks go on to a sweep's next job only when all of them know this one failed.
        if HydraConfig.get().mode == RunMode.MULTIRUN and (distributed.world()[1] == 1 or getattr(err, "agreed", False)):
            raise JobFailed(one_line(err)) from err
        raise SystemExit(EXIT_FAILED) from None
    except Exception:
        if distributed.is_main_process() or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        raise SystemExit(EXIT_FAILED) from None  # another rank's crash: rank 0 reports it, from the store


def _terminate(signum, frame) -> None:
    raise Interrupted(signum)  # SIGTERM's default would end the process without closing the run


def check_current_folder(args) -> None:
    """Installed from a wheel, a run writes outputs/ in the current folder, and Hydra makes its
    folder there before any of our checks runs: a folder we cannot write in would end in Hydra's
    traceback. (A checkout writes in its own outputs/, checked with tracking.uri.)"""
    if not INSTALLED or any(a.startswith(("hydra.run.dir=", "hydra.sweep.dir=")) or a in NO_RUN for a in args):
        return
    if not os.access(BASE_DIR, os.W_OK | os.X_OK):
        key = "hydra.sweep.dir" if {"-m", "--multirun"} & set(args) else "hydra.run.dir"
        print(f"error: {key}: outputs/ goes in the current folder, and {BASE_DIR} is not writable: run from a "
              f"writable folder, or set {key}=<a writable folder> and tracking.uri=sqlite:///<a writable "
              f"folder>/mlflow.db", file=sys.stderr)
        raise SystemExit(EXIT_FAILED)


def cli() -> None:
    """Hydra's main, with SIGINT/SIGTERM anywhere (a run, a sweep between jobs) ending in one line."""
    sys.argv = ["engine.quiet=true" if a in ("-q", "--quiet") else a for a in sys.argv]  # no end-of-run summary
    check_current_folder(sys.argv[1:])
    signal.signal(signal.SIGTERM, _terminate)
    distributed.launch()  # under torchrun: join the ranks before Hydra names the output folder
    distributed.quiet_other_ranks()
    try:
        main()
    except KeyboardInterrupt as stop:
        signum = getattr(stop, "signum", signal.SIGINT)
        faults.stopped_by = signum
        run_id = getattr(stop, "run_id", None)
        closed = f": run {run_id} marked KILLED, what it measured is saved" if run_id else ""
        if distributed.is_main_process():
            print(f"interrupted by {signal.Signals(signum).name}{closed}", file=sys.stderr)
        raise SystemExit(128 + signum) from None
    finally:
        distributed.finish()  # under torchrun: rank 0 done first, then leave the process group


if __name__ == "__main__":
    cli()
