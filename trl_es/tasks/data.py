"""Where task data comes from: a local file, a hub id, or the repository's copy of the benchmark files.

`local_data("gsm8k/test.jsonl", hub_id="openai/gsm8k")` looks for the file under `$TRL_ES_DATA` and returns its
path; without a local copy it returns the hub id, which `load_rows` hands to `datasets.load_dataset`. The tests point
`TRL_ES_DATA` at the repository's `tests/data` (the first rows of the real files), so they need no Hub access.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from datasets import Dataset, load_dataset
from datasets.exceptions import DatasetGenerationError


_FILE_SUFFIXES = (".json", ".jsonl")


def local_data(relative: str, hub_id: str) -> str:
    """The local copy `$TRL_ES_DATA/relative` when it exists, else `hub_id`."""
    root = os.environ.get("TRL_ES_DATA")
    path = Path(root) / relative if root else None
    return str(path) if path is not None and path.is_file() else hub_id


def load_rows(source: str, split: str, hub_config: str | None = None) -> Dataset:
    """Rows from a local .json/.jsonl file (all of it; the caller picks its split; a file that is not JSON is a
    ValueError naming its line) or from `load_dataset(source, hub_config, split=split)` for a hub id or a local
    dataset directory."""
    if source.endswith(_FILE_SUFFIXES):
        if not os.path.isfile(source):
            raise FileNotFoundError(f"task data file {source!r} does not exist")
        try:
            return load_dataset("json", data_files=source, split="train")
        except (DatasetGenerationError, StopIteration, ValueError) as error:  # StopIteration: an empty .jsonl
            raise ValueError(f"{source!r} {_json_problem(source, error)}") from error
    try:
        return load_dataset(source, hub_config, split=split)
    except OSError as error:  # offline, or the Hub unreachable (ConnectionError and the Hub's own errors are OSErrors)
        if os.path.isdir(source):
            raise
        raise ValueError(
            f"the task data comes from the Hub dataset {source!r}, which could not be loaded "
            f"({type(error).__name__}). Without Hub access, pass a local .json/.jsonl copy (`--source FILE`, or "
            "`source=`), or set TRL_ES_DATA to a folder holding the task's files (the repository's tests/data "
            "holds the first rows of each)"
        ) from error


def _json_problem(path: str, error: BaseException) -> str:
    """What keeps the file from loading: the first line where it stops being JSON (a .jsonl file read line by line,
    a .json file as one document), that it is empty, or else datasets' `error`."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        return "is empty"
    documents = text.split("\n") if path.endswith(".jsonl") else [text]
    for number, document in enumerate(documents, start=1):
        if not document.strip():
            continue
        try:
            json.loads(document)
        except json.JSONDecodeError as problem:
            return f"is not JSON at line {number + problem.lineno - 1} ({problem.msg})"
    return f"could not be read as rows of JSON objects ({error.__cause__ or error})"


def require_columns(dataset: Dataset, columns: list[str], source: str) -> None:
    """A clear error when `dataset` lacks a column the task reads."""
    missing = [c for c in columns if c not in dataset.column_names]
    if missing:
        raise ValueError(f"{source!r} has no column(s) {missing} (columns: {dataset.column_names})")


def require_answers(dataset: Dataset, column: str, source: str) -> None:
    """A clear error naming the first row of `source` whose reference answer (`column`) is missing (null, blank or
    empty): a missing reference would score non-answers as correct."""
    for row, answer in enumerate(dataset[column], start=1):
        if answer is None or (isinstance(answer, str) and not answer.strip()) or answer == []:
            raise ValueError(f"{source!r} row {row} has no {column!r} (its reference answer); fix or remove the row")


def as_prompt(text: str, conversational: bool):
    """One user message (a chat prompt) or the plain text."""
    return [{"role": "user", "content": text}] if conversational else text


def completion_text(completion) -> str:
    """The text of a completion given as a string or as a list of messages (TRL's two formats)."""
    return completion if isinstance(completion, str) else completion[-1]["content"]
