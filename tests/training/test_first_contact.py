"""A TRL user's first contact: what a port from GRPOTrainer meets, each as a behaviour that could fail (progress and
cost, eval decoding, offline data, a GRPO checkpoint, reward signatures, a ported GRPOConfig, outputs, one CLI,
warnings, GRPOTrainer's log keys and train_loss, gradient accumulation)."""

import json
import os
import stat
import warnings

import pandas as pd
import pytest
import torch
from datasets import Dataset
from helpers import es_config
from trl import GRPOConfig, GRPOTrainer

from trl_es import ESConfig, ESTrainer
from trl_es.cli import main as cli
from trl_es.tasks.data import load_rows


def length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def test_a_step_prints_its_cost_and_shows_progress_per_member(tmp_path, tiny_model_dir, prompt_dataset, capsys):
    import trl_es.training.population

    bars = []

    class RecordedBar(trl_es.training.population.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            bars.append((self, kwargs["disable"]))

    args = es_config(tmp_path, max_steps=2, disable_tqdm=False)
    trainer = ESTrainer(model=tiny_model_dir, reward_funcs=length_reward, args=args, train_dataset=prompt_dataset)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trl_es.training.population, "tqdm", RecordedBar)
        trainer.train()
    err = capsys.readouterr().err
    assert "each ES step generates 32 completions (4 members × 4 prompts × num_generations=2" in err
    # one bar per step, numbered as the log numbers steps, counting every member
    assert [(bar.desc, bar.n, bar.total, disabled) for bar, disabled in bars] == [
        ("ES step 1: members", 4, 4, False),
        ("ES step 2: members", 4, 4, False),
    ]


def test_grpo_log_keys_with_their_meaning(tmp_path, tiny_model_dir, prompt_dataset):
    """num_tokens (prompt + completion tokens of the whole population, cumulative), step_time,
    frac_reward_zero_std and the terminated-length statistics, as GRPOTrainer logs them."""
    args = es_config(tmp_path, log_completions=True)
    trainer = ESTrainer(model=tiny_model_dir, reward_funcs=length_reward, args=args, train_dataset=prompt_dataset)
    output = trainer.train()
    steps = [entry for entry in trainer.state.log_history if "reward" in entry]
    prompt_tokens = sum(map(len, trainer.generation.tokenize(prompt_dataset["prompt"][:4])))
    first = steps[0]
    completion_tokens = first["completions/mean_length"] * 4 * 4 * 2  # members × prompts × generations
    assert first["num_tokens"] == pytest.approx(prompt_tokens * 2 * 4 + completion_tokens)
    assert steps[1]["num_tokens"] > first["num_tokens"]  # cumulative
    assert first["step_time"] > 0 and 0 <= first["frac_reward_zero_std"] <= 1
    for name in ("mean", "min", "max"):
        assert f"completions/{name}_terminated_length" in first
    # train_loss is the loss ES minimises, −(mean population reward) over the run; the steps log `reward`, no `loss`
    summary = trainer.state.log_history[-1]
    mean_reward = (steps[0]["reward"] + steps[1]["reward"]) / 2
    assert summary["train_loss"] == output.training_loss == pytest.approx(-mean_reward)
    assert not any("loss" in entry for entry in steps)
    table = pd.read_parquet(tmp_path / "out" / "completions" / "completions_00002.parquet")
    assert list(table.columns[:3]) == ["step", "prompt", "completion"] and "length_reward" in table.columns


def test_train_loss_leaves_out_the_steps_without_a_reward(tmp_path, tiny_model_dir, prompt_dataset):
    """A step whose completions all got None has no population reward: train_loss is −(mean reward) of the others,
    not NaN and not pulled toward 0."""

    def none_at_first(completions, trainer_state, **kwargs):
        return [None if trainer_state.global_step == 0 else float(len(c)) for c in completions]

    args = es_config(tmp_path, population_size=2, per_device_train_batch_size=2, max_completion_length=3)
    trainer = ESTrainer(model=tiny_model_dir, reward_funcs=none_at_first, args=args, train_dataset=prompt_dataset)
    with pytest.warns(UserWarning, match="no spread"):
        output = trainer.train()
    first, second = (entry for entry in trainer.state.log_history if "reward" in entry)
    assert first["reward"] is None and second["reward"] > 0
    assert output.training_loss == trainer.state.log_history[-1]["train_loss"] == -second["reward"]


def test_gradient_accumulation_folds_into_the_prompts_of_one_es_step(tmp_path, tiny_model_dir, prompt_dataset, capsys):
    """gradient_accumulation_steps=2 with 2 prompts per device is one ES step over 4 prompts, as GRPO's effective
    batch: bitwise the weights of per_device_train_batch_size=4; max_steps counts ES steps; the cost line says so."""
    seen = []

    def reward(prompts, completions, **kwargs):
        seen.append(len(prompts))
        return length_reward(completions)

    runs = {}
    for name, batch in {"accumulated": dict(per_device_train_batch_size=2, gradient_accumulation_steps=2),
                        "whole": dict(per_device_train_batch_size=4)}.items():  # fmt: skip
        seen.clear()
        args = es_config(tmp_path / name, population_size=2, max_completion_length=3, **batch)
        trainer = ESTrainer(model=tiny_model_dir, reward_funcs=reward, args=args, train_dataset=prompt_dataset)
        trainer.train()
        assert trainer.state.global_step == 2 and set(seen) == {4 * 2}  # 4 prompts × num_generations=2, per call
        steps = [entry for entry in trainer.state.log_history if "reward" in entry]
        assert len(steps) == 2 and all(entry["es/update_norm"] > 0 for entry in steps)  # the weights moved
        runs[name] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    assert all(torch.equal(p, runs["whole"][n]) for n, p in runs["accumulated"].items())
    err = capsys.readouterr().err
    assert "(2 members × 4 prompts (per_device_train_batch_size=2 × gradient_accumulation_steps=2) × " in err


def test_frac_reward_zero_std_counts_the_prompts_that_cannot_rank_members():
    import torch

    from trl_es.generation import Completions
    from trl_es.training.population import SummaryLayout

    layout = SummaryLayout(1, 2)

    def member(prompt_rewards):  # one completion per prompt
        rewards = torch.tensor([[r, r] for r in prompt_rewards])
        return layout.row(rewards, Completions(["p", "q"], ["a", "b"], [[0], [0]], [False, False]), torch.zeros(2))

    rows = torch.stack([member([1.0, 0.0]), member([1.0, 2.0])])  # prompt 0: both 1 (no signal); prompt 1: 0 vs 2
    assert rows[:, layout.prompt_rewards].tolist() == [[1.0, 0.0], [1.0, 2.0]]
    assert layout.frac_reward_zero_std(rows) == 0.5


def test_eval_decodes_greedily_and_says_which_decoding(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "eval"
    argv = ["eval", "--model", tiny_model_dir, "--task", "small_sums", "--limit", "2", "--out_dir", str(out)]
    assert cli([*argv, "--greedy", "--n", "1"]) == 0
    assert "decoding: greedy" in capsys.readouterr().out
    settings = json.loads((out / "results.json").read_text())["settings"]["small_sums"]  # per task
    assert settings["do_sample"] is False
    assert cli([*argv, "--temperature", "0", "--n", "4"]) == 1  # greedy: n equal completions
    assert "evaluate it with n=1" in capsys.readouterr().err
    assert cli([*argv, "--n", "2", "--top-k", "5", "--out-dir", str(tmp_path / "sampled")]) == 0
    assert "decoding: sampled, temperature 1.0, top-p 1.0, top-k 5" in capsys.readouterr().out


def test_hub_task_data_offline_says_where_it_comes_from(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="Hub dataset 'openai/gsm8k'.*--source FILE.*TRL_ES_DATA"):
        load_rows("openai/gsm8k", "test", "main")


@pytest.mark.slow  # trains GRPOTrainer for a step first
def test_resuming_a_grpo_checkpoint_says_to_pass_it_as_the_model(tmp_path, tiny_model_dir, prompt_dataset):
    grpo_args = GRPOConfig(
        output_dir=str(tmp_path / "grpo"), per_device_train_batch_size=2, num_generations=2, max_completion_length=4,
        max_steps=1, save_steps=1, report_to="none", use_cpu=True, bf16=False, disable_tqdm=True,
    )  # fmt: skip
    GRPOTrainer(tiny_model_dir, length_reward, args=grpo_args, train_dataset=prompt_dataset).train()
    checkpoint = str(tmp_path / "grpo" / "checkpoint-1")
    trainer = ESTrainer(
        model=tiny_model_dir, reward_funcs=length_reward, args=es_config(tmp_path), train_dataset=prompt_dataset
    )
    with pytest.raises(ValueError, match=r"not an ESTrainer checkpoint.*pass it as the model: ESTrainer\(model="):
        trainer.train(resume_from_checkpoint=checkpoint)
    ESTrainer(model=checkpoint, reward_funcs=length_reward, args=es_config(tmp_path), train_dataset=prompt_dataset)


def test_reward_signatures_are_checked_when_the_trainer_is_built(tmp_path, tiny_model_dir, prompt_dataset):
    def no_kwargs(prompts, completions):
        return [0.0] * len(prompts)

    def needs_answer(completions, answer, **kwargs):
        return [0.0] * len(completions)

    def reads_target(completions, target, **kwargs):  # `target` is a column of the dataset
        return [float(t == c) for t, c in zip(target, completions, strict=True)]

    build = lambda reward: ESTrainer(  # noqa: E731
        model=tiny_model_dir, reward_funcs=reward, args=es_config(tmp_path), train_dataset=prompt_dataset
    )
    with pytest.raises(
        TypeError, match=r"'no_kwargs' cannot take the keyword arguments \['completion_ids'.*\*\*kwargs"
    ):
        build(no_kwargs)
    with pytest.raises(TypeError, match=r"'needs_answer' requires \['answer'\].*columns are \['prompt', 'target'\]"):
        build(needs_answer)
    build(reads_target)


def test_a_ported_grpo_config_warns_only_about_what_its_user_set(tmp_path):
    grpo = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, num_generations=4, logging_steps=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = ESConfig.from_grpo_config(grpo, learning_rate=5e-4, population_size=4)
    assert [str(w.message) for w in caught if issubclass(w.category, UserWarning)] == []
    assert (args.num_generations, args.logging_steps, args.population_size) == (4, 5, 4)
    assert args.max_grad_norm == 0.0 and args.gradient_checkpointing is False
    with pytest.warns(UserWarning, match="ignored by ES: epsilon") as caught:
        ESConfig.from_grpo_config(GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, epsilon=0.3))
    assert caught[0].filename == __file__  # attributed to the caller's line, not to config.py
    with pytest.raises(TypeError, match=r"is a GRPOConfig.*ESConfig.from_grpo_config\(args"):
        ESTrainer(model="unused", reward_funcs=length_reward, args=grpo)


def test_outputs_a_teammate_can_read(tmp_path, tiny_model_dir, prompt_dataset):
    previous = os.umask(0o022)
    try:
        args = es_config(tmp_path, save_strategy="steps", save_steps=1)
        trainer = ESTrainer(model=tiny_model_dir, reward_funcs=length_reward, args=args, train_dataset=prompt_dataset)
        trainer.train()
        trainer.save_model()
    finally:
        os.umask(previous)
    out = tmp_path / "out"
    for path in (out / "es_chain.json", out / "checkpoint-1" / "es_chain.json", out / "README.md"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path
    assert stat.S_IMODE((out / "checkpoint-1").stat().st_mode) == 0o755
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []  # no staging, no lock left
    card = (out / "README.md").read_text()
    assert "None" not in card.split("## Evolution Strategies settings")[0]
    assert "# Model Card for out" in card and f'model="{out}"' in card and f"`{tiny_model_dir}`" in card


def test_every_subcommand_takes_both_spellings_shows_defaults_and_a_version(capsys):
    from trl_es import __version__

    assert cli(["--version"]) == 0 and capsys.readouterr().out.strip() == f"trl-es {__version__}"
    for spelling in ("--top_fraction", "--top-fraction"):  # one parser error further: the model does not exist
        assert cli(["sparsify", "--base", "nowhere", "--tuned", "x", spelling, "0.1", "--out", "d"]) == 1
        assert "model 'nowhere' does not exist" in capsys.readouterr().err
    for command in ("demo", "eval", "study"):
        with pytest.raises(SystemExit):
            cli([command, "--help"])
        text = capsys.readouterr().out
        assert text.startswith(f"usage: trl-es {command}") and "(default: " in text


def test_steps_without_spread_give_one_summary_warning(tmp_path, tiny_model_dir, prompt_dataset):
    constant = lambda completions, **kwargs: [1.0] * len(completions)  # noqa: E731
    trainer = ESTrainer(
        model=tiny_model_dir, reward_funcs=constant, args=es_config(tmp_path), train_dataset=prompt_dataset
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    spread = [str(w.message) for w in caught if "no spread" in str(w.message)]
    assert len(spread) == 1 and spread[0].startswith("2 ES step(s) of this run left the weights unchanged")
    assert [entry["es/skipped_update"] for entry in trainer.state.log_history if "reward" in entry] == [1.0, 1.0]


def test_a_stream_skips_the_column_check_but_not_the_kwargs_check(tmp_path, tiny_model_dir, prompt_dataset):
    def no_kwargs(prompts, completions):
        return [0.0] * len(prompts)

    stream = Dataset.from_dict(prompt_dataset.to_dict()).to_iterable_dataset()
    ESTrainer(model=tiny_model_dir, reward_funcs=length_reward, args=es_config(tmp_path), train_dataset=stream)
    with pytest.raises(TypeError, match="'no_kwargs' cannot take"):
        ESTrainer(model=tiny_model_dir, reward_funcs=no_kwargs, args=es_config(tmp_path), train_dataset=stream)
