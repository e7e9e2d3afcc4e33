"""A process-wide stop request that long loops check between steps.

A signal handler (SIGTERM from a scheduler) or a test calls :func:`request_stop`; decoding
and generation loops call :func:`check` between steps and leave with
:class:`StopRequested` instead of running to the end of a long output.
"""

from __future__ import annotations

__all__ = ["StopRequested", "check", "request_stop", "reset", "stop_requested"]

_requested = False


class StopRequested(RuntimeError):
    """A stop was requested (:func:`request_stop`) while a loop was running."""


def request_stop() -> None:
    """Ask running loops to stop at their next step (safe to call from a signal handler)."""
    global _requested
    _requested = True


def stop_requested() -> bool:
    """Whether :func:`request_stop` was called since the last :func:`reset`."""
    return _requested


def reset() -> None:
    """Clear a stop request (e.g. between tests, or before a new job in one process)."""
    global _requested
    _requested = False


def check(where: str) -> None:
    """Raise :class:`StopRequested` if a stop was requested.

    Args:
        where: What is being stopped, for the message (e.g. ``"beam search"``).

    Raises:
        StopRequested: :func:`request_stop` was called.
    """
    if _requested:
        raise StopRequested(f"{where} stopped: a stop was requested (e.g. SIGTERM)")
