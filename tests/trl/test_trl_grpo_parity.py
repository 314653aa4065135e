"""TRL's own GRPOTrainer contract tests (tests/test_grpo_trainer.py of TRL), written anew for ESTrainer.

Each test keeps TRL's scenario and what it asserts, on the data TRL's tests use (`trl-internal-testing/zen`, rebuilt
offline in tests/data/zen) and offline tiny models of the same architectures (Qwen2, Qwen3, Llama causal LMs and
sequence classifiers, SmolLM2's tokenizer). Where TRL asserts `train_loss` and that every parameter changed, these
tests assert the same: ES's `train_loss` is the loss it minimises, −(mean population reward) over the run.

Not adapted, and why:
- loss, clipping, importance sampling, KL/reference model, entropy bonus, Liger, off-policy masks, delta clipping,
  sequence-level IS, cast_lm_head_to_fp32, num_iterations/steps_per_generation buffering, gradient checkpointing
  (`test_train_beta_non_zero`, `test_train_with_sync_ref_model`, `test_train_with_entropy_filter`,
  `test_train_multiple_iterations`, ...): they assert a loss or a gradient, which ES does not have (the fields are
  accepted and ignored: test_grpo_only_fields_are_accepted_and_listed_once; `test_train_loss_types` is kept for its
  gradient accumulation, which ES folds into the prompts of a step);
- `test_iterable_dataset_requires_dispatch_batches_false`, `test_iterable_eval_keeps_map_style_train_workers`:
  ESTrainer reads iterable datasets without Accelerate's dispatching and evaluates without an eval dataloader, so
  these settings have nothing to act on;
- `test_train_with_mask_truncated_completions*`: they assert the loss mask; ES's meaning (no reward for truncated
  completions) is tested here as test_mask_truncated_completions_gives_them_no_reward;
- tools, environments, rollout_func, VLM/images, continuous batching, vLLM on GPU: ESTrainer has no tools or
  images; continuous batching is refused with the reason; vLLM is tests/vllm/test_vllm.py;
- MoE auxiliary loss and the remaining model architectures of `test_train` (Cohere2, GLM4-MoE, GPT-OSS, Qwen3-MoE,
  NemotronH): no loss; the architectures are covered by Qwen2, Qwen3 and Llama here.
"""

import asyncio
import warnings
from contextlib import nullcontext

import pytest
import torch
from datasets import DatasetDict, IterableDatasetDict, load_dataset
from helpers import DATA
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from trl_es import ESConfig, ESTrainer


ZEN = str(DATA / "zen")


def zen(config="standard_prompt_only", split="train", streaming=False):
    return load_dataset(ZEN, config, split=split, streaming=streaming)


def build(path, tokenizer_dir, architecture, **overrides):
    """A tiny model of `architecture` (a transformers config + model class name) with SmolLM2's tokenizer."""
    import transformers

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config_class = getattr(transformers, architecture.replace("ForCausalLM", "Config").replace(
        "ForSequenceClassification", "Config"))  # fmt: skip
    size = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
    config = config_class(vocab_size=len(tokenizer), num_key_value_heads=1, pad_token_id=tokenizer.pad_token_id,
                          bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                          max_position_embeddings=256, **size, **overrides)  # fmt: skip
    torch.manual_seed(0)
    getattr(transformers, architecture)(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer_dir):
    folder = tmp_path_factory.mktemp("parity-models")
    names = {
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "llama": "LlamaForCausalLM",
        "qwen2_rm": "Qwen2ForSequenceClassification",
        "llama_rm": "LlamaForSequenceClassification",
    }
    built = {key: build(folder / key, tokenizer_dir, name, **({"num_labels": 1} if "rm" in key else {}))
             for key, name in names.items()}  # fmt: skip
    built["remote"] = remote_code_model(folder / "remote", built["llama"])
    return built


def remote_code_model(path, llama_dir):
    """A model whose class ships in its directory (`auto_map`), like TRL's tiny-RemoteForCausalLM."""
    import json
    import shutil

    shutil.copytree(llama_dir, path)
    (path / "configuration_remote.py").write_text(
        "from transformers import LlamaConfig\n\nclass RemoteConfig(LlamaConfig):\n    model_type = 'remote_llama'\n"
    )
    (path / "modeling_remote.py").write_text(
        "from transformers import LlamaForCausalLM\nfrom .configuration_remote import RemoteConfig\n\n"
        "class RemoteForCausalLM(LlamaForCausalLM):\n    config_class = RemoteConfig\n"
    )
    config = json.loads((path / "config.json").read_text())
    config.update(
        model_type="remote_llama",
        architectures=["RemoteForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_remote.RemoteConfig",
            "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM",
        },
    )
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def std(tmp_path, **overrides):
    """TRL's common test config (learning_rate=0.1, 3 prompts × 3 generations, 8 tokens, GRPOConfig's
    logging_steps=10, so the last steps' metrics reach only the final record) with ES's population and a 1-step
    budget in place of 3 epochs (one update moves every parameter)."""
    values = dict(output_dir=str(tmp_path), learning_rate=0.1, per_device_train_batch_size=3, num_generations=3,
                  max_completion_length=8, report_to="none", population_size=3, sigma=0.05, max_steps=1,
                  logging_steps=10, save_strategy="no", disable_tqdm=True)  # fmt: skip
    return ESConfig(**{**values, **overrides})


def reward_len(completions, **kwargs):
    return [float(len(c if isinstance(c, str) else c[0]["content"])) for c in completions]


def train_and_check(trainer, trainable=None):
    """TRL's check: training ran to its summary with a `train_loss`, and every (trainable) parameter changed."""
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    for name, p in trainer.model.named_parameters():
        if trainable is None or trainable(name):
            assert not torch.equal(p, before[name]), f"{name} did not change"
    return before


def test_init_minimal(models):
    trainer = ESTrainer(model=models["qwen2"], reward_funcs=models["qwen2_rm"], train_dataset=zen())
    assert trainer.args.output_dir == "qwen2-ES"


@pytest.mark.parametrize(
    "model", ["qwen2", pytest.param("qwen3", marks=pytest.mark.slow), pytest.param("llama", marks=pytest.mark.slow)]
)
def test_train(models, tmp_path, model):
    trainer = ESTrainer(models[model], reward_funcs=models["qwen2_rm"], args=std(tmp_path), train_dataset=zen())
    train_and_check(trainer)


@pytest.mark.parametrize(
    "loss_type", ["bnpo", *(pytest.param(t, marks=pytest.mark.slow) for t in ("dr_grpo", "dapo", "cispo", "sapo"))]
)
def test_train_loss_types(models, tmp_path, loss_type):
    """TRL's scenario with gradient_accumulation_steps=2: GRPO's loss type is ignored by ES, the accumulation runs
    (each ES step takes 3 × 2 prompts)."""
    with pytest.warns(UserWarning, match="ignored by ES: loss_type") if loss_type != "dapo" else nullcontext():
        args = std(tmp_path, gradient_accumulation_steps=2, loss_type=loss_type)
    trainer = ESTrainer(models["qwen2"], models["qwen2_rm"], args=args, train_dataset=zen())
    train_and_check(trainer)


@pytest.mark.parametrize(
    "config", ["standard_prompt_only", pytest.param("conversational_prompt_only", marks=pytest.mark.slow)]
)
def test_train_dataset_format(models, tmp_path, config):
    trainer = ESTrainer(models["qwen2"], models["qwen2_rm"], args=std(tmp_path), train_dataset=zen(config))
    train_and_check(trainer)


def test_trust_remote_code(models, tmp_path):
    with pytest.raises(ValueError, match="custom code"):
        ESTrainer(models["remote"], reward_len, args=std(tmp_path), train_dataset=zen())
    trainer = ESTrainer(models["remote"], reward_len, args=std(tmp_path, trust_remote_code=True), train_dataset=zen())
    assert type(trainer.model).__name__ == "RemoteForCausalLM"


@pytest.mark.slow  # kept out of the fast suite for time; ~3.5 s
def test_train_with_iterable_dataset(models, tmp_path):
    trainer = ESTrainer(models["qwen2"], models["qwen2_rm"], args=std(tmp_path, max_steps=4),
                        train_dataset=zen(streaming=True))  # fmt: skip
    train_and_check(trainer)


def test_iterable_dataset_forces_num_workers_zero(models, tmp_path):
    """Workers would each read the whole stream (every prompt N times): ESTrainer reads it in the main process."""
    args = std(tmp_path, dataloader_num_workers=4, max_steps=1)
    with pytest.warns(UserWarning, match="dataloader_num_workers"):
        trainer = ESTrainer(models["qwen2"], reward_len, args=args, train_dataset=zen(streaming=True))
    assert trainer.args.dataloader_num_workers == 0


@pytest.mark.slow  # spawns dataloader worker processes
def test_train_multiple_dataloader_workers(models, tmp_path):
    trainer = ESTrainer(models["qwen2"], reward_len, args=std(tmp_path, dataloader_num_workers=2),
                        train_dataset=zen())  # fmt: skip
    train_and_check(trainer)


def test_dataset_required(models, tmp_path):
    with pytest.raises(ValueError, match="train_dataset"):
        ESTrainer(models["qwen2"], reward_len, args=std(tmp_path))


@pytest.mark.parametrize(
    "extra",
    [
        {},
        pytest.param({"num_generations_eval": 1}, marks=pytest.mark.slow),
        pytest.param({"eval_on_start": True}, marks=pytest.mark.slow),
    ],
    ids=["eval", "num_generations_eval", "start"],
)
def test_train_with_eval(models, tmp_path, extra):
    args = std(tmp_path, per_device_eval_batch_size=3, eval_strategy="steps", eval_steps=2, max_steps=2, **extra)
    dataset = load_dataset(ZEN, "standard_prompt_only")
    trainer = ESTrainer(models["qwen2"], models["qwen2_rm"], args=args, train_dataset=dataset["train"],
                        eval_dataset=dataset["test"])  # fmt: skip
    trainer.train()
    evals = [log for log in trainer.state.log_history if "eval_reward" in log]
    assert len(evals) == 1 + bool(extra.get("eval_on_start"))


def eval_sets(kind):
    """TRL's seven forms of `eval_dataset`: one dataset, iterable, DatasetDict, IterableDatasetDict, dicts of
    either, or None."""
    if kind == "none":
        return None
    one = zen(split="test", streaming="iterable" in kind)
    if kind in ("dataset", "iterable_dataset"):
        return one
    two = {"data1": one, "data2": zen(split="test", streaming="iterable" in kind)}
    return {"dataset_dict": DatasetDict, "iterable_dataset_dict": IterableDatasetDict}.get(kind, dict)(two)


KINDS = ["dataset", "iterable_dataset", "dataset_dict", "iterable_dataset_dict", "dict_of_dataset",
         "dict_of_iterable_dataset"]  # fmt: skip


@pytest.mark.parametrize("kind", [*KINDS, "none"])
def test_init_with_eval_dataset(models, tmp_path, kind):
    eval_dataset = eval_sets(kind)
    trainer = ESTrainer(models["qwen2"], reward_len, args=std(tmp_path), train_dataset=zen(),
                        eval_dataset=eval_dataset)  # fmt: skip
    if eval_dataset is None:
        assert trainer.eval_dataset is None
    elif isinstance(eval_dataset, dict):
        assert set(trainer.eval_dataset.keys()) == {"data1", "data2"}
    else:
        assert trainer.eval_dataset is eval_dataset


@pytest.mark.parametrize("kind", KINDS)
def test_evaluate_with_eval_dataset(models, tmp_path, kind):
    trainer = ESTrainer(models["qwen2"], reward_len, args=std(tmp_path, per_device_eval_batch_size=3),
                        train_dataset=zen())  # fmt: skip
    metrics = trainer.evaluate(eval_dataset=eval_sets(kind))
    if kind.startswith("dict") or kind.endswith("dict"):
        assert metrics["eval_data1_reward"] is not None and metrics["eval_data2_reward"] is not None
        assert metrics["eval_data1_reward"] == metrics["eval_data2_reward"]  # the same rows, the same θ and seeds
    else:
        assert metrics["eval_reward"] is not None


@pytest.mark.slow  # kept out of the fast suite for time; ~2.5 s
def test_train_different_reward_model(models, tmp_path):
    reward_model = AutoModelForSequenceClassification.from_pretrained(models["llama_rm"], num_labels=1)
    tokenizer = AutoTokenizer.from_pretrained(models["llama_rm"])
    tokenizer.pad_token = "<|endoftext|>"
    trainer = ESTrainer(models["qwen2"], reward_model, args=std(tmp_path), reward_processing_classes=tokenizer,
                        train_dataset=zen("conversational_prompt_only"))  # fmt: skip
    train_and_check(trainer)


@pytest.mark.parametrize(
    "config", ["standard_prompt_only", pytest.param("conversational_prompt_only", marks=pytest.mark.slow)]
)
def test_train_reward_func(models, tmp_path, config):
    trainer = ESTrainer(models["qwen2"], reward_len, args=std(tmp_path), train_dataset=zen(config))
    train_and_check(trainer)


@pytest.mark.slow
def test_train_multiple_and_mixed_reward_funcs(models, tmp_path):
    def distinct(completions, **kwargs):
        return [float(len(set(c))) for c in completions]

    trainer = ESTrainer(models["qwen2"], [reward_len, distinct, models["qwen2_rm"]], args=std(tmp_path),
                        train_dataset=zen())  # fmt: skip
    train_and_check(trainer)


def test_train_sync_and_async_reward_funcs(models, tmp_path):
    def one(completions, **kwargs):
        return [1 for _ in completions]

    async def async_len(completions, **kwargs):
        await asyncio.sleep(0.01)
        return [float(len(c)) for c in completions]

    trainer = ESTrainer(models["qwen2"], [reward_len, one, async_len], args=std(tmp_path), train_dataset=zen())
    train_and_check(trainer)


def test_train_multiple_reward_funcs_with_none_output(models, tmp_path):
    def nothing(completions, **kwargs):
        return [None] * len(completions)

    trainer = ESTrainer(models["qwen2"], [reward_len, nothing], args=std(tmp_path), train_dataset=zen())
    train_and_check(trainer)


def reward_func1(completions, **kwargs):
    return [float(len(c)) for c in completions]


def reward_func2(completions, **kwargs):
    return [float(len(set(c))) for c in completions]


def test_train_multiple_reward_funcs_with_weights(models, tmp_path):
    trainer = ESTrainer(models["qwen2"], [reward_func1, reward_func2], train_dataset=zen(),
                        args=std(tmp_path, reward_weights=[0.7, 0.3], logging_steps=3, max_steps=2))  # fmt: skip
    train_and_check(trainer)
    last = trainer.state.log_history[-1]  # steps after the last logging step are flushed into the final record
    assert {"rewards/reward_func1/mean", "rewards/reward_func1/std", "rewards/reward_func2/mean",
            "rewards/reward_func2/std"} <= last.keys()  # fmt: skip


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_reward_metric_reflects_reward_weights(models, tmp_path, aggregation):
    def constant_reward_1(completions, **kwargs):
        return [1.0] * len(completions)

    def constant_reward_0(completions, **kwargs):
        return [0.0] * len(completions)

    args = std(tmp_path, reward_weights=[0.7, 0.3], multi_objective_aggregation=aggregation)
    trainer = ESTrainer(models["qwen2"], [constant_reward_1, constant_reward_0], args=args, train_dataset=zen())
    with pytest.warns(UserWarning, match="no spread"):  # constant rewards: ES has no signal and skips the update
        trainer.train()
    assert abs(trainer.state.log_history[-1]["reward"] - 0.7) < 1e-5


def test_train_normalize_then_sum_aggregation(models, tmp_path):
    args = std(tmp_path, multi_objective_aggregation="normalize_then_sum")
    trainer = ESTrainer(models["qwen2"], [reward_func1, reward_func2], args=args, train_dataset=zen())
    train_and_check(trainer)


def test_train_reward_func_additional_column(models, tmp_path):
    dataset = zen()
    dataset = dataset.add_column("some_values", list(range(len(dataset))))

    def reward(completions, some_values, **kwargs):
        return [float(len(c)) + v for c, v in zip(completions, some_values, strict=True)]

    train_and_check(ESTrainer(models["qwen2"], reward, args=std(tmp_path), train_dataset=dataset))


def test_reward_func_receives_trainer_state_log_extra_and_log_metric(models, tmp_path):
    def reward(completions, trainer_state, log_extra, log_metric, **kwargs):
        assert trainer_state is not None and hasattr(trainer_state, "global_step")
        log_extra("test_column", [c[:5] for c in completions])
        log_metric("custom_accuracy", 0.75)
        return [float(len(c)) for c in completions]

    trainer = ESTrainer(models["qwen2"], reward, args=std(tmp_path, log_completions=True), train_dataset=zen())
    trainer.train()
    assert "test_column" in trainer.population.last_completions[3]  # the columns of the completions table
    assert any("custom_accuracy" in log for log in trainer.state.log_history)


@pytest.mark.slow
def test_warning_raised_all_rewards_none(models, tmp_path):
    def nothing(completions, **kwargs):
        return [None] * len(completions)

    trainer = ESTrainer(models["qwen2"], nothing, args=std(tmp_path), train_dataset=zen())
    with pytest.warns(UserWarning, match="all None"):
        trainer.train()


def test_no_reward_source_raises(models, tmp_path):
    with pytest.raises(ValueError, match="No reward source provided"):
        ESTrainer(models["qwen2"], reward_funcs=None, args=std(tmp_path), train_dataset=zen())


@pytest.mark.slow  # kept out of the fast suite for time; ~2.5 s
def test_reward_processing_classes(models, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(models["qwen2_rm"])
    rms = [models["qwen2_rm"], models["llama_rm"]]
    with pytest.raises(ValueError, match="must match"):
        ESTrainer(models["qwen2"], rms, args=std(tmp_path), train_dataset=zen(), reward_processing_classes=[tokenizer])
    trainer = ESTrainer(models["qwen2"], rms, args=std(tmp_path), train_dataset=zen(),
                        reward_processing_classes=[tokenizer, tokenizer])  # fmt: skip
    assert len(trainer.reward_processing_classes) == 2
    single = ESTrainer(models["qwen2"], models["qwen2_rm"], args=std(tmp_path), train_dataset=zen(),
                       reward_processing_classes=tokenizer)  # fmt: skip
    assert len(single.reward_processing_classes) == 1 and single.reward_processing_classes[0] == tokenizer
    assert single.reward_func_names == ["qwen2_rm"] and single.reward_funcs[0].config.num_labels == 1
    assert single.reward_weights.tolist() == [1.0]


@pytest.mark.parametrize(
    "scale_rewards", [False, "group", *(pytest.param(s, marks=pytest.mark.slow) for s in ("batch", True, "none"))]
)
def test_train_scale_rewards(models, tmp_path, scale_rewards):
    """GRPO's reward scaling is ES's per-prompt normalisation of the members' rewards: every GRPO value is accepted
    (True and False as GRPO maps them), none is reported as ignored, and each trains."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="ignored by ES")
        args = std(tmp_path, scale_rewards=scale_rewards)
    assert args.scale_rewards == {True: "group", False: "none"}.get(scale_rewards, scale_rewards)
    train_and_check(ESTrainer(models["qwen2"], reward_len, args=args, train_dataset=zen()))


@pytest.mark.parametrize(
    "generation",
    [
        {"top_p": 0.9, "top_k": 10, "min_p": 0.01, "repetition_penalty": 1.1},
        {"generation_kwargs": {"do_sample": True, "top_k": 50, "num_beams": 2, "length_penalty": -0.1}},
        pytest.param({"pad_to_multiple_of": 8}, marks=pytest.mark.slow),
    ],
    ids=["sampling", "generation_kwargs", "pad_to_multiple_of"],
)
def test_train_with_generation_settings(models, tmp_path, generation):
    train_and_check(ESTrainer(models["qwen2"], reward_len, args=std(tmp_path, **generation), train_dataset=zen()))


@pytest.mark.slow
def test_train_with_chat_template_kwargs(models, tmp_path):
    args = std(tmp_path, chat_template_kwargs={"enable_thinking": False})
    trainer = ESTrainer(models["qwen3"], reward_len, args=args, train_dataset=zen("conversational_prompt_only"))
    train_and_check(trainer)


def test_train_peft_config(models, tmp_path):
    from peft import LoraConfig

    model = AutoModelForCausalLM.from_pretrained(models["qwen2"], dtype=torch.float32)
    trainer = ESTrainer(model, reward_len, args=std(tmp_path), train_dataset=zen(), peft_config=LoraConfig())
    before = train_and_check(trainer, trainable=lambda name: "lora_" in name)
    for name, p in trainer.model.named_parameters():
        if "lora_" not in name:  # the base model stays as it was
            torch.testing.assert_close(p, before[name])


@pytest.mark.slow
def test_train_peft_model(models, tmp_path):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(models["qwen2"]), LoraConfig())
    trainer = ESTrainer(model, reward_len, args=std(tmp_path), train_dataset=zen())
    before = train_and_check(trainer, trainable=lambda name: "lora_" in name)
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters() if "lora_" not in n)


def test_mask_truncated_completions_gives_them_no_reward(models, tmp_path):
    """ES's meaning of GRPO's field: completions cut at max_completion_length leave the member reward R_i."""
    args = std(tmp_path, mask_truncated_completions=True, max_completion_length=2, max_steps=1)
    trainer = ESTrainer(models["qwen2"], reward_len, args=args, train_dataset=zen())
    with pytest.warns(UserWarning, match="no spread"):  # every completion is cut at 2 tokens: no reward at all
        trainer.train()
    assert trainer.state.log_history[0]["completions/clipped_ratio"] == 1.0
    assert trainer.state.log_history[0]["reward"] is None  # no completion kept a reward


def test_grpo_only_fields_are_accepted_and_listed_once(tmp_path):
    with pytest.warns(UserWarning) as caught:
        args = std(tmp_path, beta=0.04, loss_type="grpo", epsilon=0.3, num_iterations=2, sync_ref_model=True)
    ignored = [str(w.message) for w in caught if "ignored by ES" in str(w.message)]
    assert len(ignored) == 1 and all(f in ignored[0] for f in ("beta", "loss_type", "epsilon", "num_iterations"))
    assert args.beta == 0.04  # kept as given, for the record
    with pytest.raises(ValueError, match="use_transformers_continuous_batching"):
        std(tmp_path, use_transformers_continuous_batching=True)


def test_unknown_field_names_the_closest_one(tmp_path):
    with pytest.raises(TypeError, match="has no field 'num_generation'; did you mean 'num_generations'"):
        std(tmp_path, num_generation=4)


def test_a_gradient_sized_learning_rate_warns(tmp_path):
    with pytest.warns(UserWarning, match="looks like a gradient learning rate.*0.1·σ and 2·σ"):
        std(tmp_path, learning_rate=1e-6, sigma=1e-3)
