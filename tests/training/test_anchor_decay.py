"""The anchored decay θ ← θ − λ·(θ − θ₀) after each update (`ESConfig.es_anchor_decay`): λ = 0 is the run without it
bitwise; λ > 0 pulls toward the run's starting weights by hand-checkable amounts; a seed chain replays it bitwise; a
resumed run, whose checkpoint keeps θ₀, equals the uninterrupted one; it is refused where it has no meaning."""

import pytest
import torch
from datasets import Dataset
from helpers import es_config

from trl_es import ESTrainer, load_chain
from trl_es.chains import replay
from trl_es.es.full import FullSpace
from trl_es.es.space import UpdateRule, anchor_pull
from trl_es.es.weights import LocalWeights
from trl_es.training.checkpoints import ANCHOR_FILE


PROMPTS = Dataset.from_dict({"prompt": [f"Count to {n}:" for n in range(1, 9)]})


def reward(completions, **kwargs):
    return [len(c) / 10 + ("1" in c) for c in completions]


def same_weights(a, b) -> bool:
    a, b = dict(a.named_parameters()), dict(b.named_parameters())
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def trainer(folder, model, **overrides):
    return ESTrainer(model, reward, args=es_config(folder, **overrides), train_dataset=PROMPTS)


def test_the_pull_is_theta_minus_lambda_times_theta_minus_theta0():
    theta = {"w": torch.tensor([1.0, 2.0, -4.0]), "b": torch.tensor([0.5], dtype=torch.bfloat16)}
    anchor_pull(theta, {"w": torch.tensor([0.0, 4.0, -4.0]), "b": torch.tensor([1.5], dtype=torch.bfloat16)}, 0.25)
    assert theta["w"].tolist() == [0.75, 2.5, -4.0]  # 1 − ¼·1, 2 − ¼·(−2), at θ₀ already
    assert theta["b"].tolist() == [0.75] and theta["b"].dtype == torch.bfloat16


def test_one_update_from_theta0_keeps_one_minus_lambda_of_the_step():
    """From θ₀, the anchored update is θ₀ + (1 − λ)·Δ, Δ the update without the decay."""

    def step(decay):
        torch.manual_seed(0)
        params = {"a": torch.nn.Parameter(torch.randn(300)), "b": torch.nn.Parameter(torch.randn(7, 5))}
        start = {name: p.detach().clone() for name, p in params.items()}
        weights = LocalWeights(params, seed=1, table_size=1 << 21)
        space = FullSpace(weights, seed=1, population_size=4, rule=UpdateRule(sigma=0.1, anchor_decay=decay))
        weights.capture()
        space.rule.hold_anchor(params)
        space.tell(space.ask(0), torch.tensor([1.0, 0.0, 3.0, 2.0]), learning_rate=0.5)
        return {name: p.detach() - start[name] for name, p in params.items()}

    plain, anchored = step(0.0), step(0.2)
    for name in plain:
        assert plain[name].abs().max() > 0.1
        torch.testing.assert_close(anchored[name], 0.8 * plain[name], rtol=0, atol=1e-6)


def test_lambda_zero_is_the_run_without_the_field(tmp_path, tiny_model_dir):
    runs = [trainer(tmp_path / str(k), tiny_model_dir, save_strategy="steps", save_steps=1, **field)
            for k, field in enumerate(({}, {"es_anchor_decay": 0.0}))]  # fmt: skip
    for run in runs:
        run.train()
    assert same_weights(*(run.model for run in runs))
    assert runs[0].chain.header["space"] == runs[1].chain.header["space"] == {"kind": "full", "groups": None}
    assert not (tmp_path / "1" / "out" / "checkpoint-1" / ANCHOR_FILE).exists()


def test_the_decay_pulls_the_run_toward_its_start(tmp_path, tiny_model_dir):
    start = {name: p.detach().clone() for name, p in trainer(tmp_path / "s", tiny_model_dir).model.named_parameters()}

    def distance(model):
        return sum(float((p.detach() - start[name]).square().sum()) for name, p in model.named_parameters()) ** 0.5

    plain, anchored = (
        trainer(tmp_path / "p", tiny_model_dir),
        trainer(tmp_path / "a", tiny_model_dir, es_anchor_decay=0.5),
    )
    plain.train(), anchored.train()
    assert 0 < distance(anchored.model) < distance(plain.model)
    assert anchored.chain.header["space"]["anchor_decay"] == 0.5


SETTINGS = {
    "full": {},
    "lowrank": {"es_search_space": "lowrank", "lowrank_rank": 2},
    "adamw": {"es_optimizer": True, "optim": "adamw_torch", "learning_rate": 3e-3, "weight_decay": 0.01},
}


@pytest.mark.parametrize("setting", SETTINGS)
def test_the_chain_replays_the_decay_bitwise(tmp_path, tiny_model_dir, setting):
    from transformers import AutoModelForCausalLM

    run = trainer(tmp_path, tiny_model_dir, max_steps=3, es_anchor_decay=0.3, **SETTINGS[setting])
    run.train()
    run.save_model(str(tmp_path / "saved"))
    assert not (tmp_path / "saved" / ANCHOR_FILE).exists()  # a saved model's chain rebuilds θ₀ from its base
    chain = load_chain(str(tmp_path / "saved"))
    assert any(entry["update"] is not None for entry in chain.steps)
    replay(chain, tiny_model_dir, str(tmp_path / "rebuilt"))
    assert same_weights(AutoModelForCausalLM.from_pretrained(tmp_path / "rebuilt"), run.model)
    del chain.header["space"]["anchor_decay"]  # the same updates without the pull: other weights than its tip
    with pytest.raises(ValueError, match="other weights than its tip"):
        chain.apply(AutoModelForCausalLM.from_pretrained(tiny_model_dir))


def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path, tiny_model_dir):
    overrides = dict(max_steps=3, es_anchor_decay=0.3, save_strategy="steps", save_steps=1)
    full = trainer(tmp_path / "full", tiny_model_dir, **overrides)
    full.train()
    checkpoint = tmp_path / "full" / "out" / "checkpoint-1"
    start = {name: p.detach() for name, p in trainer(tmp_path / "s", tiny_model_dir).model.named_parameters()}
    from safetensors.torch import load_file

    kept = load_file(checkpoint / ANCHOR_FILE)
    assert kept.keys() == start.keys() and all(torch.equal(kept[name], start[name]) for name in kept)
    resumed = trainer(tmp_path / "resumed", tiny_model_dir, **overrides)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.chain.steps == full.chain.steps
    assert same_weights(resumed.model, full.model)


def test_a_missing_or_foreign_theta0_is_refused(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file, save_file

    overrides = dict(max_steps=1, es_anchor_decay=0.3, save_strategy="steps", save_steps=1)
    trainer(tmp_path / "a", tiny_model_dir, **overrides).train()
    checkpoint = tmp_path / "a" / "out" / "checkpoint-1"
    kept = load_file(checkpoint / ANCHOR_FILE)
    save_file({name: t + 1 for name, t in kept.items()}, checkpoint / ANCHOR_FILE)
    with pytest.raises(ValueError, match="not the weights this run started from"):
        trainer(tmp_path / "b", tiny_model_dir, **{**overrides, "max_steps": 2}).train(str(checkpoint))
    (checkpoint / ANCHOR_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="es_anchor.safetensors is missing"):
        trainer(tmp_path / "c", tiny_model_dir, **{**overrides, "max_steps": 2}).train(str(checkpoint))
    with pytest.raises(ValueError, match="other .* than it was trained with"):  # the chain records λ
        trainer(tmp_path / "d", tiny_model_dir, max_steps=2).train(str(checkpoint))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"es_anchor_decay": 1.0}, "0 ≤ λ < 1"),
        ({"es_anchor_decay": -0.1}, "0 ≤ λ < 1"),
        ({"es_anchor_decay": 0.1, "es_search_space": "merge", "merge_models": ["m"]}, "overwrite a pull"),
        ({"es_anchor_decay": 0.1, "use_vllm": True}, "the pull toward θ₀ is not one"),
    ],
)
def test_refused_where_it_has_no_meaning(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=f"es_anchor_decay.*{message}"):
        es_config(tmp_path, **overrides)
