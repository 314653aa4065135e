"""GRPO ⇄ ES hand-off with real TRL GRPOTrainer and ESTrainer: each order, each stage's output kept and loadable."""

import importlib.util
from pathlib import Path

import pytest
import torch
from helpers import REPOSITORY
from transformers import AutoModelForCausalLM, AutoTokenizer


EXAMPLE = REPOSITORY / "examples" / "sequential.py"


def token_sum_reward(completion_ids, **kwargs):
    """Varies between completions (and between ES members), so both trainers get a signal on a tiny model."""
    return [float(sum(ids) % 7) for ids in completion_ids]


def weights(path):
    return dict(AutoModelForCausalLM.from_pretrained(path).named_parameters())


@pytest.mark.slow  # real GRPOTrainer and ESTrainer stages, both orders
@pytest.mark.parametrize("order", ["grpo-es", "es-grpo"])
def test_sequential_example_runs_both_orders_and_keeps_each_stage(tmp_path, tiny_model_dir, order):
    spec = importlib.util.spec_from_file_location("sequential", EXAMPLE)
    sequential = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sequential)
    outputs = sequential.main(
        [
            "--order",
            order,
            "--model",
            tiny_model_dir,
            "--output-dir",
            str(tmp_path),
            "--grpo-steps",
            "2",
            "--es-steps",
            "2",
            "--reward",
            "test_handoff.token_sum_reward",
        ]
    )
    first, second = order.split("-")
    assert outputs == [str(tmp_path / f"1-{first}"), str(tmp_path / f"2-{second}")]
    chain = [tiny_model_dir, *outputs]
    for previous, stage, name in zip(chain, chain[1:], order.split("-"), strict=False):
        tokenizer = AutoTokenizer.from_pretrained(stage)  # the tokenizer and chat template travel with the model
        assert tokenizer.chat_template == AutoTokenizer.from_pretrained(tiny_model_dir).chat_template
        before, after = weights(previous), weights(stage)
        assert any(not torch.equal(before[n], after[n]) for n in before), f"{stage} did not train"
        if name == "es":  # ESTrainer's card names the weights it started from
            assert f"| base model | `{previous}` |" in (Path(stage) / "README.md").read_text()
    if order == "es-grpo":  # GRPO started from the ES output: it is nearer to it than to the original model
        original, es, grpo = weights(tiny_model_dir), weights(outputs[0]), weights(outputs[1])
        distance = lambda a, b: sum(float((a[n] - b[n]).square().sum()) for n in a)  # noqa: E731
        assert distance(grpo, es) < distance(grpo, original)


@pytest.fixture(scope="module")
def grpo_lora_checkpoint(tmp_path_factory, tiny_model_dir):
    """A real GRPOTrainer LoRA run's checkpoint-1 (adapter, tokenizer, trainer state)."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    out = tmp_path_factory.mktemp("grpo-lora")
    args = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        max_steps=1,
        learning_rate=1e-2,
        bf16=False,
        save_strategy="steps",
        save_steps=1,
        report_to="none",
        disable_tqdm=True,
    )
    dataset = Dataset.from_dict({"prompt": [f"Count to {n}:" for n in range(1, 9)]})
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    GRPOTrainer(tiny_model_dir, token_sum_reward, args=args, train_dataset=dataset, peft_config=lora).train()
    return out / "checkpoint-1"


@pytest.mark.slow  # kept out of the fast suite for time; ~5 s
def test_es_starts_from_a_grpo_lora_checkpoint_merged_or_adapter_only(tmp_path, grpo_lora_checkpoint, prompt_dataset):
    from helpers import es_config
    from peft import PeftModel

    from trl_es import ESTrainer

    assert (grpo_lora_checkpoint / "adapter_config.json").is_file()
    merged = ESTrainer(
        str(grpo_lora_checkpoint), token_sum_reward, args=es_config(tmp_path / "merged"), train_dataset=prompt_dataset
    )
    assert not isinstance(merged.model, PeftModel) and not any("lora" in n for n, _ in merged.model.named_parameters())
    assert len(merged.es_params) == len(list(merged.model.parameters()))  # every weight of the merged model moves

    args = es_config(tmp_path / "adapter", es_adapter_only=True, population_size=8, sigma=0.05)
    trainer = ESTrainer(str(grpo_lora_checkpoint), token_sum_reward, args=args, train_dataset=prompt_dataset)
    assert isinstance(trainer.model, PeftModel) and set(trainer.es_params) == {
        n for n, _ in trainer.model.named_parameters() if "lora_" in n
    }
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    trainer.save_model()
    moved = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all("lora_" in n for n in moved)  # only the adapter moved
    saved = tmp_path / "adapter" / "out"
    assert (saved / "adapter_model.safetensors").is_file()  # a normal PEFT adapter
    base = AutoModelForCausalLM.from_pretrained(trainer.model.peft_config["default"].base_model_name_or_path)
    reloaded = PeftModel.from_pretrained(base, saved)
    for name, p in reloaded.named_parameters():
        if "lora_" in name:
            assert torch.equal(p, dict(trainer.model.named_parameters())[name]), name


def test_bad_starting_points_are_clear_errors(tmp_path, grpo_lora_checkpoint, tiny_model_dir, prompt_dataset):
    import json
    import shutil

    from helpers import es_config
    from transformers import AddedToken

    from trl_es import ESTrainer

    orphan = tmp_path / "orphan"
    shutil.copytree(grpo_lora_checkpoint, orphan)
    config = json.loads((orphan / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "deleted-base")
    (orphan / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match="needs its base model"):
        ESTrainer(str(orphan), token_sum_reward, args=es_config(tmp_path), train_dataset=prompt_dataset)

    no_weights = tmp_path / "checkpoint-7"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((Path(tiny_model_dir) / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="holds no model weights"):
        ESTrainer(str(no_weights), token_sum_reward, args=es_config(tmp_path), train_dataset=prompt_dataset)

    with pytest.raises(ValueError, match="sparse_delta_tau needs a full model"):
        ESTrainer(
            str(grpo_lora_checkpoint),
            token_sum_reward,
            args=es_config(tmp_path, es_adapter_only=True, sparse_delta_tau=1e-3),
            train_dataset=prompt_dataset,
        )

    with pytest.raises(ValueError, match="needs a PEFT adapter"):
        ESTrainer(
            tiny_model_dir,
            token_sum_reward,
            args=es_config(tmp_path, es_adapter_only=True),
            train_dataset=prompt_dataset,
        )

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_tokens([AddedToken(f"<extra_{k}>") for k in range(64)])
    with pytest.raises(ValueError, match="do not belong together"):
        ESTrainer(
            tiny_model_dir,
            token_sum_reward,
            args=es_config(tmp_path),
            train_dataset=prompt_dataset,
            processing_class=tokenizer,
        )


def test_es_starts_from_a_full_grpo_checkpoint(tmp_path, tiny_model_dir, prompt_dataset):
    from helpers import es_config
    from trl import GRPOConfig, GRPOTrainer

    from trl_es import ESTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path / "grpo"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        max_steps=1,
        learning_rate=1e-2,
        bf16=False,
        save_strategy="steps",
        save_steps=1,
        report_to="none",
        disable_tqdm=True,
    )
    GRPOTrainer(tiny_model_dir, token_sum_reward, args=args, train_dataset=prompt_dataset).train()
    checkpoint = tmp_path / "grpo" / "checkpoint-1"
    assert (checkpoint / "optimizer.pt").is_file()  # a real Trainer checkpoint, not just a model dir
    trainer = ESTrainer(str(checkpoint), token_sum_reward, args=es_config(tmp_path), train_dataset=prompt_dataset)
    grpo_weights, original = weights(checkpoint), weights(tiny_model_dir)
    assert any(not torch.equal(grpo_weights[n], original[n]) for n in original)
    assert all(torch.equal(p, grpo_weights[n]) for n, p in trainer.model.named_parameters())


def test_a_save_writing_no_delta_removes_an_earlier_runs_delta(tmp_path, tiny_model_dir, prompt_dataset):
    """`sparse_delta.safetensors` describes the model saved beside it: a later save into the same directory that
    writes none removes the earlier run's, and its statistics leave the model card."""
    from helpers import es_config

    from trl_es import ESTrainer

    delta = tmp_path / "out" / "sparse_delta.safetensors"
    ESTrainer(tiny_model_dir, token_sum_reward, args=es_config(tmp_path, sparse_delta_tau=0.01),
              train_dataset=prompt_dataset).save_model()  # fmt: skip
    assert delta.is_file()
    ESTrainer(tiny_model_dir, token_sum_reward, args=es_config(tmp_path), train_dataset=prompt_dataset).save_model()
    assert not delta.exists()
    assert "sparse delta" not in (tmp_path / "out" / "README.md").read_text()
