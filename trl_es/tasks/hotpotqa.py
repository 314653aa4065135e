"""HotpotQA, distractor setting (Yang et al. 2018): multi-hop questions over ten Wikipedia paragraphs, two of them
relevant, scored by exact match of a short answer.

Prompt template: `Answer the question using the paragraphs below.`, then each paragraph as `{title}: {sentences}`
(blank lines between), then `Question: {question}` and `Give a short answer (a few words, or yes/no) on the last line,
as "Answer: <answer>".`, as one user message (or plain text). Answer column `answer`, as text (a file's numbers too).
The completion's answer is the first line of text after its last `Answer:`; it is correct when it equals `answer`
after SQuAD's normalisation (lowercase; punctuation, the articles a/an/the and extra whitespace removed). The reward
also logs the mean token F1 (HotpotQA's: yes/no/noanswer score only against themselves) as `hotpotqa_f1` when the
trainer passes `log_metric`.
"""

from __future__ import annotations

import re
import string
from collections import Counter

from datasets import Dataset

from .data import as_prompt, completion_text, load_rows, local_data, require_answers, require_columns


INTRODUCTION = "Answer the question using the paragraphs below."
INSTRUCTION = 'Give a short answer (a few words, or yes/no) on the last line, as "Answer: <answer>".'
_LOCAL_FILES = {"validation": "hotpotqa/hotpot_dev_distractor_v1.json", "train": "hotpotqa/hotpot_train_v1.1.json"}
_AFTER_ANSWER = re.compile(r"(?i:answer)\s*:\s*([^\n]*)")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)
_SPECIAL = {"yes", "no", "noanswer"}


def hotpotqa(split: str = "validation", source: str | None = None, conversational: bool = True) -> Dataset:
    """Columns `prompt`, `question`, `answer`, `type`. `source`: a local .json file in the authors' format (`context`
    a list of [title, sentences] pairs), a hub id (`hotpotqa/hotpot_qa`, config `distractor`: `context` {"title":
    [...], "sentences": [[...]]}) or None for the local copy of the authors' dev (validation) or train file."""
    if split not in _LOCAL_FILES:
        raise ValueError(f"unknown HotpotQA split {split!r}; choose 'train' or 'validation'")
    source = source or local_data(_LOCAL_FILES[split], hub_id="hotpotqa/hotpot_qa")
    rows = load_rows(source, split, hub_config="distractor")
    require_columns(rows, ["question", "answer", "context"], source)
    require_answers(rows, "answer", source)
    rows = rows.remove_columns("answer").add_column("answer", [str(answer) for answer in rows["answer"]])
    return rows.map(lambda row: _format(row, conversational), remove_columns=rows.column_names)


def _paragraphs(context) -> list[tuple[str, list[str]]]:
    """(title, sentences) pairs from either layout of `context`."""
    if isinstance(context, dict):  # the hub's: {"title": [...], "sentences": [[...], ...]}
        return list(zip(context["title"], context["sentences"], strict=True))
    return [(title, sentences) for title, sentences in context]  # the authors': [[title, [sentences]], ...]


def _format(row: dict, conversational: bool) -> dict:
    paragraphs = [
        f"{title}: {' '.join(s.strip() for s in sentences)}" for title, sentences in _paragraphs(row["context"])
    ]
    text = "\n\n".join([INTRODUCTION, *paragraphs, f"Question: {row['question']}\n{INSTRUCTION}"])
    return {
        "prompt": as_prompt(text, conversational),
        "question": row["question"],
        "answer": row["answer"],
        "type": row.get("type"),
    }


def normalize(text: str) -> str:
    """SQuAD's answer normalisation: lowercase, no punctuation, no articles, single spaces."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def extract_answer(text: str) -> str | None:
    """The normalised answer after the completion's last `Answer:` (its vote in Maj@K), or None."""
    found = _AFTER_ANSWER.findall(text)
    answer = normalize(found[-1]) if found else ""
    return answer or None


def f1(prediction: str | None, reference: str | None) -> float:
    """Token F1 of a normalised prediction against a reference (0 for either None, or a yes/no mismatch)."""
    if prediction is None or reference is None:
        return 0.0
    reference = normalize(str(reference))
    if {prediction, reference} & _SPECIAL and prediction != reference:
        return 0.0
    common = sum((Counter(prediction.split()) & Counter(reference.split())).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(prediction.split()), common / len(reference.split())
    return 2 * precision * recall / (precision + recall)


def hotpotqa_reward(completions, answer, log_metric=None, **kwargs) -> list[float]:
    """TRL-signature reward: 1.0 when the completion's answer matches `answer` exactly after normalisation, else
    0.0 (also when `answer` is missing); the batch's mean token F1 goes to `log_metric("hotpotqa_f1", …)` when
    given."""
    predictions = [extract_answer(completion_text(c)) for c in completions]
    if log_metric is not None and predictions:
        scores = [f1(p, a) for p, a in zip(predictions, answer, strict=True)]
        log_metric("hotpotqa_f1", sum(scores) / len(scores))
    return [
        float(p is not None and a is not None and p == normalize(str(a)))
        for p, a in zip(predictions, answer, strict=True)
    ]
