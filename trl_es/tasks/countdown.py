"""Countdown (3–4 numbers), generated here with a fixed seed, following the ES paper's Countdown setup.

Instances: n ∈ {3, 4}, target ~ U{10..100}, numbers ~ U{1..99} with replacement, re-drawn until an exhaustive search
finds a solution under Stream-of-Search's integer rules (a+b, a·b, |a−b|, exact division). Prompt: the ES paper's
raw-text template. Reward (on the completion only): 0.1 × format reward + answer reward, where the answer
— the last `<answer>…</answer>` — must use each given number exactly once and equal the target. The expression is
evaluated by walking its syntax tree (numbers, + − × ÷, parentheses only), never with `eval()`. A fixed set with the
columns of the Hub's `Jiayi-Pan/Countdown-Tasks-3to4` (`target`, `nums`), e.g. a published test set, is read
instead with `source=`.
"""

from __future__ import annotations

import ast
import random
import re

from datasets import Dataset

from .data import load_rows, require_answers, require_columns


TEMPLATE = (
    "You are a helpful assistant. You first think about the reasoning process in your mind and then provide the user "
    "with the answer.Using the numbers {nums}, create an equation that equals {target}. You can use basic arithmetic "
    "operations (+, -, *, /) and each number can only be used once. Show your work in <think> </think> tags. And "
    "return the final answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>.Let me solve "
    "this step by step.\n<think>"
)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_STRICT_FORMAT = re.compile(r"^<think>.*?</think>\n<answer>.*?</answer>$", re.DOTALL)
_ALLOWED = re.compile(r"^[0-9+\-*/() ]+$")
_OPERATORS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


def solve(numbers: list[int], target: int) -> str | None:
    """An expression reaching `target` from `numbers` under the integer rules, or None (exhaustive search)."""

    def search(items: list[tuple[int, str]]) -> str | None:
        if len(items) == 1:
            return items[0][1] if items[0][0] == target else None
        for i in range(len(items)):
            for j in range(i + 1, len(items)):
                (a, ea), (b, eb) = sorted([items[i], items[j]], reverse=True)
                rest = [items[k] for k in range(len(items)) if k not in (i, j)]
                candidates = [(a + b, f"({ea} + {eb})"), (a * b, f"({ea} * {eb})"), (a - b, f"({ea} - {eb})")]
                if b and a % b == 0:
                    candidates.append((a // b, f"({ea} / {eb})"))
                for value in candidates:
                    found = search([*rest, value])
                    if found:
                        return found
        return None

    return search([(n, str(n)) for n in numbers])


def _format_nums(numbers: list[int]) -> str:
    """numpy's array formatting, as the ES paper's prompts: `[ 2 11 73]`."""
    width = max(len(str(n)) for n in numbers)
    return "[" + " ".join(str(n).rjust(width) for n in numbers) + "]"


def countdown(
    split: str = "train", n_train: int = 200, n_test: int = 2000, seed: int = 0, source: str | None = None
) -> Dataset:
    """Columns `prompt` (raw text), `numbers`, `target`, `solution`. The first `n_train` instances drawn from `seed`
    are the train split, the next `n_test` the test split. With `source`, all the rows of that fixed set instead
    (`fixed_set`)."""
    if split not in ("train", "test"):
        raise ValueError(f"unknown split {split!r}; choose 'train' or 'test'")
    if source is not None:
        return fixed_set(source)
    rng, rows = random.Random(seed), []
    while len(rows) < n_train + (n_test if split == "test" else 0):
        size, target = rng.choice((3, 4)), rng.randint(10, 100)
        numbers = [rng.randint(1, 99) for _ in range(size)]
        solution = solve(numbers, target)
        if solution is not None:
            rows.append({"numbers": numbers, "target": target, "solution": solution})
    rows = rows[:n_train] if split == "train" else rows[n_train:]
    return Dataset.from_dict(
        {
            "prompt": [_prompt(r["numbers"], r["target"]) for r in rows],
            "numbers": [r["numbers"] for r in rows],
            "target": [r["target"] for r in rows],
            "solution": [r["solution"] for r in rows],
        }
    )


def fixed_set(source: str) -> Dataset:
    """Columns `prompt`, `numbers`, `target` from a local .json/.jsonl file or a hub id (its `train` split) with
    `Jiayi-Pan/Countdown-Tasks-3to4`'s columns `target` (int) and `nums` (list of int), or `numbers` instead."""
    rows = load_rows(source, "train")
    numbers = "numbers" if "numbers" in rows.column_names and "nums" not in rows.column_names else "nums"
    require_columns(rows, [numbers, "target"], source)
    require_answers(rows, numbers, source)
    require_answers(rows, "target", source)
    return Dataset.from_dict(
        {
            "prompt": [_prompt(n, t) for n, t in zip(rows[numbers], rows["target"], strict=True)],
            "numbers": rows[numbers],
            "target": rows["target"],
        }
    )


def _prompt(numbers: list[int], target: int) -> str:
    """The ES paper's prompt for one instance."""
    return TEMPLATE.format(nums=_format_nums(numbers), target=target)


def evaluate_expression(text: str) -> float:
    """The value of an arithmetic expression of numbers, + − * /, parentheses (ValueError for anything else)."""

    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        raise ValueError(f"not allowed in an equation: {ast.dump(node)[:60]}")

    try:
        return float(walk(ast.parse(text.strip(), mode="eval")))
    except (SyntaxError, ZeroDivisionError, RecursionError) as error:
        raise ValueError(str(error)) from error


def extract_answer(text: str) -> str | None:
    """The content of the completion's last <answer>…</answer> (its vote in Maj@K), or None."""
    answers = _ANSWER.findall(text)
    return answers[-1].strip() if answers else None


def countdown_answer_reward(completion: str, numbers: list[int], target) -> float:
    """1.0 when the last <answer> uses each number exactly once and equals `target` (|x − target| < 1e-5)."""
    answers = _ANSWER.findall(completion)
    if not answers or not _ALLOWED.match(answers[-1]):
        return 0.0
    content = answers[-1]
    if sorted(int(n) for n in re.findall(r"\d+", content)) != sorted(numbers):
        return 0.0
    try:
        return float(abs(evaluate_expression(content) - float(target)) < 1e-5)
    except ValueError:
        return 0.0


def countdown_reward(completions, numbers, target, **kwargs) -> list[float]:
    """TRL-signature reward: 0.1 × format reward + answer reward (0 to 1.1); the format is checked on
    "<think>" + completion, since the prompt ends with <think>."""
    rewards = []
    for completion, nums, goal in zip(completions, numbers, target, strict=True):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        full = "<think>" + text
        if _STRICT_FORMAT.match(full):
            form = 1.0
        else:
            form = 0.1 * bool(re.search(r"<think>.*?</think>", full, re.DOTALL))
            form += 0.5 * bool(_ANSWER.search(full))
        rewards.append(0.1 * form + countdown_answer_reward(text, nums, goal))
    return rewards
