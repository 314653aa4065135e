"""The research benchmarks: AIME 2024/2025, AMC 2023, DeepScaleR, GPQA Diamond, HotpotQA and Countdown's fixed set.

Loaders on the first real rows (tests/data), rewards of correct, wrong and malformed completions (plain text and
chat), Maj@K answers, and the errors for missing data. GPQA's rows are never printed: its checks compare inside
the test and assert only booleans and letters.
"""

import csv
import json
import os

import pytest

from trl_es.tasks import (
    SUCCESS_THRESHOLD,
    TASKS,
    aime24,
    aime25,
    amc23,
    choice_reward,
    deepscaler,
    gpqa,
    hotpotqa,
    hotpotqa_reward,
    math_reward,
)
from trl_es.tasks.countdown import TEMPLATE, countdown, countdown_reward
from trl_es.tasks.gpqa import HOW_TO_GET, _zip_member, option_order
from trl_es.tasks.hotpotqa import extract_answer as hotpot_answer
from trl_es.tasks.hotpotqa import f1, normalize
from trl_es.tasks.math500 import extract_answer as math_answer


def chat(text):
    return [{"role": "assistant", "content": text}]


def test_registry_entries():
    for name, split in [("aime24", "test"), ("aime25", "test"), ("amc23", "test"), ("deepscaler", "train")]:
        task = TASKS[name]
        assert (task.reward, task.answer_columns, task.eval_split) == (math_reward, ("answer",), split)
        assert task.extract_answer is math_answer and task.max_completion_length == 2048
    assert TASKS["gpqa"].reward is choice_reward and TASKS["gpqa"].eval_split == "test"
    assert TASKS["hotpotqa"].reward is hotpotqa_reward and TASKS["hotpotqa"].eval_split == "validation"
    assert TASKS["hotpotqa"].extract_answer is hotpot_answer


@pytest.mark.parametrize("name", ["aime24", "aime25", "amc23", "deepscaler", "gpqa", "hotpotqa"])
def test_reference_answers_and_only_them_are_correct(name):
    task = TASKS[name]
    rows = task.load(task.eval_split)
    reference = "So \\boxed{{{}}}." if task.reward is math_reward else "Answer: {}"
    right = task.reward([reference.format(a) for a in rows["answer"]], rows["answer"][:])
    wrong = task.reward([reference.format("-12345")] * len(rows), rows["answer"][:])
    assert all(r >= SUCCESS_THRESHOLD for r in right) and all(r < SUCCESS_THRESHOLD for r in wrong)
    assert [task.extract_answer(reference.format(a)) is not None for a in rows["answer"]] == [True] * len(rows)


@pytest.mark.parametrize(
    ("load", "rows", "first_answer", "start"),
    [
        (aime24, 8, "204", "Every morning Aya goes for a $9$-kilometer-long walk"),
        (aime25, 8, "70", "Find the sum of all integer bases $b>9$"),
        (amc23, 8, "27", "Cities $A$ and $B$ are $45$ miles apart."),
        (deepscaler, 4, "-\\frac{2}{3}", "The operation $\\otimes$ is defined"),
    ],
)
def test_competition_math_loaders(load, rows, first_answer, start):
    data = load()
    assert len(data) == rows and data.column_names == ["prompt", "problem", "answer"]
    assert data[0]["answer"] == first_answer and data[0]["problem"].startswith(start)
    message = data[0]["prompt"][0]
    assert message["role"] == "user" and message["content"].startswith(start)
    assert message["content"].endswith("Let's think step by step and output the final answer within \\boxed{}.")
    assert load(conversational=False)[0]["prompt"] == message["content"]


def test_competition_math_answers_as_text():
    assert aime24()["answer"][:] == ["204", "113", "371", "385", "110", "104", "721", "025"]
    assert aime25()["answer"][:] == ["70", "588", "16", "117", "279", "504", "821", "77"]
    assert amc23()["answer"][:] == ["27", "36", "45", "3159", "36", "7", "21", "3"]  # 27.0 … in the file
    assert deepscaler()["answer"][:] == ["-\\frac{2}{3}", "26", "1", "\\frac{\\sqrt{2}}{2}"]


def test_competition_math_rewards_by_hand():
    aime = ["So the walk takes \\boxed{204} minutes.", chat("\\boxed{204}"), "\\boxed{240}", "\\boxed{", "204?"]
    assert math_reward(aime, ["204"] * 5) == [1.0, 1.0, 0.0, 0.0, 1.0]  # math-verify falls back to the last number
    assert math_reward(["\\boxed{25}", chat("$\\boxed{025}$"), "\\boxed{52}"], [aime24()[7]["answer"]] * 3) == [
        1.0,
        1.0,
        0.0,
    ]
    assert math_reward(["\\boxed{70}", "\\boxed{71}", "no idea"], [aime25()[0]["answer"]] * 3) == [1.0, 0.0, 0.0]
    amc = ["\\boxed{27}", chat("\\boxed{27.0}"), "\\boxed{18}", "}}{{\\frac"]
    assert math_reward(amc, [amc23()[0]["answer"]] * 4) == [1.0, 1.0, 0.0, 0.0]
    rows = deepscaler()
    scaler = ["\\boxed{-\\frac{2}{3}}", chat("$\\boxed{-2/3}$"), "\\boxed{A}", "\\boxed{\\frac{2}{3}}"]
    assert math_reward(scaler, [rows[0]["answer"]] * 4) == [1.0, 1.0, 0.0, 0.0]  # the solution's letter is wrong
    assert math_reward(["\\boxed{\\frac{1}{\\sqrt{2}}}"], [rows[3]["answer"]]) == [1.0]
    assert math_answer("so \\boxed{27}") == "27" and math_answer("nothing here") is None


def test_competition_math_sources_and_errors(tmp_path):
    hub_like = tmp_path / "amc.jsonl"  # math-ai/amc23's `question` column, a float answer
    hub_like.write_text(json.dumps({"id": 0, "question": "What is $3 \\cdot 9$?", "answer": 27.0}) + "\n")
    rows = amc23(source=str(hub_like), conversational=False)
    assert rows[0]["problem"] == "What is $3 \\cdot 9$?" and rows[0]["answer"] == "27"
    assert rows[0]["prompt"].startswith("What is $3 \\cdot 9$? Let's think step by step")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        aime24(source=str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"problem": "1+1?", "solution": "2"}) + "\n")
    with pytest.raises(ValueError, match=r"no column\(s\) \['answer'\]"):
        aime25(source=str(bad))
    with pytest.raises(ValueError, match="AIME 2024 has only the 'test' split"):
        aime24("train")
    with pytest.raises(ValueError, match="DeepScaleR has only the 'train' split"):
        deepscaler("test")


def test_gpqa_loader_shuffles_options_per_question():
    rows = gpqa()
    assert len(rows) == 8 and rows.column_names == ["prompt", "answer", "id"]
    assert rows["answer"][:] == ["A", "C", "C", "C", "A", "A", "A", "D"]
    assert rows[0]["id"] == "rec06pnAkLOr2t2mp"
    records = list(
        csv.DictReader(
            _zip_member(os.path.join(os.environ["TRL_ES_DATA"], "gpqa", "dataset.zip")).splitlines(keepends=True)
        )
    )
    shown = []
    for row, record in zip(rows, records, strict=True):
        text = row["prompt"][0]["content"]
        correct_at_letter = f"({row['answer']}) {record['Correct Answer'].strip()}\n" in text
        all_options = all(f") {record[f'Incorrect Answer {i}'].strip()}\n" in text for i in (1, 2, 3))
        shown.append(correct_at_letter and all_options and text.startswith(record["Question"].strip()))
        shown.append(text.endswith('on the last line, as "Answer: X".') and text.count("\n(") == 4)
    assert all(shown)  # booleans only: GPQA's text must not reach the test output
    assert option_order("same question") == option_order("same question") == [0, 3, 1, 2]
    assert isinstance(gpqa(conversational=False)[0]["prompt"], str)


def test_gpqa_reward_and_letters():
    answers = gpqa()["answer"][:2]  # A, C
    completions = ["Reasoning...\nAnswer: A", chat("The answer is (C)."), "Answer: B", "Answer: E", "I cannot tell."]
    assert choice_reward(completions, [answers[0], answers[1], "A", "A", "A"]) == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert choice_reward([chat("D"), "Answer: A then Answer: D"], ["D", "D"]) == [1.0, 1.0]
    assert TASKS["gpqa"].extract_answer("so Answer: (B)") == "B" and TASKS["gpqa"].extract_answer("hmm") is None


def test_gpqa_csv_and_missing_copies(tmp_path, monkeypatch):
    columns = ["Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3"]
    path = tmp_path / "gpqa_diamond.csv"  # a made-up question in the authors' columns
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerows([columns, ["Which is a noble gas?", "Neon", "Iron", "Sodium", "Carbon"]])
    row = gpqa(source=str(path), conversational=False)[0]
    letter = "ABCD"[option_order("Which is a noble gas?").index(0)]
    assert f"({letter}) Neon" in row["prompt"] and row["answer"] == letter and row["id"] is None
    with pytest.raises(FileNotFoundError, match="does not exist.*idavidrein/gpqa.*--source path/to/dataset.zip"):
        gpqa(source=str(tmp_path / "dataset.zip"))
    monkeypatch.setenv("TRL_ES_DATA", str(tmp_path))  # no local copy: the gated Hub set, unreachable offline
    with pytest.raises(ValueError, match="GPQA could not be loaded from 'Idavidrein/gpqa'") as error:
        gpqa()
    assert HOW_TO_GET in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(ValueError, match="only the 'test' split"):
        gpqa("train")


def test_gpqa_files_that_are_not_the_authors_are_one_line_errors_naming_them(tmp_path, monkeypatch):
    """Tracebacks the CLI did not catch: RuntimeError (another password), BadZipFile (a login page or a Git LFS
    pointer saved as dataset.zip), AttributeError (a CSV row short of fields)."""
    zip_path = tmp_path / "dataset.zip"
    for text in ["<html><body>Sign in to GitHub</body></html>", "version https://git-lfs.github.com/spec/v1\n"]:
        zip_path.write_text(text)
        with pytest.raises(ValueError, match=rf"^'{zip_path}' is not the authors' GPQA zip \(.*\)\. GPQA is gated"):
            gpqa(source=str(zip_path))
    real = os.path.join(os.environ["TRL_ES_DATA"], "gpqa", "dataset.zip")
    monkeypatch.setitem(_zip_member.__globals__, "_ZIP_PASSWORD", b"another password")
    with pytest.raises(ValueError, match=rf"^'{real}' is not the authors' GPQA zip \(.*password.*\)"):
        gpqa(source=real)
    columns = ["Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3"]
    rows = {"short": ["Which is a noble gas?", "Neon", "Iron"], "long": ["Which?", "Neon", "Iron", "Tin", "Lead", "?"]}
    for name, row in rows.items():
        path = tmp_path / f"{name}.csv"
        with path.open("w", newline="") as file:
            csv.writer(file).writerows([columns, columns[:1] * 5, row])
        with pytest.raises(ValueError, match=rf"^'{path}' row 2 has {len(row)} fields, its header 5; fix or remove"):
            gpqa(source=str(path))
    path = tmp_path / "blank.csv"
    with path.open("w", newline="") as file:
        csv.writer(file).writerows([columns, ["Which is a noble gas?", " ", "Iron", "Sodium", "Carbon"]])
    with pytest.raises(ValueError, match=rf"^'{path}' row 1 has no 'Correct Answer' \(its reference answer\)"):
        gpqa(source=str(path))
    path.write_bytes(b"Question,\xff\xfe")
    with pytest.raises(ValueError, match=rf"^'{path}' is not UTF-8 text"):
        gpqa(source=str(path))
    path.write_text("Question\n" + "x" * 200_000)  # csv.Error: beyond the csv module's field limit
    with pytest.raises(ValueError, match=rf"^'{path}' could not be read as CSV \(field larger"):
        gpqa(source=str(path))


def test_hotpotqa_loader_puts_the_ten_paragraphs_in_the_prompt():
    rows = hotpotqa()
    assert len(rows) == 8 and {"prompt", "question", "answer", "type"} <= set(rows.column_names)
    assert rows["answer"][:3] == ["yes", "Chief of Protocol", "Animorphs"] and rows[0]["type"] == "comparison"
    text = rows[0]["prompt"][0]["content"]
    assert text.startswith("Answer the question using the paragraphs below.\n\nEd Wood (film): Ed Wood is a 1994")
    assert (
        "film directed and produced by Tim Burton, and starring Johnny Depp as cult filmmaker Ed Wood. The film"
        in text
    )
    assert text.count("\n\n") == 11  # introduction, 10 paragraphs, question
    assert text.endswith(
        "Question: Were Scott Derrickson and Ed Wood of the same nationality?\n"
        'Give a short answer (a few words, or yes/no) on the last line, as "Answer: <answer>".'
    )
    assert hotpotqa(conversational=False)[0]["prompt"] == text


def test_hotpotqa_hub_layout_and_errors(tmp_path):
    hub_like = tmp_path / "hotpot.jsonl"  # hotpotqa/hotpot_qa's context: {"title": [...], "sentences": [[...]]}
    row = {
        "id": "x",
        "question": "Which river flows through Paris?",
        "answer": "the Seine",
        "type": "bridge",
        "level": "easy",
        "context": {
            "title": ["Paris", "Lyon"],
            "sentences": [["Paris is a city.", " The Seine runs through it."], ["Lyon is a city."]],
        },
    }
    hub_like.write_text(json.dumps(row) + "\n")
    text = hotpotqa(source=str(hub_like), conversational=False)[0]["prompt"]
    assert "\n\nParis: Paris is a city. The Seine runs through it.\n\nLyon: Lyon is a city.\n\nQuestion: Which" in text
    with pytest.raises(FileNotFoundError, match="does not exist"):
        hotpotqa(source=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="unknown HotpotQA split 'test'"):
        hotpotqa("test")


@pytest.mark.parametrize("answers", [[3677, 12], [3677, "yes"]], ids=["numbers", "numbers-and-text"])
def test_hotpotqa_numeric_answers_are_read_as_text(tmp_path, answers):
    """A file whose answers are JSON numbers loaded, then the reward crashed (`int.lower`)."""
    path = tmp_path / "hotpot.jsonl"
    context = {"title": ["Stadium"], "sentences": [["It seats 3677."]]}
    path.write_text("\n".join(json.dumps({"question": "?", "answer": a, "context": context}) for a in answers))
    rows = hotpotqa(source=str(path))
    assert rows["answer"][:] == [str(a) for a in answers]
    assert hotpotqa_reward(["Answer: 3677", "Answer: 12"], rows["answer"][:]) == [1.0, float(answers[1] == 12)]
    metrics = []
    assert hotpotqa_reward(["Answer: 3,677"], [3677], log_metric=lambda *m: metrics.append(m)) == [1.0]
    assert metrics == [("hotpotqa_f1", 1.0)]  # a caller's own numbers: as text too


def test_hotpotqa_exact_match_and_f1():
    answers = hotpotqa()["answer"][:]
    completions = [
        "Both are American.\nAnswer: Yes",
        chat("Answer: the Chief of Protocol."),
        "Answer: the Animorphs books",  # partial: F1 2/3, not correct
        "Answer: yes",  # a yes/no answer to a question whose answer is "no"
        "The answer is Greenwich Village",  # no "Answer:" line
        "Answer:\n**YG Entertainment**",  # the next line, markdown removed
        "Answer: Eenasul Fateh",
        "Answer: 3677 seated",
    ]
    metrics = []
    rewards = hotpotqa_reward(completions, answers, log_metric=lambda name, value: metrics.append((name, value)))
    assert rewards == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert [r >= SUCCESS_THRESHOLD for r in rewards] == [bool(r) for r in rewards]
    assert metrics == [("hotpotqa_f1", pytest.approx((1 + 1 + 2 / 3 + 0 + 0 + 1 + 1 + 1) / 8))]
    assert hotpotqa_reward(["Answer: YG Entertainment"], ["YG Entertainment"]) == [1.0]  # no log_metric: fine
    assert normalize("The  Chief, of Protocol!") == "chief of protocol"
    assert f1("new york city", "New York") == pytest.approx(0.8) and f1(None, "yes") == 0.0 and f1("no", "yes") == 0.0
    assert hotpot_answer("Answer: A\nAnswer: The Beatles.") == "beatles" and hotpot_answer("Answer: the") is None


def test_countdown_fixed_set_in_the_hub_schema(tmp_path):
    path = tmp_path / "countdown_test.jsonl"  # Jiayi-Pan/Countdown-Tasks-3to4's columns
    path.write_text(
        "\n".join(json.dumps(r) for r in [{"target": 98, "nums": [44, 19, 35]}, {"target": 24, "nums": [2, 3, 4, 1]}])
    )
    rows = countdown("test", source=str(path))
    assert len(rows) == 2 and rows.column_names == ["prompt", "numbers", "target"]
    assert rows["numbers"][:] == [[44, 19, 35], [2, 3, 4, 1]] and rows["target"][:] == [98, 24]
    assert rows[0]["prompt"] == TEMPLATE.format(nums="[44 19 35]", target=98)
    assert "Using the numbers [2 3 4 1], create an equation that equals 24." in rows[1]["prompt"]
    completions = [
        " ok </think>\n<answer>44 + 19 + 35</answer>",
        chat(" ok </think>\n<answer>2 * 3 * 4 * 1</answer>"),
        "</think>\n<answer>(2 + 4) * 3</answer>",  # 1 unused
        "98",  # no <answer>
    ]
    numbers, targets = [rows["numbers"][i] for i in (0, 1, 1, 0)], [rows["target"][i] for i in (0, 1, 1, 0)]
    assert countdown_reward(completions, numbers, targets) == [pytest.approx(1.1), pytest.approx(1.1), 0.1, 0.0]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        countdown("test", source=str(tmp_path / "missing.jsonl"))
    path.write_text(json.dumps({"target": 24}) + "\n")
    with pytest.raises(ValueError, match=r"no column\(s\) \['nums'\]"):
        countdown("test", source=str(path))
