"""A resume never changes which weights a run trains without saying so: a checkpoint resumed on another base, with
another adapter, learning rate or optimizer, or with its frozen weights edited is refused in one line before it
trains; a run never writes into the directory of the model it starts from; a PeftModel given in memory writes a
chain that replays."""

import shutil

import pytest
import torch
from datasets import Dataset
from helpers import es_config
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from trl_es import ESTrainer, load_chain
from trl_es.chains import replay


PROMPTS = Dataset.from_dict({"prompt": [f"Count to {n}:" for n in range(1, 9)]})
LORA = dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def reward(completions, **kwargs):
    return [len(c) / 10 + ("1" in c) for c in completions]


def slow(*values):
    return pytest.param(*values, marks=pytest.mark.slow)


def one_step(folder, model, **kwargs):
    """A 1-step run with a checkpoint (folder/out/checkpoint-1); the trainer."""
    peft_config = kwargs.pop("peft_config", None)
    args = es_config(folder, max_steps=1, save_strategy="steps", save_steps=1, **kwargs)
    trainer = ESTrainer(model, reward, args=args, train_dataset=PROMPTS, peft_config=peft_config)
    trainer.train()
    return trainer


@pytest.fixture(scope="module")
def adapter_checkpoint(tmp_path_factory, tiny_model_dir):
    folder = tmp_path_factory.mktemp("adapter")
    one_step(folder, tiny_model_dir, peft_config=LoraConfig(**LORA))
    return str(folder / "out" / "checkpoint-1")


def edited_base(tiny_model_dir):
    """The tiny model loaded from its directory, one weight edited in memory."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)
    return model


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model": "edited base"}, "weights ES does not train .* are not those the run started from"),  # item 1
        ({"peft_config": LoraConfig(**{**LORA, "lora_alpha": 8})}, r"peft_config\.lora_alpha: 4 → 8"),  # item 2
        slow({"peft_config": LoraConfig(**{**LORA, "r": 4})}, r"peft_config\.r: 2 → 4"),  # item 9
        slow({"peft_config": None}, r"other adapter .*peft_config: \{.* → None"),  # item 17
        ({"learning_rate": 0.05}, r"learning-rate schedule .*learning_rate: 0\.02 → 0\.05"),  # item 7
        slow({"es_optimizer": True, "optim": "sgd"}, "optimizer torch.optim.SGD where it was trained with none"),
    ],  # the slow ones (~2 s each) in the full suite
)
def test_a_resume_that_would_train_other_weights_is_refused_in_one_line(
    tmp_path, tiny_model_dir, adapter_checkpoint, change, message
):
    change = dict(change)
    model = edited_base(tiny_model_dir) if change.pop("model", None) else tiny_model_dir
    peft_config = change.pop("peft_config", LoraConfig(**LORA))
    args = es_config(tmp_path, max_steps=2, **change)
    trainer = ESTrainer(model, reward, args=args, train_dataset=PROMPTS, peft_config=peft_config)
    with pytest.raises(ValueError, match=message) as refusal:
        trainer.train(resume_from_checkpoint=adapter_checkpoint)
    assert "\n" not in str(refusal.value)
    assert trainer.chain is None or len(trainer.chain.steps) == 1  # no step of this run was taken
    assert not (tmp_path / "out" / "checkpoint-2").exists()


def test_a_resume_with_another_sigma_says_so_and_the_chain_records_it(tmp_path, tiny_model_dir, adapter_checkpoint):
    """Item 17: the chain's settings were those of the run's start after a resume at another σ schedule. Now the
    change is said and recorded with the first step it applies to."""
    args = es_config(tmp_path, max_steps=2, sigma_decay=0.5)
    trainer = ESTrainer(tiny_model_dir, reward, args=args, train_dataset=PROMPTS, peft_config=LoraConfig(**LORA))
    with pytest.warns(UserWarning, match="other settings than it was trained with: {'sigma_decay': 0.5}"):
        trainer.train(resume_from_checkpoint=adapter_checkpoint)
    steps = trainer.chain.steps
    assert "settings" not in steps[0] and steps[1]["settings"] == {"sigma_decay": 0.5}
    assert trainer.chain.header["settings"]["sigma_decay"] == 1.0 and trainer.chain.settings()["sigma_decay"] == 0.5


@pytest.mark.slow  # two short runs; ~6 s
def test_an_optimizer_checkpoint_resumes_only_with_its_optimizer(tmp_path, tiny_model_dir):
    """Item 8: optimizer.pt of AdamW loaded into SGD was `KeyError: 'momentum'` inside torch."""
    checkpoint = str(tmp_path / "a" / "out" / "checkpoint-1")
    one_step(tmp_path / "a", tiny_model_dir, es_optimizer=True, optim="adamw_torch", learning_rate=1e-3)
    args = es_config(tmp_path / "b", max_steps=2, es_optimizer=True, optim="sgd", learning_rate=1e-3)
    trainer = ESTrainer(tiny_model_dir, reward, args=args, train_dataset=PROMPTS)
    with pytest.raises(ValueError, match="optimizer torch.optim.SGD where it was trained with torch.optim.AdamW"):
        trainer.train(resume_from_checkpoint=checkpoint)


@pytest.mark.slow  # two short runs; ~5 s
def test_a_checkpoint_whose_frozen_weights_changed_is_refused_and_the_untouched_one_resumes(tmp_path, tiny_model_dir):
    """Item 5: ES trains the MLPs only; the checkpoint's attention weights edited on disk no longer rebuild from its
    chain. The untouched checkpoint resumes and trains on (the check does not refuse what is whole)."""
    one_step(tmp_path / "a", tiny_model_dir, es_parameter_patterns=["mlp"])
    checkpoint = tmp_path / "a" / "out" / "checkpoint-1"
    edited = tmp_path / "edited"
    shutil.copytree(checkpoint, edited)
    weights = load_file(edited / "model.safetensors")
    weights["model.layers.0.self_attn.q_proj.weight"][0, 0] += 1
    save_file(weights, edited / "model.safetensors", metadata={"format": "pt"})
    args = es_config(tmp_path / "b", max_steps=2, es_parameter_patterns=["mlp"])
    with pytest.raises(ValueError, match="weights ES does not train"):
        ESTrainer(tiny_model_dir, reward, args=args, train_dataset=PROMPTS).train(resume_from_checkpoint=str(edited))
    resumed = ESTrainer(tiny_model_dir, reward, args=args, train_dataset=PROMPTS)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 2 and len(resumed.chain.steps) == 2


def test_a_run_never_writes_into_the_model_it_starts_from(tmp_path, tiny_model_dir):
    """Item 3: output_dir = the model's directory, or model=<run>/checkpoint-K with output_dir=<run> (what the
    resume refusal used to suggest), would overwrite or rotate away the weights the chain replays from."""
    run = tmp_path / "run"
    (run / "checkpoint-2").mkdir(parents=True)
    shutil.copytree(tiny_model_dir, run / "checkpoint-2", dirs_exist_ok=True)
    for model, output_dir in [(tiny_model_dir, tiny_model_dir), (str(run / "checkpoint-2"), str(run))]:
        with pytest.raises(ValueError, match="holds the model this run starts from"):
            ESTrainer(model, reward, args=es_config(tmp_path, output_dir=output_dir), train_dataset=PROMPTS)
    loaded = AutoModelForCausalLM.from_pretrained(tiny_model_dir)  # a model object loaded from there, too
    with pytest.raises(ValueError, match="holds the model this run starts from"):
        ESTrainer(loaded, reward, args=es_config(tmp_path, output_dir=tiny_model_dir), train_dataset=PROMPTS)


@pytest.mark.slow  # a run and its replay; ~4 s
def test_a_peft_model_given_in_memory_writes_a_chain_that_replays(tmp_path, tiny_model_dir):
    """Item 6: the chain's base is the PeftModel as given (its starting adapter saved beside the run), so replay
    rebuilds the trained adapter bitwise; it used to name the bare base, which no replay could match."""
    torch.manual_seed(5)  # an adapter initialised from the user's RNG: not reproducible from any seed the run knows
    lora = LoraConfig(**LORA, init_lora_weights=False)  # B ≠ 0: the adapter acts from the start
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora)
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    args = es_config(tmp_path, max_steps=2, sigma=0.1, learning_rate=0.1)
    trainer = ESTrainer(model, reward, args=args, train_dataset=PROMPTS)
    trainer.train()
    trainer.save_model(str(tmp_path / "saved"))
    chain = load_chain(str(tmp_path / "saved"))
    replay(chain, chain.header["base"]["path"], str(tmp_path / "rebuilt"))
    rebuilt = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    from peft import PeftModel

    rebuilt = PeftModel.from_pretrained(rebuilt, str(tmp_path / "rebuilt"))
    trained = dict(trainer.model.named_parameters())
    assert any(not torch.equal(p, start[name]) for name, p in trained.items())  # the adapter was trained
    assert all(torch.equal(p, trained[name]) for name, p in rebuilt.named_parameters())
