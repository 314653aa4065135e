"""`trl-es eval` and `trl_es.evaluation`: scores by hand, suites and the protocol, the research's tables, the files and
plots it writes, resume per (model, task), bad input."""

import json
import os
import shutil
import sys

import pytest
import torch

from trl_es.cli import main as cli
from trl_es.evaluation import evaluate, evaluate_tasks, expand_tasks, resolve_protocol, score_problems
from trl_es.evaluation.report import averages, heldout_change, pareto_front, tables


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
    assert sums["maj@1"] == pytest.approx(sums["pass@1"])  # Maj@1 is Pass@1 on the same samples
    assert sums["maj@2"] == pytest.approx(1 / 3)  # pairs 7·8 and 7·8' tie (½ each), 8·8' wins wrong
    assert sums["maj@3"] == 0.0
    assert "maj@1" not in score_problems(rows, correct, None, 3, [1])


class FixedCompletions:
    """A rollout that answers every problem with the same completions (n of them)."""

    records_entropy = False

    def __init__(self, completions):
        self.completions = completions

    def __call__(self, rows, n, seeds, key=None, record_entropy=False):
        from trl_es.generation import Completions

        completions = [c for _ in rows for c in self.completions]
        return Completions([row["prompt"] for row in rows for _ in range(n)], completions, [[0]] * len(completions),
                           [False] * len(completions))  # fmt: skip


def test_maj_at_k_votes_by_the_tasks_equivalence_of_answers(tmp_path):
    """Math's Maj@K voted by the matched text: 25, 025 and \\frac{50}{2} were three answers and the two wrong 7s won
    (Maj@5 0 while 3 of the 5 samples verify). Votes are grouped by math-verify's equivalence, also when a resumed
    evaluation scores the answers its records kept."""
    from datasets import Dataset

    from trl_es.evaluation.loop import evaluate_task
    from trl_es.tasks import TASKS

    rollout = FixedCompletions(
        ["\\boxed{25}", "\\boxed{025}", "\\boxed{\\frac{50}{2}}", "\\boxed{7}", "so \\boxed{7}"]
    )
    dataset = Dataset.from_dict({"prompt": ["2 + 23?", "5 * 5?"], "answer": ["25", "25"]})
    records = str(tmp_path / "math500.jsonl")
    arguments = (
        TASKS["math500"],
        dataset,
        5,
        [1, 3, 5],
        records,
        {"seed": 0, "weights_sha256": "θ"},
        1,
        "stub",
        lambda message: None,
    )
    scores = evaluate_task(rollout, *arguments)
    assert scores["pass@1"] == pytest.approx(3 / 5) and scores["maj@1"] == pytest.approx(3 / 5)
    # K = 3: the three 25s win unless the subset holds both 7s (3 of the C(5, 3) = 10 subsets: 7, 7 and one 25)
    assert scores["maj@3"] == pytest.approx(7 / 10) and scores["maj@5"] == 1.0
    assert json.loads(read_lines(records)[1])["answers"] == ["25", "025", "\\frac{50}{2}", "7", "7"]
    assert evaluate_task(FixedCompletions(["none"] * 5), *arguments) == scores  # read back from the records


def test_the_trainers_maj_at_k_votes_by_the_tasks_equivalence_too(tmp_path, tiny_model_dir):
    """ESTrainer.evaluate with eval_task='math500': 25, 025 and \\frac{50}{2} are one answer, which wins Maj@5."""
    from datasets import Dataset
    from helpers import es_config, scripted

    from trl_es import ESTrainer
    from trl_es.tasks import TASKS

    answers = ["\\boxed{25}", "\\boxed{025}", "\\boxed{\\frac{50}{2}}", "\\boxed{7}", "so \\boxed{7}"]
    dataset = Dataset.from_dict({"prompt": ["5 * 5?"], "answer": ["25"]})
    args = es_config(
        tmp_path, eval_task="math500", num_generations_eval=5, eval_k=[1, 5], per_device_eval_batch_size=1
    )
    trainer = ESTrainer(tiny_model_dir, TASKS["math500"].reward, args=args, train_dataset=dataset)
    scripted(trainer, lambda row, prompt, ids: answers[row % 5])
    metrics = trainer.evaluate(dataset)
    assert metrics["eval_pass@1"] == pytest.approx(3 / 5) and metrics["eval_maj@1"] == pytest.approx(3 / 5)
    assert metrics["eval_maj@5"] == 1.0  # voted by the matched text: the two 7s won, 0


@pytest.mark.parametrize(
    "answers", [[["7"], ["8"]], [{"vote": 7}, None], None, ["7"]], ids=["lists", "dict", "null", "one"]
)
def test_a_records_line_without_its_answers_as_text_is_refused_naming_the_file(tmp_path, answers):
    """Answers that were lists crashed the resume (unhashable type: 'list'), as did a line without answers."""
    from datasets import Dataset

    from trl_es.evaluation.loop import evaluate_task
    from trl_es.tasks import TASKS

    records = tmp_path / "small_sums.jsonl"
    dataset = Dataset.from_dict({"prompt": ["3 + 4?"], "answer": ["7"]})
    arguments = (TASKS["small_sums"], dataset, 2, [1, 2], str(records), {"seed": 0, "weights_sha256": "θ"}, 1, "stub",
                 lambda message: None)  # fmt: skip
    evaluate_task(FixedCompletions(["7", "8"]), *arguments)
    header, batch = read_lines(records)
    records.write_text(header + "\n" + json.dumps({**json.loads(batch), "answers": answers}) + "\n")
    with pytest.raises(
        ValueError, match=rf"^{records} line 2 is not a batch of this evaluation \(batch 0 lacks its 2 answers"
    ):
        evaluate_task(FixedCompletions(["7", "8"]), *arguments)


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
        assert json.load(f)["models"]["model"]["tasks"]["small_sums"]["pass@4"] == scores["pass@4"]
    text = (tmp_path / "eval" / "tables.md").read_text()
    assert "| model | small_sums @1 | small_sums @2 | small_sums @4 |" in text and "Average" not in text
    assert f"| model | {100 * scores['pass@1']:.1f} | {100 * scores['pass@2']:.1f} |" in text

    # An interrupted run: the records keep the settings and the first of 3 batches; resuming redoes only the rest.
    records = os.path.join(out, "records", "small_sums", "model.jsonl")
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
    records = os.path.join(out, "records", "small_sums", "model.jsonl")
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


def test_suites_expand_to_their_tasks_in_the_research_order():
    assert expand_tasks([], ["easy"]) == ["gsm8k", "commonsenseqa", "hotpotqa", "countdown", "gpqa", "mbpp"]
    assert expand_tasks([], ["math"]) == ["aime24", "aime25", "amc23", "math500"]
    assert expand_tasks(["gsm8k", "mbpp"], ["heldout"]) == ["gsm8k", "mbpp", "gpqa", "commonsenseqa", "countdown"]
    with pytest.raises(ValueError, match=r"unknown suite\(s\) \['hard'\]"):
        expand_tasks([], ["hard"])
    with pytest.raises(ValueError, match="unknown task 'gsm9k'"):
        expand_tasks(["gsm9k"], [])
    with pytest.raises(ValueError, match="at least one task"):
        expand_tasks([], [])


def test_the_protocol_gives_the_research_settings_and_explicit_values_override_it():
    values, record = resolve_protocol("paper")
    assert values == {"temperature": 0.6, "n": 32, "k": [1, 16, 32], "max_completion_length": 2048}
    assert record == {"name": "paper", **values, "overridden": {}}
    values, record = resolve_protocol("paper-hard", n=4, k=None, temperature=None, max_completion_length=None)
    assert values == {"temperature": 0.6, "n": 4, "k": [1], "max_completion_length": 8192}  # K cut to ≤ n
    assert record["overridden"] == {"n": 4, "k": [1]} and record["max_completion_length"] == 8192
    values, record = resolve_protocol("paper", n=4, k=[1, 2, 4], temperature=0.6)
    assert values["k"] == [1, 2, 4] and record["overridden"] == {"n": 4, "k": [1, 2, 4]}  # 0.6 is no override
    assert resolve_protocol(None) == ({"temperature": 1.0, "n": 8, "k": [1], "max_completion_length": None}, None)
    with pytest.raises(ValueError, match="unknown protocol 'papers'; choose from paper, paper-hard"):
        resolve_protocol("papers")


def research_results():
    """Two models on three tasks (mbpp without answers to vote on), trained on gsm8k: the layout of evaluate_tasks."""
    scores = {
        "base": {"gsm8k": (0.50, 0.90, 0.70), "commonsenseqa": (0.60, 0.95, 0.65), "mbpp": (0.30, 0.80, None)},
        "es": {"gsm8k": (0.70, 0.92, 0.80), "commonsenseqa": (0.58, 0.97, 0.66), "mbpp": (0.34, 0.79, None)},
    }
    results = {"tasks": ["gsm8k", "commonsenseqa", "mbpp"], "k": [1, 16], "train_task": "gsm8k", "models": {}}
    for name, by_task in scores.items():
        rows = {}
        for task, (pass1, pass16, maj16) in by_task.items():
            rows[task] = {"pass@1": pass1, "pass@16": pass16}
            if maj16 is not None:
                rows[task] |= {"maj@1": pass1, "maj@16": maj16}
        results["models"][name] = {"tasks": rows}
        results["models"][name]["average"] = averages(results, name)
    return results


def test_tables_have_the_research_layout_with_the_average_and_the_held_out_change_in_points():
    results = research_results()
    assert results["models"]["base"]["average"] == pytest.approx(
        {"pass@1": 1.4 / 3, "pass@16": 2.65 / 3, "maj@1": 0.55, "maj@16": 0.675}
    )  # Maj@K over the two tasks with answers
    change = heldout_change(results)  # over commonsenseqa and mbpp (gsm8k trained on), ×100
    assert change["es"] == pytest.approx({"pass@1": 1.0, "pass@16": 0.5, "maj@16": 1.0})
    results["heldout_change"] = change
    shown = tables(results)
    pass_lines = shown["pass"].splitlines()
    assert pass_lines[2] == (
        "| model | gsm8k @1 | gsm8k @16 | commonsenseqa @1 | commonsenseqa @16 | mbpp @1 | mbpp @16 | Average @1 "
        "| Average @16 |"
    )
    assert pass_lines[4] == "| base | 50.0 | 90.0 | 60.0 | 95.0 | 30.0 | 80.0 | 46.7 | 88.3 |"
    maj_lines = shown["maj"].splitlines()  # Maj@16 only (Maj@1 is Pass@1); mbpp has no vote
    assert "mbpp: no answers to vote on" in maj_lines[0]
    assert maj_lines[2] == "| model | gsm8k @16 | commonsenseqa @16 | Average @16 |"
    assert maj_lines[5] == "| es | 80.0 | 66.0 | 73.0 |"
    heldout_lines = shown["heldout"].splitlines()
    assert heldout_lines[0] == "Held-out change against base (points; mean over commonsenseqa, mbpp)"
    assert heldout_lines[2] == "| model | Δ@1 | Δ@16 | ΔM@16 |"
    assert heldout_lines[4] == "| es | +1.0 | +0.5 | +1.0 |"
    assert heldout_change({**results, "models": {"base": results["models"]["base"]}}) == {}  # one model: no change


@pytest.mark.slow  # two models on two tasks, twice; ~15 s
def test_protocol_is_recorded_and_each_model_and_task_resumes_on_its_own(tiny_model_dir, tmp_path):
    out = tmp_path / "eval"
    settings = {"n": 2, "k": [1, 2], "out_dir": str(out), "limit": 2, "max_completion_length": 3, "batch_size": 2,
                "protocol": "paper", "train_task": "small_sums"}  # fmt: skip
    results = evaluate_tasks([tiny_model_dir, tiny_model_dir], ["small_sums", "gsm8k"], **settings, progress=print)
    assert results["protocol"] == {"name": "paper", "temperature": 0.6, "n": 32, "k": [1, 16, 32],
                                   "max_completion_length": 2048,
                                   "overridden": {"n": 2, "k": [1, 2], "max_completion_length": 3}}  # fmt: skip
    assert {s["temperature"] for s in results["settings"].values()} == {0.6}  # the protocol's, not the default 1
    written = json.loads((out / "results.json").read_text())
    assert written["protocol"] == results["protocol"] and written["tables"] == results["tables"]
    assert set(written["heldout_change"]["model'"]) == {"pass@1", "pass@2", "maj@2"}
    assert "| model' |" in (out / "tables.md").read_text()
    for task in ("small_sums", "gsm8k"):
        for name in ("model", "model'"):
            assert len(read_lines(out / "records" / task / f"{name}.jsonl")) == 1 + 1  # settings, its batch

    (out / "records" / "gsm8k" / "model'.jsonl").unlink()  # one (model, task) interrupted before its first batch
    messages = []
    again = evaluate_tasks([tiny_model_dir, tiny_model_dir], ["small_sums", "gsm8k"], **settings,
                           progress=messages.append)  # fmt: skip
    generated = [m.strip().split(":")[0] for m in messages if m.startswith("  ")]
    assert generated == ["model' on gsm8k"]  # its batch only; the others' are read back
    for name in ("model", "model'"):
        for task in ("small_sums", "gsm8k"):
            scores, before = again["models"][name]["tasks"][task], results["models"][name]["tasks"][task]
            assert {**scores, "wall_s": 0} == {**before, "wall_s": 0}  # the same seeds, the same numbers


def test_batch_size_below_one_is_a_one_line_error_before_any_model_is_loaded(tmp_path, capsys):
    for size in ("0", "-2"):
        argv = ["eval", "--model", "no-such-model", "--task", "gsm8k", "--batch-size", size]
        assert cli([*argv, "--out-dir", str(tmp_path / "eval")]) == 1
        error = capsys.readouterr().err
        assert error == f"trl-es eval: --batch-size must be ≥ 1 problem per generate call, got {size}\n"
    assert not (tmp_path / "eval").exists()


def test_eval_refuses_a_file_as_out_dir_a_missing_vllm_and_bad_decoding_before_loading_a_model(
    tmp_path, capsys, monkeypatch
):
    """Were a FileExistsError traceback, an ImportError traceback once the model had loaded, the task's default
    length taken silently for 0, and an infinite temperature accepted."""
    monkeypatch.setitem(sys.modules, "vllm", None)  # not installed: `import vllm` raises ImportError
    a_file = tmp_path / "results"
    a_file.write_text("mine")
    for flags, error in [
        (["--out-dir", str(a_file)], f"--out-dir '{a_file}' cannot be made a folder (File exists); choose another"),
        (["--use-vllm"], "use_vllm=True needs vLLM, which is not installed: "),
        (["--max-completion-length", "0"], "--max-completion-length must be ≥ 1 token, got 0"),
        *((["--temperature", t], f"sampling needs a finite temperature > 0, 0 < top_p ≤ 1, top_k ≥ 0 (got {t}, ")
          for t in ("inf", "nan", "-1.0")),
    ]:  # fmt: skip
        argv = ["eval", "--model", "no-such-model", "--task", "small_sums", "--out-dir", str(tmp_path / "eval")]
        assert cli([*argv, *flags]) == 1
        printed = capsys.readouterr().err
        assert printed.startswith(f"trl-es eval: {error}") and printed.count("\n") == 1, printed
    assert a_file.read_text() == "mine" and not (tmp_path / "eval").exists()


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
    with pytest.raises(ValueError, match="--split and --source name one task's data"):
        evaluate_tasks(["no-such-model"], ["gsm8k", "math500"], n=2, source=str(lacking), out_dir=str(out))
    with pytest.raises(ValueError, match=r"every K must be in 1..n=4"):
        evaluate_tasks(["no-such-model"], ["gsm8k"], n=4, protocol="paper", k=[1, 16, 32], out_dir=str(out))
    with pytest.raises(ValueError, match="greedy decoding gives the same completion n=32 times"):
        evaluate_tasks(["no-such-model"], ["gsm8k"], protocol="paper", greedy=True, out_dir=str(out))
    assert not out.exists()  # nothing was generated or written


def test_cli_eval(tiny_model_dir, tmp_path, capsys):
    out = str(tmp_path / "cli")
    argv = [
        "eval",
        "--model",
        tiny_model_dir,
        "--task",
        "gsm8k,small_sums",
        "--n",
        "2",
        "--k",
        "1,2",
        "--limit",
        "1",
        "--max-completion-length",
        "4",
        "--out-dir",
        out,
    ]
    assert cli(argv) == 0
    printed = capsys.readouterr().out
    assert "| model | gsm8k @1 | gsm8k @2 | small_sums @1 | small_sums @2 | Average @1 | Average @2 |" in printed
    assert "| model | gsm8k @2 | small_sums @2 | Average @2 |" in printed  # the Maj@K table
    assert "model on small_sums: mean token entropy" in printed and "temperature 1.0" in printed
    assert cli([*argv[:6], "3", "--k", "1,4", "--out-dir", out + "2"]) == 1
    assert "every K must be in 1..n=3" in capsys.readouterr().err


def test_entropy_scored_by_teacher_forcing_equals_the_entropy_recorded_while_sampling(tiny_model_dir):
    """`completion_entropy_sums` (how `trl-es eval --use-vllm` gets token entropy) on completions sampled by
    transformers: each completion's summed entropy equals the one `EntropyRecorder` recorded while generating, for
    prompts of different lengths (left padding there, right padding here) and completions cut at EOS or not."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_es.generation import TransformersGeneration, decoding_config
    from trl_es.generation.transformers_backend import completion_entropy_sums
    from trl_es.util.models import eos_token_ids

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    eos = eos_token_ids(model, tokenizer)
    generation = TransformersGeneration(model, tokenizer, decoding_config(tokenizer, eos, 12, temperature=0.6), eos)
    rows = [tokenizer("1 + 1 =").input_ids, tokenizer("What is twelve plus four? Answer:").input_ids] * 3
    completions, _, recorded = generation.generate_ids(rows, seeds=list(range(6)), record_entropy=True)
    assert len(set(map(len, rows))) == 2 and len(set(map(tuple, completions))) > 1
    scored = completion_entropy_sums(model, rows, completions, batch_size=4)
    assert min(recorded) > 0.1
    assert scored == pytest.approx(recorded, rel=1e-4)


class EngineOfFours:
    """An in-process vLLM engine's `generate` without vLLM: every completion is "4" (its token ids)."""

    def __init__(self, tokenizer_dir):
        from transformers import AutoTokenizer

        self.ids = AutoTokenizer.from_pretrained(tokenizer_dir)("4", add_special_tokens=False).input_ids

    def generate(self, prompt_ids, settings, adapters=None):
        return [(list(self.ids), "stop") for _ in prompt_ids]


def test_eval_through_vllm_scores_token_entropy_only_when_asked(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Scoring vLLM's completions' token entropy (a teacher-forced forward of every completion in transformers) cost
    more than generating them (0.41 of plain vLLM's speed): `--use-vllm` leaves it out, says so and how to get it, and
    keeps such records apart; `--vllm-entropy` scores it."""
    from trl_es.evaluation import loop

    monkeypatch.setattr("trl_es.generation.vllm_engine.require_vllm", lambda: None)  # vLLM need not be installed
    monkeypatch.setattr(loop, "vllm_engine", lambda model: EngineOfFours(tiny_model_dir))
    argv = ["eval", "--model", tiny_model_dir, "--task", "small_sums", "--n", "2", "--limit", "2", "--use-vllm"]
    assert cli([*argv, "--out-dir", str(tmp_path / "plain")]) == 0
    printed = capsys.readouterr().out
    assert "model on small_sums: token entropy not scored (--use-vllm; --vllm-entropy scores it" in printed
    results = json.loads((tmp_path / "plain" / "results.json").read_text())
    assert "mean_token_entropy" not in results["models"]["model"]["tasks"]["small_sums"]
    assert results["settings"]["small_sums"]["entropy"] is False  # such records are not mixed with scored ones
    with pytest.raises(ValueError, match="holds an evaluation with other settings"):
        evaluate([tiny_model_dir], "small_sums", n=2, limit=2, use_vllm=True, vllm_entropy=True,
                 out_dir=str(tmp_path / "plain"))  # fmt: skip

    assert cli([*argv, "--vllm-entropy", "--out-dir", str(tmp_path / "scored")]) == 0
    assert "model on small_sums: mean token entropy" in capsys.readouterr().out
    results = json.loads((tmp_path / "scored" / "results.json").read_text())
    assert results["models"]["model"]["tasks"]["small_sums"]["mean_token_entropy"] > 0.1
    assert "entropy" not in results["settings"]["small_sums"]  # as the records of scored runs before the flag

    assert cli(["eval", "--model", "no-such-model", "--task", "small_sums", "--vllm-entropy"]) == 1
    assert capsys.readouterr().err == (
        "trl-es eval: --vllm-entropy scores vLLM's completions: add --use-vllm (without it the entropy is always "
        "recorded)\n"
    )
