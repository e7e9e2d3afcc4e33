"""The problems of ``task=algo``: each one's generator, sizes, vocabulary and test grid
(:class:`Problem`, :data:`PROBLEMS`), and :func:`instance`, the instance of a size and a
stream key. The datasets, batches and data module are in :mod:`posenc.data.algo`.
"""

from __future__ import annotations

import copy
import dataclasses
import random
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from posenc.data import algo_chomsky as chomsky
from posenc.data import algo_content as content
from posenc.data import algo_retrieval as retrieval

__all__ = [
    "CHOMSKY",
    "CONTENT",
    "DEFAULTS",
    "RETRIEVAL",
    "GRIDS",
    "PROBLEMS",
    "AlgoVocab",
    "Options",
    "Problem",
    "buckets",
    "instance",
    "longest_sequence",
    "problem_default",
    "size_buckets",
    "grid_sizes",
]

# (prompt symbols, answer symbols), or for a tagged problem (tokens, labels: a symbol or
# None per token)
Instance = tuple[list[str], list[Any]]

SPECIALS = ("<pad>", "<bos>", "<sep>", "<eos>")
PAD, BOS, SEP, EOS = range(len(SPECIALS))
LETTERS = "abcdefghijklmnopqrstuvwxyz"
DIGITS = "0123456789"


@dataclass(frozen=True)
class Options:
    """What an instance depends on besides its size and key.

    Attributes:
        symbols: ``task.symbols``: letters of the letter problems, variables of ``count``.
        reverse_digits: ``task.reverse_digits`` (addition).
        data_tokens: ``task.data_tokens``: data tokens of ``selective_copy``.
        pairs: ``task.pairs``: key-value pairs of ``mqar``, needles of the ``niah_*``
            problems.
        queries: ``task.queries``: keys ``mqar`` and ``niah_multiquery`` ask for (at most
            ``pairs``).
        key_vocab: ``task.key_vocab``: the keys ``mqar`` and the needles draw from (the
            variables of ``variable_tracking``).
        value_vocab: ``task.value_vocab``: the values they draw from.
        haystack: ``task.haystack``: the retrieval problems' filler
            (:data:`posenc.data.algo_retrieval.HAYSTACKS`).
        chains: ``task.chains``: chains of assignments of ``variable_tracking``.
        hops: ``task.hops``: copies per chain after its first assignment.
        variant: The test variant (:attr:`Problem.variants`); ``""`` is the training
            distribution.
    """

    symbols: int = 16
    reverse_digits: bool = False
    data_tokens: int = 16
    pairs: int = 4
    queries: int = 4
    key_vocab: int = 16
    value_vocab: int = 16
    haystack: str = "noise"
    chains: int = 2
    hops: int = 2
    variant: str = ""


def _letters(rng: random.Random, n: int, k: int) -> list[str]:
    return [LETTERS[rng.randrange(k)] for _ in range(n)]


def _copy(rng: random.Random, n: int, o: Options) -> Instance:
    x = _letters(rng, n, o.symbols)
    return x, list(x)


def _reverse(rng: random.Random, n: int, o: Options) -> Instance:
    x = _letters(rng, n, o.symbols)
    return x, x[::-1]


def _duplicate(rng: random.Random, n: int, o: Options) -> Instance:
    x = _letters(rng, n, o.symbols)
    return x, x + x


def _sort(rng: random.Random, n: int, o: Options) -> Instance:
    x = _letters(rng, n, o.symbols)
    return x, sorted(x)


def _number(rng: random.Random, n: int) -> int:
    """A uniform n-digit number (no leading zero; 0..9 for n = 1)."""
    return rng.randrange(10 ** (n - 1) if n > 1 else 0, 10**n)


def _addition(rng: random.Random, n: int, o: Options) -> Instance:
    a, b = _number(rng, n), _number(rng, n)
    order = (lambda s: s[::-1]) if o.reverse_digits else (lambda s: s)
    return [*order(str(a)), "+", *order(str(b))], list(order(str(a + b)))


def _parity(rng: random.Random, n: int, o: Options) -> Instance:
    bits = [rng.choice("01") for _ in range(n)]
    return bits, [str(bits.count("1") % 2)]


def _modarith(rng: random.Random, n: int, o: Options) -> Instance:
    expr = [str(rng.randrange(5))]
    for _ in range(n - 1):
        expr += [rng.choice("+-*"), str(rng.randrange(5))]
    # Usual precedence (* before + and -); Python's % is non-negative for a positive modulus.
    return expr, [str(eval("".join(expr)) % 5)]


#: The keys a problem may give a default of its own (``${posenc_problem:<key>}`` in
#: ``conf/task/algo.yaml``), and their values for a problem that gives none.
DEFAULTS: dict[str, Any] = {
    "task.train_lengths": [1, 8],
    "task.test_multiple": 3,
    "task.bucket_width": 4,
    "task.symbols": 16,
    "task.reverse_digits": False,
    "task.data_tokens": 16,
    "task.pairs": 4,
    "task.queries": 4,
    "task.key_vocab": 16,
    "task.value_vocab": 16,
    "task.chains": 2,
    "task.hops": 2,
    "task.val_per_size": 16,
    "task.test_per_size": 24,
    "task.optim.lr": 3e-3,
    "trainer.max_steps": 500,
    "trainer.val_check_interval": 250,
}

#: Test grids (``task.test_sizes``): every valid size from the smallest up to the largest
#: test size, or the largest training size and its doublings (``hi, 2 hi, 4 hi, ...``).
GRIDS = ("every", "doubling")
#: Layouts of an instance (``task.shape``): decoder-only (BOS prompt SEP answer EOS, loss on
#: the answer) or encoder-decoder (prompt -> answer).
SHAPES = ("decoder", "encdec")


@dataclass(frozen=True)
class Problem:
    """One algorithmic problem.

    Attributes:
        name: The ``task.problem`` value.
        size: What the size ``n`` counts.
        alphabet: The symbols of prompts and answers, given the options (``task.symbols``).
        make: ``(rng, n, options) -> (prompt, answer)``, or ``(tokens, labels)`` if tagged.
        lengths: ``(n, options) -> (prompt or token length, longest answer)`` in symbols
            (a tagged problem's answer length is 0: its labels lie on its tokens).
        min_size: The smallest valid size, given the options.
        step: Valid sizes are multiples of it (flip-flop: whole instruction/bit pairs).
        letters: The problem draws from ``task.symbols`` letters.
        haystack: Its filler is ``task.haystack`` (the retrieval problems).
        tagged: Labels on the tokens (decoder-only) instead of a prompt and an answer.
        lm: Tagged, and its tokens are a language: ``task.lm_loss`` may train every next
            token, not only the labels (flip-flop: the paper's language-model loss).
        variants: Test distributions: ``""`` (the training one) first, then others whose
            metrics are named ``<metric>_<variant>``.
        grid: The test grid (:data:`GRIDS`) when ``task.test_sizes=auto``.
        metrics: The test metrics of its tables (:data:`posenc.tasks.algo_job.METRICS`).
        paper: Where the problem comes from, for ``metrics.json`` and the docs.
        defaults: Its own values of keys of :data:`DEFAULTS` (the sizes this CPU fits),
            taken wherever the command line and the presets leave those keys unset.
        rules: What is wrong with its options, one config error a line (mqar: more
            queries than pairs).
        pairs: The key-value pairs of an instance of ``options.variant``, for a problem
            whose test variants differ in their number of pairs (mqar): the report draws
            accuracy by length x pairs.
    """

    name: str
    size: str
    alphabet: Callable[[Options], list[str]]
    make: Callable[[random.Random, int, Options], Instance]
    lengths: Callable[[int, Options], tuple[int, int]]
    min_size: Callable[[Options], int] = lambda o: 1
    step: int = 1
    letters: bool = False
    haystack: bool = False
    tagged: bool = False
    lm: bool = False
    variants: tuple[str, ...] = ("",)
    grid: str = "every"
    metrics: tuple[str, ...] = ("seq_acc", "acc")
    paper: str = ""
    defaults: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    rules: Callable[[Options], list[str]] = lambda o: []
    pairs: Callable[[Options], int] | None = None

    @property
    def shapes(self) -> tuple[str, ...]:
        """The model shapes it can run in: a tagged problem labels the positions of one
        causal sequence, so it is decoder-only."""
        return ("decoder",) if self.tagged else ("decoder", "encdec")

    def valid(self, n: int, options: Options) -> bool:
        return n >= self.min_size(options) and n % self.step == 0

    def sizes(self, lo: int, hi: int, options: Options) -> list[int]:
        """The valid sizes in ``[lo, hi]``."""
        return [n for n in range(lo, hi + 1) if self.valid(n, options)]


def _letter_alphabet(o: Options) -> list[str]:
    return list(LETTERS[: o.symbols])


def longest_sequence(problem: Problem, n: int, shape: str, options: Options | None = None) -> int:
    """The most positions an instance of size ``n`` takes in one stack: decoder-only
    ``BOS prompt SEP answer EOS`` (tagged: ``BOS tokens``); encoder-decoder, the longer of
    the source and the decoder's ``BOS answer`` / ``answer EOS``."""
    prompt, answer = problem.lengths(n, options or Options())
    if problem.tagged:
        return prompt + 1
    return prompt + answer + 3 if shape == "decoder" else max(prompt, answer + 1)


def _flipflop(rng: random.Random, n: int, o: Options) -> Instance:
    return content.flipflop(rng, n, content.FLIPFLOP_IGNORE[o.variant])


def _state(group: str, sizes: list[int], steps: tuple[int, int]) -> Problem:
    """State tracking over ``group``, trained on words of ``sizes`` elements for
    ``steps`` (the cap, and the steps between validations) by default."""
    size = len(content.GROUPS[group])
    return Problem(
        f"state_{group}",
        f"{group.upper()} elements (of {size}) to multiply",
        lambda o: list(content.GROUPS[group]),
        lambda rng, n, o: content.state(rng, n, group),
        lambda n, o: (n, 0),
        tagged=True,
        paper="Merrill et al. 2024, The Illusion of State in State-Space Models",
        defaults={
            "task.train_lengths": sizes,
            "task.test_multiple": 4,
            "task.val_per_size": 64,
            "trainer.max_steps": steps[0],
            "trainer.val_check_interval": steps[1],
        },
    )


def _mqar_keys(o: Options) -> list[str]:
    return [f"k{i}" for i in range(o.key_vocab)]


def _mqar_values(o: Options) -> list[str]:
    return [f"v{i}" for i in range(o.value_vocab)]


#: MQAR's test distributions: the training one (``""``, ``task.pairs`` pairs) and others
#: with this many times ``task.pairs`` pairs, so the report can draw accuracy by length x
#: number of pairs (Zoology tests beyond its training pairs as well as lengths).
MQAR_PAIRS: dict[str, float] = {"": 1.0, "pairs_half": 0.5, "pairs_x2": 2.0, "pairs_x4": 4.0}


def mqar_pairs(o: Options) -> int:
    """The key-value pairs of an MQAR instance of ``o.variant`` (at least one)."""
    return max(1, int(o.pairs * MQAR_PAIRS[o.variant]))


def _mqar_queries(o: Options) -> int:
    """Queries of an instance of ``o.variant``: ``task.queries``, at most its pairs."""
    return min(o.queries, mqar_pairs(o))


def _mqar_min_size(o: Options) -> int:
    """Pairs and queries take two tokens each; a variant with more pairs than keys or
    values has no valid size (its cells are left empty, not failed)."""
    pairs = mqar_pairs(o)
    if pairs > min(o.key_vocab, o.value_vocab):
        return sys.maxsize
    return 2 * pairs + 2 * _mqar_queries(o)


def _mqar(rng: random.Random, n: int, o: Options) -> Instance:
    return content.mqar(rng, n, mqar_pairs(o), _mqar_queries(o), _mqar_keys(o), _mqar_values(o))


def _at_least(key: str, value: int, need: int, why: str) -> list[str]:
    """``task.<key>=<value>: fewer than <why>; raise it ...`` if ``value < need``."""
    if value >= need:
        return []
    return [f"task.{key}={value}: fewer than {why}; raise it to at least {need}"]


def _pair_rules(o: Options, keys: bool = True, queries: bool = True) -> list[str]:
    """Each query asks for a different key, and the pairs' keys (if ``keys``: a
    multi-value needle has one) and values are distinct."""
    found = []
    if queries and o.queries > o.pairs:
        found.append(
            f"task.queries={o.queries}: more than task.pairs={o.pairs} (each query asks for "
            f"a different key); lower it to at most {o.pairs}"
        )
    why = f"task.pairs={o.pairs} (the pairs' keys and values are distinct)"
    if keys:
        found += _at_least("key_vocab", o.key_vocab, o.pairs, why)
    return found + _at_least("value_vocab", o.value_vocab, o.pairs, why)


#: The problems where content decides which position matters (:mod:`.algo_content`).
CONTENT = (
    Problem(
        "flipflop",
        "tokens (instruction/bit pairs)",
        lambda o: ["w", "r", "i", "0", "1"],
        _flipflop,
        lambda n, o: (n, 0),
        min_size=lambda o: 4,
        step=2,
        tagged=True,
        lm=True,
        variants=tuple(content.FLIPFLOP_IGNORE),
        grid="doubling",
        metrics=("read_err",),
        paper="Liu et al. 2023, Exposing Attention Glitches with Flip-Flop Language Modeling",
        defaults={
            "task.train_lengths": [32, 32],
            "task.test_multiple": 8,  # T, 2T, 4T, 8T (the doubling grid)
            "task.val_per_size": 256,  # one training size: 256 validation strings
            "task.test_per_size": 250,  # strings per length and split
        },
    ),
    Problem(
        "selective_copy",
        "tokens, data and noise (task.data_tokens of them data)",
        lambda o: [content.NOISE, *LETTERS[: o.symbols]],
        lambda rng, n, o: content.selective_copy(rng, n, o.data_tokens, LETTERS[: o.symbols]),
        lambda n, o: (n, o.data_tokens),
        min_size=lambda o: o.data_tokens,
        letters=True,
        paper="Gu and Dao 2023, Mamba, section 3.1",
        defaults={
            "task.data_tokens": 4,
            "task.symbols": 8,
            "task.train_lengths": [4, 16],
            "task.bucket_width": 8,
        },
    ),
    Problem(
        "count",
        "statements",
        lambda o: [
            *LETTERS[: o.symbols],
            "=",
            ";",
            "pass;",
            "++;",
            "print",
            *map(str, range(content.COUNT_MAX + 1)),
        ],
        lambda rng, n, o: content.count(rng, n, LETTERS[: o.symbols]),
        lambda n, o: (4 * n + 2, 1),
        letters=True,
        paper="Golovneva et al. 2024, Contextual Position Encoding, section 4",
        defaults={
            "task.symbols": 3,  # variables a, b, c (the authors' generator's --nvars 3)
            "task.train_lengths": [1, 32],
            "trainer.max_steps": 800,
            "trainer.val_check_interval": 400,
        },
    ),
    _state("s3", sizes=[1, 4], steps=(3000, 500)),
    _state("a5", sizes=[1, 2], steps=(5000, 1000)),
    Problem(
        "mqar",
        "tokens (task.pairs key-value pairs, then task.queries queries among noise)",
        lambda o: [*_mqar_keys(o), *_mqar_values(o)],
        _mqar,
        lambda n, o: (n, 0),
        min_size=_mqar_min_size,
        step=2,
        tagged=True,
        variants=tuple(MQAR_PAIRS),
        pairs=mqar_pairs,
        paper="Arora et al. 2023, Zoology: Measuring and Improving Recall in Efficient "
        "Language Models (multi-query associative recall)",
        defaults={
            "task.train_lengths": [16, 32],
            "task.test_multiple": 4,
            "task.bucket_width": 16,
            "task.optim.lr": 1e-3,
            "trainer.max_steps": 3000,
        },
        rules=_pair_rules,
    ),
)

RULER = (
    "Hsieh et al. 2024, RULER: What's the Real Context Size of Your Long-Context Language Models?"
)
#: The retrieval problems' sizes on this CPU: prompts of 16..32 tokens, tested up to 128.
_RETRIEVAL_SIZES = {
    "task.train_lengths": [16, 32],
    "task.test_multiple": 4,
    "task.bucket_width": 16,
    "trainer.max_steps": 1000,
}


def _haystack_alphabet(o: Options, *words: str) -> list[str]:
    """The filler's symbols (``task.symbols`` letters, or TinyShakespeare's characters),
    the needles' ``words`` and the question token."""
    shakespeare = o.haystack == "shakespeare"
    hay = sorted(set(retrieval.shakespeare())) if shakespeare else list(LETTERS[: o.symbols])
    return [*hay, *words, retrieval.QUESTION]


def _niah(name: str, size: str, one_key: bool = False, multiquery: bool = False) -> Problem:
    """A needle problem: ``task.pairs`` key-value needles (all of one key if ``one_key``),
    ``task.queries`` keys asked for if ``multiquery``, else one
    (:func:`.algo_retrieval.niah`)."""

    def asked(o: Options) -> int:
        return o.queries if multiquery else 1

    def make(rng: random.Random, n: int, o: Options) -> Instance:
        return retrieval.niah(
            rng,
            n,
            needles=o.pairs,
            queries=asked(o),
            one_key=one_key,
            keys=_mqar_keys(o),
            values=_mqar_values(o),
            haystack=o.haystack,
            letters=LETTERS[: o.symbols],
        )

    return Problem(
        name,
        size,
        lambda o: _haystack_alphabet(o, *_mqar_keys(o), *_mqar_values(o)),
        make,
        lambda n, o: (n, o.pairs if one_key else asked(o)),
        min_size=lambda o: 2 * o.pairs + 1 + asked(o),
        letters=True,
        haystack=True,
        paper=RULER,
        defaults=_RETRIEVAL_SIZES,
        rules=lambda o: _pair_rules(o, keys=not one_key, queries=multiquery),
    )


def _variables(o: Options) -> list[str]:
    return [f"x{i}" for i in range(o.key_vocab)]


def _tracking_rules(o: Options) -> list[str]:
    """Every variable of every chain is a different one, every chain's value too."""
    names = o.chains * (o.hops + 1)
    return _at_least(
        "key_vocab",
        o.key_vocab,
        names,
        f"the {names} variables of task.chains={o.chains} chains of task.hops={o.hops} "
        "copies (each a different variable)",
    ) + _at_least(
        "value_vocab",
        o.value_vocab,
        o.chains,
        f"task.chains={o.chains} (each chain holds a different value)",
    )


#: RULER's retrieval problems (:mod:`.algo_retrieval`): prompts and answers, the size the
#: prompt's tokens in all (filler, needles and question), so longer sizes add filler.
RETRIEVAL = (
    _niah(
        "niah_multikey",
        "prompt tokens (task.pairs key-value needles in a haystack, one key asked)",
    ),
    _niah(
        "niah_multivalue",
        "prompt tokens (task.pairs needles of one key in a haystack, all its values asked)",
        one_key=True,
    ),
    _niah(
        "niah_multiquery",
        "prompt tokens (task.pairs key-value needles in a haystack, task.queries keys asked)",
        multiquery=True,
    ),
    Problem(
        "variable_tracking",
        "prompt tokens (task.chains chains of 1 + task.hops assignments in a haystack)",
        lambda o: _haystack_alphabet(o, *_variables(o), retrieval.ASSIGN, *_mqar_values(o)),
        lambda rng, n, o: retrieval.variable_tracking(
            rng,
            n,
            chains=o.chains,
            hops=o.hops,
            variables=_variables(o),
            values=_mqar_values(o),
            haystack=o.haystack,
            letters=LETTERS[: o.symbols],
        ),
        lambda n, o: (n, o.hops + 1),
        min_size=lambda o: 3 * o.chains * (o.hops + 1) + 2,
        letters=True,
        haystack=True,
        paper=RULER,
        defaults={**_RETRIEVAL_SIZES, "task.train_lengths": [20, 40], "task.bucket_width": 20},
        rules=_tracking_rules,
    ),
)

#: The problems that index positions.
CLASSIC = (
    Problem("copy", "symbols to copy", _letter_alphabet, _copy, lambda n, o: (n, n), letters=True),
    Problem(
        "reverse",
        "symbols to reverse",
        _letter_alphabet,
        _reverse,
        lambda n, o: (n, n),
        letters=True,
    ),
    Problem(
        "duplicate",
        "symbols to write twice",
        _letter_alphabet,
        _duplicate,
        lambda n, o: (n, 2 * n),
        letters=True,
    ),
    Problem("sort", "symbols to sort", _letter_alphabet, _sort, lambda n, o: (n, n), letters=True),
    Problem(
        "addition",
        "digits per operand",
        lambda o: [*DIGITS, "+"],
        _addition,
        lambda n, o: (2 * n + 1, n + 1),
        # least-significant digit first: the carry is written after the digits it
        # depends on
        defaults={"task.reverse_digits": True},
    ),
    Problem("parity", "bits", lambda o: ["0", "1"], _parity, lambda n, o: (n, 1)),
    Problem(
        "modarith",
        "operands in 0..4 of + - * (mod 5)",
        lambda o: ["0", "1", "2", "3", "4", "+", "-", "*"],
        _modarith,
        lambda n, o: (2 * n - 1, 1),
    ),
)

CHOMSKY_PAPER = "Deletang et al. 2023, Neural Networks and the Chomsky Hierarchy"
#: The Chomsky-hierarchy tasks' budget at the generic CPU sizes: up to 3000 steps, the gate
#: stopping a run where it learned (rope, seed 0, met it on 4 of the 15 in 500 steps, on 10
#: in 3000: docs/algorithmic.md).
_CHOMSKY_CPU = {"trainer.max_steps": 3000}


def _alias(of: str, name: str, defaults: Mapping[str, Any]) -> Problem:
    """A Chomsky-hierarchy task that is posenc's problem ``of`` in the authors' format,
    under the authors' name, with its own ``defaults`` (their alphabet's size)."""
    (problem,) = [p for p in CLASSIC if p.name == of]
    own = {**_CHOMSKY_CPU, **defaults}
    return dataclasses.replace(problem, name=name, paper=CHOMSKY_PAPER, defaults=own)


def _chomsky(
    name: str,
    size: str,
    alphabet: list[str],
    make: Callable[[random.Random, int], Instance],
    answer: Callable[[int], int],
) -> Problem:
    """A Chomsky-hierarchy task over a fixed ``alphabet``: the input takes ``n`` symbols,
    the answer at most ``answer(n)``."""
    return Problem(
        name,
        size,
        lambda o: alphabet,
        lambda rng, n, o: make(rng, n),
        lambda n, o: (n, answer(n)),
        paper=CHOMSKY_PAPER,
        defaults=_CHOMSKY_CPU,
    )


_BITS = ["0", "1"]
_RESIDUES = [str(r) for r in range(chomsky.MODULUS)]

#: The tasks of Deletang et al. 2023 (:mod:`.algo_chomsky`), named as in the authors'
#: repository; the size is their input length.
CHOMSKY = (
    # regular
    _chomsky("even_pairs", "bits", _BITS, chomsky.even_pairs, lambda n: 1),
    _alias("parity", "parity_check", {}),
    _chomsky(
        "cycle_navigation",
        "moves (left, stay, right)",
        [*chomsky.CYCLE, *_RESIDUES],
        chomsky.cycle_navigation,
        lambda n: 1,
    ),
    Problem(
        "modular_arithmetic",
        "tokens, operands and operators (an even size writes one fewer)",
        lambda o: [*_RESIDUES, "+", "-", "*"],
        lambda rng, n, o: _modarith(rng, (n + 1) // 2, o),
        lambda n, o: (2 * ((n + 1) // 2) - 1, 1),
        paper=CHOMSKY_PAPER,
        defaults=_CHOMSKY_CPU,
    ),
    # deterministic context-free
    _chomsky(
        "stack_manipulation",
        "tokens (stack bits, then actions)",
        [*_BITS, *chomsky.STACK_ACTIONS],
        chomsky.stack_manipulation,
        lambda n: n,
    ),
    _alias("reverse", "reverse_string", {"task.symbols": 2}),
    _chomsky(
        "modular_arithmetic_brackets",
        "characters",
        chomsky.BRACKET_SYMBOLS[:-2],
        chomsky.modular_arithmetic_brackets,
        lambda n: 1,
    ),
    _chomsky(
        "solve_equation", "characters", chomsky.BRACKET_SYMBOLS, chomsky.solve_equation, lambda n: 1
    ),
    # context-sensitive
    _alias("duplicate", "duplicate_string", {"task.symbols": 2}),
    _chomsky(
        "missing_duplicate_string",
        "tokens (a bit string twice, one bit missing)",
        [*_BITS, chomsky.MISSING, chomsky.PADDING],
        chomsky.missing_duplicate_string,
        lambda n: 1,
    ),
    Problem(
        "odds_first",
        "symbols",
        _letter_alphabet,
        lambda rng, n, o: chomsky.odds_first(rng, n, LETTERS[: o.symbols]),
        lambda n, o: (n, n),
        letters=True,
        paper=CHOMSKY_PAPER,
        defaults={**_CHOMSKY_CPU, "task.symbols": 2},
    ),
    _chomsky(
        "binary_addition",
        "tokens (two little-endian numbers and +)",
        [*_BITS, "+"],
        chomsky.binary_addition,
        lambda n: n,
    ),
    _chomsky(
        "binary_multiplication",
        "tokens (two little-endian numbers and *)",
        [*_BITS, "*"],
        chomsky.binary_multiplication,
        lambda n: n - 1,
    ),
    _chomsky("compute_sqrt", "bits", _BITS, chomsky.compute_sqrt, lambda n: -(-n // 2)),
    _alias("sort", "bucket_sort", {"task.symbols": 5}),
)

#: ``task.problem`` -> :class:`Problem`.
PROBLEMS: dict[str, Problem] = {p.name: p for p in (*CLASSIC, *CONTENT, *RETRIEVAL, *CHOMSKY)}


def problem_default(problem: Any, key: str) -> Any:
    """The value of ``key`` (a key of :data:`DEFAULTS`) for the problem named ``problem``:
    its own default, else the generic one (for an unknown name too: the config check
    refuses that name, with the names allowed).

    Raises:
        KeyError: ``key`` is not a key of :data:`DEFAULTS`.
    """
    if key not in DEFAULTS:
        raise KeyError(f"{key!r} has no problem default; keys with one: {', '.join(DEFAULTS)}")
    own = PROBLEMS[problem].defaults if isinstance(problem, str) and problem in PROBLEMS else {}
    return copy.deepcopy(own.get(key, DEFAULTS[key]))


class AlgoVocab:
    """Ids: the four specials (:data:`SPECIALS`), then the problem's alphabet for the
    options."""

    def __init__(self, problem: Problem, options: Options) -> None:
        self.tokens = [*SPECIALS, *dict.fromkeys(problem.alphabet(options))]
        self.ids = {s: i for i, s in enumerate(self.tokens)}

    def __len__(self) -> int:
        return len(self.tokens)

    def encode(self, symbols: Sequence[str | None]) -> list[int]:
        """Ids of ``symbols``; None (a position without a label) is PAD."""
        return [PAD if s is None else self.ids[s] for s in symbols]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self.tokens[i] for i in ids)


def instance(
    problem: Problem, n: int, key: str, options: Options | None = None, **fields: Any
) -> Instance:
    """The instance of size ``n`` of stream position ``key`` (a pure function of both, and
    of the variant: the training distribution's keys carry none).

    Args:
        problem: The problem.
        n: The size.
        key: The stream key.
        options: The options (default :class:`Options`'s).
        fields: Options that replace those of ``options`` (``symbols=8``,
            ``variant="sparse"``).
    """
    options = dataclasses.replace(options or Options(), **fields)
    if not problem.valid(n, options):
        step = f" and a multiple of {problem.step}" if problem.step > 1 else ""
        raise ValueError(
            f"problem {problem.name}: size {n} must be at least {problem.min_size(options)}{step}"
        )
    if options.variant not in problem.variants:
        raise ValueError(f"problem {problem.name}: no variant {options.variant!r}")
    stream = f"{problem.name}:{options.variant}" if options.variant else problem.name
    rng = random.Random(f"{stream}:{n}:{key}")
    return problem.make(rng, n, options)


def training_size(seed: int, index: int, sizes: Sequence[int]) -> int:
    """The size of training instance ``index``: uniform over ``sizes`` (the valid sizes of
    the training range), from the seed."""
    return random.Random(f"size:{seed}:{index}").choice(sizes)


def buckets(lo: int, hi: int, top: int, width: int) -> list[tuple[int, int]]:
    """Size buckets: the training range ``[lo, hi]``, then ranges of ``width`` sizes up to
    ``top`` (the last one may be shorter): ``buckets(1, 16, 48, 8)`` gives
    ``[(1, 16), (17, 24), (25, 32), (33, 40), (41, 48)]``."""
    edges = list(range(hi, top, width)) + [top]
    return [(lo, hi)] + [(a + 1, b) for a, b in pairwise(edges)]


def grid_sizes(problem: Problem, lo: int, hi: int, top: int, grid: str, o: Options) -> list[int]:
    """The sizes tested: on the ``every`` grid each valid size from the smallest to
    ``top``; on ``doubling``, ``hi, 2 hi, 4 hi, ...`` up to ``top``."""
    if grid == "doubling":
        return [hi * 2**k for k in range(top.bit_length()) if hi * 2**k <= top]
    return [n for n in range(1, top + 1) if problem.valid(n, o)]


def size_buckets(
    problem: Problem, lo: int, hi: int, top: int, grid: str, width: int, o: Options
) -> list[tuple[int, int]]:
    """The report's buckets: the training range, then :func:`buckets` of ``width`` sizes
    (``every``) or each doubling of its own (``doubling``)."""
    lo = max(lo, problem.min_size(o))
    if grid == "doubling":
        return [(lo, hi)] + [(n, n) for n in grid_sizes(problem, lo, hi, top, grid, o) if n > hi]
    return buckets(lo, hi, top, width)


def bucket_name(bucket: tuple[int, int]) -> str:
    return f"len{bucket[0]}-{bucket[1]}"


def check(
    problem: Problem, shape: str, lo: int, hi: int, options: Options, lm_loss: bool = False
) -> list[str]:
    """What is wrong with running ``problem`` in ``shape`` on training sizes ``[lo, hi]``
    (with ``task.lm_loss``), one line each (config errors, naming the key and the fix).
    Training draws the valid sizes of the range, so it must hold one."""
    found = problem.rules(options)
    if options.haystack != "noise" and not problem.haystack:
        found.append(
            f"task.haystack={options.haystack}: {problem.name} has no haystack (only "
            f"{', '.join(p.name for p in RETRIEVAL)} have); drop it"
        )
    if shape not in problem.shapes:
        found.append(
            f"task.shape={shape}: {problem.name} labels positions of one causal sequence, "
            f"so it runs decoder-only; drop task.shape or set task.shape=decoder"
        )
    if lm_loss and not problem.lm:
        lm = [p.name for p in PROBLEMS.values() if p.lm]
        found.append(
            f"task.lm_loss=true: {problem.name} has no language-model loss (only "
            f"{', '.join(lm)} has); drop it"
        )
    least = problem.min_size(options)
    # no size fits options the rules refuse (more pairs than keys): those lines say why
    if least < sys.maxsize and not problem.sizes(lo, hi, options):
        rule = f"at least {least}"
        if problem.step > 1:
            rule += f" and a multiple of {problem.step}"
        fit = max(least, hi)
        fit += -fit % problem.step
        found.append(
            f"task.train_lengths=[{lo}, {hi}]: holds no valid size of {problem.name} (a size "
            f"counts {problem.size} and must be {rule}); e.g. task.train_lengths=[{fit},{fit}]"
        )
    return found
