"""es_optimizer: the ES gradient estimate ĝ = 1/(Nσ)·Σ z_i ε_i goes to Trainer's own optimizer as the gradient of
−R. SGD on ĝ is the plain update with α = lr/σ; AdamW and SGD with momentum train, resume bitwise, keep weights and
optimizer state bitwise through a failed step, and their seed chains replay through the optimizer bitwise. The default
stays the plain update (the regression guard holds its hashes; 1 vs 2 processes: the guard's full_adamw scenario)."""

import pytest
import torch
from datasets import Dataset
from helpers import es_config

from trl_es import ESTrainer, load_chain
from trl_es.chains import replay


PROMPTS = Dataset.from_dict({"prompt": [f"Count to {n}:" for n in range(1, 9)]})
ADAMW = {"es_optimizer": True, "optim": "adamw_torch", "learning_rate": 3e-3, "weight_decay": 0.01,
         "lr_scheduler_type": "cosine", "warmup_steps": 1}  # fmt: skip
SGD_MOMENTUM = {"es_optimizer": True, "optim": "sgd", "optim_args": "momentum=0.9", "learning_rate": 1e-4}
ADAFACTOR = {"es_optimizer": True, "optim": "adafactor", "learning_rate": 1e-3}  # transformers' (torch has its own)


def reward(completions, **kwargs):
    return [len(c) / 10 + ("1" in c) for c in completions]


def weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def optimizer_state(trainer) -> list[torch.Tensor]:
    return [t.clone() for state in trainer.optimizer.state.values() for t in state.values() if torch.is_tensor(t)]


def train(folder, model_dir, max_steps=3, reward_funcs=reward, **overrides):
    args = es_config(folder, max_steps=max_steps, **overrides)
    trainer = ESTrainer(model_dir, reward_funcs, args=args, train_dataset=PROMPTS)
    trainer.train()
    return trainer


@pytest.mark.slow  # kept out of the fast suite for time; ~3 s
def test_sgd_on_the_gradient_estimate_is_the_plain_update(tmp_path, tiny_model_dir):
    """θ − η·(−ĝ) = θ + η/(Nσ)·Σ z ε: SGD with lr η gives the plain update with α = η/σ (up to rounding)."""
    sigma, eta = 0.02, 4e-4
    sgd = train(tmp_path / "sgd", tiny_model_dir, max_steps=1, sigma=sigma, es_optimizer=True, optim="sgd",
                learning_rate=eta)  # fmt: skip
    plain = train(tmp_path / "plain", tiny_model_dir, max_steps=1, sigma=sigma, learning_rate=eta / sigma)
    start = weights(ESTrainer(tiny_model_dir, reward, args=es_config(tmp_path), train_dataset=PROMPTS).model)
    for name, p in plain.model.named_parameters():
        moved = p - start[name]
        assert moved.abs().max() > 0
        torch.testing.assert_close(dict(sgd.model.named_parameters())[name] - start[name], moved, rtol=1e-4, atol=1e-7)
    assert "es/gradient_norm" in sgd.state.log_history[0] and "es/update_norm" not in sgd.state.log_history[0]


@pytest.mark.parametrize(
    "settings", [pytest.param(s, marks=pytest.mark.slow) for s in (ADAMW, SGD_MOMENTUM)], ids=["adamw", "sgd-momentum"]
)
def test_resume_is_bitwise_with_the_optimizer_state_in_checkpoints(tmp_path, tiny_model_dir, settings):
    full = train(tmp_path / "run", tiny_model_dir, save_strategy="steps", save_steps=1, **settings)
    assert optimizer_state(full)  # the optimizer holds state (moments, momentum)
    resumed = ESTrainer(tiny_model_dir, reward, args=es_config(tmp_path / "run", max_steps=3, **settings),
                        train_dataset=PROMPTS)  # fmt: skip
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "out" / "checkpoint-1"))
    assert same(weights(resumed.model), weights(full.model))
    assert all(torch.equal(a, b) for a, b in zip(optimizer_state(resumed), optimizer_state(full), strict=True))


@pytest.mark.slow
def test_a_failed_step_leaves_weights_and_optimizer_state_bitwise(tmp_path, tiny_model_dir):
    calls = []

    def flaky(completions, trainer_state, **kwargs):
        calls.append(trainer_state.global_step)
        if trainer_state.global_step == 2 and calls.count(2) == 3:
            raise RuntimeError("reward server down")
        return reward(completions)

    args = es_config(tmp_path, max_steps=3, **ADAMW)
    trainer = ESTrainer(tiny_model_dir, flaky, args=args, train_dataset=PROMPTS)
    kept = {}
    trainer.add_callback(type("Keep", (__import__("transformers").TrainerCallback,), {
        "on_step_end": lambda self, args, state, control, **kw: kept.update(
            weights=weights(trainer.model), optimizer=optimizer_state(trainer)),
    })())  # fmt: skip
    with pytest.raises(RuntimeError, match="reward server down"):
        trainer.train()
    assert trainer.state.global_step == 2
    assert same(weights(trainer.model), kept["weights"])
    assert all(torch.equal(a, b) for a, b in zip(optimizer_state(trainer), kept["optimizer"], strict=True))
    assert all(p.grad is None for p in trainer.model.parameters())  # no gradient left for a later step()


def test_an_optimizer_step_that_overflows_is_refused_inside_the_step(tmp_path, tiny_model_dir):
    """The optimizer steps inside the guarded ES step and its result is checked like every other update: SGD at
    lr=3e38 turned 26 of 27 tensors into inf while training reported success. Now: an error naming the tensor, θ
    restored bitwise, and the distance metric of a normal step is that step's own (it lagged one step)."""
    from transformers import AutoModelForCausalLM

    args = es_config(tmp_path, max_steps=1, es_optimizer=True, optim="sgd", learning_rate=3e38)
    trainer = ESTrainer(tiny_model_dir, reward, args=args, train_dataset=PROMPTS)
    with pytest.raises(FloatingPointError, match="optimizer's step made"):
        trainer.train()
    assert same(weights(trainer.model), weights(AutoModelForCausalLM.from_pretrained(tiny_model_dir)))
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    trainer = ESTrainer(
        tiny_model_dir, reward, args=es_config(tmp_path, max_steps=1, **SGD_MOMENTUM), train_dataset=PROMPTS
    )
    trainer.train()
    assert trainer.state.log_history[0]["es/rel_distance_from_start"] > 0  # the step's own update, not the last one's


@pytest.mark.parametrize(
    "settings",
    [
        ADAMW,
        ADAFACTOR,
        pytest.param(SGD_MOMENTUM, marks=pytest.mark.slow),
        pytest.param({**ADAMW, "es_search_space": "lowrank", "lowrank_rank": 2}, marks=pytest.mark.slow),
    ],
    ids=["adamw", "adafactor", "sgd-momentum", "lowrank-adamw"],
)
def test_chains_replay_through_the_optimizer_bitwise(tmp_path, tiny_model_dir, settings):
    """The chain names the optimizer's module and class, so replay builds that one: transformers' Adafactor, not
    torch.optim's algorithm of the same name."""
    from transformers import AutoModelForCausalLM

    trainer = train(tmp_path, tiny_model_dir, **settings)
    trainer.save_model(str(tmp_path / "saved"))
    chain = load_chain(str(tmp_path / "saved"))
    recorded = chain.header["space"]["optimizer"]
    built = {"adamw_torch": ("torch.optim", "AdamW"), "sgd": ("torch.optim", "SGD"),
             "adafactor": ("transformers.optimization", "Adafactor")}  # fmt: skip
    assert (recorded["module"], recorded["class"]) == built[settings["optim"]]
    replay(chain, tiny_model_dir, str(tmp_path / "rebuilt"))
    assert same(weights(AutoModelForCausalLM.from_pretrained(tmp_path / "rebuilt")), weights(trainer.model))


def test_settings_without_meaning_are_refused(tmp_path):
    with pytest.raises(ValueError, match="es_optimizer=True is invalid: Hyper-ES"):
        es_config(tmp_path, es_optimizer=True, es_search_space="merge", merge_models=["m"])
    with pytest.raises(ValueError, match="es_optimizer=True is invalid: vLLM"):
        es_config(tmp_path, es_optimizer=True, use_vllm=True)
