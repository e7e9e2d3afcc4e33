"""Errors that mean "the input is wrong", not "posenc has a bug".

``run.py`` prints a :class:`UserError` as one message, without a traceback, and exits
with status 2 (a multirun job records it in ``error.json`` and the sweep goes on).
Anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad input or environment: the message says what is wrong and how to fix it."""


class RunDirError(UserError, FileExistsError):
    """The run directory holds another run's results."""


class CheckpointError(UserError):
    """A checkpoint is unreadable, damaged, or does not match the config."""


class CacheError(UserError):
    """A file posenc wrote to its cache is damaged or unusable."""
