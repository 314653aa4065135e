"""Comparing models from GRPO, ES and both in sequence, as in the ES-vs-GRPO research.

- `update_cosine`: cosine between two updates θ_a − θ_base and θ_b − θ_base (do GRPO and ES move the same way?);
- `linear_path`: a score along θ(α) = (1 − α)·θ_a + α·θ_b (is there a barrier between two solutions?);
- `mean_token_kl`: mean next-token KL(π_ref ‖ π) over texts, e.g. an off-task prompt set (how far did training
  drift away from the task?); `mean_nll`: a ready score for `linear_path`.

Weights are dicts name → tensor (`dict(model.named_parameters())`), checked for the same names and shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from ..util.deltas import check_same_architecture, weight_delta
from ..util.models import with_pad_token


def update_cosine(
    base: Mapping[str, torch.Tensor], a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]
) -> float:
    """cos(θ_a − θ_base, θ_b − θ_base) over all parameters, accumulated in float64."""
    delta_a, delta_b = weight_delta(base, a), weight_delta(base, b)
    dot = norm_a = norm_b = 0.0
    for name, da in delta_a.items():
        da, db = da.double(), delta_b[name].double()
        dot += float((da * db).sum())
        norm_a += float(da.square().sum())
        norm_b += float(db.square().sum())
    if norm_a == 0 or norm_b == 0:
        raise ValueError("one of the updates is zero: the cosine is undefined")
    return dot / (norm_a * norm_b) ** 0.5


@torch.no_grad()
def linear_path(
    model: torch.nn.Module,
    a: Mapping[str, torch.Tensor],
    b: Mapping[str, torch.Tensor],
    score: Callable[[torch.nn.Module], float],
    alphas: list[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
) -> list[tuple[float, float]]:
    """[(α, score(model at (1 − α)·θ_a + α·θ_b))] for each α; `model` (same architecture) gets its weights back."""
    params = dict(model.named_parameters())
    check_same_architecture(a, b)
    check_same_architecture(params, a)
    saved = {name: p.detach().clone() for name, p in params.items()}
    results = []
    try:
        for alpha in alphas:
            for name, p in params.items():
                p.copy_(torch.lerp(a[name].float(), b[name].float(), alpha).to(p.dtype))
            results.append((alpha, float(score(model))))
    finally:
        for name, p in params.items():
            p.copy_(saved[name])
    return results


def _logits(model, tokenizer, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Next-token logits (float32), their targets and the mask of real (non-padding) targets."""
    batch = with_pad_token(tokenizer)(texts, return_tensors="pt", padding=True).to(model.device)
    logits = model(**batch).logits[:, :-1].float()
    return logits, batch["input_ids"][:, 1:], batch["attention_mask"][:, 1:].bool()


@torch.no_grad()
def mean_nll(model, tokenizer, texts: list[str]) -> float:
    """Mean negative log-likelihood per predicted token of `texts` (padding excluded)."""
    logits, targets, mask = _logits(model, tokenizer, texts)
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    return float(nll[mask].mean())


@torch.no_grad()
def mean_token_kl(reference, model, tokenizer, texts: list[str]) -> float:
    """Mean over the positions of `texts` of KL(π_ref(·|x_<t) ‖ π(·|x_<t)) (padding excluded): 0 for the same
    weights, larger the more `model` drifted from `reference` on these texts. Summed in float64 and clamped at 0 per
    position: KL ≥ 0, and what rounding leaves below 0 for a near-zero drift (float32 gave −3e-8) is rounding."""
    ref_logits, _, mask = _logits(reference, tokenizer, texts)
    logits, _, _ = _logits(model, tokenizer, texts)
    ref_logp, logp = ref_logits.double().log_softmax(-1), logits.double().log_softmax(-1)
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1).clamp_min(0.0)
    return float(kl[mask].mean())
