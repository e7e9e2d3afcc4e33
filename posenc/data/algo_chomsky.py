"""Generators of the Chomsky-hierarchy tasks (Delétang et al. 2023, "Neural Networks and
the Chomsky Hierarchy"), registered as ``task.problem`` values in
:mod:`posenc.data.algo_problems` under the names of the authors' repository
(google-deepmind/neural_networks_chomsky_hierarchy, ``tasks/``).

Each takes the instance's :class:`random.Random` and the authors' *length* (the input's
tokens) and returns ``(input, output)`` as symbols, drawn as the authors' ``sample_batch``
draws them. Their outputs padded after a termination token become our answer, and the
termination token our EOS: the answer is the output up to it. The tasks posenc already
had under another name (parity, reverse, duplicate, sort) reuse those generators.
"""

from __future__ import annotations

import math
import random

__all__ = [
    "BRACKET_SYMBOLS",
    "CYCLE",
    "MISSING",
    "MODULUS",
    "PADDING",
    "STACK_ACTIONS",
    "binary_addition",
    "binary_multiplication",
    "compute_sqrt",
    "cycle_navigation",
    "even_pairs",
    "missing_duplicate_string",
    "modular_arithmetic_brackets",
    "odds_first",
    "solve_equation",
    "stack_manipulation",
]

Instance = tuple[list[str], list[str]]

#: The modulus of cycle navigation (the circle's length) and of the arithmetic tasks.
MODULUS = 5
#: Cycle navigation's moves: left, stay, right (the authors' actions 0, 1, 2).
CYCLE = {"left": -1, "stay": 0, "right": 1}
#: Missing duplicate: the missing symbol and the empty symbol that pads an odd length
#: (the authors' tokens 2 and 3).
MISSING, PADDING = "_", "."
#: Stack manipulation's actions (the authors' tokens 2, 3, 4).
STACK_ACTIONS = ("pop", "push0", "push1")
#: Modular arithmetic with brackets and solve equation: digits, operators, brackets,
#: unknown, equals.
BRACKET_SYMBOLS = [*map(str, range(MODULUS)), "+", "-", "(", ")", "x", "="]


def _bits(rng: random.Random, n: int) -> list[str]:
    return [rng.choice("01") for _ in range(n)]


# ----------------------------------------------------------------------------- regular
def even_pairs(rng: random.Random, n: int) -> Instance:
    """``n`` bits; ``1`` if the count of ``01`` and ``10`` pairs is odd, else ``0``."""
    bits = _bits(rng, n)
    unequal = sum(a != b for a, b in zip(bits, bits[1:], strict=False))
    return bits, [str(unequal % 2)]


def cycle_navigation(rng: random.Random, n: int) -> Instance:
    """``n`` moves on a circle of :data:`MODULUS` places from place 0; the place reached."""
    moves = [rng.choice(list(CYCLE)) for _ in range(n)]
    return moves, [str(sum(CYCLE[m] for m in moves) % MODULUS)]


# ------------------------------------------------------------------ deterministic context-free
def stack_manipulation(rng: random.Random, n: int) -> Instance:
    """A stack of bits (bottom to top), then actions; the final stack, top to bottom.

    ``n = 1``: one bit, which is the answer. Else the stack has 1..n-1 bits (uniform) and
    the other tokens are actions, uniform over :data:`STACK_ACTIONS`; a pop of an empty
    stack does nothing. The answer may be empty (only the EOS).
    """
    if n == 1:
        bit = rng.choice("01")
        return [bit], [bit]
    stack = _bits(rng, rng.randint(1, n - 1))
    actions = [rng.choice(STACK_ACTIONS) for _ in range(n - len(stack))]
    final = list(stack)
    for action in actions:
        if action == "pop":
            final = final[:-1]
        else:
            final.append(action[-1])
    return [*stack, *actions], final[::-1]


def _bracket_expression(rng: random.Random, n: int) -> tuple[str, int]:
    """An expression of ``n`` characters over :data:`MODULUS` with ``+``, ``-`` and
    brackets, and its value (the authors' ``generate_one_expression_and_result``, without
    multiplication: their paper's setting)."""
    digit = rng.randrange(MODULUS)
    if n <= 4:  # d, -d, (d), (-d)
        text = [f"{digit}", f"-{digit}", f"({digit})", f"(-{digit})"][n - 1]
        return text, (-digit if n % 2 == 0 else digit) % MODULUS
    left_n = rng.randint(1, n - 4)
    left, a = _bracket_expression(rng, left_n)
    right, b = _bracket_expression(rng, n - left_n - 3)
    op = rng.choice("+-")
    return f"({left}{op}{right})", (a + b if op == "+" else a - b) % MODULUS


def modular_arithmetic_brackets(rng: random.Random, n: int) -> Instance:
    """An expression of ``n`` characters with brackets (:func:`_bracket_expression`);
    its value mod :data:`MODULUS`."""
    text, value = _bracket_expression(rng, n)
    return list(text), [str(value)]


def solve_equation(rng: random.Random, n: int) -> Instance:
    """``expression = value`` of ``n`` characters with one digit of the expression
    replaced by ``x``; the answer is that digit (unique: no multiplication).

    Below 3 characters the authors' task gives ``n`` zeros and the answer ``0``.
    """
    if n < 3:
        return ["0"] * n, ["0"]
    text, value = _bracket_expression(rng, n - 2)
    i = rng.randrange(len(text))
    while not text[i].isdigit():  # the next digit, cyclically, as the authors search
        i = (i + 1) % len(text)
    return [*text[:i], "x", *text[i + 1 :], "=", str(value)], [text[i]]


# ----------------------------------------------------------------------- context-sensitive
def odds_first(rng: random.Random, n: int, letters: str) -> Instance:
    """``n`` letters; those at odd indices (0-based), then those at even ones, as the
    authors' code orders them (``s[1::2] + s[::2]``; their docstring's example reads the
    other way)."""
    x = [rng.choice(letters) for _ in range(n)]
    return x, x[1::2] + x[::2]


def missing_duplicate_string(rng: random.Random, n: int) -> Instance:
    """``n // 2`` bits written twice with one symbol replaced by :data:`MISSING` (and
    :data:`PADDING` at the end when ``n`` is odd); the answer is the missing bit.
    ``n = 1``: the input ``1`` and the answer ``1`` (the authors' convention)."""
    if n == 1:
        return ["1"], ["1"]
    twice = _bits(rng, n // 2) * 2
    i = rng.randrange(len(twice))
    answer = twice[i]
    twice[i] = MISSING
    return twice + [PADDING] * (n % 2), [answer]


def _little_endian(value: int, width: int = 0) -> list[str]:
    """Bits of ``value``, least significant first, padded with zeros to ``width``."""
    return list(f"{value:b}".zfill(width)[::-1])


def _binary(rng: random.Random, n: int, op: str) -> Instance:
    """``a op b`` in little-endian binary, ``n`` tokens: ``a`` takes 1..n-2 bits (uniform),
    ``b`` the rest, each a uniform non-zero number of its width (leading zeros allowed);
    the answer is ``a + b`` or ``a * b`` in little-endian binary without leading zeros.

    Up to 2 tokens the input is one number in ``0 .. 2^n - 2`` of ``n`` bits; the answer
    of addition is that number, of multiplication ``n - 1`` zeros (the authors' fill-ins).
    """
    if n <= 2:
        value = rng.randrange(2**n - 1)
        return _little_endian(value, n), _little_endian(value) if op == "+" else ["0"] * (n - 1)
    width_a = rng.randint(1, n - 2)
    width_b = n - 1 - width_a
    a, b = rng.randint(1, 2**width_a - 1), rng.randint(1, 2**width_b - 1)
    result = a + b if op == "+" else a * b
    return [*_little_endian(a, width_a), op, *_little_endian(b, width_b)], _little_endian(result)


def binary_addition(rng: random.Random, n: int) -> Instance:
    """:func:`_binary` with ``+``."""
    return _binary(rng, n, "+")


def binary_multiplication(rng: random.Random, n: int) -> Instance:
    """:func:`_binary` with ``*``."""
    return _binary(rng, n, "*")


def compute_sqrt(rng: random.Random, n: int) -> Instance:
    """A uniform number in ``1 .. 2^n - 1`` as ``n`` bits, most significant first; the
    floor of its square root as ``ceil(n / 2)`` bits."""
    value = rng.randint(1, 2**n - 1)
    root = math.isqrt(value)
    return list(f"{value:b}".zfill(n)), list(f"{root:b}".zfill(math.ceil(n / 2)))
