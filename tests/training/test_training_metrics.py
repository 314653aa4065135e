"""Evaluation during training (eval_dataset + eval_steps → Pass@K, Maj@K) and the entropy / diversity logs."""

import math

import pytest
from datasets import Dataset
from helpers import es_config as config

from trl_es import ESTrainer


def even_first_token(completion_ids, **kwargs):
    """1.0 when the first completion token's id is even: about half of the tiny model's samples, varying by member
    and prompt."""
    return [float(ids[0] % 2 == 0) for ids in completion_ids]


def always(value):
    def reward(completions, **kwargs):
        return [value] * len(completions)

    return reward


@pytest.fixture
def sums():
    prompts = [[{"role": "user", "content": f"What is {a} + 1?"}] for a in range(6)]
    return Dataset.from_dict({"prompt": prompts, "answer": [str(a + 1) for a in range(6)]})


def test_eval_steps_log_pass_and_maj_at_k_and_train_steps_log_entropy_and_diversity(tmp_path, tiny_model_dir, sums):
    args = config(
        tmp_path,
        eval_strategy="steps",
        eval_steps=1,
        num_generations_eval=4,
        eval_k=[1, 2, 4],
        eval_task="small_sums",
        per_device_eval_batch_size=2,
        log_completion_entropy=True,
        log_population_diversity=True,
        max_completion_length=5,
    )
    trainer = ESTrainer(
        tiny_model_dir, even_first_token, args=args, train_dataset=sums, eval_dataset=sums.select(range(3))
    )
    trainer.train()
    evals = [log for log in trainer.state.log_history if "eval_pass@1" in log]
    assert [log["step"] for log in evals] == [1, 2]
    for log in evals:
        assert 0 <= log["eval_pass@1"] <= log["eval_pass@2"] <= log["eval_pass@4"] <= 1
        assert {"eval_maj@1", "eval_maj@4", "eval_reward"} <= log.keys() and log["eval_mean_token_entropy"] > 0
        assert log["eval_pass@1"] == pytest.approx(log["eval_reward"])  # 0/1 rewards: Pass@1 is the mean reward
    steps = [log for log in trainer.state.log_history if "es/population_diversity" in log]
    assert len(steps) == 2
    for log in steps:
        assert log["completions/mean_token_entropy"] > 0
        assert 0 <= log["es/population_diversity"] <= math.log(args.population_size) + 1e-9


def test_pass_at_k_follows_the_verdicts(tmp_path, tiny_model_dir, sums):
    """Correct ⇔ combined reward ≥ success_threshold: all-correct gives 1, none gives 0 (no answers: no Maj@K)."""
    for value, threshold, expected in [(1.0, 1.0, 1.0), (0.5, 1.0, 0.0), (0.5, 0.5, 1.0)]:
        args = config(tmp_path, num_generations_eval=3, eval_k=[1, 3], success_threshold=threshold)
        trainer = ESTrainer(tiny_model_dir, always(value), args=args, train_dataset=sums)
        metrics = trainer.evaluate(sums)
        assert metrics["eval_pass@1"] == metrics["eval_pass@3"] == expected
        assert "eval_maj@1" not in metrics and metrics["eval_reward"] == pytest.approx(value)


def test_bad_evaluation_settings_are_refused(tmp_path, tiny_model_dir, sums):
    with pytest.raises(ValueError, match=r"eval_k=\[1, 8\] is invalid: every K must be an integer in 1..4"):
        config(tmp_path, num_generations_eval=4, eval_k=[1, 8])
    with pytest.raises(ValueError, match="eval_task='mbpp' is invalid: choose a task with answers"):
        config(tmp_path, eval_task="mbpp")
    with pytest.raises(ValueError, match=r"`eval_dataset` lacks column\(s\) \['answer'\]"):
        ESTrainer(
            tiny_model_dir,
            even_first_token,
            args=config(tmp_path),
            train_dataset=sums,
            eval_dataset=sums.remove_columns("answer"),
        )
    with pytest.raises(ValueError, match="eval_dataset"):
        ESTrainer(
            tiny_model_dir,
            even_first_token,
            args=config(tmp_path, eval_strategy="steps", eval_steps=1),
            train_dataset=sums,
        )


@pytest.mark.slow
def test_every_step_reaches_the_logs_with_logging_steps_above_one(tmp_path, tiny_model_dir, prompt_dataset):
    """logging_steps=2, max_steps=3: steps 1-2 are averaged into one record, step 3's metrics reach the final record
    (GRPO's behaviour: folded into the summary with train_runtime, even when a checkpoint is saved at that step);
    a checkpoint between logging steps carries the metrics of the steps before it."""
    import json

    per_step = []

    def length(completions, **kwargs):
        rewards = [float(len(c)) for c in completions]
        per_step.append(sum(rewards) / len(rewards))
        return rewards

    args = config(tmp_path, max_steps=3, logging_steps=2, save_strategy="steps", save_steps=3)
    trainer = ESTrainer(tiny_model_dir, length, args=args, train_dataset=prompt_dataset)
    trainer.train()
    logged = [log for log in trainer.state.log_history if "reward" in log]
    assert [log["step"] for log in logged] == [2, 3]
    members = args.population_size
    steps = [sum(per_step[k * members : (k + 1) * members]) / members for k in range(3)]
    assert logged[0]["reward"] == pytest.approx((steps[0] + steps[1]) / 2)  # the window's mean
    assert logged[1]["reward"] == pytest.approx(steps[2]) and "train_runtime" in logged[1]  # one final record
    assert trainer.state.log_history[-1] is logged[1]
    saved = json.loads((tmp_path / "out" / "checkpoint-3" / "trainer_state.json").read_text())
    assert any(log.get("step") == 3 and "reward" in log for log in saved["log_history"])
