"""Errors that mean 'the input is wrong': reported as one line, no traceback."""


class ConfigError(ValueError):
    """A config value or combination that cannot run; the message names the key and the fix."""
