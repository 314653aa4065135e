"""A new search space is one registered class: defined here alone, it trains and replays its seed chain bitwise with
no change to trl-es; the regression guard's `registered_space` scenario trains it with 1 and 2 processes (same
weights, recorded hash)."""

import contextlib
import os
import sys
from pathlib import Path

import pytest
import torch


sys.path.insert(0, os.path.dirname(__file__))
from datasets import Dataset  # noqa: E402

from trl_es import ESConfig, ESTrainer, load_chain
from trl_es.es import SEARCH_SPACES, Direction, SearchSpace, register, update_coefficients
from trl_es.es.space import one_member


class NormsOnlySpace(SearchSpace):
    """Antithetic Gaussian members over the normalisation weights alone; the plain ES update on them."""

    name = "test-norms-only"

    def __init__(self, weights, seed: int, population_size: int, sigma: float):
        self.weights, self.seed, self.population_size, self.sigma = weights, seed, population_size, sigma
        self.names = [name for name in weights.params if "norm" in name]

    @classmethod
    def check_config(cls, args, refuse):
        if args.population_size % 2:
            refuse("population_size", "this space pairs its members")

    @classmethod
    def from_config(cls, args, model, weights, load_model=None):
        return cls(weights, args.seed, args.population_size, args.sigma)

    def _ask(self, step):
        return [
            Direction(self.seed * 1000 + step * 100 + i // 2, 1 - 2 * (i % 2)) for i in range(self.population_size)
        ]

    @contextlib.contextmanager
    def evaluating(self, members):
        route = one_member(members)
        (member,) = members
        if member is None:
            self.weights.center()
        else:
            self.weights.member(member.seed, member.sign * self.sigma, self.names)
        yield route

    def _tell(self, members, rewards, fitness, learning_rate):
        pairs = [(m.seed, m.sign) for m in members]
        coefficients = update_coefficients(fitness, pairs, learning_rate, len(members))
        norm = self.weights.update(coefficients, 0.0, self.names)
        return {"es/update_norm": norm}, {"coefficients": [[s, c] for s, c in coefficients.items()]}

    def chain_header(self):
        return {"kind": self.name, "names": self.names}

    @staticmethod
    def replayer(header, weights, load_model=None):
        def replay(update):
            weights.update({int(s): float(c) for s, c in update["coefficients"]}, 0.0, header["names"])

        return replay


if NormsOnlySpace.name not in SEARCH_SPACES:
    register(NormsOnlySpace)


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
