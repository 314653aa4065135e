"""ES on a quantized base (bitsandbytes on CPU): members and updates move the adapter only — the quantized weights never
change, a failed step puts the adapter back bitwise, a resumed run and the seed chain's replay (which loads the base
quantized, as its header records) end on the trained adapter bitwise — for a new adapter (`peft_config`) and for an
adapter continued with `es_adapter_only`; `lowrank` perturbs the adapter's linears over a 4-bit base. Full ES on
quantized weights is refused with the reason, from Python and from `trl-es es` recipes (`load_in_8bit` without
`use_peft`). 1 vs 2 processes: tests/distributed/test_multiprocess.py."""

import pytest
import torch
from datasets import Dataset
from helpers import build_tiny_model, es_config


pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")

from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, TrainerCallback

from trl_es import ESTrainer, load_chain
from trl_es.chains import replay
from trl_es.es.params import is_quantized, select_parameters


PROMPTS = Dataset.from_dict({"prompt": [f"Count to {n}:" for n in range(1, 9)]})
INT8 = BitsAndBytesConfig(load_in_8bit=True)
NF4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
SETTINGS = dict(sigma=0.05, learning_rate=0.05)


def reward(completions, **kwargs):
    return [len(c) / 10 + ("1" in c) for c in completions]


def lora():
    """A LoRA adapter with random A and B (`init_lora_weights=False`), so that the first members already differ."""
    return peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False, task_type="CAUSAL_LM")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, tokenizer_dir):
    """A tiny Llama whose linear layers have ≥32 output features (bitsandbytes' 4-bit CPU layout needs them)."""
    path = tmp_path_factory.mktemp("quantizable") / "model"
    return build_tiny_model(path, tokenizer_dir, hidden_size=64, intermediate_size=128, initializer_range=0.3)


@pytest.fixture(scope="module")
def int8_dir(base_dir, tmp_path_factory):
    """The base quantized to 8 bits once and saved with its tokenizer: a pre-quantized checkpoint."""
    path = tmp_path_factory.mktemp("int8") / "model"
    AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=INT8).save_pretrained(path)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def adapter_dir(base_dir, tmp_path_factory):
    """A LoRA adapter saved for the base (base_model_name_or_path: `base_dir`)."""
    path = tmp_path_factory.mktemp("adapter") / "adapter"
    torch.manual_seed(0)
    peft.get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), lora()).save_pretrained(path)
    return str(path)


def quantized_weights(model) -> dict[str, torch.Tensor]:
    """The quantized tensors, by the name of the layer that holds them (PEFT's prefixes dropped)."""
    return {
        name.removeprefix("base_model.model.").replace(".base_layer", ""): p.detach().clone()
        for name, p in model.named_parameters()
        if is_quantized(p)
    }


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def adapter(trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.es_params.items()}


def saved_adapter(folder) -> dict[str, torch.Tensor]:
    return load_file(f"{folder}/adapter_model.safetensors")


def test_quantized_parameters_are_never_selected(base_dir):
    model = AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=INT8)
    linear = model.model.layers[0].self_attn.q_proj.weight
    assert is_quantized(linear) and not is_quantized(model.model.norm.weight)

    class Packed(torch.nn.Parameter):  # a quantized tensor subclass reporting a float dtype, as torchao's do
        pass

    packed = Packed(torch.zeros(4))
    norm = torch.nn.Parameter(torch.ones(4))
    assert list(select_parameters([("packed", packed), ("norm", norm)])) == ["norm"]
    with pytest.raises(ValueError, match="all quantized .*'packed'.* Train an adapter"):
        select_parameters([("packed", packed), ("norm", norm)], patterns=["packed"])


def test_full_es_on_quantized_weights_is_refused(tmp_path, base_dir, int8_dir, adapter_dir):
    why = r"quantized \(bitsandbytes 8-bit, e.g. 'model.layers.0.self_attn.q_proj.weight'\): ES writes .* peft_config"
    with pytest.raises(ValueError, match=why):
        ESTrainer(base_dir, reward, args=es_config(tmp_path), train_dataset=PROMPTS, quantization_config=INT8)
    with pytest.raises(ValueError, match=why):  # a pre-quantized checkpoint, instantiated
        ESTrainer(
            AutoModelForCausalLM.from_pretrained(int8_dir), reward, args=es_config(tmp_path), train_dataset=PROMPTS
        )
    with pytest.raises(ValueError, match="merging it .* full ES on quantized weights.* es_adapter_only=True"):
        ESTrainer(adapter_dir, reward, args=es_config(tmp_path), train_dataset=PROMPTS, quantization_config=INT8)
    with pytest.raises(ValueError, match="both as ESTrainer's argument and in `args.model_init_kwargs`"):
        args = es_config(tmp_path, model_init_kwargs={"quantization_config": INT8})
        ESTrainer(base_dir, reward, args=args, train_dataset=PROMPTS, quantization_config=INT8, peft_config=lora())


@pytest.mark.slow  # two 8-bit steps, ~20 s
def test_members_move_the_adapter_only_and_a_failed_step_restores_it_bitwise(tmp_path, base_dir):
    calls = []

    def flaky(completions, trainer_state, **kwargs):
        calls.append(trainer_state.global_step)
        if trainer_state.global_step == 1 and calls.count(1) == 3:
            raise RuntimeError("reward server down")
        return reward(completions)

    args = es_config(tmp_path, max_steps=2, **SETTINGS)
    trainer = ESTrainer(
        base_dir, flaky, args=args, train_dataset=PROMPTS, quantization_config=INT8, peft_config=lora()
    )
    assert trainer.es_params and all(".lora_" in name for name in trainer.es_params)
    base, start, kept = quantized_weights(trainer.model), adapter(trainer), {}
    assert base  # every linear layer of the base; the tied head is the embedding, not quantized
    trainer.add_callback(type("Keep", (TrainerCallback,), {
        "on_step_end": lambda self, args, state, control, **kw: kept.update(adapter=adapter(trainer)),
    })())  # fmt: skip
    with pytest.raises(RuntimeError, match="reward server down"):
        trainer.train()
    assert trainer.state.global_step == 1 and not same(kept["adapter"], start)  # step 0 moved the adapter
    assert same(adapter(trainer), kept["adapter"])  # the failed step put it back bitwise
    assert same(quantized_weights(trainer.model), base)  # the quantized weights never changed


@pytest.mark.slow  # ~40 s: 2 steps, 1 resumed step, a replay
def test_resume_and_the_seed_chain_replay_are_bitwise(tmp_path, int8_dir):
    run = tmp_path / "run"
    args = dict(max_steps=2, save_strategy="steps", save_steps=1, **SETTINGS)
    full = ESTrainer(int8_dir, reward, args=es_config(run, **args), train_dataset=PROMPTS, peft_config=lora())
    base = quantized_weights(full.model)
    full.train()
    assert same(quantized_weights(full.model), base)
    resumed = ESTrainer(int8_dir, reward, args=es_config(run, **args), train_dataset=PROMPTS, peft_config=lora())
    resumed.train(resume_from_checkpoint=str(run / "out" / "checkpoint-1"))
    assert same(adapter(resumed), adapter(full))

    full.save_model(str(tmp_path / "saved"))
    chain = load_chain(str(tmp_path / "saved"))
    assert chain.header["base"]["quantization"]["load_in_8bit"] is True  # the chain names the base's quantization
    assert chain.header["base"]["model_dtype"] == chain.header["dtype"] == "float32"
    replay(chain, int8_dir, str(tmp_path / "rebuilt"))
    assert same(saved_adapter(tmp_path / "rebuilt"), saved_adapter(tmp_path / "saved"))


@pytest.mark.slow  # ~20 s
def test_an_adapter_is_continued_on_a_quantized_base_and_replays(tmp_path, adapter_dir):
    args = es_config(tmp_path, max_steps=1, es_adapter_only=True, **SETTINGS)
    trainer = ESTrainer(adapter_dir, reward, args=args, train_dataset=PROMPTS, quantization_config=INT8)
    base, start = quantized_weights(trainer.model), adapter(trainer)
    trainer.train()
    assert not same(adapter(trainer), start) and same(quantized_weights(trainer.model), base)
    trainer.save_model(str(tmp_path / "saved"))
    chain = load_chain(str(tmp_path / "saved"))
    replay(chain, adapter_dir, str(tmp_path / "rebuilt"))  # the base quantized at load again, from the header
    assert same(saved_adapter(tmp_path / "rebuilt"), saved_adapter(tmp_path / "saved"))


@pytest.mark.slow  # ~20 s
def test_lowrank_perturbs_the_adapter_over_a_4bit_base(tmp_path, base_dir):
    args = es_config(tmp_path, max_steps=2, es_search_space="lowrank", model_init_kwargs={"dtype": "bfloat16"},
                     **SETTINGS)  # fmt: skip
    trainer = ESTrainer(
        base_dir, reward, args=args, train_dataset=PROMPTS, quantization_config=NF4, peft_config=lora()
    )
    assert set(trainer.space.targets) == set(trainer.es_params)  # the adapter's lora_A / lora_B linears
    start = adapter(trainer)
    trainer.train()
    assert not same(adapter(trainer), start)
    # bitsandbytes re-lays 4-bit weights out for its CPU kernel at the first forward: compare after one
    reference = AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=NF4, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        reference(torch.tensor([[1, 2, 3]]))
    assert same(quantized_weights(trainer.model), quantized_weights(reference))
    trainer.save_model(str(tmp_path / "saved"))
    chain = load_chain(str(tmp_path / "saved"))
    assert (chain.header["base"]["model_dtype"], chain.header["dtype"]) == ("bfloat16", "float32")
    replay(chain, base_dir, str(tmp_path / "rebuilt"))
    assert same(saved_adapter(tmp_path / "rebuilt"), saved_adapter(tmp_path / "saved"))


def test_recipes_take_load_in_8bit_with_an_adapter(tmp_path, base_dir):
    from trl_es.commands.train import build_trainer, make_parser

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(f'{{"prompt": "Count to {n}:"}}\n' for n in range(1, 5)))
    recipe = ["--model_name_or_path", base_dir, "--dataset_name", str(data), "--reward_funcs",
              "test_quantized.reward", "--output_dir", str(tmp_path / "out"), "--load_in_8bit", "true"]  # fmt: skip
    parsed = make_parser().parse_args_and_config(args=[*recipe, "--use_peft", "true", "--lora_r", "4"])
    trainer = build_trainer(*parsed)
    assert isinstance(trainer.model, peft.PeftModel) and quantized_weights(trainer.model)
    with pytest.raises(ValueError, match=r"Train an adapter .*`use_peft: true`"):
        build_trainer(*make_parser().parse_args_and_config(args=recipe))
