"""The problems where content decides the position (flip-flop, selective copy, counting,
state tracking over S3 and A5): every label and answer recomputed here by plain Python
written apart from the generators, their splits, sizes, loss masks and test grids."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from posenc.data.algo import (
    BOS,
    PAD,
    PROBLEMS,
    AlgoDataModule,
    AlgoVocab,
    Options,
    collate_decoder,
    collate_encdec,
    collate_eval,
    collate_tagged,
    evaluation_set,
    instance,
    size_batches,
)
from posenc.data.algo_content import COUNT_MAX, GROUPS, NOISE
from posenc.data.algo_problems import check, grid_sizes, size_buckets

# ---------------------------------------------------------------------------- flip-flop


def _flipflop_reads(tokens: list[str]) -> list[str | None]:
    """The label of every token: after ``r``, the bit of the last ``w`` (a register
    simulated pair by pair)."""
    register, out = None, []
    for op, bit in zip(tokens[::2], tokens[1::2], strict=True):
        if op == "w":
            register = bit
        out += [register if op == "r" else None, None]
    return out


@pytest.mark.parametrize("variant", ["", "sparse", "dense"])
def test_flipflop_strings_and_read_labels(variant: str) -> None:
    p = PROBLEMS["flipflop"]
    for n in (4, 6, 16, 64):
        for i in range(40):
            tokens, labels = instance(p, n, f"k{i}", variant=variant)
            assert len(tokens) == len(labels) == n
            assert all(op in "wri" for op in tokens[::2]) and all(b in "01" for b in tokens[1::2])
            assert tokens[0] == "w" and tokens[-2] == "r"  # write first, read last
            assert labels == _flipflop_reads(tokens)
            # the label of a read is the token after it (what a language model predicts)
            assert all(lab is None or lab == tokens[t + 1] for t, lab in enumerate(labels))


def test_flipflop_splits_draw_the_papers_ignore_rates() -> None:
    """Ignore rates of the middle instructions: 0.8 (training and in-distribution test),
    0.98 (sparse), 0.1 (dense); writes and reads share the rest equally."""
    p = PROBLEMS["flipflop"]
    for variant, rate in (("", 0.8), ("sparse", 0.98), ("dense", 0.1)):
        ops = [
            op
            for i in range(400)
            for op in instance(p, 64, f"r{i}", variant=variant)[0][2:-2:2]  # middle pairs
        ]
        share = {op: ops.count(op) / len(ops) for op in "wri"}
        assert share["i"] == pytest.approx(rate, abs=0.015), (variant, share)
        assert share["w"] == pytest.approx((1 - rate) / 2, abs=0.015)
        assert share["r"] == pytest.approx((1 - rate) / 2, abs=0.015)
    # the variants are other streams: the same key gives other strings
    assert instance(p, 64, "k", variant="sparse") != instance(p, 64, "k")
    with pytest.raises(ValueError, match="no variant 'medium'"):
        instance(p, 8, "k", variant="medium")
    with pytest.raises(ValueError, match="multiple of 2"):
        instance(p, 7, "k")


# ----------------------------------------------------------------------- selective copy


def test_selective_copy_answers_are_the_data_tokens_in_order() -> None:
    p = PROBLEMS["selective_copy"]
    for n in (4, 5, 12, 50):
        places = set()
        for i in range(50):
            prompt, answer = instance(p, n, f"k{i}", symbols=6, data_tokens=4)
            assert len(prompt) == n and len(answer) == 4
            assert answer == [x for x in prompt if x != NOISE]
            assert set(answer) <= set("abcdef")
            places |= {j for j, x in enumerate(prompt) if x != NOISE}
        assert places == set(range(n)) or n == 50  # data lands anywhere
    with pytest.raises(ValueError, match="at least 4"):
        instance(p, 3, "k", data_tokens=4)


# ---------------------------------------------------------------------------- counting


def _run_count(prompt: list[str]) -> tuple[int, list[str]]:
    """Interpret a counting prompt: returns the statements' count and the answer."""
    values: dict[str, int] = {}
    statements, i = 0, 0
    while prompt[i] != "print":
        statements += 1
        if prompt[i] == "pass;":
            i += 1
        elif prompt[i + 1] == "=":
            assert prompt[i + 2 : i + 4] == ["0", ";"]
            values[prompt[i]] = 0
            i += 4
        else:
            assert prompt[i + 1] == "++;"
            values[prompt[i]] += 1  # a KeyError would be an increment of an unset variable
            assert values[prompt[i]] <= COUNT_MAX
            i += 2
    assert i == len(prompt) - 2
    return statements, [str(values[prompt[-1]])]


def test_count_answers_by_interpreting_the_program() -> None:
    p = PROBLEMS["count"]
    vocab = AlgoVocab(p, Options(symbols=3))
    answers = set()
    for n in (1, 3, 20, 64, 128, 256):
        for i in range(60):
            prompt, answer = instance(p, n, f"k{i}", symbols=3)
            statements, reference = _run_count(prompt)
            assert statements == n and answer == reference
            assert set(prompt[:-2]) <= {"a", "b", "c", "=", "0", ";", "pass;", "++;"}
            vocab.encode(prompt + answer)
            answers.add(int(answer[0]))
    assert answers == set(range(COUNT_MAX + 1))  # every value occurs, up to the cap


def test_count_draws_statements_at_the_authors_rates() -> None:
    """Weights 1 : 50 : 7 for set, pass and increment (RAM count_data_gen.py); increments
    that cannot happen are redrawn, so they fall a little below 7/58."""
    words = [w for i in range(100) for w in instance(PROBLEMS["count"], 200, f"s{i}")[0]]
    sets, passes, incs = words.count("="), words.count("pass;"), words.count("++;")
    total = sets + passes + incs
    assert sets / total == pytest.approx(1 / 58, abs=0.004)
    assert 0.08 < incs / total <= 7 / 58 + 0.005


# ------------------------------------------------------------------------ state tracking


def _matrix(perm: str) -> list[list[int]]:
    """The permutation matrix with a 1 at (i, perm(i))."""
    n = len(perm)
    return [[int(int(perm[i]) == j) for j in range(n)] for i in range(n)]


def _matmul(a: list[list[int]], b: list[list[int]]) -> list[list[int]]:
    return [[sum(row[k] * b[k][j] for k in range(len(b))) for j in range(len(b[0]))] for row in a]


def _perm(m: list[list[int]]) -> str:
    return "".join(str(row.index(1)) for row in m)


def _sign(perm: str) -> int:
    """+1 for an even permutation: (-1) ** (points - cycles), from the cycles."""
    seen, cycles = set(), 0
    for start in range(len(perm)):
        if start not in seen:
            cycles += 1
            x = start
            while x not in seen:
                seen.add(x)
                x = int(perm[x])
    return (-1) ** (len(perm) - cycles)


def test_groups_are_s3_and_a5() -> None:
    s3, a5 = GROUPS["s3"], GROUPS["a5"]
    assert sorted(s3) == sorted("".join(p) for p in itertools.permutations("012"))
    assert len(set(a5)) == 60 and all(_sign(g) == 1 for g in a5)
    assert len([p for p in itertools.permutations("01234") if _sign("".join(p)) == 1]) == 60
    for group in (s3, a5):  # closed under composition
        assert {_perm(_matmul(_matrix(g), _matrix(h))) for g in group for h in group} == set(group)


@pytest.mark.parametrize("name", ["state_s3", "state_a5"])
def test_state_labels_are_the_running_products(name: str) -> None:
    """The label at t is the product of the first t elements, applied in order: as
    permutation matrices M(g_1) M(g_2) ... M(g_t) (row i has its 1 at g_t(...g_1(i)))."""
    p = PROBLEMS[name]
    group = GROUPS[name.removeprefix("state_")]
    vocab = AlgoVocab(p, Options(symbols=16))
    for n in (1, 2, 7, 33):
        for i in range(20):
            tokens, labels = instance(p, n, f"k{i}")
            assert len(tokens) == len(labels) == n and set(tokens) <= set(group)
            m = _matrix(group[0])
            assert _perm(m) == "".join(map(str, range(len(group[0]))))  # the identity
            for t, g in enumerate(tokens):
                m = _matmul(m, _matrix(g))
                assert labels[t] == _perm(m), (t, tokens[: t + 1])
            vocab.encode(tokens + labels)
    # two elements by hand (S3): 0->1->2 then swap 0,1: 0 goes to 1 then 0... (120 then 102)
    assert _perm(_matmul(_matrix("120"), _matrix("102"))) == "021"


def test_state_problems_are_non_commutative_words() -> None:
    """The order matters (so a model cannot just count elements): swapping the first two
    elements changes the final state for some instances."""
    p = PROBLEMS["state_s3"]
    changed = 0
    for i in range(50):
        tokens, labels = instance(p, 5, f"c{i}")
        swapped = [tokens[1], tokens[0], *tokens[2:]]
        m = _matrix(GROUPS["s3"][0])
        for g in swapped:
            m = _matmul(m, _matrix(g))
        changed += _perm(m) != labels[-1]
    assert changed > 10


# ---------------------------------------------------------------------- batches, masks


def test_tagged_loss_masks_by_hand() -> None:
    """Flip-flop: every next token is trained (the paper's language-model loss), only the
    read bits are scored; state tracking: every label trained and scored; the BOS and the
    padding never."""
    vocab = AlgoVocab(PROBLEMS["flipflop"], Options(symbols=16))
    w, r, i, zero, one = (vocab.ids[s] for s in "wri01")
    tokens = [w, one, i, zero, r, one]  # "w 1 i 0 r 1"
    labels = [PAD, PAD, PAD, PAD, one, PAD]
    short = [w, zero, r, zero]
    b = collate_tagged([(tokens, labels, 6), (short, [PAD, PAD, zero, PAD], 4)], lm_loss=True)
    assert b["input"].tolist() == [[BOS, *tokens], [BOS, *short, PAD, PAD]]
    assert b["target"][0].tolist() == [w, one, i, zero, r, one, PAD]  # the next tokens
    assert b["loss_mask"][0].tolist() == [True] * 6 + [False]
    assert b["score_mask"][0].tolist() == [False] * 5 + [True, False]  # after "r": the bit
    assert b["target"][0][b["score_mask"][0]].tolist() == [one]
    assert b["loss_mask"][1].tolist() == [True] * 4 + [False] * 3
    assert b["target"][1][b["score_mask"][1]].tolist() == [zero]
    # state tracking: the label of token t is the target at input position t + 1
    s = collate_tagged([([7, 8, 9], [10, 11, 12], 3)], lm_loss=False)
    assert s["input"].tolist() == [[BOS, 7, 8, 9]]
    assert s["target"].tolist() == [[PAD, 10, 11, 12]]
    assert s["loss_mask"].tolist() == s["score_mask"].tolist() == [[False, True, True, True]]


def test_every_problem_batches_in_its_shapes() -> None:
    # sizes 6 and 8 valid for every problem
    options = Options(symbols=5, data_tokens=3, pairs=2, queries=1, chains=1, hops=0)
    for name, p in PROBLEMS.items():
        vocab = AlgoVocab(p, options)
        examples = []
        for i, n in enumerate((6, 8)):
            x, y = instance(p, n, f"b{i}", options)
            examples.append((vocab.encode(x), vocab.encode(y), n))
        if p.tagged:
            assert p.shapes == ("decoder",)
            b = collate_tagged(examples, lm_loss=p.lm)
            assert b["score_mask"].any(-1).all(), name  # every instance has a label
        else:
            assert p.shapes == ("decoder", "encdec")
            for collate in (collate_decoder, collate_encdec, collate_eval):
                collate(examples)


def test_test_grids_and_buckets() -> None:
    p, o = PROBLEMS["flipflop"], Options()
    assert grid_sizes(p, 32, 32, 256, "doubling", o) == [32, 64, 128, 256]
    assert grid_sizes(p, 32, 32, 200, "doubling", o) == [32, 64, 128]
    assert size_buckets(p, 32, 32, 256, "doubling", 4, o) == [
        (32, 32),
        (64, 64),
        (128, 128),
        (256, 256),
    ]
    assert grid_sizes(p, 4, 8, 12, "every", o) == [4, 6, 8, 10, 12]  # even sizes only
    sc = PROBLEMS["selective_copy"]
    assert grid_sizes(sc, 4, 8, 12, "every", Options(data_tokens=4))[0] == 4
    assert size_buckets(sc, 1, 8, 16, "every", 4, Options(data_tokens=4)) == [
        (4, 8),
        (9, 12),
        (13, 16),
    ]


def test_size_rules_are_config_errors_naming_the_fix() -> None:
    ff, o = PROBLEMS["flipflop"], Options()
    assert check(ff, "decoder", 32, 32, o) == []
    assert check(ff, "decoder", 31, 33, o) == []  # trains at 32, the one valid size
    (msg,) = check(ff, "decoder", 1, 3, o)
    assert msg.startswith("task.train_lengths=[1, 3]: holds no valid size of flipflop")
    assert "multiple of 2" in msg and "task.train_lengths=[4,4]" in msg
    (msg,) = check(ff, "encdec", 32, 32, o)
    assert msg.startswith("task.shape=encdec: flipflop") and "decoder-only" in msg
    assert check(PROBLEMS["state_a5"], "encdec", 1, 8, o)
    (msg,) = check(PROBLEMS["count"], "decoder", 1, 8, o, lm_loss=True)
    assert msg.startswith("task.lm_loss=true: count has no language-model loss (only flipflop")
    assert check(ff, "decoder", 32, 32, o, lm_loss=True) == []
    assert check(PROBLEMS["selective_copy"], "decoder", 1, 3, Options(data_tokens=4))
    assert check(PROBLEMS["selective_copy"], "decoder", 1, 4, Options(data_tokens=4)) == []


@pytest.mark.parametrize("lm_loss", [False, True])
def test_flipflop_datamodule_trains_at_one_length_and_tests_three_splits(lm_loss: bool) -> None:
    dm = AlgoDataModule(
        problem="flipflop",
        shape="decoder",
        train_lengths=[16, 16],
        top=64,
        options=Options(),
        batch_size=4,
        eval_batch_size=8,
        steps=3,
        val_per_size=5,
        test_per_size=3,
        seed=0,
        lm_loss=lm_loss,
    )
    assert dm.grid == "doubling" and dm.test_sizes() == [16, 32, 64]
    train = next(iter(dm.train_dataloader()))
    assert train["input"].shape == (4, 17) and (train["size"] == 16).all()
    reads = train["input"] == dm.vocab.ids["r"]
    assert torch.equal(train["score_mask"], reads)  # the read bits, scored
    # trained: the read bits only, or every next token (the language-model loss)
    assert torch.equal(train["loss_mask"], reads if not lm_loss else train["target"] != PAD)
    assert train["loss_mask"][:, :16].all() == lm_loss
    val = list(dm.val_dataloader())
    assert sum(len(b["size"]) for b in val) == 5
    test = list(dm.test_dataloader())
    seen = {(int(b["variant"][0]), int(b["size"][0])) for b in test}
    assert seen == {(v, n) for v in range(3) for n in (16, 32, 64)}
    for b in test:  # one variant and size per batch, scored at the reads only
        assert len(set(b["variant"].tolist())) == 1 and len(set(b["size"].tolist())) == 1
        reads = b["input"] == dm.vocab.ids["r"]
        assert torch.equal(b["score_mask"], reads & (b["target"] != PAD))


def test_size_batches_group_by_variant_then_size() -> None:
    sizes = [2, 1, 2, 1]
    variants = ["a", "a", "b", "b"]
    assert size_batches(sizes, 4, variants) == [[1], [0], [3], [2]]
    assert size_batches(sizes, 4) == [[1, 3], [0, 2]]


def test_content_instances_are_a_function_of_the_key() -> None:
    o = Options(data_tokens=4, pairs=2, queries=2)
    for name in ("flipflop", "selective_copy", "count", "state_s3", "state_a5", "mqar"):
        p = PROBLEMS[name]
        assert instance(p, 12, "a", o) == instance(p, 12, "a", o)
        distinct = {str(instance(p, 12, f"x{i}", o)) for i in range(30)}
        assert len(distinct) > 20, name
    # generators use only the instance's own random stream
    state = random.getstate()
    instance(PROBLEMS["count"], 50, "g")
    assert random.getstate() == state


# ------------------------------------------------------------ multi-query associative recall
MQAR = Options(pairs=3, queries=2, key_vocab=5, value_vocab=4)


def test_mqar_labels_are_the_values_of_the_queried_keys() -> None:
    """Recomputed from the tokens alone: a table of the pairs, then each labelled token
    looked up in it; the queries stand at even offsets past the pairs, one per key."""
    p = PROBLEMS["mqar"]
    vocab = AlgoVocab(p, MQAR)
    assert vocab.tokens[4:] == [*(f"k{i}" for i in range(5)), *(f"v{i}" for i in range(4))]
    for n in (10, 12, 30):
        for i in range(50):
            tokens, labels = instance(p, n, f"q{i}", MQAR)
            assert len(tokens) == len(labels) == n
            keys, values = tokens[0:6:2], tokens[1:6:2]
            assert len(set(keys)) == 3 and all(k.startswith("k") for k in keys)
            assert len(set(values)) == 3 and all(v.startswith("v") for v in values)
            table = dict(zip(keys, values, strict=True))
            asked = [t for t, label in enumerate(labels) if label is not None]
            assert len(asked) == 2 and all(t >= 6 and (t - 6) % 2 == 0 for t in asked)
            assert len({tokens[t] for t in asked}) == 2  # different keys
            assert [labels[t] for t in asked] == [table[tokens[t]] for t in asked]
            vocab.encode(tokens)


def test_mqar_queries_follow_the_power_law_and_noise_fills_the_rest() -> None:
    """Zoology's gaps: slot i weighs i^-0.99, so about 69% of the queries fall in the first
    quarter of 50 slots (uniform: 25%); the other tokens are keys and values alike."""
    p, o = PROBLEMS["mqar"], Options(pairs=3, queries=1, key_vocab=8, value_vocab=8)
    early, noise = 0, set()
    for i in range(400):
        tokens, labels = instance(p, 106, f"w{i}", o)
        (t,) = [t for t, label in enumerate(labels) if label is not None]
        early += (t - 6) // 2 < 13
        noise |= {tok for j, tok in enumerate(tokens[6:], 6) if j != t}
    assert 0.6 < early / 400 < 0.8
    assert noise == {*(f"k{i}" for i in range(8)), *(f"v{i}" for i in range(8))}


def test_mqar_sizes_and_options_are_config_errors_naming_the_fix() -> None:
    p = PROBLEMS["mqar"]
    assert check(p, "decoder", 16, 32, Options()) == []
    (msg,) = check(p, "decoder", 1, 15, Options())  # 4 pairs and 4 queries take 16
    assert "holds no valid size of mqar" in msg and "task.train_lengths=[16,16]" in msg
    msgs = check(p, "decoder", 16, 32, Options(queries=5, key_vocab=3))
    assert "task.queries=5: more than task.pairs=4" in msgs[0] and "at most 4" in msgs[0]
    assert msgs[1].startswith("task.key_vocab=3: fewer than task.pairs=4")
    # more pairs than keys: the vocabularies are named, not an impossible length
    msgs = check(p, "decoder", 16, 32, Options(pairs=100, queries=4))
    assert len(msgs) == 2 and all("fewer than task.pairs=100" in m for m in msgs), msgs
    with pytest.raises(ValueError, match="must be at least 16 and a multiple of 2"):
        instance(p, 14, "k")


def test_mqar_test_variants_hold_their_number_of_pairs_where_it_fits() -> None:
    """The variants have half, twice and four times ``task.pairs`` pairs (as many queries
    as fit); a size too short for a variant's pairs, or more pairs than keys, is left out
    of its test set, never failed."""
    p, o = PROBLEMS["mqar"], Options(pairs=4, queries=2, key_vocab=8, value_vocab=8)
    assert p.variants == ("", "pairs_half", "pairs_x2", "pairs_x4")
    for variant, pairs in (("", 4), ("pairs_half", 2), ("pairs_x2", 8)):
        tokens, labels = instance(p, 40, "t", o, variant=variant)
        keys = tokens[0 : 2 * pairs : 2]
        assert len(set(keys)) == pairs and all(k.startswith("k") for k in keys)
        assert sum(label is not None for label in labels) == 2
    assert instance(p, 40, "t", o) != instance(p, 40, "t", o, variant="pairs_x2")
    vocab = AlgoVocab(p, o)
    data = evaluation_set(p, vocab, "test", [12, 20], 3, p.variants, options=o)
    held = sorted({(v, n) for v, n in zip(data.variants, data.sizes, strict=True)})
    # 8 pairs and 2 queries take 20 tokens; 16 pairs exceed the 8 keys: no instance
    assert held == [("", 12), ("", 20), ("pairs_half", 12), ("pairs_half", 20), ("pairs_x2", 20)]
    assert len(data) == 5 * 3
