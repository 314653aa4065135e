"""Analysis helpers on tiny real models: update cosine by hand, the linear path, KL drift and NLL."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_es.research.analysis import linear_path, mean_nll, mean_token_kl, update_cosine


TEXTS = ["The capital of France is Paris.", "Water boils at 100 degrees."]


def test_update_cosine_by_hand():
    base = {"w": torch.zeros(2, 2), "b": torch.zeros(2)}
    a = {"w": torch.tensor([[1.0, 0.0], [0.0, 0.0]]), "b": torch.tensor([0.0, 1.0])}
    b = {"w": torch.tensor([[1.0, 0.0], [0.0, 0.0]]), "b": torch.tensor([0.0, -1.0])}
    assert update_cosine(base, a, a) == pytest.approx(1.0)
    assert update_cosine(base, a, b) == pytest.approx(0.0)  # (1·1 + 1·(−1)) / (√2·√2)
    assert update_cosine(base, a, {"w": 2 * a["w"], "b": torch.zeros(2)}) == pytest.approx(1 / math.sqrt(2))
    with pytest.raises(ValueError, match="zero"):
        update_cosine(base, a, base)


def test_linear_path_scores_the_endpoints_and_restores_the_model(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    a = {n: p.detach().clone() for n, p in model.named_parameters()}
    other = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.5)
    b = {n: p.detach().clone() for n, p in other.named_parameters()}
    path = linear_path(model, a, b, lambda m: mean_nll(m, tokenizer, TEXTS), alphas=[0.0, 0.5, 1.0])
    assert [alpha for alpha, _ in path] == [0.0, 0.5, 1.0]
    assert path[0][1] == pytest.approx(mean_nll(model, tokenizer, TEXTS))
    assert path[2][1] == pytest.approx(mean_nll(other, tokenizer, TEXTS))
    assert path[0][1] != pytest.approx(path[2][1])
    assert all(torch.equal(p, a[n]) for n, p in model.named_parameters())  # weights given back


def test_kl_drift_is_zero_for_the_same_weights_and_grows_with_change(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert mean_token_kl(reference, model, tokenizer, TEXTS) == pytest.approx(0.0, abs=1e-7)
    drifts = []
    for scale in (0.01, 0.1):
        torch.manual_seed(0)
        with torch.no_grad():
            for p, q in zip(model.parameters(), reference.parameters(), strict=False):
                p.copy_(q + scale * torch.randn_like(q))
        drifts.append(mean_token_kl(reference, model, tokenizer, TEXTS))
    assert 0 < drifts[0] < drifts[1]


def test_kl_drift_of_a_tiny_update_is_never_negative(tmp_path, tokenizer_dir):
    """KL ≥ 0 by definition; summed in float32, the rounding of a near-zero update made it negative (-9e-9 in a
    study run, -3e-8 here: peaked next-token distributions of a model with large weights, a 1e-7 drift)."""
    from helpers import build_tiny_model

    path = build_tiny_model(tmp_path / "model", tokenizer_dir, initializer_range=0.3)
    tokenizer = AutoTokenizer.from_pretrained(path)
    reference = AutoModelForCausalLM.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator), alpha=1e-7)
    texts = [f"{TEXTS[0]} Sentence number {k} of an off-task text." for k in range(16)]
    assert mean_token_kl(reference, model, tokenizer, texts) >= 0.0
    assert mean_token_kl(reference, reference, tokenizer, texts) == 0.0
