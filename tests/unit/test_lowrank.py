"""Low-rank (EGGROLL-style) perturbations: factors, the batched population against explicitly perturbed copies
(a mixture of experts' fused experts and routers included), exact restore, the update."""

import copy
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from trl_es.es import select_parameters
from trl_es.es.lowrank import apply_lowrank_update, lowrank_factors, lowrank_update
from trl_es.generation.lowrank_forward import LowRankPopulation, lowrank_targets


SIGMA = 0.05
SEEDS, SIGNS = [11, 11, 12], [1, -1, 1]  # members 0 and 1 are an antithetic pair


@pytest.fixture
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def targets_of(model):
    return lowrank_targets(model, select_parameters(model.named_parameters()))


@pytest.fixture
def moe(tiny_moe_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_moe_dir).eval()


def noise(seed, name, shape, rank):
    """A·Bᵀ/√r, one such matrix per expert of a fused (E × out × in) shape, built expert by expert."""
    a, b = lowrank_factors(seed, name, shape, rank)
    if len(shape) == 3:
        return torch.stack([a[e] @ b[e].T for e in range(shape[0])]) / math.sqrt(rank)
    return a @ b.T / math.sqrt(rank)


def target_weight(module, name):
    return getattr(module, name.rpartition(".")[2])


def explicit_member(model, member, rank, sigma=SIGMA):
    """A copy of `model` whose target weights are W + σ·sign·A·Bᵀ/√r (member −1: the centre, unperturbed)."""
    member_model = copy.deepcopy(model)
    if member >= 0:
        with torch.no_grad():
            for name, module in targets_of(member_model).items():
                weight = target_weight(module, name)
                weight.add_(sigma * SIGNS[member] * noise(SEEDS[member], name, weight.shape, rank))
    return member_model


def test_factors_are_a_pure_function_of_seed_and_name_with_unit_variance_noise():
    a, b = lowrank_factors(3, "w", (512, 256), rank=4)
    assert a.shape == (512, 4) and b.shape == (256, 4) and a.dtype == torch.float32
    again = lowrank_factors(3, "w", (512, 256), rank=4)
    assert torch.equal(a, again[0]) and torch.equal(b, again[1])
    assert not torch.equal(a, lowrank_factors(3, "v", (512, 256), rank=4)[0])  # other parameter
    assert not torch.equal(a, lowrank_factors(4, "w", (512, 256), rank=4)[0])  # other member
    e = a @ b.T / 2
    assert abs(e.var().item() - 1) < 0.15 and abs(e.mean().item()) < 0.05
    experts = lowrank_factors(3, "w", (3, 512, 256), rank=4)  # a fused expert tensor: factors per expert
    assert experts[0].shape == (3, 512, 4) and experts[1].shape == (3, 256, 4)
    assert len({experts[0][e].sum().item() for e in range(3)}) == 3
    half = lowrank_factors(3, "w", (512, 256), rank=4, dtype=torch.bfloat16)[0]
    assert half.dtype == torch.bfloat16 and torch.equal(half, a.bfloat16())
    with pytest.raises(ValueError, match="rank"):
        lowrank_factors(3, "w", (4, 4), rank=0)


def test_targets_are_the_linear_weights_and_exclude_a_tied_lm_head(model):
    targets = targets_of(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(m is not model.lm_head for m in targets.values())
    projections = [f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    projections += [f"mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    assert sorted(targets) == sorted(f"model.layers.{i}.{p}.weight" for i in range(2) for p in projections)
    assert all(module.weight is dict(model.named_parameters())[name] for name, module in targets.items())

    class Toy(torch.nn.Module):
        def __init__(self, tied):
            super().__init__()
            self.embed, self.head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False)
            if tied:
                self.head.weight = self.embed.weight

    assert set(lowrank_targets(Toy(False), dict(Toy(False).named_parameters()))) == set()  # other instance's params
    untied = Toy(False)
    assert set(lowrank_targets(untied, dict(untied.named_parameters()))) == {"head.weight"}
    tied = Toy(True)
    assert lowrank_targets(tied, dict(tied.named_parameters())) == {}


def test_targets_of_a_mixture_of_experts_are_its_linears_fused_experts_and_routers(moe):
    targets = targets_of(moe)
    layer = moe.model.layers[0]
    assert targets["model.layers.0.mlp.experts.gate_up_proj"] is layer.mlp.experts
    assert targets["model.layers.0.mlp.experts.down_proj"] is layer.mlp.experts
    assert targets["model.layers.0.mlp.gate.weight"] is layer.mlp.gate
    assert targets["model.layers.0.self_attn.q_proj.weight"] is layer.self_attn.q_proj
    assert len(targets) == 2 * 7  # per layer: q, k, v, o, the router and the two expert tensors


@pytest.mark.parametrize("rank", [1, 2])
def test_mixture_of_experts_batched_forward_equals_explicitly_perturbed_models(moe, rank):
    """Each row sees its member's experts (one rank-r matrix per expert) and router, whichever experts it routes to;
    the experts' and routers' own forwards come back on exit."""
    row_members = [2, 0, -1, 1, 0]
    input_ids = torch.randint(0, moe.config.vocab_size, (5, 7), generator=torch.Generator().manual_seed(0))
    forwards = {m: m.forward for m in (moe.model.layers[0].mlp.experts, moe.model.layers[0].mlp.gate)}
    with torch.no_grad():
        centre = moe(input_ids).logits
        with LowRankPopulation(targets_of(moe), SEEDS, SIGNS, SIGMA, rank) as route:
            route(row_members)
            batched = moe(input_ids).logits
        routers_only = {n: m for n, m in targets_of(moe).items() if ".mlp.gate." in n}
        with LowRankPopulation(routers_only, SEEDS, SIGNS, 0.5, rank) as route:
            route(row_members)
            rerouted = moe(input_ids).logits
    for row, member in enumerate(row_members):
        with torch.no_grad():
            expected = explicit_member(moe, member, rank)(input_ids[row : row + 1]).logits[0]
        torch.testing.assert_close(batched[row], expected, atol=1e-5, rtol=1e-5)
        if member >= 0:  # the perturbation is not negligible, so the check above has teeth
            assert (batched[row] - centre[row]).abs().max() > 1e-2
            assert (rerouted[row] - centre[row]).abs().max() > 1e-2  # the routers alone move the logits
    assert torch.equal(batched[2], centre[2]) and torch.equal(rerouted[2], centre[2])
    assert all(m.forward == forward and "forward" not in m.__dict__ for m, forward in forwards.items())


def test_mixture_of_experts_update_is_rank_r_per_expert(moe):
    """The update adds to each expert e of a fused tensor Σ_s c_s·A_s,e·B_s,eᵀ/√r: a matrix of rank ≤ S·r per
    expert, equal to the expert-by-expert sum."""
    rank, coefficients = 2, {11: 0.3, 12: -0.2}
    name = "model.layers.1.mlp.experts.down_proj"
    weight = dict(moe.named_parameters())[name]
    before = weight.detach().clone()
    apply_lowrank_update({name: weight}, coefficients, rank)
    delta = weight.detach() - before
    expected = sum(c * noise(seed, name, weight.shape, rank) for seed, c in coefficients.items())
    torch.testing.assert_close(delta, expected, atol=1e-6, rtol=1e-4)
    assert all(torch.linalg.matrix_rank(delta[e]).item() == 2 * rank for e in range(weight.shape[0]))


@pytest.mark.parametrize("rank", [1, 2])
def test_batched_forward_equals_explicitly_perturbed_models_row_by_row(model, rank):
    row_members = torch.tensor([2, 0, -1, 1, 0])
    input_ids = torch.randint(0, model.config.vocab_size, (5, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), LowRankPopulation(targets_of(model), SEEDS, SIGNS, SIGMA, rank) as route:
        route(row_members)
        batched = model(input_ids).logits
        route([1, 2])  # routed again, as a later turn of an episode evaluates only some rows
        rerouted = model(input_ids[[0, 4]]).logits
    centre = model(input_ids).logits.detach()
    for row, member in enumerate(row_members.tolist()):
        with torch.no_grad():
            expected = explicit_member(model, member, rank)(input_ids[row : row + 1]).logits[0]
        torch.testing.assert_close(batched[row], expected, atol=1e-5, rtol=1e-5)
        if member >= 0:  # the perturbation is not negligible, so the check above has teeth
            assert (batched[row] - centre[row]).abs().max() > 1e-2
    for k, (row, member) in enumerate([(0, 1), (4, 2)]):
        with torch.no_grad():
            expected = explicit_member(model, member, rank)(input_ids[row : row + 1]).logits[0]
        torch.testing.assert_close(rerouted[k], expected, atol=1e-5, rtol=1e-5)


def test_batched_generation_equals_per_member_generation(model):
    rank, row_members = 2, torch.tensor([0, 1, 2, -1, 2])
    prompt = torch.randint(0, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(1))
    input_ids = prompt.repeat(len(row_members), 1)  # same prompt: rows differ only by their member
    options = {"do_sample": False, "max_new_tokens": 8, "min_new_tokens": 8}
    with torch.no_grad(), LowRankPopulation(targets_of(model), SEEDS, SIGNS, 0.5, rank) as route:
        route(row_members)
        batched = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **options)
    options["attention_mask"] = torch.ones_like(prompt)
    for row, member in enumerate(row_members.tolist()):
        expected = explicit_member(model, member, rank, sigma=0.5).generate(prompt, **options)[0]
        assert torch.equal(batched[row], expected), (row, member)
    completions = {tuple(row[6:].tolist()) for row in batched}
    assert len(completions) >= 3  # members generate different tokens


def test_weights_and_outputs_bitwise_unchanged_and_hooks_removed_also_on_exception(model):
    input_ids = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(2))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        logits = model(input_ids).logits
        with LowRankPopulation(targets_of(model), SEEDS, SIGNS, SIGMA, 1) as route:
            route([0, 2])
            assert not torch.equal(model(input_ids).logits, logits)
        population = LowRankPopulation(targets_of(model), SEEDS, SIGNS, SIGMA, 1)
        with pytest.raises(RuntimeError, match="boom"), population as route:
            route([0, 2])
            model(input_ids)
            raise RuntimeError("boom")
        assert torch.equal(model(input_ids).logits, logits)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert all(not m._forward_hooks for m in model.modules())


def test_population_rejects_bad_rows(model):
    targets = targets_of(model)
    with pytest.raises(ValueError, match="row_members"):
        LowRankPopulation(targets, SEEDS, SIGNS, SIGMA, 1).route(torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="signs"):
        LowRankPopulation(targets, SEEDS, SIGNS[:2], SIGMA, 1)
    with (
        pytest.raises(ValueError, match="rows"),
        torch.no_grad(),
        LowRankPopulation(targets, SEEDS, SIGNS, SIGMA, 1) as route,
    ):
        route(torch.tensor([0, 1, 2]))
        model(torch.zeros(2, 3, dtype=torch.long))
    assert all(not m._forward_hooks for m in model.modules())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_equals_the_explicit_sum_and_returns_its_norm(dtype):
    rank, lr = 3, 0.1
    torch.manual_seed(0)
    weights = {"a.weight": torch.randn(24, 16).to(dtype), "b.weight": torch.randn(8, 24).to(dtype)}
    before = {name: w.clone() for name, w in weights.items()}
    directions = [(11, 1), (11, -1), (12, 1), (13, -1)]
    fitness = torch.tensor([1.2, -0.3, 0.5, -1.4], dtype=torch.float64)
    norm = lowrank_update(weights, directions, fitness, lr, n_members=4, rank=rank)
    squared = 0.0
    for name, w in weights.items():
        terms = zip(fitness.tolist(), directions, strict=False)
        delta = sum(lr / 4 * z * sign * noise(seed, name, w.shape, rank) for z, (seed, sign) in terms)
        squared += float(delta.square().sum())
        expected = (before[name].float() + delta).to(dtype)
        torch.testing.assert_close(w, expected, atol=1e-6, rtol=1e-6 if dtype == torch.float32 else 1e-2)
    assert norm == pytest.approx(squared**0.5, rel=1e-5)


def test_antithetic_pair_with_equal_fitness_cancels():
    weights = {"a.weight": torch.randn(16, 8)}
    before = weights["a.weight"].clone()
    norm = lowrank_update(weights, [(5, 1), (5, -1)], torch.tensor([0.7, 0.7]), 0.5, n_members=2)
    assert norm < 1e-7
    torch.testing.assert_close(weights["a.weight"], before, atol=1e-7, rtol=0)
