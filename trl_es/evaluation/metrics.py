"""The research's evaluation metrics, as plain functions: Pass@K, Maj@K, token entropy, population diversity.

- `pass_at_k`: the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code"),
  1 − C(n−c, k)/C(n, k) for n samples of which c are correct, computed as a stable product.
- `maj_at_k`: majority vote over the extracted answers of the first k samples (unparsable answers, None, do not
  vote; a tie goes to the answer seen first); 1 when the winner is a correct answer (the verifier's verdict on a
  sample giving it, so equivalence is the task's, e.g. math-verify's).
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

import torch

from ..generation.transformers_backend import token_entropy


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased Pass@K from n samples with c correct: 1 − C(n−c, k)/C(n, k)."""
    if not 0 <= c <= n:
        raise ValueError(f"the number of correct samples c={c} must be in [0, n={n}]")
    if not 1 <= k <= n:
        raise ValueError(f"Pass@{k} needs 1 ≤ K ≤ n samples per problem, got n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def maj_at_k(answers: list, correct: list[bool], k: int) -> float:
    """1.0 when the most frequent parsed answer among the first k samples is correct (`correct[i]` is the verifier's
    verdict on sample i), else 0.0."""
    if len(answers) != len(correct):
        raise ValueError(f"{len(answers)} answers but {len(correct)} verdicts")
    if not 1 <= k <= len(answers):
        raise ValueError(f"Maj@{k} needs 1 ≤ K ≤ n samples per problem, got n={len(answers)}")
    votes = Counter(answer for answer in answers[:k] if answer is not None)
    if not votes:
        return 0.0
    top = max(votes.values())
    winner = next(i for i, answer in enumerate(answers[:k]) if answer is not None and votes[answer] == top)
    return float(correct[winner])


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
