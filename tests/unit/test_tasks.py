"""The reasoning tasks: loaders on the real benchmark files (first rows, tests/data), rewards and answer extraction."""

import json
import time

import pytest

from trl_es.tasks import TASKS, choice_reward, commonsenseqa, get_task, gsm8k, gsm8k_reward, math500, math_reward
from trl_es.tasks.commonsenseqa import extract_answer as choice_answer
from trl_es.tasks.data import local_data
from trl_es.tasks.gsm8k import extract_answer as gsm8k_answer
from trl_es.tasks.gsm8k import reference_answer


def test_gsm8k_loader_and_reference_answers():
    rows = gsm8k("test")
    assert len(rows) == 8 and {"prompt", "question", "answer"} <= set(rows.column_names)
    assert rows[0]["answer"] == "18"  # "Janet's ducks … #### 18"
    assert rows[0]["prompt"][0]["role"] == "user" and rows[0]["prompt"][0]["content"].endswith('after "####".')
    assert isinstance(gsm8k("train", conversational=False)[0]["prompt"], str)
    with pytest.raises(ValueError, match="unknown GSM8K split"):
        gsm8k("dev")


def test_gsm8k_reward_by_hand():
    completions = [
        "She sells 9 eggs at $2: 9 * 2 = 18\n#### 18",
        "The answer is \\boxed{18}.",
        "16 - 3 - 4 = 9, and 9 * 2 = 18 dollars.",  # no marker: the last number
        "#### 1,8",  # "1,8" → 18 after removing the comma, as GSM8K's references do
        "#### 17",
        "I do not know.",  # unparsable: wrong, not an error
        [{"role": "assistant", "content": "#### 18.0"}],
    ]
    assert gsm8k_reward(completions, ["18"] * 7) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    assert gsm8k_answer("it costs $1,000.") == "1000"
    assert gsm8k_answer("no numbers") is None
    with pytest.raises(ValueError, match="####"):
        reference_answer("no final answer")


def test_math500_loader_and_math_verify_equivalence():
    rows = math500()
    assert len(rows) == 8 and "\\boxed{}" in rows[0]["prompt"][0]["content"]
    assert rows[3]["answer"] == "9"  # "How many positive whole-number divisors does 196 have?"
    completions = [
        "so \\boxed{\\frac{1}{2}}",
        "the answer is \\boxed{0.5}",
        "\\boxed{2/4}",
        "\\boxed{0.6}",
        "\\boxed{",
        "}}{{ garbage \\frac",
    ]
    assert math_reward(completions, ["\\frac12"] * 6) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="only the 'test' split"):
        math500("train")


def test_commonsenseqa_loader_reward_and_hub_layout(tmp_path):
    rows = commonsenseqa()
    assert len(rows) == 8 and rows[0]["answer"] == "A"
    text = rows[0]["prompt"][0]["content"]
    assert "A. bank" in text and "E. new york" in text and text.endswith('"Answer: X".')
    assert choice_reward(["Answer: A", "The answer is B.", "A", "(A)", "Answer: Bank", "I think a"], ["A"] * 6) == [
        1.0,
        0.0,
        1.0,
        1.0,
        0.0,
        0.0,
    ]
    assert choice_answer("Answer: C ... Answer: D") == "D"
    # SmolLM2-Instruct's answers: a choice restated, once (its letter) or in a list of several (no answer)
    assert [choice_answer(c) for c in [
        "A. complete job", "(B) water\n\nFish live in water.", "C) kill animals", "The correct choice is C. kill",
        "A. complete job\nB. learn from each other", "A. complete job\nA. complete job\nD. wear hats",
        "This is the answer to the question.", "Consider each:\nB. water", "Bank. It is A.",
    ]] == ["A", "B", "C", "C", None, None, None, None, None]  # fmt: skip
    # the hub's layout (question string, choices {label, text}) through load_dataset on a directory, as for a hub id
    folder = tmp_path / "csqa"
    folder.mkdir()
    row = {
        "id": "x",
        "question": "Where do fish live?",
        "question_concept": "fish",
        "answerKey": "B",
        "choices": {"label": ["A", "B"], "text": ["tree", "water"]},
    }
    (folder / "validation.jsonl").write_text(json.dumps(row) + "\n")
    hub_like = commonsenseqa("validation", source=str(folder), conversational=False)
    assert hub_like[0]["answer"] == "B" and "B. water" in hub_like[0]["prompt"]
    with pytest.raises(ValueError, match="test has no answers"):
        commonsenseqa("test")


def test_local_files_and_their_errors(tmp_path, monkeypatch):
    good = tmp_path / "mine.jsonl"
    good.write_text(json.dumps({"question": "1+1?", "answer": "so #### 2"}) + "\n")
    assert gsm8k(source=str(good))[0]["answer"] == "2"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "1+1?", "solution": "2"}) + "\n")
    with pytest.raises(ValueError, match=r"no column\(s\) \['answer'\]"):
        gsm8k(source=str(bad))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        gsm8k(source=str(tmp_path / "missing.jsonl"))
    monkeypatch.setenv("TRL_ES_DATA", str(tmp_path))  # no local copy there: the hub id is the source
    assert local_data("gsm8k/test.jsonl", hub_id="openai/gsm8k") == "openai/gsm8k"


@pytest.mark.parametrize(
    ("name", "text", "problem"),
    [
        (
            "truncated.jsonl",
            '{"question": "1+1?", "answer": "#### 2"}\n{"question": "2+2?", "ans',
            r"is not JSON at line 2 \(Unterminated string.*\)",
        ),
        ("prose.jsonl", "Here are the problems:\n", r"is not JSON at line 1 \(Expecting value\)"),
        (
            "blank_line.jsonl",
            '{"question": "1+1?", "answer": "#### 2"}\n\n{"question"\n',
            r"is not JSON at line 3 \(Expecting ':' delimiter\)",
        ),
        ("empty.jsonl", "", "is empty"),
        ("blank.json", "\n\n", "is empty"),
        (
            "truncated.json",
            '[\n{"question": "1+1?", "answer": "#### 2"},\n{"question": "2+',
            r"is not JSON at line 3 \(Unterminated string.*\)",
        ),
    ],
)
def test_a_malformed_data_file_is_a_one_line_error_naming_the_file_and_line(tmp_path, capsys, name, text, problem):
    """datasets' DatasetGenerationError (or a bare StopIteration for an empty file) was a traceback."""
    from trl_es.cli import main as cli

    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"^'{path}' {problem}$") as message:
        gsm8k(source=str(path))
    assert cli(["eval", "--model", "no-such-model", "--task", "gsm8k", "--source", str(path)]) == 1
    error = capsys.readouterr().err
    assert error.endswith(f"trl-es eval: {message.value}\n") and "Traceback" not in error


@pytest.mark.slow  # 30 MBPP programs through the sandbox
def test_every_task_rewards_its_reference_answers_and_only_them():
    """Reward ≥ 1 exactly for correct answers (the evaluation's notion of correct), on the real rows."""
    references = {
        "gsm8k": lambda row: f"Step by step.\n#### {row['answer']}",
        "math500": lambda row: f"So the answer is $\\boxed{{{row['answer']}}}$.",
        "commonsenseqa": lambda row: f"Answer: {row['answer']}",
        "countdown": lambda row: f"...</think>\n<answer>{row['solution']}</answer>",
        "small_sums": lambda row: row["answer"],
    }
    wrong = {
        "gsm8k": "#### -1",
        "math500": "\\boxed{-12345}",
        "commonsenseqa": "Answer: Z",
        "countdown": "</think>\n<answer>1 + 1</answer>",
        "small_sums": "-1",
    }
    for name, reference in references.items():
        task = get_task(name)
        rows = task.load(task.eval_split).select(range(6))
        columns = {c: rows[c] for c in task.answer_columns}
        right = task.reward(completions=[reference(row) for row in rows], **columns)
        assert all(r >= 1.0 for r in right), (name, right)
        assert all(r < 1.0 for r in task.reward(completions=[wrong[name]] * 6, **columns)), name
        assert task.extract_answer(reference(rows[0])) is not None
    assert TASKS["mbpp"].extract_answer is None  # programs are not voted on: no Maj@K for code
    with pytest.raises(
        ValueError, match="unknown task 'gsm9k'; built-in tasks: aime24, aime25, amc23, commonsenseqa, countdown"
    ):
        get_task("gsm9k")


def test_small_sums_last_scores_the_last_integer_the_first_integer_check_misses():
    from trl_es.tasks import TASKS, last_integer_reward

    task = TASKS["small_sums_last"]
    completions = ["12 + 4 equals 16.", "16", "The answer is 15, not 16 + 0 = 17", "sixteen", [{"role": "assistant",
                   "content": "4 + 12 = 16"}]]  # fmt: skip
    assert last_integer_reward(completions, ["16"] * 5) == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert TASKS["small_sums"].reward(completions[:1], ["16"]) == [0.0]  # the first integer is the operand 12
    assert [task.extract_answer(c) for c in ["12 + 4 equals 16.", "none"]] == ["16", None]
    assert task.load("test")["answer"] == TASKS["small_sums"].load("test")["answer"]  # the same problems


@pytest.mark.parametrize(
    ("extract", "before"),
    [
        (choice_answer, "answer"),
        (choice_answer, "The answer is"),
        (gsm8k_answer, "####"),
        (gsm8k_answer, "\\boxed{"),
        (gsm8k_answer, "1"),
    ],  # fmt: skip
)
def test_a_long_run_of_whitespace_or_commas_is_parsed_in_linear_time(extract, before):
    """28k characters of whitespace after "answer" took 7.5–9 s in CommonsenseQA's and GPQA's parser (the pattern
    tried every split of the run between its two `\\s*`); GSM8K's `####` and `\\boxed{` had the same shape, and
    its numbers backtracked through a run of commas."""
    for run in (" " * 28_000, "\n" * 28_000, "," * 28_000):
        start = time.perf_counter()
        assert extract(before + run + "x") in (None, "1")
        assert time.perf_counter() - start < 0.5, (before, run[0])


def test_answer_parsers_read_the_answer_after_any_spacing():
    assert [choice_answer(text) for text in ["answer:B", "The answer is  :  (C)", "answer\n\nD", "choice is E"]] == [
        "B", "C", "D", "E"
    ]  # fmt: skip
    assert [gsm8k_answer(t) for t in ["####  $ 1,000", "\\boxed{ $ -2.5 }", "so ,5 and 1,,"]] == ["1000", "-2.5", "1"]


ROWS = {  # each task's smallest good row from a file, and the column holding its reference answer
    "gsm8k": ({"question": "1+1?", "answer": "so #### 2"}, "answer"),
    "math500": ({"problem": "1+1?", "answer": "2"}, "answer"),
    "aime24": ({"problem": "1+1?", "answer": "2"}, "answer"),
    "amc23": ({"question": "1+1?", "answer": 2.0}, "answer"),
    "deepscaler": ({"problem": "1+1?", "answer": "2"}, "answer"),
    "commonsenseqa": (
        {"id": "x", "question": {"stem": "1+1?", "choices": [{"label": "A", "text": "2"}]}, "answerKey": "A"},
        "answerKey",
    ),
    "hotpotqa": (
        {"question": "1+1?", "answer": "2", "context": {"title": ["T"], "sentences": [["1+1=2."]]}},
        "answer",
    ),
    "mbpp": ({"task_id": 11, "prompt": "p", "test_list": ["assert True"], "test_imports": []}, "test_list"),
    "countdown": ({"target": 3, "nums": [1, 2]}, "target"),
}


@pytest.mark.parametrize(
    ("name", "missing"),
    [*((name, None) for name in ROWS), ("commonsenseqa", " "), ("math500", ""), ("mbpp", [])],
)
def test_a_row_without_its_reference_answer_is_refused_naming_the_file_and_the_row(tmp_path, name, missing):
    """A null answer loaded silently and then scored non-answers as correct (CommonsenseQA: None == None)."""
    row, column = ROWS[name]
    task = TASKS[name]
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text(json.dumps(row) + "\n")
    bad.write_text("\n".join(json.dumps(r) for r in [row, row, {**row, column: missing}]) + "\n")
    assert len(task.load(task.eval_split, source=str(good))) == 1
    with pytest.raises(ValueError, match=rf"^'{bad}' row 3 has no '{column}' \(its reference answer\)") as error:
        task.load(task.eval_split, source=str(bad))
    assert "\n" not in str(error.value)


def test_rewards_never_credit_a_missing_reference_answer():
    non_answers = ["I do not know.", "\\boxed{None}", "Answer: None", "####", "Answer: yes"]
    for name, task in TASKS.items():
        if task.answer_columns == ("answer",):
            assert task.reward(non_answers, [None] * len(non_answers)) == [0.0] * len(non_answers), name
