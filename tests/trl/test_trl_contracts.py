"""GRPOTrainer's contracts: reward functions written for GRPO run unchanged; outputs load back into TRL."""

import asyncio
import json
import re
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from helpers import REPOSITORY, es_config
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForSequenceClassification
from transformers.trainer_callback import TrainerState
from trl import GRPOConfig, GRPOTrainer

from trl_es import ESTrainer


def es_args(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path / "es"),
        population_size=2,
        sigma=0.01,
        per_device_train_batch_size=2,
        max_completion_length=4,
        max_steps=1,
    )
    return es_config(tmp_path, **{**values, **overrides})


def grpo_args(tmp_path):
    return GRPOConfig(
        output_dir=str(tmp_path / "grpo"),
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=4,
        max_steps=1,
        bf16=False,
        gradient_checkpointing=False,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )


def describe(value):
    """The shape of an argument, comparable across trainers: type, and element types for lists."""
    if isinstance(value, list):
        return ("list", len(value), type(value[0]).__name__ if value else None)
    return type(value).__name__


def recording_reward(calls):
    def reward_contains_answer(
        prompts, completions, completion_ids, answer, trainer_state, log_metric, log_extra, **kw
    ):
        calls.append(
            {
                "prompts": prompts,
                "kwargs": {
                    "prompts": describe(prompts),
                    "completions": describe(completions),
                    "completion_ids": describe(completion_ids),
                    "completion_ids[0]": describe(completion_ids[0]),
                    "answer": describe(answer),
                    "one prompt per pair": len(set(map(str, prompts))) == 1,
                    "extra": {k: describe(v) for k, v in kw.items()},
                    "trainer_state": isinstance(trainer_state, TrainerState),
                    "log_metric": callable(log_metric),
                    "log_extra": callable(log_extra),
                },
            }
        )
        log_metric("answer_seen", 1.0)
        return [
            float(a in (c if isinstance(c, str) else c[0]["content"]))
            for c, a in zip(completions, answer, strict=False)
        ]

    return reward_contains_answer


@pytest.mark.parametrize("conversational", [pytest.param(False, marks=pytest.mark.slow), True])
def test_grpo_reward_function_runs_unchanged_with_the_same_arguments(tmp_path, tiny_model_dir, conversational):
    questions = ["One plus one?", "Two plus two?"]
    prompts = [[{"role": "user", "content": q}] for q in questions] if conversational else questions
    dataset = Dataset.from_dict({"prompt": prompts, "answer": ["2", "4"], "difficulty": [1, 2]})
    es_calls, grpo_calls = [], []
    # GRPO's per_device_train_batch_size counts completions, ESConfig's counts prompts: 1 prompt × 2 completions each
    es_config = es_args(tmp_path, per_device_train_batch_size=1)
    ESTrainer(tiny_model_dir, recording_reward(es_calls), args=es_config, train_dataset=dataset).train()
    GRPOTrainer(tiny_model_dir, recording_reward(grpo_calls), args=grpo_args(tmp_path), train_dataset=dataset).train()
    assert es_calls and grpo_calls
    es_seen, grpo_seen = es_calls[0]["kwargs"], grpo_calls[0]["kwargs"]
    assert es_seen == grpo_seen  # same argument names, types, lengths, extra columns ("difficulty")
    assert "difficulty" in es_seen["extra"]
    assert all(p in prompts for call in es_calls + grpo_calls for p in call["prompts"])


def test_reward_model_id_async_function_weights_and_none(tmp_path, tiny_model_dir, tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    rm_config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    rm_dir = tmp_path / "reward_model"
    LlamaForSequenceClassification(rm_config).save_pretrained(rm_dir)
    tokenizer.save_pretrained(rm_dir)

    async def async_length(completions, **kwargs):
        await asyncio.sleep(0)
        return [float(len(c)) for c in completions]

    def sometimes_none(completions, **kwargs):
        return [None if k % 2 else 1.0 for k in range(len(completions))]

    dataset = Dataset.from_dict({"prompt": ["Say hi", "Say bye"]})
    trainer = ESTrainer(
        tiny_model_dir,
        [str(rm_dir), async_length, sometimes_none],
        args=es_args(tmp_path, reward_weights=[1.0, 0.5, 2.0], population_size=4),
        train_dataset=dataset,
    )
    assert trainer.reward_functions.names == ["reward_model", "async_length", "sometimes_none"]
    trainer.train()
    log = next(log for log in trainer.state.log_history if "reward" in log)
    expected = log["rewards/reward_model/mean"] + 0.5 * log["rewards/async_length/mean"] + 2.0 * 1.0 / 2
    assert log["reward"] == pytest.approx(expected, rel=1e-4)
    assert log["rewards/sometimes_none/mean"] == 1.0  # None → NaN, excluded from the mean


def test_saved_model_loads_in_transformers_and_grpo_with_a_model_card(tmp_path, tiny_model_dir, prompt_dataset):
    trainer = ESTrainer(
        tiny_model_dir,
        lambda completions, **kw: [float(len(c)) for c in completions],
        args=es_args(tmp_path, population_size=4),
        train_dataset=prompt_dataset,
    )
    trainer.train()
    trainer.save_model()
    out = Path(trainer.args.output_dir)
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "README.md"):
        assert (out / name).is_file(), name
    card = (out / "README.md").read_text()
    for text in ("trl-es", "evolution-strategies", "- trl", "population_size", "sigma", "Evolution Strategies"):
        assert text in card, text
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    for (name, p), q in zip(trainer.model.named_parameters(), reloaded.parameters(), strict=False):
        assert torch.equal(p, q), name
    grpo = GRPOTrainer(
        str(out),
        lambda completions, **kw: [0.0] * len(completions),
        args=grpo_args(tmp_path),
        train_dataset=prompt_dataset,
    )
    assert grpo.model.config.vocab_size == reloaded.config.vocab_size


def test_the_model_card_table_keeps_a_regex_alternation_in_one_cell(tmp_path, tiny_model_dir, prompt_dataset):
    """A `|` in a setting (`es_parameter_patterns=["(q|v)_proj"]`) is escaped, so each row keeps its two cells."""
    args = es_args(tmp_path, es_parameter_patterns=["(q|v)_proj"])
    trainer = ESTrainer(tiny_model_dir, lambda completions, **kw: [0.0] * len(completions), args=args,
                        train_dataset=prompt_dataset)  # fmt: skip
    trainer.save_model()
    table = (Path(args.output_dir) / "README.md").read_text().split("## Evolution Strategies settings")[1]
    rows = [line for line in table.strip().splitlines() if line.startswith("|")]
    assert rows and all(len(re.split(r"(?<!\\)\|", row)) == 4 for row in rows), rows  # | setting | value |
    assert "| es_parameter_patterns | `['(q\\|v)_proj']` |" in rows


def test_report_to_tensorboard_and_log_completions(tmp_path, tiny_model_dir, prompt_dataset, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = es_args(tmp_path, report_to="tensorboard", log_completions=True, population_size=4, max_steps=2)

    def first_token_mod_3(completion_ids, log_extra, log_metric, **kwargs):
        log_extra("first_token", [ids[0] for ids in completion_ids])
        log_metric("custom/first_token_mean", sum(ids[0] for ids in completion_ids) / len(completion_ids))
        return [float(ids[0] % 3) for ids in completion_ids]

    ESTrainer(tiny_model_dir, first_token_mod_3, args=args, train_dataset=prompt_dataset).train()
    events = EventAccumulator(str(next(tmp_path.rglob("events.out.tfevents*")).parent))
    events.Reload()
    tags = events.Tags()["scalars"]
    for tag in (
        "train/reward",
        "train/es/update_norm",
        "train/es/population_reward_std",
        "train/es/time/generate",
        "train/custom/first_token_mean",
    ):
        assert tag in tags, tags
    table = capsys.readouterr().out
    assert "Count to" in table and "first_token" in table  # prompts and the column logged with log_extra


def test_push_to_hub_goes_through_trainer(tmp_path, tiny_model_dir, prompt_dataset, monkeypatch):
    """The Hub's network is the one boundary replaced here: create_repo/upload_folder record instead of uploading."""
    import transformers.trainer as hf_trainer

    uploads = []

    class RecordingHub:
        def create_repo(self, repo_id, **kwargs):
            return type("RepoUrl", (), {"repo_id": repo_id})()

        def upload_folder(self, repo_id, folder_path, **kwargs):
            uploads.append((repo_id, sorted(p.name for p in Path(folder_path).iterdir())))

    monkeypatch.setattr(hf_trainer, "hf_api", RecordingHub)
    args = es_args(tmp_path, population_size=4, hub_model_id="me/tiny-es", push_to_hub=False)
    trainer = ESTrainer(
        tiny_model_dir,
        lambda completions, **kw: [float(len(c)) for c in completions],
        args=args,
        train_dataset=prompt_dataset,
    )
    trainer.train()
    trainer.push_to_hub()
    assert uploads and uploads[-1][0] == "me/tiny-es"
    assert {"model.safetensors", "README.md", "config.json"} <= set(uploads[-1][1])


def test_cli_trains_from_a_yaml_recipe(tmp_path, tiny_model_dir, prompt_dataset, monkeypatch, capsys):
    """`trl-es es --config recipe.yaml` with a local data file and a reward function from a module in the working
    directory (a dotted path, as in TRL's script); a bad reward name is one line naming it."""
    from trl_es.cli import main

    data = tmp_path / "data.jsonl"
    data.write_text(
        "\n".join(
            json.dumps({"prompt": p, "target": t})
            for p, t in zip(prompt_dataset["prompt"], prompt_dataset["target"], strict=True)
        )
    )
    (tmp_path / "my_rewards.py").write_text(
        "def target_in_completion(completions, target, **kwargs):\n"
        "    return [float(t in c) + 0.01 * len(c) for c, t in zip(completions, target)]\n"
    )
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"model_name_or_path: {tiny_model_dir}\ndataset_name: {data}\nreward_funcs: [my_rewards.target_in_completion]\n"
        f"output_dir: {tmp_path / 'cli-out'}\npopulation_size: 4\nsigma: 0.01\nper_device_train_batch_size: 4\n"
        "max_completion_length: 4\nmax_steps: 5\nsave_strategy: 'no'\nreport_to: none\n"
    )
    monkeypatch.chdir(tmp_path)
    assert main(["es", "--config", str(recipe), "--max_steps", "2"]) == 0
    assert (tmp_path / "cli-out" / "model.safetensors").is_file()
    assert "trl-es" in (tmp_path / "cli-out" / "README.md").read_text()
    with pytest.raises(SystemExit, match="Unknown reward function 'nope'"):
        main(["es", "--config", str(recipe), "--reward_funcs", "nope"])


def test_example_recipe_parses_into_esconfig():
    from trl_es.commands.train import make_parser

    recipe = REPOSITORY / "examples" / "recipe.yaml"
    script_args, args, model_args, _ = make_parser().parse_args_and_config(
        args=["--config", str(recipe), "--output_dir", "/tmp/unused"]
    )
    assert model_args.model_name_or_path == "smollm2" and script_args.reward_funcs == ["first_integer_reward"]
    assert (args.population_size, args.sigma, args.learning_rate, args.seed) == (8, 0.005, 0.005, 4)
    assert args.generation_kwargs == {"do_sample": False}
