"""GRPOTrainer's `optimizers=(optimizer, scheduler)` and Trainer's `optimizer_cls_and_kwargs`, with
`es_optimizer=True`: the given optimizer (or the one built from the class) is the one that steps on the ES gradient
estimate, at its scheduler's learning rate, and the seed chain replays through it. Without `es_optimizer` they are
refused with the reason, as are a scheduler without its optimizer or built on another, an optimizer that lacks ES
parameters and one a seed chain could not rebuild."""

import pytest
import torch
from datasets import Dataset
from helpers import es_config
from transformers import AutoModelForCausalLM

from trl_es import ESTrainer, load_chain
from trl_es.chains import replay


PROMPTS = Dataset.from_dict({"prompt": [f"Count to {n}:" for n in range(1, 9)]})
SIGMA, ETA = 0.02, 4e-4


def reward(completions, **kwargs):
    return [len(c) / 10 + ("1" in c) for c in completions]


def weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.slow  # two runs and a replay, ~10 s
def test_the_given_optimizer_and_scheduler_step_on_the_gradient_estimate(tmp_path, tiny_model_dir):
    """As Trainer's own test of `optimizers`: the trainer holds the given pair, and the weights moved as that optimizer
    moves them — SGD at half of η (the scheduler's factor) is the plain update with α = η/(2σ)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    start = weights(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=ETA)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    args = es_config(tmp_path / "given", max_steps=1, sigma=SIGMA, learning_rate=1.0, es_optimizer=True)
    trainer = ESTrainer(model, reward, args=args, train_dataset=PROMPTS, optimizers=(optimizer, scheduler))
    trainer.train()
    assert trainer.optimizer is optimizer and trainer.lr_scheduler is scheduler
    assert optimizer.param_groups[0]["lr"] == ETA / 2  # its scheduler's rate, not learning_rate=1.0
    plain = ESTrainer(tiny_model_dir, reward, args=es_config(tmp_path / "plain", max_steps=1, sigma=SIGMA,
                      learning_rate=ETA / 2 / SIGMA), train_dataset=PROMPTS)  # fmt: skip
    plain.train()
    for name, p in plain.model.named_parameters():
        moved = p - start[name]
        assert moved.abs().max() > 0
        torch.testing.assert_close(
            dict(trainer.model.named_parameters())[name] - start[name], moved, rtol=1e-4, atol=1e-7
        )
    trainer.save_model(str(tmp_path / "saved"))
    chain = load_chain(str(tmp_path / "saved"))
    assert chain.steps[0]["update"]["learning_rates"] == [ETA / 2]
    replay(chain, tiny_model_dir, str(tmp_path / "rebuilt"))
    rebuilt = weights(AutoModelForCausalLM.from_pretrained(tmp_path / "rebuilt"))
    assert all(torch.equal(rebuilt[n], p) for n, p in weights(trainer.model).items())


@pytest.mark.slow  # ~5 s
def test_optimizer_cls_and_kwargs_builds_the_optimizer_over_the_new_adapter(tmp_path, tiny_model_dir):
    """The adapter `peft_config` adds exists only inside ESTrainer, so its optimizer comes as a class and kwargs."""
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False, task_type="CAUSAL_LM")
    args = es_config(tmp_path, max_steps=1, sigma=0.5, es_optimizer=True)  # members of a tiny adapter that differ
    trainer = ESTrainer(tiny_model_dir, reward, args=args, train_dataset=PROMPTS, peft_config=lora,
                        optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}))  # fmt: skip
    trainer.train()
    assert type(trainer.optimizer) is torch.optim.SGD and trainer.optimizer.defaults["momentum"] == 0.9
    momentum = [trainer.optimizer.state[p].get("momentum_buffer") for p in trainer.es_params.values()]
    assert all(buffer is not None and buffer.abs().max() > 0 for buffer in momentum)  # it stepped on every one


def test_optimizers_without_es_optimizer_are_refused(tmp_path, tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    optimizer = torch.optim.SGD(model.parameters(), lr=ETA)
    with pytest.raises(ValueError, match=r"`optimizers` gives Trainer an optimizer, which the plain ES update does"):
        ESTrainer(model, reward, args=es_config(tmp_path), train_dataset=PROMPTS, optimizers=(optimizer, None))
    with pytest.raises(ValueError, match="`optimizer_cls_and_kwargs` .* set ESConfig\\(es_optimizer=True\\)"):
        ESTrainer(model, reward, args=es_config(tmp_path), train_dataset=PROMPTS,
                  optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": ETA}))  # fmt: skip
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    with pytest.raises(ValueError, match="a scheduler without its optimizer"):
        ESTrainer(model, reward, args=es_config(tmp_path, es_optimizer=True), train_dataset=PROMPTS,
                  optimizers=(None, scheduler))  # fmt: skip
    other = torch.optim.SGD(model.parameters(), lr=ETA)  # the scheduler would set its rate, never stepped: rate 0
    with pytest.raises(ValueError, match="a scheduler built on another optimizer than the one it holds"):
        ESTrainer(model, reward, args=es_config(tmp_path, es_optimizer=True), train_dataset=PROMPTS,
                  optimizers=(other, scheduler))  # fmt: skip


def test_an_optimizer_lacking_es_parameters_is_refused(tmp_path, tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    optimizer = torch.optim.SGD(model.model.layers.parameters(), lr=ETA)  # not the embedding nor the final norm
    args = es_config(tmp_path, es_optimizer=True)
    trainer = ESTrainer(model, reward, args=args, train_dataset=PROMPTS, optimizers=(optimizer, None))
    with pytest.raises(
        ValueError, match=r"does not hold 2 of the \d+ parameters ES trains \(e.g. 'model.embed_tokens"
    ):
        trainer.train()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), AutoModelForCausalLM.from_pretrained(
        tiny_model_dir).parameters(), strict=True))  # fmt: skip


class SGD(torch.optim.SGD):
    """A user's optimizer under torch's class name: a chain recording "SGD" alone would replay torch's."""


def test_an_optimizer_a_seed_chain_cannot_rebuild_is_refused_before_the_first_update(tmp_path, tiny_model_dir):
    args = es_config(tmp_path, max_steps=1, es_optimizer=True)
    trainer = ESTrainer(tiny_model_dir, reward, args=args, train_dataset=PROMPTS,
                        optimizer_cls_and_kwargs=(SGD, {"lr": ETA}))  # fmt: skip
    start = weights(trainer.model)
    with pytest.raises(ValueError, match=r"test_optimizers_argument.SGD: a seed chain records optimizers of torch"):
        trainer.train()
    assert all(torch.equal(p, start[n]) for n, p in trainer.model.named_parameters())
