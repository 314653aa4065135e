"""Built-in tasks: datasets with a "prompt" column plus answer columns, and TRL-signature reward functions.

`TASKS[name]` bundles a task's loader, its reward, the columns the reward reads and, for Maj@K, its answer
extractor. Every task's reward is ≥ 1 exactly when the answer is correct (format bonuses stay below 1), so
"correct" means reward ≥ `SUCCESS_THRESHOLD` for evaluation and for `ESConfig.success_threshold`'s default.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import arithmetic as _arithmetic
from . import commonsenseqa as _commonsenseqa
from . import countdown as _countdown
from . import gsm8k as _gsm8k
from . import hotpotqa as _hotpotqa
from . import math500 as _math500
from .arithmetic import first_integer_reward, last_integer_reward, small_sums, wide_sums
from .commonsenseqa import choice_reward, commonsenseqa
from .competition_math import aime24, aime25, amc23, deepscaler
from .countdown import countdown, countdown_reward
from .gpqa import gpqa
from .gsm8k import gsm8k, gsm8k_reward
from .hotpotqa import hotpotqa, hotpotqa_reward
from .math500 import math500, math_reward
from .mbpp import mbpp, mbpp_reward


SUCCESS_THRESHOLD = 1.0
"""A completion is correct when its reward is at least this (every built-in task's contract)."""


@dataclass(frozen=True)
class Task:
    """`load(split, source=None, conversational=True)` → Dataset; `reward` (TRL signature) reads `answer_columns`;
    `extract_answer(text)` → the answer a completion votes for in Maj@K (None: Maj@K is not defined, e.g. code);
    `same_answer(a, b)` → whether two such answers are one vote, by the task's own equivalence (None: equal text)."""

    name: str
    load: Callable
    reward: Callable
    answer_columns: tuple[str, ...]
    eval_split: str
    max_completion_length: int
    extract_answer: Callable[[str], str | None] | None = None
    same_answer: Callable[[str, str], bool] | None = None


TASKS = {
    "gsm8k": Task("gsm8k", gsm8k, gsm8k_reward, ("answer",), "test", 512, _gsm8k.extract_answer),
    "math500": Task(
        "math500", math500, math_reward, ("answer",), "test", 1024, _math500.extract_answer, _math500.same_answer
    ),
    "countdown": Task(
        "countdown", countdown, countdown_reward, ("numbers", "target"), "test", 512, _countdown.extract_answer
    ),
    "commonsenseqa": Task(
        "commonsenseqa", commonsenseqa, choice_reward, ("answer",), "validation", 256, _commonsenseqa.extract_answer
    ),
    "mbpp": Task("mbpp", mbpp, mbpp_reward, ("test_list", "test_imports"), "test", 512, None),
    "small_sums": Task(
        "small_sums", small_sums, first_integer_reward, ("answer",), "test", 32, _arithmetic.extract_answer
    ),
    "small_sums_last": Task(
        "small_sums_last", small_sums, last_integer_reward, ("answer",), "test", 32, _arithmetic.extract_last_answer
    ),
    "small_sums_last_wide": Task(
        "small_sums_last_wide",
        wide_sums,
        last_integer_reward,
        ("answer",),
        "test",
        32,
        _arithmetic.extract_last_answer,
    ),
    "aime24": Task(
        "aime24", aime24, math_reward, ("answer",), "test", 2048, _math500.extract_answer, _math500.same_answer
    ),
    "aime25": Task(
        "aime25", aime25, math_reward, ("answer",), "test", 2048, _math500.extract_answer, _math500.same_answer
    ),
    "amc23": Task(
        "amc23", amc23, math_reward, ("answer",), "test", 2048, _math500.extract_answer, _math500.same_answer
    ),
    "deepscaler": Task(
        "deepscaler",
        deepscaler,
        math_reward,
        ("answer",),
        "train",
        2048,
        _math500.extract_answer,
        _math500.same_answer,
    ),
    "gpqa": Task("gpqa", gpqa, choice_reward, ("answer",), "test", 2048, _commonsenseqa.extract_answer),
    "hotpotqa": Task("hotpotqa", hotpotqa, hotpotqa_reward, ("answer",), "validation", 512, _hotpotqa.extract_answer),
}


def get_task(name: str) -> Task:
    """The built-in task `name`, or a ValueError listing them."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; built-in tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name]


__all__ = [
    "SUCCESS_THRESHOLD",
    "TASKS",
    "Task",
    "aime24",
    "aime25",
    "amc23",
    "choice_reward",
    "commonsenseqa",
    "countdown",
    "countdown_reward",
    "deepscaler",
    "first_integer_reward",
    "get_task",
    "gpqa",
    "gsm8k",
    "gsm8k_reward",
    "hotpotqa",
    "hotpotqa_reward",
    "math500",
    "math_reward",
    "mbpp",
    "mbpp_reward",
    "small_sums",
    "last_integer_reward",
    "wide_sums",
]
