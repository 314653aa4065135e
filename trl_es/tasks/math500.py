"""MATH-500 (Lightman et al. 2023): competition problems with LaTeX answers, checked for equivalence by math-verify.

Prompt template (SimpleRL/veRL's): `{problem} Let's think step by step and output the final answer within
\\boxed{}.`, as one user message (or plain text). Answer column `answer` (LaTeX, from the data). A completion is
correct when math-verify's `verify(parse("$answer$"), parse(completion))` holds (equivalent numbers, fractions,
intervals, expressions…); its vote for Maj@K is math-verify's string form of what it parsed, and answers math-verify
holds equivalent (`25`, `025`, `\\frac{50}{2}`) are one vote (`same_answer`).
"""

from __future__ import annotations

from ..util.compat import import_extra
from .data import as_prompt, completion_text, load_rows, local_data, require_answers, require_columns


TEMPLATE = "{problem} Let's think step by step and output the final answer within \\boxed{{}}."


def math500(split: str = "test", source: str | None = None, conversational: bool = True):
    """Columns `prompt`, `problem`, `answer`, `subject`, `level`. `source`: a local .jsonl file, a hub id
    (`HuggingFaceH4/MATH-500`) or None for the local copy."""
    if split != "test":
        raise ValueError(f"MATH-500 has only the 'test' split, got {split!r}")
    source = source or local_data("math500/test.jsonl", hub_id="HuggingFaceH4/MATH-500")
    rows = load_rows(source, split)
    require_columns(rows, ["problem", "answer"], source)
    require_answers(rows, "answer", source)
    return rows.map(lambda row: {"prompt": as_prompt(TEMPLATE.format(problem=row["problem"]), conversational)})


def _parse(text: str) -> list:
    parse = import_extra("math_verify", "tasks", "the math500 task").parse

    try:
        return parse(text)
    except Exception:  # noqa: BLE001 — math-verify's parser errors and timeouts: unparsable means wrong
        return []


def extract_answer(text: str) -> str | None:
    """math-verify's string form of the completion's final answer; None when it finds none."""
    parsed = _parse(text)
    return str(parsed[-1]) if parsed else None


def _equivalent(gold: list, predicted: list) -> bool:
    verify = import_extra("math_verify", "tasks", "the math500 task").verify

    try:
        return bool(gold and predicted and verify(gold, predicted))
    except Exception:  # noqa: BLE001 — a comparison math-verify cannot make counts as different
        return False


def same_answer(first: str, second: str) -> bool:
    """Whether two answers `extract_answer` gave are equivalent by math-verify (one vote in Maj@K)."""
    return first == second or _equivalent(_parse(f"${first}$"), _parse(f"${second}$"))


def math_reward(completions, answer, **kwargs) -> list[float]:
    """TRL-signature reward: 1.0 when the completion's answer is equivalent to `answer` (math-verify), else 0.0 (also
    when `answer` is missing)."""
    rewards = []
    for completion, reference in zip(completions, answer, strict=True):
        gold = [] if reference is None else _parse(f"${reference}$")  # None would read as the symbols N·o·n·e
        rewards.append(float(_equivalent(gold, _parse(completion_text(completion)))))
    return rewards
