"""CommonsenseQA (Talmor et al. 2019): five-way multiple choice, scored on the answer letter.

Prompt template: the question, then one line per choice (`A. bank`), then `Answer with the letter of the correct
choice, as "Answer: X".`, as one user message (or plain text). Answer column `answer` (a letter A–E). The
completion's letter is the one after its last `Answer:` (or "answer is", "choice is"), else a completion that is just
a letter (`B`, `B.`, `(B)`), else the label of a completion that starts with one choice and names no other at a line's
start (`B. water`, `(B) water`, as small instruct models answer; a list of several choices is no answer).
"""

from __future__ import annotations

import re

from .data import as_prompt, completion_text, load_rows, local_data, require_answers, require_columns


INSTRUCTION = 'Answer with the letter of the correct choice, as "Answer: X".'
_LOCAL_FILES = {"train": "commonsenseqa/train_rand_split.jsonl", "validation": "commonsenseqa/dev_rand_split.jsonl"}
# each run of whitespace is read by one `\s*` (two in a row tried every split of it: quadratic time)
_AFTER_ANSWER = re.compile(r"(?i:answer|choice)\s*(?:(?i:is)\s*)?(?::\s*)?\(?([A-E])\b")
_JUST_A_LETTER = re.compile(r"\s*\(?([A-E])\)?[.:]?\s*")
_CHOICE_LINE = re.compile(r"^[ \t]*\(?([A-E])[.):][ \t]", re.MULTILINE)  # `B. water`, `(B) water` at a line's start


def commonsenseqa(split: str = "validation", source: str | None = None, conversational: bool = True):
    """Columns `prompt`, `answer` (letter), `id`. `source`: a local .jsonl file in the authors' format (question
    {stem, choices}), a hub id (`tau/commonsense_qa`: question string, choices {label, text}) or None for the local
    copy. The authors' test split has no answers and is refused."""
    if split not in _LOCAL_FILES:
        raise ValueError(
            f"unknown CommonsenseQA split {split!r}; choose 'train' or 'validation' (test has no answers)"
        )
    source = source or local_data(_LOCAL_FILES[split], hub_id="tau/commonsense_qa")
    rows = load_rows(source, split)
    require_columns(rows, ["question", "answerKey"], source)
    require_answers(rows, "answerKey", source)
    return rows.map(lambda row: _format(row, conversational), remove_columns=rows.column_names)


def _format(row: dict, conversational: bool) -> dict:
    question = row["question"]
    if isinstance(question, dict):  # the authors' files: {"stem": ..., "choices": [{"label", "text"}]}
        stem, choices = question["stem"], [(c["label"], c["text"]) for c in question["choices"]]
    else:  # the hub's: question is the stem, choices {"label": [...], "text": [...]}
        stem, choices = question, list(zip(row["choices"]["label"], row["choices"]["text"], strict=True))
    lines = [stem, *(f"{label}. {text}" for label, text in choices), INSTRUCTION]
    return {"prompt": as_prompt("\n".join(lines), conversational), "answer": row["answerKey"], "id": row["id"]}


def extract_answer(text: str) -> str | None:
    """The answer letter, or None."""
    found = _AFTER_ANSWER.findall(text)
    if found:
        return found[-1]
    alone = _JUST_A_LETTER.fullmatch(text)
    if alone:
        return alone.group(1)
    lines = _CHOICE_LINE.findall(text)
    starts_with_one = bool(lines) and _CHOICE_LINE.match(text.lstrip()) is not None and set(lines) == {lines[0]}
    return lines[0] if starts_with_one else None


def choice_reward(completions, answer, **kwargs) -> list[float]:
    """TRL-signature reward: 1.0 when the completion's letter is `answer`, else 0.0 (also when `answer` is missing)."""
    return [
        float(a is not None and extract_answer(completion_text(c)) == a)
        for c, a in zip(completions, answer, strict=True)
    ]
