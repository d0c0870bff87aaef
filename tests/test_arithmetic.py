"""benchmarks/arithmetic.py: the verifiable reward, the held-out split and the Wilson interval."""

import pytest

from benchmarks import arithmetic


def test_reward_reads_the_last_number_of_strings_and_messages():
    completions = ["3 + 4 = 7", [{"role": "assistant", "content": "It is 12, not 7."}], "no number", "-2.0"]
    assert arithmetic.correct(completions, answer=[7, 7, 1, "-2"]) == [1.0, 1.0, 0.0, 1.0]


def test_splits_are_disjoint_and_seeded():
    train, test = arithmetic.make_splits(n_test=50, seed=0)
    assert len(test) == 50 and {str(r["prompt"]) for r in test}.isdisjoint(str(r["prompt"]) for r in train)
    assert arithmetic.make_splits(n_test=50, seed=0) == (train, test)


def test_wilson_interval_against_hand_values():
    # 54 of 200, worked by hand: center (0.27 + 1.96^2/400) / (1 + 1.96^2/200) = 0.27434, half-width 0.06110
    low, high = arithmetic.wilson(54, 200)
    assert (low, high) == pytest.approx((0.2131, 0.3353), abs=5e-4)
    assert arithmetic.wilson(0, 10)[0] == 0.0 and arithmetic.wilson(10, 10)[1] == pytest.approx(1.0)


def test_mixed_splits_hold_out_each_operation_a_third_and_their_worked_answers_are_right():
    train, test = arithmetic.make_mixed_splits(n_test=300, seed=0)
    assert {str(r["prompt"]) for r in test}.isdisjoint(str(r["prompt"]) for r in train)
    assert [sum(op in r["solution"].split("=")[0] for r in test) for op in "+-*"] == [100, 100, 100]
    rows = train + test
    assert arithmetic.correct([r["solution"] for r in rows], [r["answer"] for r in rows]) == [1.0] * len(rows)
    assert arithmetic.make_mixed_splits(n_test=300, seed=0) == (train, test)
