"""TRL's GRPO documentation, run with ES: every GRPOTrainer example of TRL's docs/source/grpo_trainer.md (its
rewards.md documents `trl.rewards` functions without examples of its own) with only the class names changed, and the
`trl grpo` recipes of TRL's docs/source/clis.md and tests/test_cli.py through `trl-es es --config`.

Stand-ins, at the Hub boundary only: the tiny offline model for "Qwen/Qwen2.5-0.5B-Instruct", small local datasets
with the columns of the Hub datasets the examples name (DeepMath's `prompt` + `solution`), and a short budget
(`args=SHORT`, one ES step) where an example runs on the defaults; the example's own lines are unchanged otherwise.
Doctest outputs printed in the docs are asserted as printed.
"""

import asyncio
import json
import re

import pytest
from datasets import Dataset
from helpers import DATA

from trl_es import ESConfig, ESTrainer


@pytest.fixture
def short(tmp_path):
    return ESConfig(output_dir=str(tmp_path / "out"), population_size=3, sigma=0.05, learning_rate=0.05,
                    per_device_train_batch_size=2, num_generations=2, max_completion_length=6, max_steps=1,
                    save_strategy="no", report_to="none", disable_tqdm=True)  # fmt: skip


def deepmath(n=4):
    """Rows shaped like trl-lib/DeepMath-103K: a conversational `prompt` and a LaTeX `solution`."""
    return Dataset.from_dict({
        "prompt": [[{"role": "user", "content": f"What is {k} + {k}? Answer in \\boxed{{}}."}] for k in range(n)],
        "solution": [str(2 * k) for k in range(n)],
    })  # fmt: skip


def test_quick_start(tiny_model_dir, short):
    from trl.rewards import accuracy_reward

    dataset = deepmath()  # load_dataset("trl-lib/DeepMath-103K", split="train")
    trainer = ESTrainer(
        model=tiny_model_dir,  # "Qwen/Qwen2.5-0.5B-Instruct"
        reward_funcs=accuracy_reward,
        train_dataset=dataset,
        args=short,
    )
    trainer.train()
    assert trainer.state.global_step == 1 and "rewards/accuracy_reward/mean" in trainer.state.log_history[0]


# Example 1: reward the number of completion tokens
def reward_func_ids(completion_ids, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of token count)."""
    return [float(len(ids)) for ids in completion_ids]


# Example 1.1: reward the number of characters
def reward_func_chars(completions, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of character count)."""
    return [float(len(completion)) for completion in completions]


# Example 2: reward completions with a specific format
def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


# Example 3: reward completions against a reference
def reward_func_ground_truth(completions, ground_truth, **kwargs):
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth, strict=True)]


def test_reward_examples_give_the_documented_values():
    assert reward_func_ids(completion_ids=[[6303, 13], [304, 279, 12884, 13]]) == [2.0, 4.0]
    assert reward_func_chars(completions=[" blue.", " in the sky."]) == [6.0, 12.0]
    completions = [
        [{"role": "assistant", "content": "<think>The sum of 1 and 2 is 3, which we multiply by 4 to get 12.</think>"
                                          "<answer>(1 + 2) * 4 = 12</answer>"}],
        [{"role": "assistant", "content": "The sum of 3 and 1 is 4, which we multiply by 2 to get 8. So (3 + 1) * 2 = 8."}],
    ]  # fmt: skip
    assert format_reward_func(completions=completions) == [1.0, 0.0]
    boxed = [r"The answer is \boxed{2}", r"The answer is \boxed{6}"]
    assert reward_func_ground_truth(completions=boxed, ground_truth=["2", "5"]) == [1.0, 0.0]


@pytest.mark.parametrize("reward_func", [reward_func_ids, reward_func_chars, reward_func_ground_truth])
def test_reward_examples_train(tiny_model_dir, short, prompt_dataset, reward_func):
    dataset = prompt_dataset.add_column("ground_truth", [str(n) for n in range(len(prompt_dataset))])
    trainer = ESTrainer(model=tiny_model_dir, reward_funcs=reward_func, args=short, train_dataset=dataset)
    trainer.train()
    assert trainer.state.global_step == 1


def test_format_reward_trains_on_conversational_prompts(tiny_model_dir, short):
    trainer = ESTrainer(model=tiny_model_dir, reward_funcs=format_reward_func, args=short, train_dataset=deepmath())
    trainer.train()
    assert trainer.state.log_history[0]["rewards/format_reward_func/mean"] is not None


# Example 4: multi-task reward functions (the doc's helpers check_math_solution / test_code_solution are stand-ins)
def check_math_solution(prompt, completion):
    return float("4" in completion)


def test_code_solution(prompt, completion):
    return float("def" in completion)


test_code_solution.__test__ = False  # a helper of the example, not a pytest test


def math_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task, strict=True):
        if t == "math":
            rewards.append(check_math_solution(prompt, completion))
        else:
            rewards.append(None)  # Return None for non-math tasks
    return rewards


def coding_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task, strict=True):
        if t == "coding":
            rewards.append(test_code_solution(prompt, completion))
        else:
            rewards.append(None)  # Return None for non-coding tasks
    return rewards


def test_multi_task_rewards(tiny_model_dir, short):
    dataset = Dataset.from_list([
        {"prompt": "What is 2+2?", "task": "math"},
        {"prompt": "Write a function that returns the sum of two numbers.", "task": "code"},
        {"prompt": "What is 3*4?", "task": "math"},
        {"prompt": "Write a function that returns the product of two numbers.", "task": "code"},
    ])  # fmt: skip
    trainer = ESTrainer(
        model=tiny_model_dir,  # "Qwen/Qwen2.5-0.5B-Instruct"
        reward_funcs=[math_reward_func, coding_reward_func],
        train_dataset=dataset,
        args=short,
    )
    trainer.train()
    assert trainer.state.global_step == 1


# Example 5: asynchronous reward functions
async def async_reward_func(prompts, completions, **kwargs):
    await asyncio.sleep(0.01)  # simulate an asynchronous I/O call (e.g. an API)
    return [1.0 if completion else 0.0 for completion in completions]


# Example 6: logging extra columns and metrics from a reward function
def reward_func_logging(completions, ground_truth, log_extra=None, log_metric=None, **kwargs):
    extracted = [re.search(r"\\boxed\{(.*?)\}", c) for c in completions]
    extracted = [m.group(1) if m else None for m in extracted]
    rewards = [1.0 if e == gt else 0.0 for e, gt in zip(extracted, ground_truth, strict=True)]
    if log_extra:
        log_extra("golden_answer", list(ground_truth))
        log_extra("extracted_answer", [e or "[none]" for e in extracted])
    if log_metric:
        log_metric("accuracy", sum(rewards) / len(rewards))
    return rewards


def test_passing_several_rewards_sync_and_async_with_logging(tiny_model_dir, short, prompt_dataset):
    dataset = prompt_dataset.add_column("ground_truth", [str(n) for n in range(len(prompt_dataset))])
    short.log_completions = True
    trainer = ESTrainer(model=tiny_model_dir, reward_funcs=[reward_func_logging, async_reward_func], args=short,
                        train_dataset=dataset)  # fmt: skip
    trainer.train()
    assert "accuracy" in trainer.state.log_history[0]
    assert {"golden_answer", "extracted_answer"} <= trainer.population.last_completions[3].keys()


def deepmath_dir(tmp_path):
    """A local dataset folder shaped like trl-lib/DeepMath-103K (train split)."""
    folder = tmp_path / "deepmath"
    folder.mkdir()
    (folder / "train.jsonl").write_text("\n".join(json.dumps(row) for row in deepmath(8).to_list()))
    return str(folder)


def es_cli(*args):
    from trl_es.cli import main

    return main(["es", *args])


RECIPES = {
    # TRL's docs/source/clis.md: the GRPO recipe
    "clis.md": "dataset_name: {deepmath}\nreward_funcs: [accuracy_reward]\n",
    # trl grpo's factory reward: TRL's script calls get_soft_overlong_punishment(1280, 256)
    "factory reward": "dataset_name: {deepmath}\nreward_funcs: [get_soft_overlong_punishment]\n",
    # TRL ModelConfig fields and GRPO loss fields
    "ModelConfig and loss fields": (
        "dataset_name: {deepmath}\nreward_funcs: [accuracy_reward]\ndtype: float32\nattn_implementation: eager\n"
        "model_revision: main\ntrust_remote_code: false\nbeta: 0.04\nloss_type: grpo\nscale_rewards: batch\n"
        "num_iterations: 1\nepsilon: 0.2\n"
    ),
    # clis.md's dataset mixture
    "dataset mixture": (
        "datasets:\n  - path: {zen}\n    name: conversational_prompt_only\n  - path: {deepmath}\n"
        "reward_funcs: [think_format_reward]\n"
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_trl_grpo_recipes_run_through_trl_es(tmp_path, tiny_model_dir, recipe):

    zen = DATA / "zen"
    body = RECIPES[recipe].format(deepmath=deepmath_dir(tmp_path), zen=zen)
    path = tmp_path / "recipe.yaml"
    path.write_text(
        f"model_name_or_path: {tiny_model_dir}\noutput_dir: {tmp_path / 'out'}\nmax_steps: 1\nreport_to: none\n"
        f"population_size: 3\nsigma: 0.05\nlearning_rate: 0.05\nper_device_train_batch_size: 2\n"
        f"num_generations: 2\nmax_completion_length: 6\nsave_strategy: 'no'\n{body}"
    )
    assert es_cli("--config", str(path)) == 0
    assert (tmp_path / "out" / "model.safetensors").is_file()


@pytest.mark.slow
def test_trl_cli_test_grpo_command(tmp_path, tiny_model_dir):
    """TRL's tests/test_cli.py `test_grpo`, with the tiny model's own reward model stand-in and the offline zen."""

    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    reward_model = tmp_path / "reward-model"
    AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1).save_pretrained(reward_model)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(reward_model)
    zen = str(DATA / "zen")
    code = es_cli("--output_dir", str(tmp_path / "out"), "--model_name_or_path", tiny_model_dir,
                  "--reward_model_name_or_path", str(reward_model), "--dataset_name", zen,
                  "--dataset_config", "standard_prompt_only", "--num_generations", "4", "--max_completion_length",
                  "32", "--report_to", "none", "--max_steps", "1", "--population_size", "2",
                  "--per_device_train_batch_size", "2")  # fmt: skip
    assert code == 0


def test_unknown_recipe_field_names_the_closest_one(tmp_path, tiny_model_dir):
    path = tmp_path / "recipe.yaml"
    path.write_text(f"model_name_or_path: {tiny_model_dir}\ndataset_name: small_sums\npopulaton_size: 3\n")
    with pytest.raises(SystemExit, match="no field 'populaton_size'; did you mean 'population_size'"):
        es_cli("--config", str(path), "--output_dir", str(tmp_path / "out"))
    path.write_text(f"model_name_or_path: {tiny_model_dir}\ndataset_name: small_sums\n")
    with pytest.raises(SystemExit, match="no field 'sigmaa'; did you mean 'sigma'"):
        es_cli("--config", str(path), "--output_dir", str(tmp_path / "out"), "--sigmaa", "0.1")
