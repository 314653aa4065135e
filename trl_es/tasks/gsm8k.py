"""GSM8K (Cobbe et al. 2021): grade-school word problems with a numeric answer after `####`.

Prompt template (veRL's): `{question} Let's think step by step and output the final answer after "####".`, as one
user message (or plain text with `conversational=False`). Answer column `answer`: the number after `####` in the
reference solution, commas removed. The completion's answer is the number after its last `####`, else inside its
last `\\boxed{}`, else its last number; answers are equal when their decimal values are.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from .data import as_prompt, completion_text, load_rows, local_data, require_answers, require_columns


TEMPLATE = '{question} Let\'s think step by step and output the final answer after "####".'
# Linear time: a number starts with a digit or a point (not a comma), each run of whitespace is read by one `\s*`
_NUMBER = r"-?(?:\d[\d,]*)?\.?\d+"
_AFTER_HASHES = re.compile(r"####\s*(?:\$\s*)?(" + _NUMBER + ")")
_BOXED = re.compile(r"\\boxed\{\s*(?:\$\s*)?(" + _NUMBER + r")\s*\}")
_ANY_NUMBER = re.compile(_NUMBER)


def gsm8k(split: str = "test", source: str | None = None, conversational: bool = True):
    """Columns `prompt`, `question`, `answer` (the reference number as a string). `source`: a local .jsonl file, a
    hub id (`openai/gsm8k`, config `main`) or None for the local copy (`trl_es.tasks.data`)."""
    if split not in ("train", "test"):
        raise ValueError(f"unknown GSM8K split {split!r}; choose 'train' or 'test'")
    source = source or local_data(f"gsm8k/{split}.jsonl", hub_id="openai/gsm8k")
    rows = load_rows(source, split, hub_config="main")
    require_columns(rows, ["question", "answer"], source)
    require_answers(rows, "answer", source)
    return rows.map(
        lambda row: {
            "prompt": as_prompt(TEMPLATE.format(question=row["question"]), conversational),
            "answer": reference_answer(row["answer"]),
        }
    )


def reference_answer(solution: str) -> str:
    """The number after `####` in a GSM8K solution."""
    if "####" not in solution:
        raise ValueError(f"a GSM8K answer must end with '#### <number>', got {solution[-60:]!r}")
    return solution.split("####")[-1].strip().replace(",", "")


def extract_answer(text: str) -> str | None:
    """The completion's final number, normalised (`1,000.` → `1000`); None when it has none."""
    for pattern in (_AFTER_HASHES, _BOXED):
        found = pattern.findall(text)
        if found:
            return _normalise(found[-1])
    found = _ANY_NUMBER.findall(text)
    return _normalise(found[-1]) if found else None


def _normalise(number: str) -> str | None:
    try:
        value = Decimal(number.replace(",", ""))
    except InvalidOperation:
        return None
    return format(value.normalize(), "f") if value == value.to_integral() else str(value.normalize())


def gsm8k_reward(completions, answer, **kwargs) -> list[float]:
    """TRL-signature reward: 1.0 when the completion's answer equals `answer` numerically, else 0.0 (also when
    `answer` is missing or not a number)."""
    rewards = []
    for completion, reference in zip(completions, answer, strict=True):
        expected = None if reference is None else _normalise(str(reference).replace(",", ""))
        rewards.append(float(expected is not None and extract_answer(completion_text(completion)) == expected))
    return rewards
