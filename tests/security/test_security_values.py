"""Nothing non-finite reaches the weights: rewards, their weighted sum, the fitness, the update coefficients and the
update itself are checked after every cast; a step that would write inf or NaN is refused with an error that says
why, and the weights stay bitwise as they were."""

import numpy as np
import pytest
import torch
from helpers import assert_same_weights, weights
from helpers import es_config as config
from transformers import AutoModelForCausalLM

from trl_es import ESTrainer
from trl_es.es import NoiseTable, ParameterSnapshot, apply_update, update_coefficients
from trl_es.es.lowrank import lowrank_update


def huge_for_long(completions, **kwargs):
    """Finite in Python, beyond float32 for long completions."""
    return [1e39 if len(c) > 10 else 1.0 for c in completions]


def huge_for_long_or_moderate(completions, **kwargs):
    return [3e38 if len(c) > 10 else 1.0 for c in completions]


@pytest.mark.parametrize("shaping", ["zscore", "none", "centered_rank"])
def test_a_reward_beyond_float32_is_an_error_naming_it_and_the_weights_stay(
    tmp_path, tiny_model_dir, prompt_dataset, shaping
):
    trainer = ESTrainer(
        tiny_model_dir, huge_for_long, args=config(tmp_path, fitness_shaping=shaping), train_dataset=prompt_dataset
    )
    before = weights(trainer.model)
    with pytest.raises(ValueError, match="'huge_for_long' returned 1e\\+39 at position .*float32"):
        trainer.train()
    assert_same_weights(trainer.model, before)


def test_a_huge_integer_reward_and_a_non_finite_weight_decay_are_refused_naming_them(tmp_path):
    from trl_es.rewards.contract import _as_reward

    with pytest.raises(ValueError, match="'huge_int' returned 1000000000.* at position 3, beyond what float32"):
        _as_reward(10**400, "huge_int", 3)  # math.isinf(10**400) raised OverflowError, naming nothing
    assert _as_reward(10**30, "big", 0) == 1e30
    for value in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="weight_decay"):
            config(tmp_path, weight_decay=value)


def test_a_weighted_sum_beyond_float32_is_refused(tmp_path, tiny_model_dir, prompt_dataset):
    funcs = [huge_for_long_or_moderate, huge_for_long_or_moderate]
    trainer = ESTrainer(tiny_model_dir, funcs, args=config(tmp_path), train_dataset=prompt_dataset)
    before = weights(trainer.model)
    with pytest.raises(ValueError, match="weighted sum of the rewards .* not finite"):
        trainer.train()
    assert_same_weights(trainer.model, before)


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.slow), torch.float16])
def test_an_update_that_would_overflow_is_refused_and_the_weights_stay(
    tmp_path, tiny_model_dir, prompt_dataset, dtype
):
    """Raw rewards (fitness_shaping='none') of 1e30 with α = 1e10: finite coefficients, an infinite update."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype)
    before = weights(model)
    big = 1e30 if dtype == torch.float32 else 1e3  # float16 overflows at 65504

    def raw(completions, **kwargs):
        return [big * len(c) for c in completions]

    args = config(tmp_path, fitness_shaping="none", learning_rate=1e10 if dtype == torch.float32 else 100.0)
    trainer = ESTrainer(model, raw, args=args, train_dataset=prompt_dataset)
    with pytest.raises(FloatingPointError, match="not finite"):
        trainer.train()
    assert_same_weights(trainer.model, before)


def test_apply_update_refuses_non_finite_coefficients_and_results():
    params = {"w": torch.nn.Parameter(torch.zeros(1000))}
    snapshot = ParameterSnapshot(params)
    snapshot.capture()
    table = NoiseTable(0, 1 << 21)
    with pytest.raises(FloatingPointError, match="coefficient"):
        apply_update(snapshot, table, {1: float("nan")})
    with pytest.raises(FloatingPointError, match="not finite"):
        apply_update(snapshot, table, {1: 1e38, 2: 1e38, 3: 1e38})
    with pytest.raises(FloatingPointError, match="not finite"):
        lowrank_update({"w": torch.zeros(4, 4)}, [(1, 1), (2, 1)], torch.tensor([1.0, -1.0]), 1e39, 2)
    with pytest.raises(FloatingPointError, match="coefficient"):
        update_coefficients(torch.tensor([1.0, -1.0]), [(1, 1), (2, 1)], float("inf"), 2)


def test_numpy_and_torch_scalars_are_rewards(tmp_path, tiny_model_dir, prompt_dataset):
    """As in GRPO, numpy bools and scalars and 0-d tensors are numbers."""

    def mixed(completions, **kwargs):
        kinds = [np.bool_(True), np.float32(0.5), np.int64(1), torch.tensor(0.25)]
        return [kinds[k % 4] if len(c) % 2 else np.bool_(False) for k, c in enumerate(completions)]

    trainer = ESTrainer(tiny_model_dir, mixed, args=config(tmp_path, max_steps=1), train_dataset=prompt_dataset)
    trainer.train()
    assert 0.0 <= trainer.state.log_history[0]["reward"] <= 1.0
