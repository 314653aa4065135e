"""Evaluation metrics against hand-computed values."""

import math

import pytest
import torch

from trl_es.evaluation.metrics import js_diversity, maj_at_k, mean_token_entropy, pass_at_k


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 2, 1) == pytest.approx(0.5)  # c/n
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)  # 1 − C(2,2)/C(4,2)
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - math.comb(7, 5) / math.comb(10, 5))
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 3, 2) == 1.0  # n − c < k: every k-subset has a success
    with pytest.raises(ValueError, match="1 ≤ K ≤ n"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="correct samples"):
        pass_at_k(4, 5, 1)


def test_maj_at_k_by_hand():
    assert maj_at_k(["3", "4", "3", None], [True, False, True, False], 4) == 1.0
    assert maj_at_k(["4", "3", "3", "3"], [False, True, True, True], 2) == 0.0  # a tie: the earlier answer wins
    assert maj_at_k([None, None, "7"], [False, False, True], 2) == 0.0  # nothing parsed among the first 2: wrong
    assert maj_at_k([None, "5", "5"], [False, True, True], 3) == 1.0
    # equivalent forms vote apart; the winner's verdict decides: "1/2" (2 votes) beats "0.5" (1 vote)
    assert maj_at_k(["0.5", "1/2", "1/2"], [True, True, True], 3) == 1.0
    with pytest.raises(ValueError, match="1 ≤ K ≤ n"):
        maj_at_k(["1"], [True], 2)
    with pytest.raises(ValueError, match="verdicts"):
        maj_at_k(["1", "2"], [True], 1)


def test_mean_token_entropy_by_hand():
    logits = torch.zeros(2, 3, 4)  # uniform over 4 tokens: log 4
    logits[1, :, 0] = 100.0  # the second sequence is (almost) certain: 0
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert mean_token_entropy(logits, mask) == pytest.approx((2 * math.log(4) + 0.0) / 3, abs=1e-6)


def test_js_diversity_by_hand():
    same = torch.tensor([[1.0, 0.5], [1.0, 0.5], [0.5, 0.25]])  # proportional success: the same distribution
    assert js_diversity(same) == pytest.approx(0.0, abs=1e-12)
    assert js_diversity(torch.tensor([[1.0, 0.0], [0.0, 1.0]])) == pytest.approx(math.log(2))  # disjoint
    # q1 = (1, 0), q2 = (1/2, 1/2): H(mean) = H(3/4, 1/4), mean H = log 2 / 2
    expected = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)) - math.log(2) / 2
    assert js_diversity(torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.0, 0.0]])) == pytest.approx(expected)
    assert math.isnan(js_diversity(torch.tensor([[1.0, 0.0], [0.0, 0.0]])))  # one member with successes
