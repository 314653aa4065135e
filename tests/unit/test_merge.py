"""Hyper-ES merging (trl_es.es.merge): task vectors, layer groups, DARE-TIES merges and the CMA-ES search."""

import json

import numpy as np
import pytest
import torch
from peft.utils.merge_utils import dare_ties

from trl_es.es.merge import MergeSearch, layer_groups, merge, merge_seed, task_vectors


pytestmark = pytest.mark.filterwarnings("ignore:The density 1.0 is greater than or equal to 1")


def tiny_llama(seed):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def models():
    """The tiny Llama's weights as base, and two 'fine-tuned' versions: base plus small seeded deltas."""
    base = {name: value.detach().clone() for name, value in tiny_llama(0).state_dict().items()}
    generator = torch.Generator().manual_seed(1)
    tuned = [
        {name: value + 0.1 * torch.randn(value.shape, generator=generator) for name, value in base.items()}
        for _ in range(2)
    ]
    return base, tuned


# ---- task vectors and layer groups -------------------------------------------------------------------------------


def test_task_vectors_by_hand():
    base = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([[0.5]], dtype=torch.bfloat16)}
    tuned = [
        {"a": torch.tensor([1.5, 1.0]), "b": torch.tensor([[1.5]], dtype=torch.bfloat16)},
        {"a": torch.tensor([0.0, 2.0]), "b": torch.tensor([[0.5]], dtype=torch.bfloat16)},
    ]
    vectors = task_vectors(base, tuned)
    assert len(vectors) == 2
    torch.testing.assert_close(vectors[0]["a"], torch.tensor([0.5, -1.0]))
    torch.testing.assert_close(vectors[0]["b"], torch.tensor([[1.0]]))
    torch.testing.assert_close(vectors[1]["a"], torch.tensor([-1.0, 0.0]))
    assert all(v.dtype == torch.float32 for vector in vectors for v in vector.values())


def test_task_vectors_mismatch_names_the_parameter():
    base = {"a": torch.zeros(2), "layer.w": torch.zeros(3)}
    with pytest.raises(ValueError, match=r"'layer\.w' is only in the base"):
        task_vectors(base, [{"a": torch.zeros(2)}])
    with pytest.raises(ValueError, match=r"'extra' is only in the tuned model 1"):
        task_vectors(base, [dict(base), {**base, "extra": torch.zeros(1)}])
    with pytest.raises(ValueError, match=r"'layer\.w' has shape \(4,\) in tuned model 0 but \(3,\)"):
        task_vectors(base, [{"a": torch.zeros(2), "layer.w": torch.zeros(4)}])


def test_layer_groups_on_llama_names(models):
    base, _ = models
    groups = layer_groups(list(base))
    assert groups["model.layers.0.self_attn.q_proj.weight"] == 0
    assert groups["model.layers.0.mlp.down_proj.weight"] == 0
    assert groups["model.layers.1.input_layernorm.weight"] == 1
    assert groups["model.embed_tokens.weight"] == groups["model.norm.weight"] == groups["lm_head.weight"] == 2
    assert set(groups.values()) == {0, 1, 2}
    assert set(groups) == set(base)


def test_layer_groups_numeric_order_and_no_other_group():
    names = ["h.layers.10.w", "h.layers.2.w", "h.layers.2.b", "mylayers.3.w"]
    # "mylayers.3." is not a `layers.<i>.` component: it goes to the "everything else" group
    assert layer_groups(names) == {"h.layers.10.w": 1, "h.layers.2.w": 0, "h.layers.2.b": 0, "mylayers.3.w": 2}
    assert layer_groups(["layers.0.w", "layers.1.w"]) == {"layers.0.w": 0, "layers.1.w": 1}


# ---- merge -------------------------------------------------------------------------------------------------------


def test_merge_single_vector_full_density_is_the_tuned_model(models):
    base, tuned = models
    vectors = task_vectors(base, tuned[:1])
    groups = layer_groups(list(base))
    ones, zeros = torch.ones(1, 3), torch.zeros(1, 3)
    merged = merge(base, vectors, ones, groups, density=1.0)
    for name in base:
        torch.testing.assert_close(merged[name], tuned[0][name])
    merged = merge(base, vectors, zeros, groups, density=1.0)
    for name in base:
        assert torch.equal(merged[name], base[name])
    # density 1 with c = 0.5: θ_base + 0.5·τ
    merged = merge(base, vectors, 0.5 * ones, groups, density=1.0)
    for name in base:
        torch.testing.assert_close(merged[name], base[name] + 0.5 * vectors[0][name])


def test_merge_per_layer_coefficients_affect_only_their_layer(models):
    base, tuned = models
    vectors = task_vectors(base, tuned)
    groups = layer_groups(list(base))
    coefficients = torch.zeros(2, 3)
    coefficients[:, 1] = torch.tensor([0.7, 1.3])
    merged = merge(base, vectors, coefficients, groups, density=0.5, seed=3)
    for name in base:
        if groups[name] == 1:
            assert not torch.equal(merged[name], base[name]), name
        else:
            assert torch.equal(merged[name], base[name]), name


def test_merge_keeps_dtype_and_leaves_global_rng_alone(models):
    base, tuned = models
    base16 = {name: value.to(torch.bfloat16) for name, value in base.items()}
    vectors = task_vectors(base16, [{name: value.to(torch.bfloat16) for name, value in tuned[0].items()}])
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    merged = merge(base16, vectors, torch.ones(1, 3), layer_groups(list(base)), density=0.5)
    assert torch.equal(torch.rand(3), expected)
    assert all(value.dtype == torch.bfloat16 for value in merged.values())


def test_merge_deterministic_per_seed(models):
    base, tuned = models
    vectors = task_vectors(base, tuned)
    groups = layer_groups(list(base))
    coefficients = torch.tensor([[0.8, 1.1, 0.9], [1.2, 0.6, 1.0]])
    first = merge(base, vectors, coefficients, groups, density=0.5, seed=7)
    torch.rand(5)  # the global RNG state must not matter
    second = merge(base, vectors, coefficients, groups, density=0.5, seed=7)
    other = merge(base, vectors, coefficients, groups, density=0.5, seed=8)
    assert all(torch.equal(first[name], second[name]) for name in base)
    assert not torch.equal(first["model.layers.0.mlp.up_proj.weight"], other["model.layers.0.mlp.up_proj.weight"])


def test_merge_is_peft_dare_ties(models):
    base, tuned = models
    vectors = task_vectors(base, tuned)
    groups = layer_groups(list(base))
    coefficients = torch.tensor([[0.8, 1.1, 0.4], [1.2, -0.6, 1.0]], dtype=torch.float64)
    merged = merge(base, vectors, coefficients, groups, density=0.3, seed=5)
    for name, theta in base.items():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(merge_seed(5, name))
            delta = dare_ties([v[name] for v in vectors], coefficients[:, groups[name]].float(), 0.3)
        torch.testing.assert_close(merged[name], theta + delta, rtol=0, atol=0)


def test_merge_rejects_bad_arguments(models):
    base, tuned = models
    vectors = task_vectors(base, tuned)
    groups = layer_groups(list(base))
    with pytest.raises(ValueError, match=r"shape \(K, L\) = \(2, 3\), got \(2, 2\)"):
        merge(base, vectors, torch.ones(2, 2), groups)
    with pytest.raises(ValueError, match="density must be in"):
        merge(base, vectors, torch.ones(2, 3), groups, density=0.0)
    with pytest.raises(ValueError, match="'lm_head.weight' has no layer group"):
        merge(base, vectors, torch.ones(2, 3), {k: v for k, v in groups.items() if k != "lm_head.weight"})


# ---- MergeSearch -------------------------------------------------------------------------------------------------

TARGET = torch.tensor([[0.3, 1.4, 0.8], [1.2, 0.5, 0.9]], dtype=torch.float64)


def toy_reward(c):
    return -float(((c - TARGET) ** 2).sum())


def run(search, generations):
    """Ask/tell `generations` times on the toy objective; return every asked population."""
    asked = []
    for _ in range(generations):
        candidates = search.ask()
        search.tell(candidates, [toy_reward(c) for c in candidates])
        asked.append(torch.stack(candidates))
    return asked


def test_merge_search_improves_toy_objective():
    search = MergeSearch(2, 3, seed=0)
    assert torch.equal(search.mean(), torch.ones(2, 3, dtype=torch.float64))
    run(search, 1)
    _, first_best = search.best()
    run(search, 29)
    best, best_reward = search.best()
    assert first_best < -0.3
    assert best_reward > -5e-3  # from ≈ -0.65 after one generation
    assert best_reward == toy_reward(best)
    assert torch.allclose(search.mean(), TARGET, atol=0.05)
    assert best.shape == search.mean().shape == (2, 3)


def test_merge_search_deterministic_in_seed():
    asks_a = run(MergeSearch(2, 3, popsize=6, seed=4), 5)
    np.random.seed(99)  # cma must not depend on numpy's global RNG
    np.random.rand(10)
    asks_b = run(MergeSearch(2, 3, popsize=6, seed=4), 5)
    asks_c = run(MergeSearch(2, 3, popsize=6, seed=5), 5)
    assert asks_a[0].shape == (6, 2, 3)
    assert all(torch.equal(a, b) for a, b in zip(asks_a, asks_b, strict=True))
    assert not torch.equal(asks_a[0], asks_c[0])


def test_merge_search_state_dict_resumes_identically():
    search = MergeSearch(2, 3, seed=1)
    run(search, 3)
    state = json.loads(json.dumps(search.state_dict()))  # data only: it goes through JSON unchanged
    continued = run(search, 4)
    resumed_search = MergeSearch(2, 3, seed=1)
    resumed_search.load_state_dict(state)
    resumed = run(resumed_search, 4)
    assert all(torch.equal(a, b) for a, b in zip(continued, resumed, strict=True))
    assert torch.equal(search.mean(), resumed_search.mean())
    assert search.best()[1] == resumed_search.best()[1]
    with pytest.raises(ValueError, match="state has 6 coefficients"):
        MergeSearch(3, 3).load_state_dict(state)
    for other, field in [({"popsize": 9}, "population_size"), ({"sigma0": 0.5}, "merge_sigma"), ({"seed": 2}, "seed")]:
        with pytest.raises(ValueError, match=f"checkpointed with other {field}"):  # not kept silently
            MergeSearch(2, 3, **{"seed": 1, **other}).load_state_dict(state)


def test_merge_search_refuses_bad_tells():
    search = MergeSearch(1, 2, seed=0)
    with pytest.raises(RuntimeError, match="no candidate has been told"):
        search.best()
    candidates = search.ask()
    rewards = [0.0] * len(candidates)
    rewards[1] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        search.tell(candidates, rewards)
    with pytest.raises(ValueError, match="candidates but"):
        search.tell(candidates, rewards[:-1])
