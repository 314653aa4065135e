"""Countdown: seeded solvable instances, the ES paper's prompt, and a verifier that never calls eval()."""

import re

import pytest

from trl_es.tasks.countdown import countdown, countdown_reward, evaluate_expression, solve


def test_instances_are_seeded_solvable_and_split_disjointly():
    train, test = countdown("train", n_train=20, n_test=30, seed=1), countdown("test", n_train=20, n_test=30, seed=1)
    assert len(train) == 20 and len(test) == 30
    assert list(train["target"]) == list(countdown("train", n_train=20, seed=1)["target"])  # same seed, same data
    for row in [*train, *test]:
        assert len(row["numbers"]) in (3, 4) and 10 <= row["target"] <= 100
        assert all(1 <= n <= 99 for n in row["numbers"])
        assert sorted(map(int, re.findall(r"\d+", row["solution"]))) == sorted(row["numbers"])
        assert evaluate_expression(row["solution"]) == row["target"]
    prompt = train[0]["prompt"]
    assert prompt.endswith("Let me solve this step by step.\n<think>") and f"equals {train[0]['target']}." in prompt
    assert solve([1, 1, 1], 100) is None


def test_reward_rules_by_hand():
    numbers, target = [[44, 19, 35]], [98]  # 44 + 19 + 35 = 98
    good = " reasoning </think>\n<answer> 44 + 19 + 35 </answer>"
    assert countdown_reward([good], numbers, target) == [pytest.approx(1.1)]  # strict format + right answer
    assert countdown_reward([" x </think> text <answer>44 + 35 + 19</answer> more"], numbers, target) == [
        pytest.approx(0.06 + 1.0)  # loose format: 0.1 × (0.1 + 0.5)
    ]
    for wrong in ("44 + 19", "44 + 19 + 35 + 35", "44 * 19 - 35", "44 + 19 + 35.0", "(44 + 19) + 35 = 98"):
        assert countdown_reward([f"</think>\n<answer>{wrong}</answer>"], numbers, target)[0] < 1.0, wrong
    assert countdown_reward(["no answer at all"], numbers, target) == [0.0]


@pytest.mark.parametrize(
    "hostile",
    ["__import__('os').system('true')", "(1).__class__", "2 ** 99999999", "1 / 0", "9" + "*9" * 5000, "lambda: 1"],
)
def test_expressions_are_evaluated_without_eval(hostile):
    # anything but numbers, + - * / and parentheses is refused, and errors become a wrong answer, not a crash
    try:
        evaluate_expression(hostile)
    except ValueError:
        pass
    assert countdown_reward([f"</think>\n<answer>{hostile}</answer>"], [[1, 2]], [3])[0] < 1.0
