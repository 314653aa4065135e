"""MBPP, sanitized (Austin et al. 2021): short Python functions checked by running the task's asserts.

Prompt template: `You are an expert Python programmer, and here is your task: {prompt} Your code should pass these
tests:\\n\\n{tests}\\n\\nWrite the complete code in one ```python code block.`, with the asserts one per line, as one
user message (or plain text with `conversational=False`). Splits by task_id (the official ones): test 11–510 (257
sanitized tasks), prompt 1–10, validation 511–600, train 601–974. Columns `prompt`, `task_id`, `test_list`,
`test_imports`. The completion's program is its last fenced code block (```python or bare ```); a completion without
one has no program. Reward 1.0 when the program, then the test imports, then the asserts, run as one file in the
sandbox (`trl_es.rewards.sandbox.run_python`), exit with status 0; else 0.0.
"""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor

from ..rewards.sandbox import run_python
from .data import as_prompt, completion_text, load_rows, local_data, require_answers, require_columns


TEMPLATE = (
    "You are an expert Python programmer, and here is your task: {prompt} Your code should pass these tests:\n\n"
    "{tests}\n\nWrite the complete code in one ```python code block."
)
SPLITS = {"test": (11, 510), "prompt": (1, 10), "validation": (511, 600), "train": (601, 974)}
_CODE_BLOCK = re.compile(r"```(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def mbpp(split: str = "test", source: str | None = None, conversational: bool = True):
    """Columns `prompt`, `task_id`, `test_list`, `test_imports`. `source`: a local .json/.jsonl file, a hub id
    (`google-research-datasets/mbpp`, config `sanitized`) or local dataset directory, or None for the local copy."""
    if split not in SPLITS:
        raise ValueError(f"unknown MBPP split {split!r}; choose one of {list(SPLITS)}")
    source = source or local_data("mbpp/sanitized-mbpp.json", hub_id="google-research-datasets/mbpp")
    rows = load_rows(source, split, hub_config="sanitized")
    columns = ["prompt", "task_id", "test_list", "test_imports"]
    require_columns(rows, columns, source)
    require_answers(rows, "test_list", source)  # no asserts: any program would pass
    first, last = SPLITS[split]
    rows = rows.filter(lambda row: first <= row["task_id"] <= last).select_columns(columns)
    return rows.map(
        lambda row: {
            "prompt": as_prompt(
                TEMPLATE.format(prompt=row["prompt"], tests="\n".join(row["test_list"])), conversational
            )
        }
    )


def extract_program(text: str) -> str | None:
    """The content of the last ```python (or bare ```) fenced block; None when there is none."""
    blocks = _CODE_BLOCK.findall(text)
    return blocks[-1] if blocks else None


def _passes(completion, tests: list[str], imports: list[str]) -> bool:
    program = extract_program(completion_text(completion))
    if program is None:
        return False
    return run_python("\n".join([program, *imports, *tests]) + "\n").passed


def mbpp_reward(completions, test_list, test_imports, **kwargs) -> list[float]:
    """TRL-signature reward: 1.0 when the completion's program passes all its task's asserts in the sandbox."""
    return [float(passed) for passed in mbpp_verify(completions, test_list, test_imports)]


def mbpp_verify(completions, test_list, test_imports, **kwargs) -> list[bool]:
    """Whether each completion's program passes all its task's asserts in the sandbox."""
    if not len(completions) == len(test_list) == len(test_imports):
        raise ValueError(
            f"{len(completions)} completions but {len(test_list)} test lists, {len(test_imports)} imports"
        )
    # one program per CPU at a time: the sandbox's timeout is wall-clock time, which oversubscribed CPUs would eat
    with ThreadPoolExecutor(len(os.sched_getaffinity(0))) as pool:
        return list(pool.map(_passes, completions, test_list, test_imports))
