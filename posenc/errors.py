"""Errors that mean "the input is wrong", not "posenc has a bug".

``run.py`` prints a :class:`UserError` as one message, without a traceback, and exits
with status 2 (a multirun job records it in ``error.json`` and the sweep goes on).
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence


class UserError(Exception):
    """Bad input or environment: the message says what is wrong and how to fix it."""


class RunDirError(UserError, FileExistsError):
    """The run directory holds another run's results."""


class CheckpointError(UserError):
    """A checkpoint is unreadable, damaged, or does not match the config."""


class CacheError(UserError):
    """A file posenc wrote to its cache is damaged or unusable."""


class DataError(UserError, ValueError):
    """A data file or the data it holds is unusable (empty, not text, corrupt, too short
    for the configured lengths, a checksum that does not match): the message names the
    file or split and the fix. A ``ValueError`` too, for code that catches those."""


class DataFileNotFound(DataError, FileNotFoundError):
    """A data file given in the config does not exist, or is not a file."""


class TrainingDiverged(UserError, FloatingPointError):
    """The training loss became NaN or infinite: the message gives the step and the fix."""


class RecordError(UserError, ValueError):
    """A run's ``metrics.json`` is not a record this posenc reads (not a result, a
    version it does not know, a metric that is not a number). A ``ValueError`` too: the
    sweep report lists such a run as unreadable and goes on."""


class ConfigError(UserError, ValueError):
    """A config value is wrong; the message lists every problem found.

    Args:
        message: The whole message (:func:`problem_message` for a list of problems).
        problems: Its problems, a line each (default: the message as one problem).
    """

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = problems if problems is not None else [message]


def problem_message(problems: list[str]) -> str:
    """A header with the number of problems (if more than one), then a line each."""
    count = f" ({len(problems)} problems)" if len(problems) > 1 else ""
    return f"invalid config{count}:\n  " + "\n  ".join(problems)


def refuse(problems: list[str]) -> None:
    """Raise :class:`ConfigError` with ``problems`` (a line each), if there are any."""
    if problems:
        raise ConfigError(problem_message(problems), problems)


def suggest(name: str, allowed: Sequence[str]) -> str:
    """``did you mean 'x'? `` for the allowed name nearest ``name``; "" if none is near."""
    close = difflib.get_close_matches(name, list(allowed), n=1)
    return f"did you mean {close[0]!r}? " if close else ""


def unknown_value(what: str, value: object, allowed: Sequence[str]) -> str:
    """``unknown <what> 'v'; did you mean 'x'? allowed: a, b``: a value outside a choice."""
    hint = suggest(value, allowed) if isinstance(value, str) else ""
    return f"unknown {what} {value!r}; {hint}allowed: {', '.join(allowed)}"
