"""Source-length buckets: translation quality is reported per bucket of source length
(:mod:`posenc.eval.bleu`), with edges from ``task.length_buckets``."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

__all__ = ["bucket_names", "bucket_of", "check_edges"]


def check_edges(edges: Sequence[int]) -> None:
    """Validate length-bucket edges.

    Args:
        edges: At least two strictly increasing ints, the first one 0.

    Raises:
        ValueError: The edges do not satisfy the above.
    """
    edges = list(edges)
    example = "e.g. [0, 10, 20, 30, 40, 1000]"
    if len(edges) < 2:
        raise ValueError(f"length bucket edges {edges} need at least two values, {example}.")
    if any(not isinstance(e, int) or isinstance(e, bool) for e in edges):
        raise ValueError(f"length bucket edges {edges} must all be ints, {example}.")
    if edges[0] != 0:
        raise ValueError(
            f"length bucket edges {edges} must start at 0 so every length has a bucket, {example}."
        )
    if any(b <= a for a, b in pairwise(edges)):
        raise ValueError(f"length bucket edges {edges} must be strictly increasing, {example}.")


def bucket_names(edges: Sequence[int]) -> list[str]:
    """Names of the buckets defined by ``edges``, in order.

    Bucket ``i`` holds lengths in ``[edges[i], edges[i+1])``, except the last, which is
    open-ended: the final edge only marks where the reported range nominally ends, and longer
    sentences still land in the last bucket so none is ever lost.

    Args:
        edges: Valid edges (see :func:`check_edges`), e.g. ``[0, 10, 20, 1000]``.

    Returns:
        E.g. ``["len0-10", "len10-20", "len20+"]`` (``len0-10`` means 0 <= length < 10).
    """
    check_edges(edges)
    names = [f"len{a}-{b}" for a, b in zip(edges[:-2], edges[1:-1], strict=True)]
    names.append(f"len{edges[-2]}+")
    return names


def bucket_of(length: int, edges: Sequence[int]) -> str:
    """The name of the one bucket that ``length`` falls into (see :func:`bucket_names`).

    Args:
        length: A non-negative sequence length in tokens.
        edges: Valid bucket edges, e.g. ``[0, 10, 20, 30, 40, 1000]``.

    Returns:
        E.g. ``bucket_of(10, [0, 10, 20, 1000]) == "len10-20"``; 25 and 5000 give ``"len20+"``.

    Raises:
        ValueError: ``length`` is negative or the edges are invalid.
    """
    check_edges(edges)
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}.")
    for a, b in zip(edges[:-2], edges[1:-1], strict=True):
        if a <= length < b:
            return f"len{a}-{b}"
    return f"len{edges[-2]}+"
