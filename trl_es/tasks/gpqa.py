"""GPQA Diamond (Rein et al. 2023): 198 graduate-level science questions, four-way multiple choice, scored on the letter.

Prompt template: the question, a blank line, the four options as `(A) …` to `(D) …` in an order drawn from a seed
derived from the question (the first 8 bytes of its SHA-256, so every run and machine shows the same order), then
`Think step by step, then give the letter of the correct choice on the last line, as "Answer: X".`, as one user
message (or plain text). Answer column `answer` (A–D). The completion's letter is read as CommonsenseQA's
(`trl_es.tasks.commonsenseqa.extract_answer`). The authors ask that the questions never appear in plain
text online, so the data is read from their password-protected zip (in memory), a user's CSV, or the gated Hub set.
"""

from __future__ import annotations

import csv
import hashlib
import io
import os
import random
import zipfile
import zlib
from pathlib import Path

from datasets import Dataset

from .data import as_prompt, load_rows, local_data, require_answers, require_columns


HUB_ID = "Idavidrein/gpqa"
INSTRUCTION = 'Think step by step, then give the letter of the correct choice on the last line, as "Answer: X".'
HOW_TO_GET = (
    f"GPQA is gated: accept its terms on the Hub ({HUB_ID}, config gpqa_diamond) and log in, or download the "
    "authors' dataset.zip from github.com/idavidrein/gpqa and pass `--source path/to/dataset.zip`"
)
_ZIP_PASSWORD = b"deserted-untie-orchid"  # published by the authors with the zip
_MEMBER = "gpqa_diamond.csv"
_OPTIONS = ["Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3"]


def gpqa(split: str = "test", source: str | None = None, conversational: bool = True) -> Dataset:
    """Columns `prompt`, `answer` (letter), `id` (`Record ID`). `source`: the authors' `dataset.zip` (its member
    `…/gpqa_diamond.csv`), a .csv file with the authors' columns (`Question`, `Correct Answer`, `Incorrect Answer
    1`–`3`, `Record ID`, …), a hub id (`Idavidrein/gpqa`, config `gpqa_diamond`, the same columns; its one split
    `train`) or None for the local copy `gpqa/dataset.zip`."""
    if split != "test":
        raise ValueError(f"GPQA Diamond has only the 'test' split, got {split!r}")
    source = source or local_data("gpqa/dataset.zip", hub_id=HUB_ID)
    rows = _read(source)
    require_columns(rows, ["Question", *_OPTIONS], source)
    require_answers(rows, "Correct Answer", source)
    return rows.map(lambda row: _format(row, conversational), remove_columns=rows.column_names)


def _read(source: str) -> Dataset:
    """The rows of a zip or CSV file (read in memory), or of a hub id; a missing copy says how to get one, a file
    that is not the authors' says what is wrong with it."""
    if not source.endswith((".zip", ".csv")):
        try:
            return load_rows(source, "train", hub_config="gpqa_diamond")
        except ValueError as error:
            raise ValueError(f"GPQA could not be loaded from {source!r}. {HOW_TO_GET}") from error
    if not os.path.isfile(source):
        raise FileNotFoundError(f"GPQA file {source!r} does not exist. {HOW_TO_GET}")
    text = _zip_member(source) if source.endswith(".zip") else _decoded(Path(source).read_bytes(), source)
    return Dataset.from_list(_csv_rows(text, source))


def _zip_member(path: str) -> str:
    """The text of the zip's `gpqa_diamond.csv`, decrypted with the authors' password."""
    try:
        with zipfile.ZipFile(path) as archive:
            members = [name for name in archive.namelist() if name.rsplit("/", 1)[-1] == _MEMBER]
            if not members:
                raise ValueError(f"{path!r} holds no {_MEMBER}. {HOW_TO_GET}")
            data = archive.read(members[0], pwd=_ZIP_PASSWORD)
    except (zipfile.BadZipFile, RuntimeError, NotImplementedError, zlib.error) as error:  # RuntimeError: password
        raise ValueError(f"{path!r} is not the authors' GPQA zip ({error}). {HOW_TO_GET}") from error
    return _decoded(data, path)


def _decoded(data: bytes, path: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path!r} is not UTF-8 text ({error.reason} at byte {error.start})") from error


def _csv_rows(text: str, source: str) -> list[dict]:
    """The CSV's rows as {column: field}; a ValueError names the first row whose fields do not match the header."""
    try:
        header, *rows = [row for row in csv.reader(io.StringIO(text)) if row] or [[]]
    except csv.Error as error:
        raise ValueError(f"{source!r} could not be read as CSV ({error})") from error
    for number, row in enumerate(rows, start=1):
        if len(row) != len(header):
            raise ValueError(
                f"{source!r} row {number} has {len(row)} fields, its header {len(header)}; fix or remove it"
            )
    return [dict(zip(header, row, strict=True)) for row in rows]


def option_order(question: str) -> list[int]:
    """The order in which the options (0 = the correct one) are shown, drawn from a seed hashed from the question."""
    order = list(range(len(_OPTIONS)))
    random.Random(int.from_bytes(hashlib.sha256(question.encode()).digest()[:8], "big")).shuffle(order)
    return order


def _format(row: dict, conversational: bool) -> dict:
    question = row["Question"].strip()
    order = option_order(question)
    options = [f"({letter}) {row[_OPTIONS[i]].strip()}" for letter, i in zip("ABCD", order, strict=True)]
    text = "\n".join([question, "", *options, "", INSTRUCTION])
    return {"prompt": as_prompt(text, conversational), "answer": "ABCD"[order.index(0)], "id": row.get("Record ID")}
