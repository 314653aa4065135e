"""QES (es_search_space='qes') on a tiny 8-bit model (bitsandbytes LLM.int8 on CPU): the int8 weights move while
their row scales stay, the seed chain replays onto a freshly quantized base to the same integers bitwise, and a run
resumed from its step-1 checkpoint ends on the uninterrupted run's integers bitwise — one shared 2-step run. Models
QES cannot train (unquantized, 4-bit, with an adapter) are refused saying why."""

import pytest
import torch
from datasets import Dataset
from helpers import build_tiny_model, es_config


pytest.importorskip("bitsandbytes")

from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from trl_es import ESTrainer, load_chain
from trl_es.chains import replay
from trl_es.es.params import is_int8_weight


PROMPTS = Dataset.from_dict({"prompt": [f"Count to {n}:" for n in range(1, 9)]})
INT8 = BitsAndBytesConfig(load_in_8bit=True)
SETTINGS = dict(
    es_search_space="qes",
    sigma=1.5,
    learning_rate=0.5,
    per_device_train_batch_size=4,
    num_generations=1,
    max_completion_length=4,
    max_steps=2,
)


def reward(completion_ids, **kwargs):
    return [sum(ids) % 1000 / 1000 for ids in completion_ids]


def integers(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if is_int8_weight(p)}


def scales(model) -> dict[str, torch.Tensor]:
    """Each 8-bit layer's row scales (SCB), wherever bitsandbytes holds them (the weight before the first forward,
    the layer's state after)."""
    return {
        name: (module.weight.SCB if module.weight.SCB is not None else module.state.SCB).clone()
        for name, module in model.named_modules()
        if type(module).__name__ == "Linear8bitLt"
    }


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, tokenizer_dir):
    """The tiny Llama with larger weights (initializer_range 0.3), so that a member's few quantization steps change
    its sampled tokens."""
    return build_tiny_model(tmp_path_factory.mktemp("qes") / "model", tokenizer_dir, initializer_range=0.3)


@pytest.fixture(scope="module")
def run(base_dir, tmp_path_factory):
    """2 QES steps, checkpointed after each, saved with its chain: (trainer, folder, starting integers and scales)."""
    folder = tmp_path_factory.mktemp("qes_run")
    args = es_config(folder, save_strategy="steps", save_steps=1, **SETTINGS)
    trainer = ESTrainer(base_dir, reward, args=args, train_dataset=PROMPTS, quantization_config=INT8)
    start = integers(trainer.model), scales(trainer.model)
    trainer.train()
    trainer.save_model(str(folder / "saved"))
    return trainer, folder, start


def test_the_int8_weights_move_and_their_scales_stay(run):
    trainer, _, (start, start_scales) = run
    assert set(trainer.es_params) == set(start) and len(start) == 14  # every linear of the 2 layers
    assert not trainer.step_log.skipped and all(h["es/update_norm"] > 0 for h in trainer.state.log_history[:2])
    trained = integers(trainer.model)
    changed = sum(int(trained[name].ne(start[name]).sum()) for name in start)
    assert 0 < changed < sum(q.numel() for q in start.values())
    assert all(q.dtype == torch.int8 and q.abs().max() <= 127 for q in trained.values())
    assert same(scales(trainer.model), start_scales)
    with torch.no_grad():
        assert torch.isfinite(trainer.model(torch.tensor([[1, 2, 3]])).logits).all()


def test_the_seed_chain_replays_onto_a_freshly_quantized_base_bitwise(run, base_dir, tmp_path):
    trainer, folder, _ = run
    chain = load_chain(str(folder / "saved"))
    assert chain.header["dtype"] == "int8" and chain.header["base"]["quantization"]["load_in_8bit"] is True
    assert chain.header["space"] == {"kind": "qes", "feedback_decay": 0.9, "feedback_window": 4}
    replay(chain, base_dir, str(tmp_path / "rebuilt"))  # the base quantized at load, as the header records
    rebuilt = AutoModelForCausalLM.from_pretrained(str(tmp_path / "rebuilt"))
    assert same(integers(rebuilt), integers(trainer.model))


@pytest.mark.slow  # a further variant: resume (tests/training/test_trainer.py) on int8 weights
def test_a_resumed_run_ends_on_the_uninterrupted_runs_integers_bitwise(run, base_dir):
    trainer, folder, _ = run
    args = es_config(folder, save_strategy="steps", save_steps=1, **SETTINGS)
    resumed = ESTrainer(base_dir, reward, args=args, train_dataset=PROMPTS, quantization_config=INT8)
    resumed.train(resume_from_checkpoint=str(folder / "out" / "checkpoint-1"))
    assert len(resumed.space.recent) == 2  # step 0's update came back from the checkpoint
    assert same(integers(resumed.model), integers(trainer.model))


def test_models_qes_cannot_train_are_refused(tmp_path, tiny_model_dir):
    args = es_config(tmp_path, es_search_space="qes", sigma=1.5, learning_rate=0.5)
    with pytest.raises(ValueError, match="qes' trains the int8 integers .* not quantized: .*load_in_8bit=True"):
        ESTrainer(tiny_model_dir, reward, args=args, train_dataset=PROMPTS)
    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    with pytest.raises(ValueError, match=r"quantized otherwise \(bitsandbytes 4-bit, e.g. 'model.layers.0.*"):
        ESTrainer(tiny_model_dir, reward, args=args, train_dataset=PROMPTS, quantization_config=nf4)
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM")
    with pytest.raises(ValueError, match="not an adapter: drop peft_config"):
        ESTrainer(tiny_model_dir, reward, args=args, train_dataset=PROMPTS, quantization_config=INT8, peft_config=lora)


def test_a_member_written_before_the_first_forward_is_what_it_computes_with_and_is_undone(base_dir):
    """A layer reads its integers from `weight.CB` at its first forward and makes that its data. In a multi-process
    run CB had become another tensor than the data once training started, so the first forward put the loaded
    integers back under a member and undoing the member corrupted θ (2 processes then ended on other weights than
    1). Here CB is made a copy, as it was there."""
    from trl_es.es.qes import Int8Weights

    model = AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=INT8)
    params = {name: p for name, p in model.named_parameters() if is_int8_weight(p)}
    for p in params.values():
        p.CB = p.data.clone()
    start, ids = integers(model), torch.tensor([[1, 2, 3, 4]])
    weights = Int8Weights(params, seed=0, table_size=1 << 21)
    weights.capture()
    weights.member(seed=7, sign=1, sigma=6.0)
    member = integers(model)
    with torch.no_grad():
        model(input_ids=ids)
    assert same(integers(model), member) and not same(member, start)  # the forward computed with the member
    weights.center()
    assert same(integers(model), start)
