"""Small sums: "What is a + b?" with a, b in 1..12, the demo task, scored two ways.

`small_sums` (`first_integer_reward`) takes the completion's first integer as its answer, which mostly measures
where the answer stands ("12 + 4 equals 16." answers 12). `small_sums_last` (`last_integer_reward`) takes the last
integer: the same model and problems then sit in the research's regime (SmolLM2-135M-Instruct at T = 0.6: Pass@1
near 0.35, Pass@16 above 0.9, docs/study.md), where a base already covers the task and Pass@K can be kept or lost.

Chosen from a calibration run: SmolLM2-135M-Instruct gets a few of these right (3/64 held
out), so the population's rewards differ and ES has a signal; on two-digit sums it scores 0 and ES learns nothing.
The 144 pairs are shuffled with a fixed seed into disjoint pools: 64 for training and 64 held out.
`wide_sums` (the task `small_sums_last_wide`) keeps those 64 held-out problems and trains on every other sum of two
numbers in 1..33 (1,025 problems): a pool a small model cannot memorise in an hour of training, where ES's 64
problems are seen again every 8 steps.
"""

from __future__ import annotations

import random
import re

from datasets import Dataset


_INTEGER = re.compile(r"-?\d+")
_ONLY_A_NUMBER = re.compile(r"\s*-?\d+\s*\.?\s*")


def small_sums(split: str = "train", conversational: bool = True, low: int = 1, high: int = 12) -> Dataset:
    """Columns: `prompt` (a chat message list, or plain text with `conversational=False`) and `answer` (str)."""
    pools = _pools(low, high)
    if split not in pools:
        raise ValueError(f"unknown split {split!r}; choose 'train' or 'test'")
    return _dataset(pools[split], conversational)


def wide_sums(split: str = "train", conversational: bool = True, high: int = 33) -> Dataset:
    """`small_sums`' held-out pool for "test"; for "train", every other pair a, b in 1..`high`, shuffled."""
    if split != "train":
        return small_sums(split, conversational)
    held_out = set(_pools(1, 12)["test"])
    pairs = [(a, b) for a in range(1, high + 1) for b in range(1, high + 1) if (a, b) not in held_out]
    random.Random(0).shuffle(pairs)
    return _dataset(pairs, conversational)


def _pools(low: int, high: int) -> dict[str, list[tuple[int, int]]]:
    pairs = [(a, b) for a in range(low, high + 1) for b in range(low, high + 1)]
    random.Random(0).shuffle(pairs)
    return {"train": pairs[:64], "test": pairs[64:128]}


def _dataset(pairs: list[tuple[int, int]], conversational: bool) -> Dataset:
    questions = [f"What is {a} + {b}?" for a, b in pairs]
    prompts = [[{"role": "user", "content": q}] for q in questions] if conversational else questions
    return Dataset.from_dict({"prompt": prompts, "answer": [str(a + b) for a, b in pairs]})


def _text(completion) -> str:
    return completion if isinstance(completion, str) else completion[-1]["content"]


def extract_answer(text: str) -> str | None:
    """The completion's first integer (its answer, for Maj@K), or None."""
    match = _INTEGER.search(text)
    return match.group() if match else None


def extract_last_answer(text: str) -> str | None:
    """The completion's last integer (its answer, for Maj@K), or None."""
    found = _INTEGER.findall(text)
    return found[-1] if found else None


def last_integer_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the last integer in the completion equals `answer`, else 0.0."""
    return [
        float(extract_last_answer(_text(completion)) == str(expected).strip())
        for completion, expected in zip(completions, answer, strict=True)
    ]


def first_integer_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the first integer in the completion equals `answer`, plus 0.1 when the completion is only a number."""
    rewards = []
    for completion, expected in zip(completions, answer, strict=True):
        text = _text(completion)
        correct = extract_answer(text) == str(expected).strip()
        rewards.append(float(correct) + (0.1 if _ONLY_A_NUMBER.fullmatch(text) else 0.0))
    return rewards
