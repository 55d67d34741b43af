"""`python -m trainer [overrides]`: the Hydra entry point; the work is in `trainer.loop.run.run`.

Bad input and failed runs end in one line on stderr and exit status 1 (set HYDRA_FULL_ERROR=1
for the full trace). Ctrl-C and SIGTERM close the run as KILLED, keeping what it measured, and
exit with 130 and 143. Under torchrun every rank runs this; rank 0 prints (`trainer.loop.distributed`).
"""

import argparse
import difflib
import errno
import importlib
import math
import os
import re
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
    from hydra._internal.utils import get_args_parser
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.types import Override
    from hydra.errors import (CompactHydraException, ConfigCompositionException, MissingConfigException,
                              OverrideParseException, SearchPathException)
    from hydra.plugins.sweeper import Sweeper
    from hydra.types import RunMode
    from omegaconf import DictConfig, ListConfig, OmegaConf
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException
    from omegaconf.nodes import BooleanNode, FloatNode, IntegerNode, StringNode

    import trainer.components  # noqa: F401  (registers every dataset, loader and model option, before Hydra composes)
    from trainer.config import BASE_DIR, CONF_DIR, INSTALLED
    from trainer.loop import distributed, faults
    from trainer.errors import EXIT_FAILED, ConfigError, Interrupted, RunFailed, argument_error_line
    from trainer.loop.run import run
    from trainer.tools.turns import pause_if_asked
    from trainer.tracking.sweep import is_study
except KeyboardInterrupt:
    _interrupted.append(signal.SIGINT)
if _interrupted:
    print("interrupted by SIGINT while starting: nothing was run", file=sys.stderr)
    raise SystemExit(128 + signal.SIGINT) from None
signal.signal(signal.SIGINT, _at_start)


NO_RUN = ("-h", "--help", "--hydra-help", "-i", "--info", "-c", "--cfg", "-sc", "--shell-completion")  # Hydra's: nothing is written
QUIET = ("-q", "--quiet")  # ours: no end-of-run summary


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
        summary = run(cfg, on_timed_start=[pause_if_asked],  # under trainer.tools.turns: stop where the timed region begins
                      # a study's trial without its objective fails (a test may call main without Hydra)
                      needs_objective=HydraConfig.initialized() and is_study(HydraConfig.get()))
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
    # What a Hydra sweeper optimises (experiment=tune_dataloader); nan when the run lacks the
    # figure, outside a study (whose trial fails without it, above: Optuna refuses a nan).
    return float(summary.get(cfg.engine.objective, math.nan))


def _terminate(signum, frame) -> None:
    raise Interrupted(signum)  # SIGTERM's default would end the process without closing the run


def check_current_folder(args) -> None:
    """Installed from a wheel, a run writes outputs/ in the current folder, and Hydra makes its
    folder there before any of our checks runs: a folder we cannot write in would end in Hydra's
    traceback. (A checkout writes in its own outputs/, checked with tracking.uri.)"""
    if not INSTALLED or any(a.startswith(("hydra.run.dir=", "hydra.sweep.dir=")) or a.partition("=")[0] in NO_RUN
                            for a in args):  # (--cfg=job too)
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
        return (f"{err.override}: not an override Hydra can read ({_parse_problem(str(err.message))}): see "
                f"https://hydra.cc/docs/advanced/override_grammar/basic/")
    if isinstance(err, MissingConfigException) and str(err).startswith("Cannot find primary config"):  # --config-name=nope
        return _missing_primary_config(err)
    folder = re.fullmatch(r"Additional config directory '(.*)' not found", str(err))
    if isinstance(err, SearchPathException) and folder:  # --config-dir=nope
        return f"--config-dir={folder[1]}: no such folder: pass a folder of configs that exists, or drop --config-dir"
    if isinstance(err, (ConfigCompositionException, OverrideParseException)):  # Hydra's own words, on one line
        detail = f" ({cause.msg.splitlines()[0]})" if isinstance(cause, OmegaConfBaseException) else ""
        return " ".join(str(err).split()) + detail
    if isinstance(err, ValueError) and isinstance(cause, OSError) and not _from_the_run(err):
        err = cause  # Hydra's log file in the run's folder: Python's logging config raises it as a ValueError
    if isinstance(err, OSError) and not _from_the_run(err):  # making the run's folder, saving its .hydra/
        key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
        if err.errno in (errno.EEXIST, errno.ENOTDIR):
            why, fix = "a file is in the way", f"move that file away or set {key}=<another folder>"
        elif err.errno == errno.ENOSPC:
            why, fix = "its disk is full", f"free space there or set {key}=<a folder on another disk>"
        else:
            why, fix = err.strerror, f"set {key}=<a folder you can write in>"
        return f"{key}: cannot write the run's folder ({why}{f': {err.filename}' if err.filename else ''}): {fix}"
    return _sweep_error(err) if multirun else None


def _parse_problem(message: str) -> str:
    """What Hydra's grammar found wrong in an override: the line saying why (`range(a,3)`: "TypeError while
    evaluating ..."), not the one repeating the override, nor the link."""
    lines = [line for line in message.splitlines() if line and not line.startswith(("Error parsing override", "See "))]
    return lines[0] if lines else message.splitlines()[0]


def _missing_primary_config(err: MissingConfigException) -> str:
    """`--config-name` naming no config in Hydra's search path (its message lists the folders)."""
    name = err.missing_cfg_file
    folders = [folder for folder in re.findall(r"path=file://(\S+)", str(err)) if os.path.isdir(folder)]
    found = sorted({f[:-len(".yaml")] for folder in folders for f in os.listdir(folder) if f.endswith(".yaml")})
    return (f"--config-name={name}: no config {name}.yaml in {' or '.join(folders)} (configs: {', '.join(found)}): "
            f"pass --config-name=<one of those> (or leave it out), or --config-dir=<the folder holding {name}.yaml>")


def _sweep_error(err: Exception) -> str | None:
    """An error while the sweeper expands the overrides into jobs (`loader=range(1,3)`,
    `range(1,3,0)`, `interval(1,3)`): Hydra raises it bare, naming no override. The override is
    read from the frames it passed through: the sweeper's, and the innermost holding an Override.
    Or a study's end when every trial failed: Optuna has no best trial to give."""
    frames = list(_frames(err))
    sweep = next((f for f in frames if f.f_code.co_name == "sweep" and isinstance(f.f_locals.get("self"), Sweeper)), None)
    if sweep is not None and isinstance(err, ValueError) and str(err) == "No trials are completed yet.":
        return ("the study completed none of its trials: every one failed, each a FAILED run of the sweep (its error: "
                "python -m trainer.report --run <its run id>): fix what they failed on and run the study again")
    inner = next((f.f_locals["override"] for f in reversed(frames) if isinstance(f.f_locals.get("override"), Override)),
                 None)
    if sweep is None or inner is None:
        return None
    key = inner.get_key_element()
    # Either one of the user's overrides, or a job's ("loader=1"), made from the user's sweep of
    # the same key ("loader=range(1,3)"): name that one.
    users = [o for o in sweep.f_locals.get("overrides") or () if isinstance(o, Override) and o.is_sweep_override()
             and o.get_key_element() == key]
    text = (inner if any(o is inner for o in users) or not users else users[-1]).input_line
    reason = " ".join(str(err).split())
    if reason.startswith("Config group override"):  # Hydra's Overrides: a group's value is an option's name
        options = sweep.f_locals["self"].hydra_context.config_loader.get_group_options(inner.key_or_group)
        return (f"{text}: {inner.key_or_group} is a config group, swept by option name, and this sweep gives "
                f"{type(inner.value()).__name__} values: name its options, e.g. {key}={','.join(options[:2])} "
                f"(options: {', '.join(options)})")
    return (f"{text}: Hydra cannot expand this sweep ({reason}): write one its basic sweeper takes (a,b,c, "
            f"range(start,stop,step), choice(...), glob(...)): "
            f"see https://hydra.cc/docs/advanced/override_grammar/extended/")


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
    return any(frame.f_code is main.__wrapped__.__code__ for frame in _frames(err))


def _frames(err: BaseException):
    """The frames `err` passed through, outermost first."""
    tb = err.__traceback__
    while tb is not None:
        yield tb.tb_frame
        tb = tb.tb_next


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


# -- Hydra's command line ----------------------------------------------------------------------------
def hydra_argv(args: list) -> list:
    """The arguments for Hydra: our `-q`/`--quiet` becomes the override engine.quiet=true, put
    first (Hydra's parser then takes overrides on either side of its options, `args_parser`), so
    that it may stand anywhere, beside any of Hydra's options. An override after a bare `-i`/`--info`
    is not taken for the info's kind (`-i loader=pinned`: all the info, with loader=pinned)."""
    # (Not for --hydra-help, which runs nothing and takes only hydra.* overrides.)
    quiet = ["engine.quiet=true"] if any(a in QUIET for a in args) and "--hydra-help" not in args else []
    args = [a for a in args if a not in QUIET]
    return quiet + ["--info=all" if a in ("-i", "--info") and _is_override(args[i + 1:i + 2]) else a
                    for i, a in enumerate(args)]


def _is_override(following: list) -> bool:
    return bool(following) and "=" in following[0] and not following[0].startswith("-")


def args_parser() -> argparse.ArgumentParser:
    """Hydra's argparse parser, which takes its overrides only in one run (`loader=pinned --cfg job
    engine.max_steps=3` is refused) and on a bad argument prints its usage and exits 2: here it
    takes overrides on both sides of its options, and a bad argument is one line, exit 1."""
    parser = get_args_parser()
    parser.parse_args = lambda args=None, namespace=None: _one_command(parser.parse_intermixed_args(args, namespace))
    parser.error = lambda message: _refuse(argument_error_line(message, parser, "python -m trainer", QUIET, overrides=True))
    return parser


def _intermixed_parser() -> None:
    """Hydra's main parses the command line with `args_parser`."""
    hydra_main = importlib.import_module("hydra.main")  # the module (`hydra.main` is the decorator)
    hydra_main.get_args_parser = args_parser  # Hydra 1.3's main looks it up there when it runs


def _one_command(args: argparse.Namespace) -> argparse.Namespace:
    """Hydra's own checks of its options, made here: Hydra raises them as a bare ValueError, traced."""
    given = [option for option, on in (("--run", args.run), ("--multirun", args.multirun), ("--cfg", args.cfg),
                                       ("--info", args.info), ("--shell-completion", args.shell_completion)) if on]
    if len(given) > 1:  # -m --cfg job
        _refuse(f"{' and '.join(given)}: Hydra does one of these at a time: keep one of them")
    ours = [o for o in args.overrides if not o.lstrip("+~").startswith(("hydra.", "hydra/"))]
    if args.hydra_help and ours:  # Hydra composes its own config alone for it
        _refuse(f"--hydra-help {' '.join(ours)}: Hydra's help shows its own config, which has none of these keys: "
                f"drop them, or use --help")
    if args.resolve and args.cfg is None and not args.help:
        _refuse("--resolve: it resolves the config that --cfg or --help prints: add --cfg job, or drop --resolve")
    return args


def _refuse(line: str):
    print(f"error: {line}", file=sys.stderr)
    raise SystemExit(EXIT_FAILED)


def cli() -> None:
    """Hydra's main, with SIGINT/SIGTERM anywhere (a run, a sweep between jobs) and Hydra's own
    errors ending in one line."""
    sys.argv = sys.argv[:1] + hydra_argv(sys.argv[1:])
    try:
        check_current_folder(sys.argv[1:])
        signal.signal(signal.SIGTERM, _terminate)
        distributed.launch()  # under torchrun: join the ranks before Hydra names the output folder
        distributed.quiet_other_ranks()
        _one_line_hydra_errors(multirun=bool({"-m", "--multirun"} & set(sys.argv[1:])))
        _intermixed_parser()
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
    except BrokenPipeError:  # `python -m trainer --help | head`: the reader is gone, nothing to say
        # Python flushes stdout again at exit: point it at /dev/null, or that flush fails too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(EXIT_FAILED) from None
    finally:
        ended = sys.exc_info()[1]  # (an error: this rank says so and leaves; else every rank leaves together)
        distributed.finish(failed=ended is not None and not (isinstance(ended, SystemExit) and ended.code in (0, None)))


if __name__ == "__main__":
    cli()
