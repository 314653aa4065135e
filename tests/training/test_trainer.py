"""ESTrainer on tiny real transformers models: learning, exact restore, reproducibility, resume, bad input."""

import math
import warnings

import pytest
import torch
from helpers import assert_same_weights, upper_vocab_share, weights
from helpers import es_config as config
from transformers import AutoModelForCausalLM

from trl_es import ESTrainer


def even_token_share(completion_ids, **kwargs):
    """Share of completion tokens whose id is even: an easy target a tiny random model starts at ~50% on."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def greedy_reward(trainer, dataset):
    """Mean reward of the unperturbed model θ (not of the perturbed members) on `dataset`, greedy."""
    prompts = list(dataset["prompt"])
    rollout = trainer.generation.generate(prompts, trainer.generation.tokenize(prompts), 1, [0] * len(prompts))
    return sum(upper_vocab_share(rollout.completion_ids)) / len(prompts)


def test_es_raises_the_reward(tmp_path, tiny_model_dir, prompt_dataset):
    args = config(
        tmp_path,
        population_size=16,
        sigma=0.01,
        learning_rate=0.01,
        per_device_train_batch_size=8,
        num_generations=1,
        generation_kwargs={"do_sample": False},
        max_steps=10,
        seed=0,
    )
    trainer = ESTrainer(tiny_model_dir, upper_vocab_share, args=args, train_dataset=prompt_dataset)
    before = greedy_reward(trainer, prompt_dataset)
    trainer.train()
    after = greedy_reward(trainer, prompt_dataset)
    assert before < 0.3 and after > 0.7, (before, after)  # measured: 0.0 → 1.0 for seeds 0-3


def test_same_seed_gives_bitwise_same_weights_and_logs(tmp_path, tiny_model_dir, prompt_dataset):
    results = []
    for run in range(2):
        trainer = ESTrainer(
            tiny_model_dir,
            even_token_share,
            args=config(tmp_path / str(run), max_steps=3),
            train_dataset=prompt_dataset,
        )
        trainer.train()
        rewards = [log["es/population_reward_max"] for log in trainer.state.log_history if "reward" in log]
        results.append((weights(trainer.model), rewards))
    assert results[0][1] == results[1][1]
    assert_same_weights_dicts(results[0][0], results[1][0])
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not torch.equal(start.model.embed_tokens.weight, results[0][0]["model.embed_tokens.weight"])


def assert_same_weights_dicts(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_resume_from_checkpoint_gives_the_uninterrupted_weights(tmp_path, tiny_model_dir, prompt_dataset):
    full = ESTrainer(
        tiny_model_dir, even_token_share, args=config(tmp_path / "full", max_steps=4), train_dataset=prompt_dataset
    )
    full.train()

    first = ESTrainer(
        tiny_model_dir,
        even_token_share,
        args=config(tmp_path / "resumed", max_steps=4, save_strategy="steps", save_steps=2),
        train_dataset=prompt_dataset,
    )
    first.train()  # writes checkpoint-2 and checkpoint-4
    checkpoint = tmp_path / "resumed" / "out" / "checkpoint-2"
    assert (checkpoint / "model.safetensors").is_file()
    resumed = ESTrainer(  # the original model: Trainer loads the checkpoint's weights, state and schedule
        tiny_model_dir,
        even_token_share,
        args=config(tmp_path / "resumed", max_steps=4),
        train_dataset=prompt_dataset,
    )
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 4
    assert_same_weights(resumed.model, weights(full.model))


def test_sigma_schedule_gives_each_step_its_sigma(tmp_path, tiny_model_dir, prompt_dataset):
    """Step t's members evaluate θ + σ_t·ε: a run with sigma_decay=0.5 equals one step at σ and, resumed, one at σ/2."""
    decayed = ESTrainer(
        tiny_model_dir,
        even_token_share,
        args=config(tmp_path / "decayed", sigma_decay=0.5),
        train_dataset=prompt_dataset,
    )
    decayed.train()
    assert [log["es/sigma"] for log in decayed.state.log_history if "es/sigma" in log] == [0.02, 0.01]
    constant = ESTrainer(
        tiny_model_dir,
        even_token_share,
        args=config(tmp_path / "constant", save_strategy="steps", save_steps=1),
        train_dataset=prompt_dataset,
    )
    constant.train()  # both steps at σ = 0.02; writes checkpoint-1
    final = weights(decayed.model)
    assert any(not torch.equal(p, final[n]) for n, p in constant.model.named_parameters())  # σ_1 changes the run
    halved = ESTrainer(
        tiny_model_dir, even_token_share, args=config(tmp_path / "constant", sigma=0.01), train_dataset=prompt_dataset
    )
    halved.train(resume_from_checkpoint=str(tmp_path / "constant" / "out" / "checkpoint-1"))
    assert_same_weights(halved.model, final)


class Boom(Exception):
    pass


@pytest.mark.parametrize("error", [Boom, pytest.param(KeyboardInterrupt, marks=pytest.mark.slow)])
def test_failing_reward_mid_population_restores_weights_bitwise(tmp_path, tiny_model_dir, prompt_dataset, error):
    calls = []

    def flaky(completion_ids, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # the third member
            raise error("reward service down")
        return even_token_share(completion_ids)

    trainer = ESTrainer(tiny_model_dir, flaky, args=config(tmp_path), train_dataset=prompt_dataset)
    before = weights(trainer.model)
    with pytest.raises(error):
        trainer.train()
    assert len(calls) == 3
    assert_same_weights(trainer.model, before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_failing_generation_restores_half_precision_weights(tmp_path, tiny_model_dir, prompt_dataset, dtype):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype)
    trainer = ESTrainer(model, even_token_share, args=config(tmp_path), train_dataset=prompt_dataset)
    real_generate, calls = trainer.generation.generate, []

    def generate_then_fail(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # Ctrl-C while the second member generates
        return real_generate(*args, **kwargs)

    trainer.generation.generate = generate_then_fail
    before = weights(trainer.model)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert_same_weights(trainer.model, before)


@pytest.mark.slow  # kept out of the fast suite for time; ~2.5 s
def test_half_precision_training_moves_weights(tmp_path, tiny_model_dir, prompt_dataset):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    before = weights(model)
    trainer = ESTrainer(
        model, even_token_share, args=config(tmp_path, sigma=0.05, learning_rate=0.05), train_dataset=prompt_dataset
    )
    trainer.train()
    after = weights(trainer.model)
    assert all(t.dtype == torch.bfloat16 for t in after.values())
    assert not torch.equal(before["model.embed_tokens.weight"], after["model.embed_tokens.weight"])
    assert all(torch.isfinite(t.float()).all() for t in after.values())


@pytest.mark.parametrize(
    "reward, message",
    [
        (lambda completions, **kw: [1.0] * (len(completions) - 1), "returned 7 rewards, but 8 were expected"),
        (lambda completions, **kw: ["high"] * len(completions), "returned 'high'"),
        (lambda completions, **kw: 1.0, "returned a float"),
        (lambda completions, **kw: [float("inf")] * len(completions), "returned inf at position 0"),
    ],
    ids=["wrong-length", "non-number", "not-a-list", "infinite"],
)
def test_bad_reward_output_is_a_clear_error_and_weights_stay(
    tmp_path, tiny_model_dir, prompt_dataset, reward, message
):
    reward.__name__ = "my_reward"
    trainer = ESTrainer(tiny_model_dir, reward, args=config(tmp_path), train_dataset=prompt_dataset)
    before = weights(trainer.model)
    with pytest.raises((ValueError, TypeError), match=f"'my_reward'.*{message}|{message}"):
        trainer.train()
    assert_same_weights(trainer.model, before)


@pytest.mark.parametrize(
    "reward",
    [lambda completions, **kw: [None] * len(completions), lambda completions, **kw: [0.5] * len(completions)],
    ids=["all-none", "no-spread"],
)
def test_rewards_without_signal_skip_the_update_with_a_warning(tmp_path, tiny_model_dir, prompt_dataset, reward):
    trainer = ESTrainer(tiny_model_dir, reward, args=config(tmp_path), train_dataset=prompt_dataset)
    before = weights(trainer.model)
    with pytest.warns(UserWarning, match="no spread"):
        trainer.train()
    assert_same_weights(trainer.model, before)
    assert [log["es/skipped_update"] for log in trainer.state.log_history if "reward" in log] == [1.0, 1.0]


def test_nan_rewards_are_excluded_not_propagated(tmp_path, tiny_model_dir, prompt_dataset):
    def half_none(completion_ids, **kwargs):
        return [None if k % 2 else float(ids[0] % 2 == 0) for k, ids in enumerate(completion_ids)]

    def always_nan(completions, **kwargs):
        return [math.nan] * len(completions)

    trainer = ESTrainer(tiny_model_dir, [half_none, always_nan], args=config(tmp_path), train_dataset=prompt_dataset)
    trainer.train()
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    logs = [log for log in trainer.state.log_history if "reward" in log]
    assert all(math.isfinite(log["reward"]) for log in logs)


def test_dataset_without_prompt_column_is_refused(tmp_path, tiny_model_dir, prompt_dataset):
    with pytest.raises(ValueError, match="no 'prompt' column"):
        ESTrainer(
            tiny_model_dir,
            even_token_share,
            args=config(tmp_path),
            train_dataset=prompt_dataset.rename_column("prompt", "question"),
        )
    with pytest.raises(ValueError, match="reward"):
        ESTrainer(tiny_model_dir, [], args=config(tmp_path), train_dataset=prompt_dataset)
    from datasets import Dataset

    for prompts, message in (([3, 4], "row 0 holds int"), ([[{"text": "hi"}]], "row 0 holds list"), ([], "empty")):
        bad = Dataset.from_dict({"prompt": prompts}) if prompts else prompt_dataset.select([])
        with pytest.raises(ValueError, match=message):
            ESTrainer(tiny_model_dir, even_token_share, args=config(tmp_path), train_dataset=bad)


def test_parameter_patterns_restrict_what_moves(tmp_path, tiny_model_dir, prompt_dataset):
    trainer = ESTrainer(
        tiny_model_dir,
        even_token_share,
        args=config(tmp_path, es_parameter_patterns=[r"layers\.1\.mlp"], common_generation_seed=False),
        train_dataset=prompt_dataset,
    )
    before = weights(trainer.model)
    trainer.train()
    for name, p in trainer.model.named_parameters():
        moved = not torch.equal(p, before[name])
        assert moved == ("layers.1.mlp" in name), name


def test_antithetic_centered_rank_and_center_baseline_run(tmp_path, tiny_model_dir, prompt_dataset):
    args = config(tmp_path, antithetic=True, fitness_shaping="centered_rank", es_baseline="center", weight_decay=0.1)
    trainer = ESTrainer(tiny_model_dir, even_token_share, args=args, train_dataset=prompt_dataset)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    logs = [log for log in trainer.state.log_history if "reward" in log]
    assert all("es/center_reward" in log for log in logs)
    assert logs[-1]["es/update_norm"] > 0


@pytest.mark.slow
def test_model_forms_model_init_kwargs_and_pad_token_fallback(tmp_path, tiny_model_dir, prompt_dataset):
    from transformers import AutoTokenizer

    trainer = ESTrainer(
        tiny_model_dir,
        even_token_share,
        args=config(tmp_path, model_init_kwargs={"dtype": "bfloat16"}),
        train_dataset=prompt_dataset,
    )
    assert trainer.model.dtype == torch.bfloat16
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.pad_token = None
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    trainer = ESTrainer(
        model, even_token_share, args=config(tmp_path), train_dataset=prompt_dataset, processing_class=tokenizer
    )
    assert trainer.model is model and tokenizer.pad_token == tokenizer.eos_token
    trainer.train()
    with pytest.raises(TypeError, match="PreTrainedModel"):
        ESTrainer(torch.nn.Linear(2, 2), even_token_share, args=config(tmp_path), train_dataset=prompt_dataset)


def test_iterable_dataset_gives_the_same_prompts_in_order(tmp_path, tiny_model_dir, prompt_dataset):
    seen = []

    def record(prompts, **kwargs):
        seen.append(prompts[0])
        return [float(len(p)) for p in prompts]

    args = config(tmp_path, population_size=2, num_generations=1, max_steps=2, shuffle_dataset=False)
    ESTrainer(tiny_model_dir, record, args=args, train_dataset=prompt_dataset.to_iterable_dataset()).train()
    # every member of a step sees the step's prompts; unshuffled, steps read the dataset in its order, 4 rows a time
    assert seen == ["Count to 1:", "Count to 1:", "Count to 5:", "Count to 5:"]


def test_fsdp1_on_cpu_is_refused_before_any_weights_load(tmp_path, monkeypatch, prompt_dataset):
    """TRL's fsdp1 config on CPU: Accelerate cannot initialize FSDP1's parameters there; ESTrainer says so, naming
    the config to use, before it loads a model (the path below does not exist)."""
    args = config(tmp_path, use_cpu=True)
    for variable, value in {
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_VERSION": "1",
        "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
    }.items():
        monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match="FSDP1 with sync_module_states cannot run on cpu.*fsdp2"):
        ESTrainer(str(tmp_path / "not-loaded"), even_token_share, args=args, train_dataset=prompt_dataset)


@pytest.mark.parametrize("column", ["image", "images"])
def test_images_for_a_text_model_are_refused_not_trained_on_their_text(tmp_path, tiny_model_dir, column):
    """GRPOTrainer shows a dataset's image(s) to a vision-language model through its processor; a text model would
    train on the text alone, so ESTrainer says so, for the train and the eval dataset (tests/training/test_vlm.py
    trains a vision-language model on images)."""
    from datasets import Dataset

    chats = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Count to 3:"}]] * 4})
    with_images = chats.add_column(column, [None] * len(chats))
    for datasets in ({"train_dataset": with_images}, {"train_dataset": chats, "eval_dataset": with_images}):
        with pytest.raises(ValueError, match=f"has an '{column}' column.*a text-only model.*train on the text alone"):
            ESTrainer(tiny_model_dir, even_token_share, args=config(tmp_path), **datasets)


def test_the_run_facts_are_decided_once_and_are_what_the_run_uses(tmp_path, tiny_model_dir, prompt_dataset):
    """`trainer.facts` (`RunFacts`) is built once from the prepared model and frozen; what the layers act on is
    it: the low-rank space perturbs the targets the facts name, θ's dtype and the engine are the facts'."""
    import dataclasses

    from trl_es.util.facts import RunFacts

    args = config(tmp_path, es_search_space="lowrank", max_steps=1)
    trainer = ESTrainer(tiny_model_dir, upper_vocab_share, args=args, train_dataset=prompt_dataset)
    facts = trainer.facts
    assert isinstance(facts, RunFacts) and facts.engine == "transformers" and facts.zero_stage is None
    assert not (facts.vision or facts.quantized or facts.adapter or facts.fused_experts)
    assert facts.lowrank_targets == tuple(trainer.space.targets)  # the weights the members perturb
    assert facts.theta_dtype == next(iter(trainer.es_params.values())).dtype and facts.compute_dtype is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        facts.engine = "vllm-colocate"
