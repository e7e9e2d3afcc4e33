"""A stop request (SIGTERM) that long loops outside Lightning check between steps."""


class StopRequested(Exception):
    """A loop stopped because a stop was requested."""


_requested = False


def request_stop() -> None:
    global _requested
    _requested = True


def stop_requested() -> bool:
    return _requested


def reset() -> None:
    global _requested
    _requested = False
