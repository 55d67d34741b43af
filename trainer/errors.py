"""What can stop a run, as exceptions `python -m trainer` reports in one line, without a traceback.

- `ConfigError`: the input is wrong (a value out of range, a combination that cannot run, data
  that is missing); the message names the key, the value and the fix. Exit status 1.
- `RunFailed`: a run that had started could not go on (NaN loss, GPU out of memory, a dead
  DataLoader worker); it is marked FAILED and what it measured is kept. Exit status 1.
- `Interrupted`: SIGINT (Ctrl-C) or SIGTERM; the run is marked KILLED and what it measured is
  kept. Exit status 128 + the signal number: 130 and 143.
"""

from __future__ import annotations

import signal
from typing import Optional

EXIT_FAILED = 1


class ConfigError(ValueError):
    """A config value or combination that cannot run; the message names the key and the fix."""


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
