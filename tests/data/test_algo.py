"""Algorithmic problems: every answer recomputed in plain Python, sizes respected, the
same instances for the same key, the loss mask on exactly the answer, size buckets.
The problems where content decides the position are in tests/data/test_algo_content.py."""

from __future__ import annotations

import pytest
import torch

from posenc.data.algo import (
    BOS,
    EOS,
    PAD,
    PROBLEMS,
    SEP,
    AlgoDataModule,
    AlgoVocab,
    Options,
    buckets,
    collate_decoder,
    collate_encdec,
    collate_eval,
    instance,
    longest_sequence,
    size_batches,
)
from posenc.data.algo_problems import CHOMSKY, CONTENT, RETRIEVAL

CLASSIC = sorted(set(PROBLEMS) - {p.name for p in (*CONTENT, *RETRIEVAL, *CHOMSKY)})


def _reference(name: str, prompt: list[str], reverse_digits: bool) -> list[str]:
    """The answer, computed independently of the generators."""
    if name == "copy":
        return prompt
    if name == "reverse":
        return list(reversed(prompt))
    if name == "duplicate":
        return prompt * 2
    if name == "sort":
        return sorted(prompt)
    if name == "addition":
        i = prompt.index("+")
        a, b = "".join(prompt[:i]), "".join(prompt[i + 1 :])
        if reverse_digits:
            return list(str(int(a[::-1]) + int(b[::-1]))[::-1])
        return list(str(int(a) + int(b)))
    if name == "parity":
        return [str(sum(int(b) for b in prompt) % 2)]
    if name == "modarith":  # left to right, * first: a two-pass evaluation
        terms, signs, current = [], [], int(prompt[0])
        for op, digit in zip(prompt[1::2], prompt[2::2], strict=True):
            if op == "*":
                current *= int(digit)
            else:
                terms.append(current)
                signs.append(op)
                current = int(digit)
        values = [*terms, current]
        total = values[0]
        for sign, term in zip(signs, values[1:], strict=True):
            total = total + term if sign == "+" else total - term
        return [str(total % 5)]
    raise AssertionError(name)


def _size_of(name: str, prompt: list[str]) -> int:
    if name == "addition":
        return prompt.index("+")
    if name == "modarith":
        return (len(prompt) + 1) // 2
    return len(prompt)


@pytest.mark.parametrize(
    ("name", "reverse_digits"), [(n, False) for n in CLASSIC] + [("addition", True)]
)
def test_answers_sizes_and_alphabet(name: str, reverse_digits: bool) -> None:
    problem = PROBLEMS[name]
    vocab = AlgoVocab(problem, Options(symbols=7))
    for n in (1, 2, 3, 9, 40):
        for i in range(25):
            prompt, answer = instance(problem, n, f"k{i}", symbols=7, reverse_digits=reverse_digits)
            assert answer == _reference(name, prompt, reverse_digits), (prompt, answer)
            assert _size_of(name, prompt) == n
            p_len, a_max = problem.lengths(n, Options())
            assert len(prompt) == p_len and 1 <= len(answer) <= a_max
            vocab.encode(prompt + answer)  # every symbol is in the vocabulary
            if problem.letters:
                assert set(prompt) <= set("abcdefg")


def test_addition_digits_are_uniform_n_digit_numbers() -> None:
    p = PROBLEMS["addition"]
    firsts = {instance(p, 3, f"k{i}")[0][0] for i in range(300)}
    assert firsts == set("123456789")  # no leading zero, every leading digit drawn
    assert {instance(p, 1, f"k{i}")[0][0] for i in range(300)} == set("0123456789")


def test_modarith_uses_precedence_and_a_non_negative_remainder() -> None:
    # 2 - 3 * 4 = -10 -> 0 (mod 5); 1 - 4 = -3 -> 2; left to right would give (2-3)*4 = -4 -> 1
    assert _reference("modarith", list("2-3*4"), False) == ["0"]
    for i in range(200):  # the generator agrees with the reference on these cases too
        prompt, answer = instance(PROBLEMS["modarith"], 4, f"m{i}")
        assert answer == [str(eval("".join(prompt)) % 5)]


def test_instances_are_a_function_of_the_key() -> None:
    p = PROBLEMS["sort"]
    assert instance(p, 10, "a") == instance(p, 10, "a")
    assert len({tuple(instance(p, 10, f"x{i}")[0]) for i in range(50)}) == 50


def test_too_small_a_size_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        instance(PROBLEMS["copy"], 0, "k")


def test_decoder_loss_mask_covers_exactly_the_answer_and_eos() -> None:
    examples = [([7, 8, 9], [9, 8, 7], 3), ([5], [5, 5], 1)]
    b = collate_decoder(examples)
    seq0 = [BOS, 7, 8, 9, SEP, 9, 8, 7, EOS]
    assert b["input"][0].tolist() == seq0[:-1]
    assert b["target"][0].tolist() == seq0[1:]
    assert b["target"][0][b["loss_mask"][0]].tolist() == [9, 8, 7, EOS]
    assert b["input"][1].tolist() == [BOS, 5, SEP, 5, 5, PAD, PAD, PAD]
    assert b["target"][1][b["loss_mask"][1]].tolist() == [5, 5, EOS]
    assert b["loss_mask"].sum().item() == 7  # padding and the prompt are never scored
    assert torch.equal(b["score_mask"], b["loss_mask"])  # what is trained is what is scored
    assert b["size"].tolist() == [3, 1]


def test_encdec_and_eval_batches() -> None:
    b = collate_encdec([([7, 8], [8, 7], 2), ([6], [6], 1)])
    assert b["src"].tolist() == [[7, 8], [6, PAD]]
    assert b["tgt_in"].tolist() == [[BOS, 8, 7], [BOS, 6, PAD]]
    assert b["tgt_out"][b["tgt_mask"]].tolist() == [8, 7, EOS, 6, EOS]
    assert torch.equal(b["score_mask"], b["tgt_mask"])
    assert b["size"].tolist() == [2, 1]
    e = collate_eval([([7, 8], [1, 2, 3], 2), ([6, 6], [4], 2)])
    assert e["prompt"].tolist() == [[BOS, 7, 8, SEP], [BOS, 6, 6, SEP]]
    assert e["prompt_pad"].tolist() == [0, 0] and e["src_mask"].all()
    assert e["answer"].tolist() == [[1, 2, 3], [4, PAD, PAD]]
    assert e["answer_len"].tolist() == [3, 1]


def test_eval_batches_of_prompts_of_different_lengths() -> None:
    """Counting's prompts vary in length within a size: decoder prompts are left-padded
    (so every answer starts at the same column), sources right-padded and masked."""
    e = collate_eval([([7, 8, 9], [1], 4), ([6], [4, 5], 4)])
    assert e["prompt"].tolist() == [[BOS, 7, 8, 9, SEP], [PAD, PAD, BOS, 6, SEP]]
    assert e["prompt_pad"].tolist() == [0, 2]
    assert e["src"].tolist() == [[7, 8, 9], [6, PAD, PAD]]
    assert e["src_mask"].tolist() == [[True] * 3, [True, False, False]]
    assert e["answer"].tolist() == [[1, PAD], [4, 5]]


def test_buckets() -> None:
    assert buckets(1, 16, 48, 8) == [(1, 16), (17, 24), (25, 32), (33, 40), (41, 48)]
    assert buckets(2, 10, 25, 10) == [(2, 10), (11, 20), (21, 25)]
    assert buckets(1, 10, 10, 5) == [(1, 10)]


def test_size_batches_hold_one_size_each() -> None:
    sizes = [3, 1, 3, 3, 1, 2]
    batches = size_batches(sizes, 2)
    assert sorted(i for b in batches for i in b) == list(range(6))
    assert all(len({sizes[i] for i in b}) == 1 and len(b) <= 2 for b in batches)


def test_longest_sequence_matches_real_instances() -> None:
    # size 6 valid for every problem
    options = Options(data_tokens=3, pairs=2, queries=1, chains=1, hops=0)
    for name, p in PROBLEMS.items():
        for shape in p.shapes:
            worst = 0
            for i in range(200):
                prompt, answer = instance(p, 6, f"w{i}", options)
                worst = max(
                    worst,
                    len(prompt) + 1  # tagged: BOS tokens
                    if p.tagged
                    else len(prompt) + len(answer) + 3
                    if shape == "decoder"
                    else max(len(prompt), len(answer) + 1),
                )
            assert longest_sequence(p, 6, shape, options) >= worst, (name, shape)
            # their answer or prompt lengths vary
            varying = ("addition", "count", "binary_addition", "binary_multiplication")
            if name not in (*varying, "stack_manipulation"):
                assert longest_sequence(p, 6, shape, options) == worst


def test_datamodule_streams() -> None:
    def dm(seed: int) -> AlgoDataModule:
        return AlgoDataModule(
            problem="reverse",
            shape="decoder",
            train_lengths=[2, 5],
            top=12,
            options=Options(symbols=5),
            batch_size=8,
            eval_batch_size=16,
            steps=20,
            val_per_size=3,
            test_per_size=4,
            seed=seed,
        )

    a, b = dm(0), dm(1)
    first = next(iter(a.train_dataloader()))
    assert torch.equal(first["input"], next(iter(dm(0).train_dataloader()))["input"])
    assert not torch.equal(first["input"][:, :4], next(iter(b.train_dataloader()))["input"][:, :4])
    sizes = torch.cat([x["size"] for _, x in zip(range(10), a.train_dataloader(), strict=False)])
    assert sizes.min() >= 2 and sizes.max() <= 5 and len(set(sizes.tolist())) == 4
    # The test set: 4 instances of every size 1..12, the same whatever the seed.
    test_a = list(a.test_dataloader())
    test_b = list(b.test_dataloader())
    assert sorted(torch.cat([x["size"] for x in test_a]).tolist()) == sorted(
        [n for n in range(1, 13) for _ in range(4)]
    )
    assert all(torch.equal(x["prompt"], y["prompt"]) for x, y in zip(test_a, test_b, strict=True))
    val_sizes = torch.cat([x["size"] for x in a.val_dataloader()])
    assert sorted(set(val_sizes.tolist())) == [2, 3, 4, 5]
