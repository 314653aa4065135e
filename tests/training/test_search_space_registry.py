"""A new search space is one registered class: defined here alone, it trains and replays its seed chain bitwise with
no change to trl-es; the regression guard's `registered_space` scenario trains it with 1 and 2 processes (same
weights, recorded hash)."""

from pathlib import Path

import pytest
import torch
from datasets import Dataset  # noqa: E402
from helpers import NormsOnlySpace

from trl_es import ESConfig, ESTrainer, load_chain


def longest_reward(completions, **kwargs):
    return [len(c) / 10 for c in completions]


def train(model_dir: str, out: Path, **overrides) -> ESTrainer:
    args = ESConfig(
        output_dir=str(out),
        es_search_space=NormsOnlySpace.name,
        population_size=4,
        sigma=0.1,
        learning_rate=0.1,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=6,
        max_steps=2,
        seed=3,
        use_cpu=True,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        **overrides,
    )
    dataset = Dataset.from_dict({"prompt": [f"Count to {n}:" for n in range(1, 9)]})
    trainer = ESTrainer(model_dir, longest_reward, args=args, train_dataset=dataset)
    trainer.train()
    return trainer


def weights(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_a_registered_space_trains_and_replays_its_chain_bitwise(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    trainer = train(tiny_model_dir, tmp_path / "out")
    trained, start = weights(trainer.model), weights(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    moved = {name for name, p in trained.items() if not torch.equal(p, start[name])}
    assert moved and all("norm" in name for name in moved)  # only the space's parameters moved
    trainer.save_model()
    chain = load_chain(str(tmp_path / "out"))
    assert chain.header["space"]["kind"] == NormsOnlySpace.name
    replayed = chain.apply(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    assert all(torch.equal(p, trained[name]) for name, p in replayed.named_parameters())
    with pytest.raises(ValueError, match="pairs its members"):
        ESConfig(output_dir=str(tmp_path), es_search_space=NormsOnlySpace.name, population_size=3)


def test_a_space_made_without_its_update_rule_is_refused_by_name():
    from trl_es.es.weights import LocalWeights

    class RulelessSpace(NormsOnlySpace):
        name = "test-ruleless"

        def __init__(self, weights):
            self.weights = weights  # SearchSpace.__init__ not called: no update rule

        @classmethod
        def from_config(cls, args, model, weights, load_model=None):
            return cls(weights)

    weights = LocalWeights({"norm.weight": torch.nn.Parameter(torch.ones(4))}, seed=0, table_size=1 << 12)
    with pytest.raises(TypeError, match="'test-ruleless' was made without its update rule"):
        RulelessSpace.build(None, None, weights, load_model=None, zero_stage=None)
