"""The research's evaluation metrics, as plain functions: Pass@K, Maj@K, token entropy, population diversity.

- `pass_at_k`: the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code"),
  1 − C(n−c, k)/C(n, k) for n samples of which c are correct, computed as a stable product (defined in
  `trl_es.es.fitness`, where the Pass@k fitness uses it too).
- `maj_at_k`: the unbiased Maj@K, as Pass@K is unbiased: the majority vote's correctness averaged over all C(n, K)
  subsets of K of the n samples, computed exactly (the subsets' vote counts are enumerated combinatorially, class by
  class, not sampled). In a subset, the extracted answers vote (unparsable ones, None, do not; no vote at all is
  wrong); a tie between answers counts each tied answer with weight 1/(answers tied), a uniformly random tie-break
  in expectation; an answer counts as correct with the share of its samples the verifier accepts. Answers are one
  vote when the task holds them equivalent (`vote_classes`: math-verify's equivalence for math, not the text).
  Maj@1 is the share of samples that are correct and parsed: Pass@1 whenever every correct sample has a parsed
  answer, as with every built-in task; Maj@n is the vote of all n.
- `mean_token_entropy`: mean over generated tokens of H(π(·|x_<t)) = −Σ_v p_v log p_v (nats); its collapse is what
  GRPO shows and ES does not.
- `js_diversity`: verifier-projected Jensen–Shannon diversity of an ES population. Member m's success rates on the
  step's prompts (share of its completions the verifier accepts) are normalized into a distribution q_m over the
  prompts; the diversity is the generalized JS divergence H(mean_m q_m) − mean_m H(q_m) (nats, in [0, log M]):
  0 when every member succeeds on the same prompts in the same proportions, log M when members succeed on
  disjoint prompts. Members without any success carry no distribution and are left out.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from fractions import Fraction
from functools import lru_cache

import torch

from ..es.fitness import pass_at_k  # noqa: F401  (part of this module's metrics)
from ..generation.transformers_backend import token_entropy


def maj_at_k(answers: list, correct: list[bool], k: int) -> float:
    """Unbiased Maj@K: the mean over all C(n, K) subsets of K of the n samples of the majority vote's correctness
    (`correct[i]` is the verifier's verdict on sample i; None answers do not vote; ties shared equally)."""
    if len(answers) != len(correct):
        raise ValueError(f"{len(answers)} answers but {len(correct)} verdicts")
    if not 1 <= k <= len(answers):
        raise ValueError(f"Maj@{k} needs 1 ≤ K ≤ n samples per problem, got n={len(answers)}")
    classes: dict = {}
    for answer, verdict in zip(answers, correct, strict=True):
        if answer is not None:
            count, right = classes.get(answer, (0, 0))
            classes[answer] = (count + 1, right + bool(verdict))
    profile = tuple(sorted(Counter(count for count, _ in classes.values()).items()))
    unparsed = len(answers) - sum(count for count, _ in classes.values())
    value = Fraction(0)
    for count, right in classes.values():
        value += Fraction(right, count) * _win_share(count, profile, unparsed, k)
    return float(value)


def vote_classes(answers: list, same_answer: Callable[[str, str], bool]) -> list:
    """Each answer replaced by the first one before it that `same_answer` holds equal to it (None stays None): the
    votes of Maj@K by the task's equivalence, not by text."""
    classes: list = []  # the first answer of each class
    votes = []
    for answer in answers:
        if answer is not None:
            answer = next((first for first in classes if same_answer(first, answer)), answer)
            if answer not in classes:
                classes.append(answer)
        votes.append(answer)
    return votes


@lru_cache(maxsize=4096)
def _win_share(m: int, profile: tuple, unparsed: int, k: int) -> Fraction:
    """Σ_t C(m, t) Σ_j W_t(K − t, j) / (j + 1) / C(n, K): the chance over K-subsets that one answer class of m samples
    draws the most votes (t), shared with the j other classes tied with it. W_t(s, j) counts the ways the other
    classes (`profile`: (samples, classes) pairs, this class included) and the `unparsed` samples fill s places with
    each other class drawing at most t votes, j of them exactly t."""
    others = Counter(dict(profile))
    others[m] -= 1
    n = unparsed + sum(size * number for size, number in profile)
    share = Fraction(0)
    for t in range(1, min(m, k) + 1):  # the class draws t votes; every other class at most t, j of them exactly t
        rest = k - t
        free = unparsed + sum(size * number for size, number in others.items() if size < t)
        ways = [[math.comb(free, s)] for s in range(rest + 1)]  # ways[s][j]: s samples drawn, j classes tied
        for size, number in others.items():
            if size < t:
                continue
            terms = [math.comb(size, i) for i in range(t + 1)]
            for _ in range(number):
                grown = [[0] * (len(ways[0]) + 1) for _ in range(rest + 1)]
                for s, row in enumerate(ways):
                    for j, w in enumerate(row):
                        if w:
                            for i, term in enumerate(terms[: rest - s + 1]):
                                grown[s + i][j + (i == t)] += w * term
                ways = grown
        share += math.comb(m, t) * sum(Fraction(w, j + 1) for j, w in enumerate(ways[rest]) if w)
    return share / math.comb(n, k)


def mean_token_entropy(logits: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean entropy (nats) of the next-token distributions `logits` (sequences, tokens, vocabulary) over the
    positions where `mask` (sequences, tokens) is true."""
    return float(token_entropy(logits)[mask.bool()].mean())


def js_diversity(success: torch.Tensor) -> float:
    """Verifier-projected JS diversity of a population from `success` (members, prompts) in [0, 1]; NaN when fewer
    than two members succeed anywhere."""
    success = success.double()
    totals = success.sum(1)
    q = success[totals > 0] / totals[totals > 0, None]
    if q.shape[0] < 2:
        return math.nan

    def entropy(p: torch.Tensor) -> torch.Tensor:
        return -(p * p.clamp_min(1e-300).log()).sum(-1)

    return float(entropy(q.mean(0)) - entropy(q).mean())
