"""What can stop a run, as exceptions `python -m trainer` reports in one line, without a traceback.

- `ConfigError`: the input is wrong (a value out of range, a combination that cannot run, data
  that is missing); the message names the key, the value and the fix. Exit status 1.
- `RunFailed`: a run that had started could not go on (NaN loss, GPU out of memory, a dead
  DataLoader worker); it is marked FAILED and what it measured is kept. Exit status 1.
- `Interrupted`: SIGINT (Ctrl-C) or SIGTERM; the run is marked KILLED and what it measured is
  kept. Exit status 128 + the signal number: 130 and 143.
"""

from __future__ import annotations

import argparse
import difflib
import re
import signal
import sys
from typing import NoReturn, Optional, Sequence

EXIT_FAILED = 1


class ConfigError(ValueError):
    """A config value or combination that cannot run; the message names the key and the fix."""


class DoesNotFit(ConfigError):
    """A dataset too large for the one block a strategy would hold it in; `fits`: how many of its
    samples would (the advisor measures the step alone on those)."""

    def __init__(self, message: str, fits: int):
        super().__init__(message)
        self.fits = fits


def one_of(key: str, value, choices, fix) -> None:
    """`key` must be one of `choices`; `fix`: what to set it to (a value, or words naming some)."""
    if value not in choices:
        raise ConfigError(f"{key} must be one of {', '.join(choices)} (got {value!r}): set {key}={fix}")


def at_least(key: str, value, low, fix) -> None:
    """`key` must be >= `low`; `fix` is a value that works."""
    if value < low:
        raise ConfigError(f"{key} must be >= {low} (got {value}): set {key}={fix}")


class RunFailed(RuntimeError):
    """A started run that could not go on; `step` is where it broke (None when not tied to one)."""

    def __init__(self, message: str, step: Optional[int] = None):
        super().__init__(message)
        self.step = step


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM received during a run (a KeyboardInterrupt, so the run is marked KILLED)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        """The shell's convention for 'killed by signal N': 128 + N."""
        return 128 + self.signum


def argument_error_line(message: str, parser: argparse.ArgumentParser, program: str,
                        more_options: Sequence[str] = (), overrides: bool = False) -> str:
    """The one line for an argument a command's argparse parser refuses (argparse's `message`,
    which it would print after its usage), naming the argument and the fix. `program`: the
    command as typed; `more_options`: options it takes outside the parser; `overrides`: it takes
    key=value overrides too."""
    if message.startswith("unrecognized arguments: "):  # --bogus
        unknown = message[len("unrecognized arguments: "):].split()
        # An unknown option's value comes along ("--cofg job"): name the options.
        args = " ".join([a for a in unknown if a.startswith("-")] or unknown)
        options = [s for a in parser._actions for s in a.option_strings] + list(more_options)
        close = difflib.get_close_matches(args.split()[0].split("=")[0], options, n=1)
        return (f"{args}: not an option of {program}{f'; did you mean {close[0]}?' if close else ''} "
                f"({program} --help lists them{'; overrides are written key=value' if overrides else ''})")
    found = re.fullmatch(r"argument (\S+): (invalid choice: '?(.*?)'? \(choose from .*\)|expected one argument)", message)
    if found is None:  # ambiguous option: --conf could match ...
        return f"{message}: see {program} --help"
    option, value = found[1].split("/")[0], found[3]
    action = parser._option_string_actions[option]
    choices = action.choices
    takes = f"{option} takes {', '.join(choices)}" if choices else f"{option} takes a value"
    if value is None:  # --cfg, last
        example = choices[0] if choices else f"<{action.metavar or 'value'}>"  # --run=<RUN_ID>
        return f"{option}: {takes}: write {option}={example}"
    close = difflib.get_close_matches(value, choices, n=1)  # --cfg jobx
    fix = f"; did you mean {option} {close[0]}?" if close else f": write {option} {choices[0]}"
    return f"{option} {value}: {takes}{fix}"


def one_line_argument_errors(parser: argparse.ArgumentParser, program: str, exit_status: int) -> argparse.ArgumentParser:
    """`parser`, refusing a bad argument in one line (`argument_error_line`) and `exit_status`,
    not argparse's usage text."""
    def refuse(message: str) -> NoReturn:
        print(f"error: {argument_error_line(message, parser, program)}", file=sys.stderr)
        raise SystemExit(exit_status)
    parser.error = refuse
    return parser
