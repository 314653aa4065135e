"""Small sums: "What is a + b?" with a, b in 1..12, the demo task.

Chosen from a calibration run: SmolLM2-135M-Instruct gets a few of these right (3/64 held
out), so the population's rewards differ and ES has a signal; on two-digit sums it scores 0 and ES learns nothing.
The 144 pairs are shuffled with a fixed seed into disjoint pools: 64 for training and 64 held out.
"""

from __future__ import annotations

import random
import re

from datasets import Dataset


_INTEGER = re.compile(r"-?\d+")
_ONLY_A_NUMBER = re.compile(r"\s*-?\d+\s*\.?\s*")


def small_sums(split: str = "train", conversational: bool = True, low: int = 1, high: int = 12) -> Dataset:
    """Columns: `prompt` (a chat message list, or plain text with `conversational=False`) and `answer` (str)."""
    pairs = [(a, b) for a in range(low, high + 1) for b in range(low, high + 1)]
    random.Random(0).shuffle(pairs)
    pools = {"train": pairs[:64], "test": pairs[64:128]}
    if split not in pools:
        raise ValueError(f"unknown split {split!r}; choose 'train' or 'test'")
    questions = [f"What is {a} + {b}?" for a, b in pools[split]]
    prompts = [[{"role": "user", "content": q}] for q in questions] if conversational else questions
    return Dataset.from_dict({"prompt": prompts, "answer": [str(a + b) for a, b in pools[split]]})


def _text(completion) -> str:
    return completion if isinstance(completion, str) else completion[-1]["content"]


def extract_answer(text: str) -> str | None:
    """The completion's first integer (its answer, for Maj@K), or None."""
    match = _INTEGER.search(text)
    return match.group() if match else None


def first_integer_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the first integer in the completion equals `answer`, plus 0.1 when the completion is only a number."""
    rewards = []
    for completion, expected in zip(completions, answer, strict=True):
        text = _text(completion)
        correct = extract_answer(text) == str(expected).strip()
        rewards.append(float(correct) + (0.1 if _ONLY_A_NUMBER.fullmatch(text) else 0.0))
    return rewards
