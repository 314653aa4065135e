"""Evaluation metrics against hand-computed values."""

import itertools
import math
import random
from collections import Counter

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


def brute_force_maj(answers, correct, k):
    """Maj@K by its definition: the vote of every K-subset (ties shared, the winner's verdict the share of its
    samples in the subset that are correct), averaged over the subsets."""
    values = []
    for subset in itertools.combinations(range(len(answers)), k):
        votes = Counter(answers[i] for i in subset if answers[i] is not None)
        top = max(votes.values(), default=0)
        tied = [answer for answer, count in votes.items() if count == top]
        verdicts = [[correct[i] for i in subset if answers[i] == answer] for answer in tied]
        values.append(sum(sum(v) / len(v) for v in verdicts) / len(tied) if tied else 0.0)
    return sum(values) / len(values)


def test_maj_at_k_by_hand():
    # "7" twice (correct), "8" once, one unparsable. K=2: the 6 pairs score 7,7 → 1; 7,8 → ½ (tie) twice; 7,None → 1
    # twice; 8,None → 0: 4/6.
    answers, correct = ["7", "7", "8", None], [True, True, False, False]
    assert maj_at_k(answers, correct, 2) == pytest.approx(4 / 6)
    assert maj_at_k(answers, correct, 1) == pytest.approx(0.5) == pass_at_k(4, 2, 1)
    assert maj_at_k(answers, correct, 4) == 1.0  # the vote of all four: 7 wins 2–1
    assert maj_at_k(["4", "3"], [False, True], 2) == 0.5  # a tie counts each tied answer half
    assert maj_at_k([None, None, "7"], [False, False, True], 2) == pytest.approx(2 / 3)  # no vote in 1 of 3 pairs
    # equivalent forms vote apart; an answer counts with its verdict: "1/2" (2 votes) beats "0.5" (1 vote)
    assert maj_at_k(["0.5", "1/2", "1/2"], [True, True, True], 3) == 1.0
    with pytest.raises(ValueError, match="1 ≤ K ≤ n"):
        maj_at_k(["1"], [True], 2)
    with pytest.raises(ValueError, match="verdicts"):
        maj_at_k(["1", "2"], [True], 1)


def test_maj_at_k_is_the_mean_vote_over_all_k_subsets_and_maj_at_1_is_pass_at_1():
    """Maj@K on the first K samples only (the former estimator) gave Maj@1 ≠ Pass@1 on the same samples."""
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        answers = [rng.choice(["a", "b", "c", None]) for _ in range(n)]
        correct = [answer is not None and rng.random() < 0.6 for answer in answers]  # correct ⇒ parsed
        assert maj_at_k(answers, correct, 1) == pytest.approx(pass_at_k(n, sum(correct), 1))
        for k in range(1, n + 1):
            assert maj_at_k(answers, correct, k) == pytest.approx(brute_force_maj(answers, correct, k), abs=1e-12)


def test_maj_at_k_is_exact_and_quick_at_the_research_scale():
    answers = [str(i % 7) if i % 5 else None for i in range(32)]  # "0"–"3" 4 votes each, "4"–"6" 3, 7 unparsable
    correct = [answer == "0" for answer in answers]
    values = [maj_at_k(answers, correct, k) for k in (1, 16, 32)]
    assert values[0] == pytest.approx(pass_at_k(32, sum(correct), 1))
    assert values[2] == pytest.approx(1 / 4)  # all 32: "0" ties with "1", "2" and "3"


def test_mean_token_entropy_by_hand():
    logits = torch.zeros(2, 3, 4)  # uniform over 4 tokens: log 4
    logits[1, :, 0] = 100.0  # the second sequence is (almost) certain: 0
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert mean_token_entropy(logits, mask) == pytest.approx((2 * math.log(4) + 0.0) / 3, abs=1e-6)
    logits[0, :, 3] = -math.inf  # a token masked out (suppress_tokens): 0·log 0 = 0, uniform over the other 3
    assert mean_token_entropy(logits, mask) == pytest.approx((2 * math.log(3) + 0.0) / 3, abs=1e-6)


def test_js_diversity_by_hand():
    same = torch.tensor([[1.0, 0.5], [1.0, 0.5], [0.5, 0.25]])  # proportional success: the same distribution
    assert js_diversity(same) == pytest.approx(0.0, abs=1e-12)
    assert js_diversity(torch.tensor([[1.0, 0.0], [0.0, 1.0]])) == pytest.approx(math.log(2))  # disjoint
    # q1 = (1, 0), q2 = (1/2, 1/2): H(mean) = H(3/4, 1/4), mean H = log 2 / 2
    expected = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)) - math.log(2) / 2
    assert js_diversity(torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.0, 0.0]])) == pytest.approx(expected)
    assert math.isnan(js_diversity(torch.tensor([[1.0, 0.0], [0.0, 0.0]])))  # one member with successes
