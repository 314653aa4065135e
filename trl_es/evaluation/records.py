"""The records of an evaluation: one JSON line per finished batch under `<out-dir>/records/<task>/<model>.jsonl`,
after a first line of the evaluation's settings, so that each (model, task) resumes where it stopped and gives the
same numbers; and the scores summed from them."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable

import torch

from ..util.atomic import atomic_write_text


RECORDS_FORMAT = 2
"""Version of the records files: a file of another version is refused, not mixed in."""


def read_records(
    path: str, settings: dict, sizes: dict[int, int], n: int, voting: bool, progress: Callable[[str], None]
) -> dict[int, dict]:
    """The finished batches of an earlier run with the same settings (a ValueError for other settings). Records of
    other weights (the model at that path was trained again since) are discarded, with a message: the model is
    evaluated again. A last line cut short by an interruption is dropped from the file: that batch is generated
    again. Every record is checked against this evaluation (`sizes`: batch → problems, `n` completions each, with
    an answer each when the task is `voting`)."""
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            if number < len(lines) - 1:
                raise ValueError(f"{path} line {number + 1} is corrupt; delete the file to start over") from error
            atomic_write_text(path, "".join(kept + "\n" for kept in lines[:-1]))  # keep the complete lines only
    if not records:
        return {}
    recorded = records[0].get("settings") if isinstance(records[0], dict) else None
    if isinstance(recorded, dict) and {**recorded, "weights_sha256": None} == {**settings, "weights_sha256": None}:
        if recorded.get("weights_sha256") != settings["weights_sha256"]:
            progress(f"  {path}: made with other weights (the model changed since): evaluating again")
            os.remove(path)
            return {}
    elif recorded != settings:
        raise ValueError(
            f"{path} holds an evaluation with other settings ({recorded}); use another --out-dir or delete it to "
            "start over"
        )
    done = {}
    for number, record in enumerate(records[1:], start=2):
        problem = _record_problem(record, sizes, n, voting, done)
        if problem:
            raise ValueError(
                f"{path} line {number} is not a batch of this evaluation ({problem}); delete the file to start over"
            )
        done[record["batch"]] = record
    return done


def _record_problem(record, sizes: dict[int, int], n: int, voting: bool, done: dict) -> str | None:
    """What is wrong with one records line, or None."""
    if not isinstance(record, dict) or type(record.get("batch")) is not int:
        return "not a batch record"
    batch = record["batch"]
    if batch not in sizes or batch in done:
        return f"batch {batch} is {'repeated' if batch in done else 'not one of this evaluation'}"
    if record.get("problems") != sizes[batch]:
        return f"batch {batch} holds {record.get('problems')!r} problems, this evaluation's has {sizes[batch]}"
    correct, answers = record.get("correct"), record.get("answers")
    if not (isinstance(correct, list) and len(correct) == sizes[batch] * n and all(type(c) is bool for c in correct)):
        return f"batch {batch} lacks its {sizes[batch] * n} verdicts"
    texts = (
        isinstance(answers, list)
        and len(answers) == len(correct)
        and all(a is None or type(a) is str for a in answers)
    )
    if voting and not texts:
        return f"batch {batch} lacks its {len(correct)} answers (text or null)"
    if not voting and answers is not None:
        return f"batch {batch} holds answers, but this task has none to vote on"
    sums = ("completions", "reward_sum", "rewards", "tokens", "entropy_sum")
    if not all(type(record.get(key)) in (int, float) and math.isfinite(record[key]) for key in sums):
        return f"batch {batch} lacks its sums"
    return None


def summarize_records(records: list[dict], k_values: list[int], maj: bool, reduce: Callable | None = None) -> dict:
    """Means over problems of Pass@K (and Maj@K with `maj`); mean reward, token entropy and completion length over
    completions. `reduce` sums the records' totals across processes (a float64 tensor in, the sum out): every
    process must call it, with records or none."""
    keys = [f"pass@{k}" for k in k_values] + [f"maj@{k}" for k in k_values if maj]
    keys += ["problems", "completions", "reward_sum", "rewards", "tokens", "entropy_sum"]
    totals = torch.tensor([sum(r[key] for r in records) for key in keys], dtype=torch.float64)
    total = dict(zip(keys, (reduce(totals) if reduce else totals).tolist(), strict=True))
    summary = {"problems": total["problems"]}
    for key in [f"{m}@{k}" for m in ("pass", "maj") for k in k_values]:
        if key in total:
            summary[key] = total[key] / total["problems"]
    summary["reward"] = total["reward_sum"] / total["rewards"] if total["rewards"] else float("nan")
    summary["mean_token_entropy"] = total["entropy_sum"] / max(total["tokens"], 1)
    summary["mean_completion_length"] = total["tokens"] / total["completions"]
    return summary
