"""A process-wide stop request that long loops check between steps.

A signal handler (SIGTERM from a scheduler, SIGINT from Ctrl-C) or a test calls
:func:`request_stop`; decoding and generation loops call :func:`check` between steps and
leave with :class:`StopRequested` instead of running to the end of a long output. The
first request names what asked (:func:`stopped_by`), so the run's last words and exit
status name the signal that stopped it.
"""

from __future__ import annotations

__all__ = ["StopRequested", "check", "request_stop", "reset", "stop_requested", "stopped_by"]

#: What asked to stop (a signal's name), or None while nothing has.
_requested: str | None = None


class StopRequested(RuntimeError):
    """A stop was requested (:func:`request_stop`) while a loop was running."""


def request_stop(by: str = "SIGTERM") -> None:
    """Ask running loops to stop at their next step (safe to call from a signal handler).

    Args:
        by: What asks, a signal's name (``"SIGINT"``). A later request keeps the first
            one's name: the signal that started the stop is the one to report.
    """
    global _requested
    if _requested is None:
        _requested = by


def stop_requested() -> bool:
    """Whether :func:`request_stop` was called since the last :func:`reset`."""
    return _requested is not None


def stopped_by() -> str:
    """The name given to the first :func:`request_stop` (``"SIGTERM"`` if none was)."""
    return _requested or "SIGTERM"


def reset() -> None:
    """Clear a stop request (e.g. between tests, or before a new job in one process)."""
    global _requested
    _requested = None


def check(where: str) -> None:
    """Raise :class:`StopRequested` if a stop was requested.

    Args:
        where: What is being stopped, for the message (e.g. ``"beam search"``).

    Raises:
        StopRequested: :func:`request_stop` was called.
    """
    if _requested:
        raise StopRequested(f"{where} stopped: a stop was requested ({_requested})")
