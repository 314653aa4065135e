"""Competition math with one final answer: AIME 2024, AIME 2025, AMC 2023 (test sets) and DeepScaleR-Preview (a
training set of AMC, AIME, Omni-MATH, STILL and MATH problems), checked for equivalence by math-verify.

Prompt template: MATH-500's, `{problem} Let's think step by step and output the final answer within \\boxed{}.`, as
one user message (or plain text). Answer column `answer`, as text (AMC's `27.0` becomes `27`; AIME's `025` stays,
and math-verify reads it as 25). Reward and Maj@K vote are MATH-500's: math-verify's equivalence of the completion's
final answer with `answer`. DeepScaleR's solutions sometimes box a multiple-choice letter, so only `answer` is graded.
The registry gives these tasks 2,048 completion tokens; the reference hard-math setting uses 8,192 (raise
`max_completion_length` for it).
"""

from __future__ import annotations

from datasets import Dataset

from .data import as_prompt, load_rows, local_data, require_answers, require_columns
from .math500 import TEMPLATE


def aime24(split: str = "test", source: str | None = None, conversational: bool = True) -> Dataset:
    """AIME 2024 I and II (30 problems). Columns `prompt`, `problem`, `answer`. `source`: a local .json/.jsonl file,
    a hub id (`HuggingFaceH4/aime_2024`: `problem`, `answer`, …; its one split `train`) or None for the local copy
    `aime24/test.jsonl` (the Qwen2.5-Math harness's file: `problem`, `question`, `answer` as text, …)."""
    source = source or local_data("aime24/test.jsonl", hub_id="HuggingFaceH4/aime_2024")
    return _load("AIME 2024", split, "test", source, "train", conversational)


def aime25(split: str = "test", source: str | None = None, conversational: bool = True) -> Dataset:
    """AIME 2025 I and II (30 problems). Columns `prompt`, `problem`, `answer`. `source`: a local .json/.jsonl file,
    a hub id (`yentinglin/aime_2025`: `problem`, `answer`, …; its one split `train`) or None for the local copy
    `aime25/test.jsonl` (`problem`, `answer` as an integer, `id`)."""
    source = source or local_data("aime25/test.jsonl", hub_id="yentinglin/aime_2025")
    return _load("AIME 2025", split, "test", source, "train", conversational)


def amc23(split: str = "test", source: str | None = None, conversational: bool = True) -> Dataset:
    """AMC 12 2023 (40 problems). Columns `prompt`, `problem`, `answer`. `source`: a local .json/.jsonl file, a hub
    id (`math-ai/amc23`: `question`, `answer`, …; split `test`) or None for the local copy `amc23/test.jsonl` (the
    Qwen2.5-Math harness's file: `problem`, `question`, `answer` as a float, …)."""
    source = source or local_data("amc23/test.jsonl", hub_id="math-ai/amc23")
    return _load("AMC 2023", split, "test", source, "test", conversational)


def deepscaler(split: str = "train", source: str | None = None, conversational: bool = True) -> Dataset:
    """DeepScaleR-Preview's training problems (about 40k). Columns `prompt`, `problem`, `answer`. `source`: a local
    .json/.jsonl file (agentica's `deepscaler.json`: `problem`, `solution`, `answer`, `difficulty`), a hub id
    (`agentica-org/DeepScaleR-Preview-Dataset`: `problem`, `answer`, `solution`; split `train`) or None for the
    local copy `deepscaler/deepscaler.json`."""
    source = source or local_data("deepscaler/deepscaler.json", hub_id="agentica-org/DeepScaleR-Preview-Dataset")
    return _load("DeepScaleR", split, "train", source, "train", conversational)


def _load(benchmark: str, split: str, only_split: str, source: str, hub_split: str, conversational: bool) -> Dataset:
    """The rows of `source` (its `hub_split` for a hub id) as `prompt`, `problem`, `answer`; the problem is read
    from `problem`, else from `question`."""
    if split != only_split:
        raise ValueError(f"{benchmark} has only the {only_split!r} split, got {split!r}")
    rows = load_rows(source, hub_split)
    problem = "question" if "question" in rows.column_names and "problem" not in rows.column_names else "problem"
    require_columns(rows, [problem, "answer"], source)
    require_answers(rows, "answer", source)
    problems = rows[problem]
    return Dataset.from_dict(
        {
            "prompt": [as_prompt(TEMPLATE.format(problem=text), conversational) for text in problems],
            "problem": list(problems),
            "answer": [answer_text(answer) for answer in rows["answer"]],
        }
    )


def answer_text(answer) -> str:
    """A reference answer as text: integral floats without their `.0` (`27.0` → `27`), anything else as written."""
    return str(int(answer)) if isinstance(answer, float) and answer.is_integer() else str(answer)
