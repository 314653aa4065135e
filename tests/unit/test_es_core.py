"""The algorithm layer on plain tensors: noise, exact restore, fitness shaping, the update."""

import math

import pytest
import torch

from trl_es.es import (
    NoiseTable,
    ParameterSnapshot,
    apply_update,
    member_noise,
    member_seed,
    select_parameters,
    shape_fitness,
    update_coefficients,
)
from trl_es.es.fitness import keep_top_k, pass_at_k_table, prompt_normalized
from trl_es.es.noise import CHUNK
from trl_es.es.seeds import noise_step
from trl_es.es.weights import LocalWeights


@pytest.fixture(scope="module")
def table():
    return NoiseTable(seed=0, size=CHUNK * 2)


def full_noise(table, seed, name, numel):
    return torch.cat([w for _, _, w in member_noise(table, seed, name, numel)])


def make_params(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    shapes = {"a.weight": (64, 48), "b.weight": (64, 48), "big": (CHUNK + 1000,), "c.bias": (7,)}
    return {n: torch.nn.Parameter(torch.randn(s).to(dtype)) for n, s in shapes.items()}


def test_member_seed_is_a_pure_function_of_seed_step_member():
    assert member_seed(0, 3, 5) == member_seed(0, 3, 5)
    seeds = {member_seed(s, t, i) for s in range(2) for t in range(3) for i in range(4)}
    assert len(seeds) == 24


def test_noise_keyed_by_name_and_member_and_reproducible(table):
    n = 64 * 48
    a = full_noise(table, 1, "a.weight", n)
    assert torch.equal(a, full_noise(table, 1, "a.weight", n))
    assert not torch.equal(a, full_noise(table, 1, "b.weight", n))  # same shape, other name
    assert not torch.equal(a, full_noise(table, 2, "a.weight", n))  # other member
    assert abs(a.mean().item()) < 0.1 and abs(a.std().item() - 1) < 0.1


def test_member_noise_is_views_of_the_table_nothing_is_allocated(table):
    start, end = table.values.data_ptr(), table.values.data_ptr() + table.size * 4
    windows = list(member_noise(table, 5, "big", CHUNK + 1000))
    assert len(windows) == 2
    for _, _, window in windows:
        assert window.untyped_storage().data_ptr() == table.values.untyped_storage().data_ptr()
        assert start <= window.data_ptr() < end


def test_noise_of_a_shard_is_the_slice_of_the_full_noise(table):
    numel = CHUNK + 5000
    full = full_noise(table, 7, "big", numel)
    start, end = CHUNK - 300, CHUNK + 1200  # crosses a chunk boundary
    shard = torch.cat([w for _, _, w in member_noise(table, 7, "big", numel, start, end)])
    assert torch.equal(shard, full[start:end])


def test_noise_table_is_the_same_for_the_same_seed():
    assert torch.equal(NoiseTable(3, 2 * CHUNK).values, NoiseTable(3, 2 * CHUNK).values)
    assert not torch.equal(NoiseTable(3, 2 * CHUNK).values, NoiseTable(4, 2 * CHUNK).values)
    with pytest.raises(ValueError, match="at least"):
        NoiseTable(0, 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_perturb_then_restore_is_bitwise_exact(table, dtype):
    params = make_params(dtype)
    before = {n: p.detach().clone() for n, p in params.items()}
    snapshot = ParameterSnapshot(params)
    snapshot.capture()
    for member in range(5):
        snapshot.perturb(table, member_seed(0, 0, member), 1e-3 * (-1) ** member)
        assert not torch.equal(params["a.weight"], before["a.weight"])
    snapshot.restore()
    for name, p in params.items():
        assert torch.equal(p, before[name]), name


def test_perturb_sets_theta_plus_scale_times_noise(table):
    params = make_params()
    theta = params["big"].detach().clone()
    snapshot = ParameterSnapshot(params)
    snapshot.capture()
    snapshot.perturb(table, 11, 0.5)
    expected = theta + 0.5 * full_noise(table, 11, "big", theta.numel())
    assert torch.equal(params["big"].detach(), expected)


def test_local_weights_members_over_changing_names_are_exact(table):
    """A member over some names after a member over others: those others are θ again, the new ones θ + scale·ε
    (written from the copy of θ, never accumulated); `center` reports what it wrote and leaves θ bitwise."""
    params = make_params()
    theta = {n: p.detach().clone() for n, p in params.items()}
    weights = LocalWeights(params, seed=0, table_size=CHUNK * 2)
    weights.capture()
    weights.table = table  # the test's own table, for `full_noise` (capture built the run's)
    assert weights.member(5, 0.5) == set(params)
    assert weights.member(6, 0.25, ["a.weight", "big"]) == set(params)  # c.bias and b.weight written back to θ
    for name in params:
        expected = theta[name] + 0.25 * full_noise(table, 6, name, theta[name].numel()).view_as(theta[name])
        assert torch.equal(params[name].detach(), expected if name in ("a.weight", "big") else theta[name]), name
    assert weights.member(7, 0.1, ["c.bias"]) == {"a.weight", "big", "c.bias"}
    assert weights.center() == {"c.bias"}
    assert all(torch.equal(params[n].detach(), theta[n]) for n in params)


def test_select_parameters_by_pattern_and_errors():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    assert list(select_parameters(model.named_parameters())) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert list(select_parameters(model.named_parameters(), [r"^0\."])) == ["0.weight", "0.bias"]
    with pytest.raises(ValueError, match="match no trainable"):
        select_parameters(model.named_parameters(), ["nothing"])
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable"):
        select_parameters(model.named_parameters())


def test_zscore_and_ranks_by_hand():
    rewards = torch.tensor([1.0, 2.0, 3.0, float("nan")])
    z = shape_fitness(rewards, "zscore")
    std = math.sqrt(2 / 3)
    assert torch.allclose(z, torch.tensor([-1 / std, 0.0, 1 / std, 0.0], dtype=torch.float64), atol=1e-6)
    ranks = shape_fitness(torch.tensor([5.0, 1.0, 5.0, 3.0]), "centered_rank")
    # ranks 0-based with ties averaged: 1.0 → 0, 3.0 → 1, 5.0 → (2+3)/2; scaled by 1/(n-1) and centred
    assert torch.allclose(ranks, torch.tensor([2.5 / 3 - 0.5, -0.5, 2.5 / 3 - 0.5, 1 / 3 - 0.5], dtype=torch.float64))
    assert torch.equal(shape_fitness(torch.tensor([0.5, 1.5]), "none"), torch.tensor([0.5, 1.5], dtype=torch.float64))


def test_no_signal_gives_no_fitness():
    assert shape_fitness(torch.tensor([1.0, 1.0, 1.0])) is None
    assert shape_fitness(torch.tensor([float("nan")] * 4)) is None
    assert shape_fitness(torch.tensor([1.0, float("nan"), float("nan")])) is None
    with pytest.raises(ValueError, match="unknown fitness shaping"):
        shape_fitness(torch.tensor([1.0, 2.0]), "bogus")


def test_per_prompt_normalisation_keeps_a_prompt_with_larger_rewards_from_deciding_the_ranking():
    """Member 0 scores 5 on prompt 0, where the others score 0; members 1–3 solve prompts 1 and 2 (reward 1), which
    member 0 does not. Its mean reward ranks member 0 first; z-scored per prompt ("group"), every prompt weighs the
    same and the members solving two prompts rank first — by hand: a_0 = (√3 − √3 − √3)/3, a_j = (−1/√3 + 2/√3)/3."""
    values = torch.tensor([[5.0, 0.0, 0.0], [0.0, 1.0, 1.0], [0.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    assert values.mean(1).argmax() == 0
    group = prompt_normalized(values, "group")
    root3 = math.sqrt(3)
    assert torch.allclose(group, torch.tensor([-root3 / 3, *[1 / (3 * root3)] * 3], dtype=torch.float64))
    centered = values.double().mean(1) - values.double().mean()
    assert torch.allclose(prompt_normalized(values, "none"), centered)  # the member's mean, centred
    assert torch.allclose(prompt_normalized(values, "batch"), centered / values.double().std(unbiased=False))
    # a prompt without spread counts 0; a member without a reward on a prompt is left out of it, none at all is NaN
    nan = float("nan")
    partial = prompt_normalized(torch.tensor([[1.0, 1.0], [1.0, nan], [1.0, 0.0], [nan, nan]]), "group")
    assert torch.allclose(partial[:3], torch.tensor([0.5, 0.0, -0.5], dtype=torch.float64)) and partial[3].isnan()
    with pytest.raises(ValueError, match="unknown scale_rewards"):
        prompt_normalized(values, "rank")


def test_pass_at_k_fitness_is_the_evaluations_unbiased_estimator():
    from trl_es.evaluation.metrics import pass_at_k as evaluation_pass_at_k

    n, k = 4, 2
    shares = torch.tensor([[0.0, 0.25, 0.5], [0.75, 1.0, float("nan")]], dtype=torch.float64)
    table = pass_at_k_table(shares, n, k)
    assert table[0].tolist() == [evaluation_pass_at_k(n, c, k) for c in (0, 1, 2)]  # the same estimator
    assert table[0].tolist() == pytest.approx([0.0, 0.5, 1 - 1 / 6])  # 1 − C(n−c, k)/C(n, k) by hand
    assert table[1, :2].tolist() == [1.0, 1.0] and table[1, 2].isnan()  # c ≥ n − k + 1 always passes; NaN: none


def test_top_k_keeps_the_best_members_fitness_only():
    rewards = torch.tensor([0.2, 0.9, float("nan"), 0.9, 0.1])
    fitness = torch.tensor([-0.5, 1.0, 0.0, 1.0, -1.5], dtype=torch.float64)
    assert keep_top_k(fitness, rewards, 2).tolist() == [0.0, 1.0, 0.0, 1.0, 0.0]
    assert keep_top_k(fitness, rewards, 3).tolist() == [-0.5, 1.0, 0.0, 1.0, 0.0]  # NaN members are never kept
    tied = keep_top_k(fitness, torch.tensor([0.9, 0.9, 0.9, 0.9, 0.9]), 1)
    assert tied.tolist() == [-0.5, 0.0, 0.0, 0.0, 0.0]  # ties go to the earlier member


def test_noise_reuse_gives_a_block_of_steps_the_directions_of_its_first():
    assert [noise_step(t, 3) for t in range(7)] == [0, 0, 0, 3, 3, 3, 6]
    assert [noise_step(t, 1) for t in range(4)] == [0, 1, 2, 3]


def test_antithetic_coefficients_merge_per_seed():
    fitness = torch.tensor([1.0, -1.0, 0.5, 0.5], dtype=torch.float64)
    coefficients = update_coefficients(fitness, [(10, 1), (10, -1), (20, 1), (20, -1)], scale=0.4, n_members=4)
    assert coefficients == pytest.approx({10: 0.4 * 2 / 4, 20: 0.0})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_is_accumulated_in_fp32_and_cast_once(table, dtype):
    params = make_params(dtype)
    theta = {n: p.detach().clone() for n, p in params.items()}
    snapshot = ParameterSnapshot(params)
    snapshot.capture()
    coefficients = {101: 3e-3, 202: -1e-3, 303: 2e-4}
    norm = apply_update(snapshot, table, coefficients, decay=0.01)
    squared = 0.0
    for name, p in params.items():
        delta = sum(c * full_noise(table, s, name, p.numel()) for s, c in coefficients.items())
        delta = delta - 0.01 * theta[name].float().view(-1)
        squared += float(delta.square().sum())
        expected = (theta[name].float().view(-1) + delta).to(dtype).view_as(p)
        assert torch.allclose(p.detach().float(), expected.float(), atol=1e-6, rtol=0), name
        if dtype == torch.float32:
            assert (p.detach() - expected).abs().max() < 1e-6
    assert norm == pytest.approx(math.sqrt(squared), rel=1e-4)
    for name in params:  # the snapshot still holds θ, so an interrupted update can be undone
        assert torch.equal(snapshot.copies[name], theta[name])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_float32_master_builds_members_in_its_precision_and_keeps_updates_below_the_tensors_resolution(table, dtype):
    """Mixed precision (bf16/fp16): θ lives in a float32 master; the tensors hold the cast of θ, of a member
    θ + σ·ε computed in float32, and of each update, which the master takes bitwise as a float32 run would — so
    updates far below the tensors' resolution add up there instead of being rounded away."""
    theta = make_params(torch.float32)
    master = {n: p.detach().clone() for n, p in theta.items()}
    tensors = {n: torch.nn.Parameter(p.detach().to(dtype)) for n, p in theta.items()}
    mixed = LocalWeights(tensors, seed=0, table_size=CHUNK * 2, master=master)
    exact = LocalWeights(theta, seed=0, table_size=CHUNK * 2)
    mixed.capture(), exact.capture()
    mixed.member(7, 1e-3)
    for name, p in tensors.items():
        expected = torch.add(master[name].view(-1), full_noise(mixed.table, 7, name, p.numel()), alpha=1e-3)
        assert torch.equal(p.detach().view(-1), expected.to(dtype)), name
    for step in range(5):  # each update ~1e-6: far below a bf16/fp16 weight's rounding step
        coefficients = {100 + step: 1e-6, 200 + step: -5e-7}
        mixed.update(coefficients), exact.update(coefficients)
        mixed.capture(), exact.capture()
    for name, p in tensors.items():
        assert torch.equal(master[name], theta[name].detach()), name  # the float32 run's θ, bitwise
        assert torch.equal(p.detach(), master[name].to(dtype)), name
    assert not torch.equal(master["a.weight"].to(dtype), make_params(torch.float32)["a.weight"].detach().to(dtype))
    mixed.member(9, 1e-3), mixed.restore()
    assert all(torch.equal(p.detach(), master[n].to(dtype)) for n, p in tensors.items())


def test_the_algorithm_layer_imports_without_transformers():
    """Every module of trl_es.es imports with torch alone: no transformers, TRL, cma or peft (Hyper-ES imports its
    extras when it runs), and nothing of the layers above."""
    import subprocess
    import sys

    code = (
        "import importlib, pkgutil, sys, trl_es.es as es\n"
        "for module in pkgutil.iter_modules(es.__path__): importlib.import_module(f'trl_es.es.{module.name}')\n"
        "loaded = [m for m in ('transformers', 'trl', 'cma', 'peft') if m in sys.modules]\n"
        "above = [m for m in sys.modules if m.startswith('trl_es.') and not m.startswith('trl_es.es')]\n"
        "assert not loaded and not above, (loaded, above)"
    )
    process = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert process.returncode == 0, process.stderr[-2000:]
