"""Generators of the problems where content, not an index, decides which position matters
(registered as ``task.problem`` values in :mod:`posenc.data.algo`).

- flip-flop language modeling (Liu et al., NeurIPS 2023): :func:`flipflop`;
- selective copying (Gu and Dao 2023, section 3.1): :func:`selective_copy`;
- counting (Golovneva et al. 2024, CoPE, section 4): :func:`count`;
- state tracking, the word problem of a group (Merrill et al. 2024, "The Illusion of State
  in State-Space Models"): :func:`state` over :data:`GROUPS` (S3 and A5);
- multi-query associative recall (Arora et al. 2023, Zoology): :func:`mqar`.

Each is a pure function of a :class:`random.Random` and its arguments, so an instance is a
function of its stream key (:func:`posenc.data.algo.instance`). Two kinds of output:

- *prompt and answer* (selective copy, counting): the model reads the prompt and writes the
  answer, as in the classic problems;
- *tokens and labels* (flip-flop, state tracking, associative recall): one sequence, and
  at some positions the symbol the model must predict once it has read the sequence up to
  there (``None`` elsewhere); the model is scored at those positions given the true prefix.
"""

from __future__ import annotations

import itertools
import random

__all__ = [
    "COUNT_MAX",
    "FLIPFLOP_IGNORE",
    "GROUPS",
    "MQAR_POWER",
    "NOISE",
    "count",
    "flipflop",
    "mqar",
    "selective_copy",
    "state",
]

Labels = list[str | None]

# ---------------------------------------------------------------------------- flip-flop
#: Ignore probability ``p_i`` of each split (Liu et al. 2023): training and the
#: in-distribution test draw FFL(0.8); the sparse test almost only ignores (FFL(0.98)),
#: the dense one rarely (FFL(0.1)). Writes and reads share the rest equally.
FLIPFLOP_IGNORE = {"": 0.8, "sparse": 0.98, "dense": 0.1}


def flipflop(rng: random.Random, length: int, p_ignore: float) -> tuple[list[str], Labels]:
    """A flip-flop string of ``length`` tokens (instruction/bit pairs) and its read labels.

    The first instruction writes, the last reads; those between ignore with probability
    ``p_ignore`` and else write or read with equal probability. Written and ignored bits
    are uniform; a read's bit is the last written one.

    Args:
        rng: The instance's generator.
        length: Tokens, even and >= 4.
        p_ignore: ``p_i``.

    Returns:
        ``(tokens, labels)``: ``labels[t]`` is the read bit for ``tokens[t] == "r"`` (the
        token after it), else None.
    """
    if length < 4 or length % 2:
        raise ValueError(f"flip-flop: length {length} must be even and at least 4")
    pairs = length // 2
    tokens: list[str] = []
    labels: Labels = []
    memory = ""
    for j in range(pairs):
        if j == 0:
            op = "w"
        elif j == pairs - 1:
            op = "r"
        elif rng.random() < p_ignore:
            op = "i"
        else:
            op = rng.choice("wr")
        bit = memory if op == "r" else rng.choice("01")
        if op == "w":
            memory = bit
        tokens += [op, bit]
        labels += [bit if op == "r" else None, None]
    return tokens, labels


# ---------------------------------------------------------------------- selective copy
#: The noise token of selective copying.
NOISE = "."


def selective_copy(
    rng: random.Random, length: int, data: int, letters: str
) -> tuple[list[str], list[str]]:
    """``data`` letters at random places among ``length - data`` noise tokens; the answer
    is the letters in order.

    Args:
        rng: The instance's generator.
        length: Prompt tokens in all (>= ``data``).
        data: Data tokens.
        letters: The data alphabet.
    """
    if length < data:
        raise ValueError(f"selective copy: length {length} is below its {data} data tokens")
    places = sorted(rng.sample(range(length), data))
    values = [rng.choice(letters) for _ in range(data)]
    prompt = [NOISE] * length
    for place, value in zip(places, values, strict=True):
        prompt[place] = value
    return prompt, values


# ---------------------------------------------------------------------------- counting
#: The largest value a counted variable reaches (the CoPE generator's cap).
COUNT_MAX = 10
# Statement weights of the authors' generator (facebookresearch/RAM,
# projects/cope/scripts/count_data_gen.py): set a variable to 0, do nothing, increment.
_COUNT_OPS = ("set", "pass", "increment")
_COUNT_WEIGHTS = (1, 50, 7)


def _statement(rng: random.Random, names: str, values: dict[str, int]) -> list[str]:
    """One statement; an increment of no variable, or past :data:`COUNT_MAX`, is redrawn
    (the op too), as the authors' generator does."""
    while True:
        (op,) = rng.choices(_COUNT_OPS, _COUNT_WEIGHTS)
        if op == "set":
            var = rng.choice(names)
            values[var] = 0
            return [var, "=", "0", ";"]
        if op == "pass":
            return ["pass;"]
        if not values:
            continue
        var = rng.choice(sorted(values))
        if values[var] + 1 > COUNT_MAX:
            continue
        values[var] += 1
        return [var, "++;"]


def count(rng: random.Random, steps: int, names: str) -> tuple[list[str], list[str]]:
    """``steps`` statements over the variables ``names``, then ``print <var>`` of a
    variable that was set; the answer is its value (increments since its last set).

    Words as in the authors' data: ``a = 0 ;``, ``pass;``, ``a ++;``, ``print a``, answer
    ``0`` .. ``10``. A draw in which no variable was set is drawn again.
    """
    if steps < 1:
        raise ValueError(f"count: {steps} statements; at least 1")
    while True:
        values: dict[str, int] = {}
        words = [w for _ in range(steps) for w in _statement(rng, names, values)]
        if values:
            break
    var = rng.choice(sorted(values))
    return [*words, "print", var], [str(values[var])]


# ------------------------------------------------------------------------ state tracking
def _even(perm: tuple[int, ...]) -> bool:
    inversions = sum(a > b for a, b in itertools.combinations(perm, 2))
    return inversions % 2 == 0


#: The groups of the state-tracking problems: each element is a permutation in one-line
#: notation (``"120"`` sends 0 to 1, 1 to 2, 2 to 0). S3: all 6 permutations of 3 points
#: (solvable); A5: the 60 even permutations of 5 points (the smallest non-solvable group).
GROUPS: dict[str, list[str]] = {
    "s3": ["".join(map(str, p)) for p in itertools.permutations(range(3))],
    "a5": ["".join(map(str, p)) for p in itertools.permutations(range(5)) if _even(p)],
}


def _then(first: str, second: str) -> str:
    """The permutation that applies ``first``, then ``second`` (``second ∘ first``)."""
    return "".join(second[int(first[i])] for i in range(len(first)))


def state(rng: random.Random, steps: int, group: str) -> tuple[list[str], Labels]:
    """``steps`` uniform elements of ``group`` and, at each position, the product of the
    elements so far: the state after applying them in order, ``g_t ∘ ... ∘ g_1``."""
    if steps < 1:
        raise ValueError(f"state: {steps} elements; at least 1")
    elements = GROUPS[group]
    tokens = [rng.choice(elements) for _ in range(steps)]
    labels: Labels = []
    product = elements[0]  # the identity: one-line notation 0 1 2 ...
    for g in tokens:
        product = _then(product, g)
        labels.append(product)
    return tokens, labels


# ------------------------------------------------------------ multi-query associative recall
#: The power law of the query gaps (Zoology's ``power_a``; 1 would be uniform): gap slot
#: ``i = 1, 2, ...`` has weight ``i ** (a - 1)``, so most queries come soon after the pairs,
#: as repeated bigrams do in text.
MQAR_POWER = 0.01


def _weighted_sample(rng: random.Random, weights: list[float], k: int) -> list[int]:
    """``k`` distinct indices of ``weights``, drawn one at a time in proportion to the
    weights left (numpy's ``choice(replace=False, p=...)``, which Zoology uses)."""
    pool, left, out = list(range(len(weights))), list(weights), []
    for _ in range(k):
        (j,) = rng.choices(range(len(pool)), left)
        out.append(pool.pop(j))
        left.pop(j)
    return out


def mqar(
    rng: random.Random, length: int, pairs: int, queries: int, keys: list[str], values: list[str]
) -> tuple[list[str], Labels]:
    """A multi-query associative recall sequence (Zoology's ``multiquery_ar``) and its labels.

    ``pairs`` key-value pairs ``k v k v ...`` (distinct keys, distinct values), then
    ``length - 2 pairs`` tokens where ``queries`` of the keys (distinct, in random order)
    stand at even offsets drawn by the power law :data:`MQAR_POWER`; every other token is
    noise, uniform over keys and values (Zoology's ``random_non_queries``).

    Args:
        rng: The instance's generator.
        length: Tokens in all: even, at least ``2 pairs + 2 queries``.
        pairs: Key-value pairs.
        queries: Keys asked for (at most ``pairs``).
        keys: The key alphabet (at least ``pairs`` symbols).
        values: The value alphabet (at least ``pairs`` symbols).

    Returns:
        ``(tokens, labels)``: at a query, the value its key has among the pairs (what the
        model must predict next); None elsewhere.
    """
    space = (length - 2 * pairs) // 2  # even offsets of the query region
    if length % 2 or space < queries or queries > pairs:
        raise ValueError(
            f"mqar: {length} tokens must be even and hold {pairs} pairs and {queries} queries"
        )
    ks, vs = rng.sample(keys, pairs), rng.sample(values, pairs)
    tokens: list[str] = [t for kv in zip(ks, vs, strict=True) for t in kv]
    labels: Labels = [None] * length
    slots = _weighted_sample(rng, [i ** (MQAR_POWER - 1) for i in range(1, space + 1)], queries)
    asked = rng.sample(range(pairs), queries)
    noise = [*keys, *values]
    tokens += [rng.choice(noise) for _ in range(length - 2 * pairs)]
    for slot, j in zip(slots, asked, strict=True):
        tokens[2 * pairs + 2 * slot] = ks[j]
        labels[2 * pairs + 2 * slot] = vs[j]
    return tokens, labels
