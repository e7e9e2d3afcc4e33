"""Generators of the RULER-style retrieval problems (Hsieh et al. 2024, "RULER: What's the
Real Context Size of Your Long-Context Language Models?"), registered as ``task.problem``
values in :mod:`posenc.data.algo_problems`:

- needles in a haystack: :func:`niah` (RULER's multi-key, multi-value and multi-query
  needles);
- variable tracking, chains of assignments among distractor chains:
  :func:`variable_tracking`.

Each writes a *prompt and an answer*: a haystack of ``task.haystack`` filler (noise letters,
or a window of TinyShakespeare's characters, as RULER fills with noise or with essays) with
the needles inserted at random depths, then a question (:data:`QUESTION` and what it asks
for); the answer is what the question retrieves. Needle and question tokens (``k3``,
``v7``, ``x2``, :data:`ASSIGN`, :data:`QUESTION`) are words of two characters or more, so
no filler character is ever one of them. Each is a pure function of its
:class:`random.Random` and its arguments.
"""

from __future__ import annotations

import functools
import random

from posenc.data.download import fetch, read_text

__all__ = [
    "ASSIGN",
    "HAYSTACKS",
    "QUESTION",
    "filler",
    "niah",
    "shakespeare",
    "variable_tracking",
]

Instance = tuple[list[str], list[str]]

#: The question token: the prompt ends with it and what it asks for.
QUESTION = "Q:"
#: The assignment of variable tracking: ``x2 := v5`` or ``x3 := x2``.
ASSIGN = ":="
#: ``task.haystack``: uniform letters of ``task.symbols``, or TinyShakespeare's characters.
HAYSTACKS = ("noise", "shakespeare")


@functools.cache
def shakespeare() -> str:
    """All of TinyShakespeare (the data folder's copy, downloaded if missing): filler only,
    never scored, so train and test draw from the whole text."""
    return read_text(fetch("tinyshakespeare/input.txt"))


def filler(rng: random.Random, length: int, haystack: str, letters: str) -> list[str]:
    """``length`` filler tokens: uniform ``letters`` (``noise``), or one contiguous window
    of TinyShakespeare's characters (``shakespeare``)."""
    if haystack == "noise":
        return [rng.choice(letters) for _ in range(length)]
    if haystack != "shakespeare":
        raise ValueError(f"haystack {haystack!r}: allowed {', '.join(HAYSTACKS)}")
    text = shakespeare()
    start = rng.randrange(len(text) - length + 1)
    return list(text[start : start + length])


def _insert(rng: random.Random, hay: list[str], needles: list[list[str]]) -> list[str]:
    """``needles`` in their order at uniform depths of ``hay`` (between any two filler
    tokens, or at either end; two needles may be adjacent)."""
    cuts = sorted(rng.randint(0, len(hay)) for _ in needles)
    out: list[str] = []
    last = 0
    for cut, needle in zip(cuts, needles, strict=True):
        out += hay[last:cut] + needle
        last = cut
    return out + hay[last:]


def niah(
    rng: random.Random,
    length: int,
    *,
    needles: int,
    queries: int,
    one_key: bool,
    keys: list[str],
    values: list[str],
    haystack: str,
    letters: str,
) -> Instance:
    """Key-value needles ``k v`` in a haystack, then ``Q:`` and the keys asked for.

    - multi-key (``one_key=False, queries=1``): ``needles`` distinct keys, one asked;
    - multi-query (``one_key=False``): ``needles`` distinct keys, ``queries`` of them asked
      (distinct, in random order);
    - multi-value (``one_key=True``): one key with ``needles`` distinct values; the key is
      asked, the answer is all its values in the order they stand.

    Args:
        rng: The instance's generator.
        length: Prompt tokens in all: filler, ``2 needles`` needle tokens and the question
            (``1 + queries`` tokens; multi-value 2).
        needles: Key-value needles.
        queries: Keys asked for (at most ``needles``; multi-value asks its one key).
        one_key: Multi-value: every needle has the same key.
        keys: The key alphabet (at least ``needles`` symbols unless ``one_key``).
        values: The value alphabet (at least ``needles`` symbols).
        haystack: :data:`HAYSTACKS`.
        letters: The noise letters.

    Returns:
        ``(prompt, answer)``: the answer is the values of the asked keys, in the order
        asked (multi-value: the key's values in the order of the text).
    """
    asked = 1 if one_key else queries
    hay = length - 2 * needles - 1 - asked
    if hay < 0 or asked > needles:
        raise ValueError(f"niah: {length} tokens cannot hold {needles} needles and {asked} asked")
    ks = [rng.choice(keys)] * needles if one_key else rng.sample(keys, needles)
    vs = rng.sample(values, needles)
    question = ks[:1] if one_key else rng.sample(ks, queries)
    answer = list(vs) if one_key else [vs[ks.index(k)] for k in question]
    needle_tokens = [[k, v] for k, v in zip(ks, vs, strict=True)]
    prompt = _insert(rng, filler(rng, hay, haystack, letters), needle_tokens)
    return [*prompt, QUESTION, *question], answer


def variable_tracking(
    rng: random.Random,
    length: int,
    *,
    chains: int,
    hops: int,
    variables: list[str],
    values: list[str],
    haystack: str,
    letters: str,
) -> Instance:
    """``chains`` chains of assignments ``x1 := v``, ``x2 := x1``, ... (``hops`` copies
    after the first), their statements interleaved (each chain's in its order) at random
    depths of a haystack, then ``Q: v`` of one chain's value; the answer is every variable
    that holds it, in its chain's order (RULER's variable tracking; the other chains, with
    other values, are the distractors).

    Args:
        rng: The instance's generator.
        length: Prompt tokens in all: filler, ``3 chains (hops + 1)`` statement tokens and
            the 2 of the question.
        chains: Chains of assignments (one asked).
        hops: Copies per chain after its first assignment.
        variables: The variable names (at least ``chains (hops + 1)``).
        values: The values (at least ``chains``).
        haystack: :data:`HAYSTACKS`.
        letters: The noise letters.
    """
    statements = chains * (hops + 1)
    hay = length - 3 * statements - 2
    if hay < 0:
        raise ValueError(f"variable tracking: {length} tokens cannot hold {statements} statements")
    names = rng.sample(variables, statements)
    vals = rng.sample(values, chains)
    chain_names = [names[c * (hops + 1) : (c + 1) * (hops + 1)] for c in range(chains)]
    order = [c for c in range(chains) for _ in range(hops + 1)]
    rng.shuffle(order)
    done = [0] * chains
    needle_tokens = []
    for c in order:
        name, j = chain_names[c], done[c]
        needle_tokens.append([name[j], ASSIGN, vals[c] if j == 0 else name[j - 1]])
        done[c] += 1
    asked = rng.randrange(chains)
    prompt = _insert(rng, filler(rng, hay, haystack, letters), needle_tokens)
    return [*prompt, QUESTION, vals[asked]], list(chain_names[asked])
