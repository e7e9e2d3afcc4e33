"""RULER's retrieval problems (posenc.data.algo_retrieval): every answer re-derived from the
prompt's text alone by a reader written here (a table of the needles, or the assignments
followed to their values), and the properties of an instance: its length, each needle once,
the filler from the haystack asked for, determinism by key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from posenc.config import validate
from posenc.data.algo_problems import PROBLEMS, AlgoVocab, Options, check, instance
from posenc.data.algo_retrieval import shakespeare
from posenc.schema import typed
from tests.conftest import compose_config

NIAH = ("niah_multikey", "niah_multivalue", "niah_multiquery")
RETRIEVAL = (*NIAH, "variable_tracking")
KEY, VALUE, VAR = re.compile(r"k\d+"), re.compile(r"v\d+"), re.compile(r"x\d+")
LETTERS = set("abcdefgh")
SMALL = Options(symbols=8, pairs=3, queries=2, key_vocab=6, value_vocab=5, chains=2, hops=2)


def _split(prompt: list[str]) -> tuple[list[str], list[str]]:
    """The body before the one ``Q:``, and the question after it."""
    assert prompt.count("Q:") == 1
    at = prompt.index("Q:")
    return prompt[:at], prompt[at + 1 :]


def _needles(body: list[str]) -> list[tuple[int, str, str]]:
    """``(position, key, value)`` of each key token followed by a value token."""
    return [
        (i, a, b)
        for i, (a, b) in enumerate(zip(body, body[1:], strict=False))
        if KEY.fullmatch(a) and VALUE.fullmatch(b)
    ]


def _read_niah(name: str, prompt: list[str]) -> list[str]:
    body, question = _split(prompt)
    found = _needles(body)
    if name == "niah_multivalue":
        (key,) = question
        return [v for _, k, v in found if k == key]
    table = {k: v for _, k, v in found}
    return [table[k] for k in question]


def _read_tracking(prompt: list[str]) -> list[str]:
    """Each ``a := b`` in order; a variable's value is followed through the variables it
    copies; the answer is every variable that ends at the asked value, as they stand."""
    body, (value,) = _split(prompt)
    assigned = {body[i - 1]: body[i + 1] for i, t in enumerate(body) if t == ":="}

    def resolve(name: str) -> str:
        while VAR.fullmatch(name):
            name = assigned[name]
        return name

    return [var for var in assigned if resolve(var) == value]


def _filler(prompt: list[str]) -> list[str]:
    """The body without needle and statement tokens."""
    body, _ = _split(prompt)
    return [t for t in body if not (KEY.fullmatch(t) or VALUE.fullmatch(t) or VAR.fullmatch(t))]


@pytest.mark.parametrize("name", RETRIEVAL)
def test_answers_re_derived_from_the_prompt(name: str) -> None:
    p = PROBLEMS[name]
    vocab = AlgoVocab(p, SMALL)
    lo = p.min_size(SMALL)
    for n in (lo, lo + 1, lo + 7, 90):
        for i in range(40):
            prompt, answer = instance(p, n, f"r{i}", SMALL)
            assert len(prompt) == n  # the size is the prompt's tokens
            tracking = name == "variable_tracking"
            assert answer == (_read_tracking(prompt) if tracking else _read_niah(name, prompt))
            assert len(answer) == (
                {"niah_multikey": 1, "niah_multiquery": 2, "niah_multivalue": 3}.get(name, 3)
            )
            assert len(answer) <= p.lengths(n, SMALL)[1]
            assert set(_filler(prompt)) <= LETTERS | {":="}
            vocab.encode(prompt + answer)


@pytest.mark.parametrize("name", NIAH)
def test_each_needle_stands_once_inside_the_prompt(name: str) -> None:
    p = PROBLEMS[name]
    for i in range(60):
        prompt, answer = instance(p, 40, f"o{i}", SMALL)
        body, question = _split(prompt)
        found = _needles(body)
        assert len(found) == SMALL.pairs
        keys = [k for _, k, _ in found]
        values = [v for _, _, v in found]
        assert len(set(values)) == SMALL.pairs
        assert all(body.count(v) == 1 for v in values)
        if name == "niah_multivalue":
            assert len(set(keys)) == 1 and question == keys[:1]
        else:
            assert all(body.count(k) == 1 for k in keys)  # each key once, its needle's
            assert len(set(question)) == len(question) and set(question) <= set(keys)
        assert all(at + 1 < len(body) for at, _, _ in found)  # a value after each key
        assert set(answer) <= set(values)


def test_needles_stand_at_every_depth() -> None:
    """The needles are spread over the haystack: first and last quarters both hold some."""
    p, depths = PROBLEMS["niah_multikey"], []
    for i in range(200):
        body, _ = _split(instance(p, 64, f"d{i}", SMALL)[0])
        depths += [at / len(body) for at, _, _ in _needles(body)]
    assert min(depths) < 0.1 and max(depths) > 0.9
    assert 0.35 < sum(d < 0.5 for d in depths) / len(depths) < 0.65


def test_variable_tracking_chains_and_distractors() -> None:
    """chains x (1 + hops) statements, each variable assigned once; the first of a chain
    takes a value, each other copies a variable assigned before it; one chain is asked."""
    p = PROBLEMS["variable_tracking"]
    for i in range(60):
        prompt, answer = instance(p, 50, f"v{i}", SMALL)
        body, (value,) = _split(prompt)
        at = [j for j, t in enumerate(body) if t == ":="]
        assert len(at) == SMALL.chains * (SMALL.hops + 1)
        targets = [body[j - 1] for j in at]
        assert len(set(targets)) == len(targets) and all(VAR.fullmatch(t) for t in targets)
        sources = [body[j + 1] for j in at]
        values = [s for s in sources if VALUE.fullmatch(s)]
        assert len(values) == len(set(values)) == SMALL.chains and value in values
        for j, source in zip(at, sources, strict=True):
            if VAR.fullmatch(source):
                assert source in targets[: at.index(j)]  # copied after it was assigned
        assert len(answer) == SMALL.hops + 1 and body.index(answer[0]) < body.index(answer[-1])


@pytest.mark.parametrize("name", RETRIEVAL)
def test_shakespeare_haystack_is_a_window_of_the_text(name: str) -> None:
    p, o = PROBLEMS[name], Options(haystack="shakespeare", pairs=2, queries=2)
    text = shakespeare()
    vocab = AlgoVocab(p, o)
    for i in range(20):
        prompt, answer = instance(p, 60, f"s{i}", o)
        filler = "".join(t for t in _filler(prompt) if t != ":=")
        assert len(filler) > 20 and filler in text
        vocab.encode(prompt + answer)
    assert set(text) <= set(vocab.tokens)


@pytest.mark.parametrize("name", RETRIEVAL)
def test_instances_are_a_function_of_the_key(name: str) -> None:
    p = PROBLEMS[name]
    assert instance(p, 30, "a", SMALL) == instance(p, 30, "a", SMALL)
    assert len({str(instance(p, 30, f"x{i}", SMALL)) for i in range(30)}) == 30


def test_options_that_cannot_make_an_instance_are_config_errors() -> None:
    mk, mq = PROBLEMS["niah_multikey"], PROBLEMS["niah_multiquery"]
    assert check(mk, "decoder", 16, 32, Options()) == []
    (msg,) = check(mk, "decoder", 16, 32, Options(pairs=20, key_vocab=20, value_vocab=20))
    assert "holds no valid size of niah_multikey" in msg and "at least 42" in msg
    (msg,) = check(mq, "decoder", 16, 32, Options(queries=5))
    assert msg.startswith("task.queries=5: more than task.pairs=4")
    assert check(PROBLEMS["niah_multivalue"], "decoder", 16, 32, Options(key_vocab=1)) == []
    (msg,) = check(mk, "decoder", 16, 32, Options(value_vocab=3))
    assert msg.startswith("task.value_vocab=3: fewer than task.pairs=4")
    vt = PROBLEMS["variable_tracking"]
    (msg,) = check(vt, "decoder", 20, 60, Options(chains=3, hops=5, key_vocab=16))
    assert msg.startswith("task.key_vocab=16: fewer than the 18 variables") and "at least 18" in msg
    (msg,) = check(PROBLEMS["copy"], "decoder", 1, 8, Options(haystack="shakespeare"))
    assert msg.startswith("task.haystack=shakespeare: copy has no haystack")
    with pytest.raises(ValueError, match="must be at least 20"):
        instance(vt, 19, "k")


#: RULER's settings (Hsieh et al. 2024, its synthetic tasks): the answer's tokens and the
#: needles (key-value pairs; assignments for variable tracking) in each prompt.
RULER = {
    "niah_multikey": (1, 4),
    "niah_multivalue": (4, 4),
    "niah_multiquery": (4, 4),
    "variable_tracking": (5, 5),  # one chain: a value and 4 hops
}


@pytest.mark.parametrize("name", RETRIEVAL)
def test_gpu_presets_draw_rulers_instances_within_the_learned_table_they_name(
    name: str, tmp_path: Path
) -> None:
    """``experiment=algo_<name>_gpu``: RULER's needle counts and answers at its shortest
    length (4096), the filler of its haystack, and every test sequence within the
    ``encoder.max_len=4200`` its docs give ``learned``."""
    cfg = compose_config(tmp_path, "task=algo", f"experiment=algo_{name}_gpu")
    validate(cfg)
    t = typed(cfg).task
    p, o = PROBLEMS[name], t.options()
    assert t.problem == name and t.train_lengths == [256, 1024] and t.test_multiple == 4
    answers, needles = RULER[name]
    for i in range(3):
        prompt, answer = instance(p, 4096, f"g{i}", o)
        assert len(prompt) == 4096 and len(answer) == answers
        tracking = name == "variable_tracking"
        assert answer == (_read_tracking(prompt) if tracking else _read_niah(name, prompt))
        body, _ = _split(prompt)
        assert (body.count(":=") if tracking else len(_needles(body))) == needles
        filler = "".join(_filler(prompt)).replace(":=", "")
        assert (filler in shakespeare()) != tracking  # RULER's essays; noise for tracking
    assert t.longest(4096) <= 4200
