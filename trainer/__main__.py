"""`python -m trainer [overrides]`: the Hydra entry point; the work is in `trainer.loop.run.run`.

Bad input and failed runs end in one line on stderr and exit status 1 (set HYDRA_FULL_ERROR=1
for the full trace). Ctrl-C and SIGTERM close the run as KILLED, keeping what it measured, and
exit with 130 and 143. Under torchrun every rank runs this; rank 0 prints (`trainer.loop.distributed`).
"""

import difflib
import errno
import math
import os
import signal
import sys

# A Ctrl-C in the first seconds lands in these imports (torch, MLflow). Raised there, it can land
# inside a compiled module's initialisation, which turns it into an ImportError (numpy: "cannot
# load module more than once") or one that an optional import swallows (the run then went on to
# its end): so it is only noted until the imports are done; a second one stops at once.
_interrupted = []


def _note_interrupt(signum, frame):
    if _interrupted:
        raise KeyboardInterrupt
    _interrupted.append(signum)


_at_start = signal.getsignal(signal.SIGINT)
if _at_start is signal.default_int_handler:  # (not where SIGINT is ignored)
    signal.signal(signal.SIGINT, _note_interrupt)
try:  # one line, no traceback
    import hydra
    import hydra._internal.utils
    from hydra.core.hydra_config import HydraConfig
    from hydra.errors import (CompactHydraException, ConfigCompositionException, MissingConfigException,
                              OverrideParseException)
    from hydra.types import RunMode
    from omegaconf import DictConfig, ListConfig, OmegaConf
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException
    from omegaconf.nodes import BooleanNode, FloatNode, IntegerNode, StringNode

    import trainer.components  # noqa: F401  (registers every dataset, loader and model option, before Hydra composes)
    from trainer.config import BASE_DIR, CONF_DIR, INSTALLED
    from trainer.loop import distributed, faults
    from trainer.errors import EXIT_FAILED, ConfigError, Interrupted, RunFailed
    from trainer.loop.run import run
    from trainer.tools.turns import pause_if_asked
except KeyboardInterrupt:
    _interrupted.append(signal.SIGINT)
if _interrupted:
    print("interrupted by SIGINT while starting: nothing was run", file=sys.stderr)
    raise SystemExit(128 + signal.SIGINT) from None
signal.signal(signal.SIGINT, _at_start)


NO_RUN = ("-h", "--help", "--hydra-help", "-i", "--info", "-c", "--cfg", "-sc", "--shell-completion")  # Hydra's: nothing is written


class JobFailed(CompactHydraException):
    """A sweep job's one-line error: Hydra marks the job FAILED, runs the remaining jobs, and
    reports it at the end without a traceback."""


def one_line(err: BaseException) -> str:
    """The error's message on one line, naming the MLflow run it closed (if one was open) and
    what the store refused of it (`trainer.tracking.runs.Tracker`)."""
    text = " ".join(str(err).split())
    return f"{text} ({closed(err, 'FAILED')})" if getattr(err, "run_id", None) else text


def closed(err: BaseException, status: str) -> str:
    """How the run that `err` stopped was closed: marked `status`, or what its store refused."""
    refused = getattr(err, "refused", None)
    return f"run {err.run_id}: {refused}" if refused else f"run {err.run_id} marked {status}"


# The checkout's conf/, or the copy a wheel carries (trainer.config.CONF_DIR): an absolute path,
# so an installed package finds its configs wherever it is run from.
@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg) -> float:
    try:
        summary = run(cfg, on_timed_start=[pause_if_asked])  # under trainer.tools.turns: stop where the timed region begins
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
    # What a Hydra sweeper optimises (experiment=tune_dataloader): nan when the run lacks the figure.
    return float(summary.get(cfg.engine.objective, math.nan))


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


# -- Hydra's own errors, before our code runs: one line each -----------------------------------------
def hydra_error_line(err: Exception, multirun: bool) -> str | None:
    """The one line for an error Hydra raises while it composes the config or makes the run's
    folder, naming the key and the fix; None for any other error (Hydra prints it, traced)."""
    cause = err.__cause__
    if isinstance(err, MissingConfigException) and err.options:  # loader=prefech
        group, _, name = err.missing_cfg_file.rpartition("/")
        close = difflib.get_close_matches(name, err.options, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        return f"{group}={name}: {group} has no option {name}{hint} (options: {', '.join(err.options)})"
    if isinstance(err, ConfigCompositionException) and isinstance(cause, OmegaConfBaseException) and cause.full_key:
        return _bad_value(cause)
    if isinstance(err, OverrideParseException):
        key, _, value = err.override.partition("=")
        if not value.isascii():
            quote = "'" if "'" not in value else '"'
            return (f"{err.override}: Hydra reads characters outside ASCII only inside quotes: write "
                    f"{key}={quote}{value}{quote} (in the shell: \"{key}={quote}{value}{quote}\")")
        return (f"{err.override}: not an override Hydra can read ({str(err.message).splitlines()[0]}): see "
                f"https://hydra.cc/docs/advanced/override_grammar/basic/")
    if isinstance(err, (ConfigCompositionException, OverrideParseException)):  # Hydra's own words, on one line
        detail = f" ({cause.msg.splitlines()[0]})" if isinstance(cause, OmegaConfBaseException) else ""
        return " ".join(str(err).split()) + detail
    if isinstance(err, OSError) and not _from_the_run(err):  # making the run's folder, saving its .hydra/
        key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
        if err.errno in (errno.EEXIST, errno.ENOTDIR):
            why, fix = "a file is in the way", f"move that file away or set {key}=<another folder>"
        elif err.errno == errno.ENOSPC:
            why, fix = "its disk is full", f"free space there or set {key}=<a folder on another disk>"
        else:
            why, fix = err.strerror, f"set {key}=<a folder you can write in>"
        return f"{key}: cannot write the run's folder ({why}{f': {err.filename}' if err.filename else ''}): {fix}"
    return None


def _bad_value(cause: OmegaConfBaseException) -> str:
    """An override of a key the schema lacks, or of a value of the wrong type."""
    node, key, full = cause.parent_node, cause.key, cause.full_key
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and isinstance(node, DictConfig):  # engine.foo=1
        keys = [str(k) for k in node.keys()]
        close = difflib.get_close_matches(str(key), keys, n=1)
        section = full.rpartition(".")[0] or "the config"
        return (f"{full}: {section} has no key {key}{f'; did you mean {close[0]}?' if close else ''} "
                f"(keys: {', '.join(keys)})")
    now = cause.child_node  # the key's node, still holding the value it had
    wanted = {IntegerNode: "an integer", FloatNode: "a number", BooleanNode: "true or false", StringNode: "a string",
              ListConfig: "a list"}.get(type(now))
    fix = f"set {full} to {wanted or 'a value of its type'}"
    if wanted is not None:
        fix += f", e.g. {full}={override_text(OmegaConf.to_container(now) if OmegaConf.is_config(now) else now._value())}"
    return f"{full}={cause.value}: {cause.msg.splitlines()[0].rstrip('.')}: {fix}"


def override_text(value) -> str:
    """A value as an override writes it: `true`, `[8,8]`."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(map(override_text, value)) + "]"
    return str(value)


def _from_the_run(err: BaseException) -> bool:
    """Whether `err` was raised inside our task function (the run), not by Hydra around it."""
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is main.__wrapped__.__code__:
            return True
        tb = tb.tb_next
    return False


def _one_line_hydra_errors(multirun: bool) -> None:
    """Hydra reports its errors in `run_and_report` (several lines, or a trace) and exits: the
    ones a user can fix are printed as one line instead. HYDRA_FULL_ERROR=1 gives Hydra's trace."""
    report = hydra._internal.utils.run_and_report

    def run_and_report(func):
        try:
            return func()
        except Exception as e:
            line = None if os.environ.get("HYDRA_FULL_ERROR") == "1" else hydra_error_line(e, multirun)
            if line is None:
                return report(lambda: _raise(e))
            print(f"error: {line}", file=sys.stderr)
            raise SystemExit(EXIT_FAILED) from None

    hydra._internal.utils.run_and_report = run_and_report  # Hydra 1.3 looks it up there when it runs


def _raise(err: BaseException):
    raise err


def cli() -> None:
    """Hydra's main, with SIGINT/SIGTERM anywhere (a run, a sweep between jobs) and Hydra's own
    errors ending in one line."""
    sys.argv = ["engine.quiet=true" if a in ("-q", "--quiet") else a for a in sys.argv]  # no end-of-run summary
    try:
        check_current_folder(sys.argv[1:])
        signal.signal(signal.SIGTERM, _terminate)
        distributed.launch()  # under torchrun: join the ranks before Hydra names the output folder
        distributed.quiet_other_ranks()
        _one_line_hydra_errors(multirun=bool({"-m", "--multirun"} & set(sys.argv[1:])))
        main()
    except KeyboardInterrupt as stop:
        signum = getattr(stop, "signum", signal.SIGINT)
        faults.stopped_by = signum
        how = ""
        if getattr(stop, "run_id", None):
            how = f": {closed(stop, 'KILLED')}" + ("" if getattr(stop, "refused", None) else ", what it measured is saved")
        if distributed.is_main_process():
            print(f"interrupted by {signal.Signals(signum).name}{how}", file=sys.stderr)
        raise SystemExit(128 + signum) from None
    finally:
        distributed.finish()  # under torchrun: rank 0 done first, then leave the process group


if __name__ == "__main__":
    cli()
