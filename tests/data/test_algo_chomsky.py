"""The Chomsky-hierarchy tasks (Deletang et al. 2023): every answer recomputed here in
plain Python written apart from the generators (parity by counting, reverse by slicing,
binary arithmetic by Python ints, equations by trying every value, expressions by
Python's own evaluation), their sizes, alphabets and the authors' corner cases."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest

from posenc.data.algo import PROBLEMS, AlgoVocab, Options, instance
from posenc.data.algo_problems import CHOMSKY, CLASSIC, check, problem_default
from tests.data.test_algo import _reference as classic_reference


def _binary(prompt: list[str], op: str) -> list[str]:
    """Little-endian operands, by Python ints."""
    text = "".join(prompt)
    a, b = text.split(op)
    value = int(a[::-1], 2) + int(b[::-1], 2) if op == "+" else int(a[::-1], 2) * int(b[::-1], 2)
    return list(bin(value)[2:][::-1])


def _stack(prompt: list[str]) -> list[str]:
    """Run the actions on a Python list; the stack is the leading bits."""
    start = next((i for i, t in enumerate(prompt) if t not in "01"), len(prompt))
    stack = prompt[:start]
    for action in prompt[start:]:
        if action == "pop":
            if stack:
                stack.pop()
        else:
            stack.append({"push0": "0", "push1": "1"}[action])
    return list(reversed(stack))


def _solve(prompt: list[str]) -> list[str]:
    """Try each value for x; exactly one satisfies the equation (no multiplication)."""
    left, right = "".join(prompt).split("=")
    found = [str(v) for v in range(5) if eval(left.replace("x", str(v))) % 5 == int(right)]
    assert len(found) == 1, prompt
    return found


def _missing(prompt: list[str]) -> list[str]:
    """The same place in the other copy."""
    body = [t for t in prompt if t != "."]
    i, half = body.index("_"), len(body) // 2
    return [body[(i + half) % len(body)]]


def _sqrt(prompt: list[str]) -> list[str]:
    value, root = int("".join(prompt), 2), 0
    while (root + 1) ** 2 <= value:
        root += 1
    return list(format(root, "b").zfill(math.ceil(len(prompt) / 2)))


#: The answer from the prompt, for sizes 3 and up (the corner cases are tested apart).
REFERENCE: dict[str, Callable[[list[str]], list[str]]] = {
    "even_pairs": lambda x: [str(int(x[0] != x[-1]))],  # each change of bit is a 01 or 10
    "parity_check": lambda x: [str(x.count("1") % 2)],
    "cycle_navigation": lambda x: [str((x.count("right") - x.count("left")) % 5)],
    "modular_arithmetic": lambda x: classic_reference("modarith", x, False),
    "stack_manipulation": _stack,
    "reverse_string": lambda x: x[::-1],
    "modular_arithmetic_brackets": lambda x: [str(eval("".join(x)) % 5)],
    "solve_equation": _solve,
    "duplicate_string": lambda x: x + x,
    "missing_duplicate_string": _missing,
    "odds_first": lambda x: (
        [x[i] for i in range(1, len(x), 2)] + [x[i] for i in range(0, len(x), 2)]
    ),
    "binary_addition": lambda x: _binary(x, "+"),
    "binary_multiplication": lambda x: _binary(x, "*"),
    "compute_sqrt": _sqrt,
    "bucket_sort": sorted,
}


def test_the_fifteen_tasks_are_registered_under_the_authors_names() -> None:
    assert sorted(p.name for p in CHOMSKY) == sorted(REFERENCE)
    assert all(PROBLEMS[name].paper.startswith("Deletang et al. 2023") for name in REFERENCE)


def _prompt_length(name: str, n: int) -> int:
    return n - 1 + n % 2 if name == "modular_arithmetic" else n  # odd lengths only


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_answers_sizes_and_alphabet(name: str) -> None:
    p = PROBLEMS[name]
    options = Options(symbols=3)
    vocab = AlgoVocab(p, options)
    for n in (3, 4, 7, 12, 41):
        for i in range(40):
            prompt, answer = instance(p, n, f"k{i}", options)
            assert answer == REFERENCE[name](prompt), (prompt, answer)
            assert len(prompt) == _prompt_length(name, n) == p.lengths(n, options)[0]
            assert len(answer) <= p.lengths(n, options)[1]
            vocab.encode(prompt + answer)  # every symbol is in the vocabulary
            if p.letters:
                assert set(prompt) <= set("abc")


def test_instances_are_a_function_of_the_key_and_use_their_own_stream() -> None:
    for p in CHOMSKY:
        assert instance(p, 9, "a") == instance(p, 9, "a")
        assert len({str(instance(p, 9, f"x{i}")) for i in range(30)}) > 5, p.name
    state = random.getstate()
    instance(PROBLEMS["modular_arithmetic_brackets"], 40, "g")
    assert random.getstate() == state


def test_the_authors_corner_cases_at_the_smallest_lengths() -> None:
    def draws(name: str, n: int) -> set[str]:
        return {str(instance(PROBLEMS[name], n, f"c{i}")) for i in range(60)}

    assert draws("binary_addition", 1) == {str((["0"], ["0"]))}  # a number in 0..2^n - 2
    assert draws("binary_addition", 2) == {
        str((["0", "0"], ["0"])),
        str((["1", "0"], ["1"])),
        str((["0", "1"], ["0", "1"])),
    }
    assert draws("binary_multiplication", 1) == {str((["0"], []))}  # n - 1 zeros
    assert draws("missing_duplicate_string", 1) == {str((["1"], ["1"]))}
    assert draws("solve_equation", 2) == {str((["0", "0"], ["0"]))}
    assert draws("stack_manipulation", 1) == {str((["0"], ["0"])), str((["1"], ["1"]))}
    assert draws("modular_arithmetic_brackets", 4) == {
        str((list(f"(-{d})"), [str(-d % 5)])) for d in range(5)
    }


def test_distributions_follow_the_authors_draws() -> None:
    """Stack manipulation ends empty sometimes (the answer is then only the EOS); binary
    operands take every split of the length, and never the value 0; odd lengths of the
    missing-duplicate task end with the padding symbol; sqrt inputs have leading zeros."""
    stacks = [instance(PROBLEMS["stack_manipulation"], 6, f"s{i}")[1] for i in range(300)]
    assert any(not s for s in stacks) and max(map(len, stacks)) >= 5
    splits = set()
    for i in range(300):
        prompt, _ = instance(PROBLEMS["binary_addition"], 8, f"b{i}")
        a, b = "".join(prompt).split("+")
        splits.add(len(a))
        assert "1" in a and "1" in b
    assert splits == set(range(1, 7))
    assert all(
        instance(PROBLEMS["missing_duplicate_string"], 9, f"m{i}")[0][-1] == "." for i in range(20)
    )
    assert any(instance(PROBLEMS["compute_sqrt"], 6, f"q{i}")[0][0] == "0" for i in range(50))


def test_aliases_are_posencs_problems_in_the_authors_alphabet() -> None:
    """reverse_string, duplicate_string and bucket_sort draw as reverse, duplicate and
    sort do, over the authors' alphabet sizes by default (2, 2, 5 symbols); parity_check
    is parity."""
    own = {p.name: p for p in CLASSIC}
    pairs = {
        "reverse_string": ("reverse", 2),
        "duplicate_string": ("duplicate", 2),
        "bucket_sort": ("sort", 5),
        "parity_check": ("parity", 16),
    }
    for alias, (name, symbols) in pairs.items():
        p = PROBLEMS[alias]
        assert (p.make, p.alphabet, p.lengths) == (
            own[name].make,
            own[name].alphabet,
            own[name].lengths,
        )
        assert p.defaults.get("task.symbols", 16) == symbols
    assert PROBLEMS["odds_first"].defaults == {"task.symbols": 2, "trainer.max_steps": 3000}


def test_the_chomsky_tasks_train_up_to_3000_steps_and_the_originals_keep_theirs() -> None:
    """At the CPU sizes every Chomsky-hierarchy task, aliases included, trains up to 3000
    steps (the budget in which rope met the gate on 10 of the 15), while posenc's own
    problems they alias keep the generic 500."""
    names = [p.name for p in CHOMSKY]
    assert len(names) == 15
    assert {n: problem_default(n, "trainer.max_steps") for n in names} == dict.fromkeys(names, 3000)
    originals = ("reverse", "duplicate", "sort", "parity")
    assert {n: problem_default(n, "trainer.max_steps") for n in originals} == dict.fromkeys(
        originals, 500
    )


def test_every_length_of_the_authors_protocol_is_valid() -> None:
    """Training on 1..40 and testing up to 500 needs no size rule (the authors define
    every length from 1)."""
    for p in CHOMSKY:
        assert check(p, "decoder", 1, 40, Options()) == []
        assert p.sizes(1, 500, Options()) == list(range(1, 501))
