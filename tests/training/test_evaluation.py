"""`trl-es eval` and `trl_es.evaluation`: scores by hand, the files and plots it writes, resume, bad input."""

import json
import os
import shutil

import pytest
import torch

from trl_es.cli import main as cli
from trl_es.evaluation import evaluate, score_problems
from trl_es.evaluation.report import pareto_front, table


def read_lines(path):
    with open(path) as f:
        return f.read().splitlines()


def test_score_problems_by_hand():
    rows = [{}, {}]
    correct = [True, False, False, False, False, False]  # problem 0: 1 of 3 correct; problem 1: none
    answers = ["7", "8", "8", None, None, None]  # problem 0's majority "8" is wrong
    sums = score_problems(rows, correct, answers, n=3, k_values=[1, 2, 3])
    assert sums["pass@1"] == pytest.approx(1 / 3)
    assert sums["pass@2"] == pytest.approx(1 - 1 / 3)  # 1 − C(2,2)/C(3,2)
    assert sums["pass@3"] == pytest.approx(1.0)
    assert sums["maj@1"] == 1.0 and sums["maj@3"] == 0.0
    assert "maj@1" not in score_problems(rows, correct, None, 3, [1])


def test_pareto_front():
    points = {"base": (0.2, 0.6), "grpo": (0.5, 0.55), "es": (0.3, 0.7), "worse": (0.25, 0.5)}
    assert pareto_front(points) == ["es", "grpo"]


@pytest.mark.slow  # kept out of the fast suite for time; ~4 s
def test_evaluate_writes_results_tables_plots_and_resumes(tiny_model_dir, tmp_path):
    out = str(tmp_path / "eval")
    settings = {
        "n": 4,
        "k": [1, 2, 4],
        "out_dir": out,
        "limit": 5,
        "max_completion_length": 6,
        "batch_size": 2,
        "progress": lambda message: None,
    }
    results = evaluate([tiny_model_dir, tiny_model_dir], "small_sums", **settings)
    assert set(results["models"]) == {"model", "model'"}  # same basename twice: both kept
    scores = results["models"]["model"]
    assert scores["problems"] == 5 and 0.0 <= scores["pass@1"] <= scores["pass@2"] <= scores["pass@4"] <= 1.0
    assert scores["mean_token_entropy"] > 0 and {"maj@1", "maj@4"} <= scores.keys()
    assert scores == {**results["models"]["model'"], "path": scores["path"], "wall_s": scores["wall_s"]}
    for name in ("results.json", "pass_at_k.png", "pareto.png"):
        assert os.path.getsize(os.path.join(out, name)) > 0
    with open(os.path.join(out, "results.json")) as f:
        assert json.load(f)["models"]["model"]["pass@4"] == scores["pass@4"]
    text = table(results)
    assert "small_sums Pass@4" in text.splitlines()[0] and f"{scores['pass@4']:.3f}" in text

    # An interrupted run: the records keep the settings and the first of 3 batches; resuming redoes only the rest.
    records = os.path.join(out, "records", "model.jsonl")
    lines = read_lines(records)
    assert len(lines) == 1 + 3
    with open(records, "w") as f:  # the header, batch 0, and batch 1's line cut short by the interruption
        f.write("\n".join(lines[:2]) + "\n" + lines[2][:40])
    messages = []
    resumed = evaluate([tiny_model_dir], "small_sums", **{**settings, "progress": messages.append})
    assert resumed["models"]["model"] == {**scores, "wall_s": resumed["models"]["model"]["wall_s"]}
    done = [m.split(": ")[1].split(" ")[0] for m in messages if "/5 problems" in m]
    assert done == ["4/5", "5/5"]  # batch 0 was not redone
    assert read_lines(records) == lines  # the same completions' verdicts, batch by batch

    with pytest.raises(ValueError, match="other settings"):
        evaluate([tiny_model_dir], "small_sums", **{**settings, "n": 2, "k": [1]})


@pytest.mark.slow  # kept out of the fast suite for time; ~5 s
def test_records_follow_the_weights_and_the_k_values_and_refuse_lines_that_are_not_batches(tiny_model_dir, tmp_path):
    """Records are keyed by the model's weights, not its path: retraining into the same path evaluates again (it
    reported the old model's scores). Another --k is computed from the kept verdicts (KeyError 'pass@2' before). A
    line that is not one of this evaluation's batches is refused, not counted (a 2-problem eval reported 1002)."""
    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    out = str(tmp_path / "eval")
    settings = {"n": 2, "out_dir": out, "limit": 2, "max_completion_length": 4, "batch_size": 2, "progress": print}
    first = evaluate([str(model_dir)], "small_sums", k=[1], **settings)["models"]["model"]
    again = evaluate([str(model_dir)], "small_sums", k=[1, 2], **settings)["models"]["model"]  # the same records
    assert again["pass@1"] == first["pass@1"] and 0 <= again["pass@1"] <= again["pass@2"] <= 1
    records = os.path.join(out, "records", "model.jsonl")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)  # "retrained" into the same path
    model.save_pretrained(model_dir)
    before = read_lines(records)
    evaluate([str(model_dir)], "small_sums", k=[1], **settings)
    after = read_lines(records)
    assert json.loads(after[0])["settings"]["weights_sha256"] != json.loads(before[0])["settings"]["weights_sha256"]
    assert after[1] != before[1]  # evaluated again: other completions' verdicts or answers
    good = read_lines(records)
    batch = json.loads(good[1])
    for extra, problem in [(json.dumps({**batch, "batch": 7, "problems": 1000}), "not one of this evaluation"),
                           (json.dumps([1, 2]), "not a batch record"),
                           (json.dumps({k: v for k, v in batch.items() if k != "reward_sum"}), "repeated|sums"),
                           (json.dumps(batch), "repeated")]:  # fmt: skip
        with open(records, "w") as f:
            f.write("\n".join([*good, extra]) + "\n")
        with pytest.raises(ValueError, match=problem):
            evaluate([str(model_dir)], "small_sums", k=[1], **settings)


def test_bad_input_fails_before_any_model_is_loaded(tmp_path):
    out = tmp_path / "eval"
    with pytest.raises(ValueError, match="unknown task 'gsm9k'"):
        evaluate(["no-such-model"], "gsm9k", out_dir=str(out))
    with pytest.raises(ValueError, match=r"every K must be in 1..n=4"):
        evaluate(["no-such-model"], "gsm8k", n=4, k=[1, 8], out_dir=str(out))
    lacking = tmp_path / "lacking.jsonl"
    lacking.write_text(json.dumps({"question": "1+1?"}) + "\n")
    with pytest.raises(ValueError, match=r"no column\(s\) \['answer'\]"):
        evaluate(["no-such-model"], "gsm8k", n=2, k=[1], source=str(lacking), out_dir=str(out))
    with pytest.raises(ValueError, match="generated, not read from files"):
        evaluate(["no-such-model"], "small_sums", n=2, k=[1], source=str(lacking), out_dir=str(out))
    assert not out.exists()  # nothing was generated or written


def test_cli_eval(tiny_model_dir, tmp_path, capsys):
    out = str(tmp_path / "cli")
    argv = [
        "eval",
        "--model",
        tiny_model_dir,
        "--task",
        "gsm8k",
        "--n",
        "2",
        "--k",
        "1,2",
        "--limit",
        "2",
        "--max-completion-length",
        "4",
        "--out-dir",
        out,
    ]
    assert cli(argv) == 0
    printed = capsys.readouterr().out
    assert "gsm8k Pass@2" in printed and "gsm8k Maj@2" in printed and "mean token entropy" in printed
    assert cli([*argv[:6], "3", "--k", "1,4", "--out-dir", out + "2"]) == 1
    assert "every K must be in 1..n=3" in capsys.readouterr().err
