"""Pass@K / Maj@K / token-entropy evaluation of models on a task: `trl-es eval` and its Python API.

    trl-es eval --model smollm2 --model outputs/es --task gsm8k --n 8 --k 1,4,8 --limit 50 --out-dir outputs/eval

For each model, n completions are sampled per problem (transformers `generate`, the trainer's generation backend) and
scored by the task's reward (correct ⇔ reward ≥ `SUCCESS_THRESHOLD`, `trl_es.tasks`). Per problem: the unbiased
Pass@K, Maj@K over the extracted answers and the completions' token entropy (`trl_es.evaluation.metrics`); the model's scores
are their means. `evaluate_batch` is the one evaluation loop: `ESTrainer.evaluate` runs it too.
Problems are generated in fixed batches, each with its own seed, and every finished batch is appended to
`<out-dir>/records/<model>.jsonl`: an interrupted evaluation resumes where it stopped and gives the same numbers.
Writes `results.json`, prints the paper's tables (rows = models, columns = task × @K) and saves `pass_at_k.png`
(the Pass@K profile of each model) and `pareto.png` (Pass@1 against Pass@K_max across models, with their front).
"""

from __future__ import annotations

import inspect
import json
import math
import os
import sys
import time
from collections.abc import Callable

import torch

from ..es.seeds import completion_seeds, eval_seed
from ..es.weights import weights_hash
from ..rewards import RewardFunctions
from ..rollout import PlainRollout, Rollout
from ..tasks import SUCCESS_THRESHOLD, Task, get_task
from ..tasks.data import completion_text
from ..util.atomic import atomic_write_text
from .metrics import maj_at_k, pass_at_k
from .report import plot_pareto, plot_pass_at_k


RECORDS_FORMAT = 2
"""Version of the records files: a file of another version is refused, not mixed in."""


def score_problems(rows: list[dict], correct: list[bool], answers: list | None, n: int, k_values: list[int]) -> dict:
    """Pass@K and Maj@K summed over `rows`, from their n-per-problem verdicts and answers (prompt-major order)."""
    sums = {f"pass@{k}": 0.0 for k in k_values}
    if answers is not None:
        sums.update({f"maj@{k}": 0.0 for k in k_values})
    for p in range(len(rows)):
        verdicts = correct[p * n : (p + 1) * n]
        for k in k_values:
            sums[f"pass@{k}"] += pass_at_k(n, sum(verdicts), k)
            if answers is not None:
                sums[f"maj@{k}"] += maj_at_k(answers[p * n : (p + 1) * n], verdicts, k)
    return sums


def evaluate_batch(
    rollout: Rollout,
    rows: list[dict],
    n: int,
    seed: int,
    rewards_of: Callable,
    k_values: list[int],
    extract: Callable[[str], str | None] | None = None,
    success_threshold: float = SUCCESS_THRESHOLD,
    key=None,
) -> dict:
    """One batch of problems: n completions per row of θ from the `rollout` (completion seeds from the batch's
    `seed`; an agent run's environments reset under `key`), rewarded by `rewards_of(rows, completions)` (a
    tensor, NaN = no reward); a completion is correct when its reward is ≥ `success_threshold`. Returns the batch's
    record: the problems' summed Pass@K (and Maj@K over the answers `extract` finds), the sums of rewards, tokens
    and token entropies, and each completion's verdict and answer."""
    seeds = completion_seeds(seed, len(rows), n)
    result = rollout(rows, n, seeds, key=key, record_entropy=rollout.records_entropy)
    rewards = torch.as_tensor(rewards_of(rows, result), dtype=torch.float64)
    correct = (rewards >= success_threshold).tolist()
    answers = [extract(completion_text(c)) for c in result.completions] if extract else None
    valid = ~rewards.isnan()
    return {
        "problems": len(rows),
        **score_problems(rows, correct, answers, n, k_values),
        "completions": len(correct),
        "reward_sum": float(rewards[valid].sum()),
        "rewards": int(valid.sum()),
        "tokens": sum(result.lengths),
        "entropy_sum": sum(result.entropy_sums or [0.0]),
        "correct": correct,
        "answers": answers,
    }


def check_k(n: int, k_values: list[int]) -> list[int]:
    """Sorted K values, each in 1..n (a ValueError otherwise)."""
    bad = [k for k in k_values if not 1 <= k <= n]
    if bad or not k_values:
        raise ValueError(f"every K must be in 1..n={n} samples per problem, got K={k_values}")
    return sorted(set(k_values))


def load_problems(task: Task, split: str | None, source: str | None, limit: int | None):
    """The task's evaluation rows (first `limit`), checked for the columns its reward reads."""
    options = {}
    if source is not None:
        if "source" not in inspect.signature(task.load).parameters:
            raise ValueError(f"task {task.name!r} is generated, not read from files: it takes no source")
        options["source"] = source
    dataset = task.load(split or task.eval_split, **options)
    missing = [c for c in ("prompt", *task.answer_columns) if c not in dataset.column_names]
    if missing:
        raise ValueError(f"the {task.name} data lacks column(s) {missing} that its reward reads")
    if limit is not None:
        dataset = dataset.select(range(min(limit, len(dataset))))
    if len(dataset) == 0:
        raise ValueError(f"the {task.name} data has no rows")
    return dataset


def print_progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _model_name(path: str, taken: set[str]) -> str:
    name = os.path.basename(os.path.normpath(path)) or path
    while name in taken:
        name += "'"
    taken.add(name)
    return name


def _load(path: str):
    from ..util.models import eos_token_ids, load_starting_model, load_tokenizer, resolve_model

    path = resolve_model(path)
    model = load_starting_model(path)
    tokenizer = load_tokenizer(path, model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.eval(), tokenizer, eos_token_ids(model, tokenizer)


def evaluate_model(
    model_path: str,
    task: Task,
    dataset,
    n: int,
    k_values: list[int],
    records_path: str,
    settings: dict,
    batch_size: int = 8,
    progress: Callable[[str], None] = print_progress,
) -> dict:
    """Sample n completions per problem of `dataset` from the model at `model_path`, appending one JSON line per
    batch to `records_path` (resuming from the batches already there), and return the model's scores."""
    from ..generation import TransformersGeneration, decoding_config

    model, tokenizer, eos_ids = _load(model_path)
    settings = {**settings, "weights_sha256": weights_hash(dict(model.named_parameters()))}  # the records' model
    n_batches = -(-len(dataset) // batch_size)
    sizes = {b: min(batch_size, len(dataset) - b * batch_size) for b in range(n_batches)}
    done = _read_records(records_path, settings, sizes, n, progress)
    for record in done.values():  # Pass@K / Maj@K for this run's K, from the kept verdicts and answers
        record.update(score_problems(range(record["problems"]), record["correct"], record["answers"], n, k_values))
    decoding = {name: settings[name] for name in ("do_sample", "temperature", "top_p", "top_k")}
    config = decoding_config(tokenizer, eos_ids, settings["max_completion_length"], **decoding)
    rollout = PlainRollout(TransformersGeneration(model, tokenizer, config, eos_ids))
    rewards = RewardFunctions(task.reward)
    rewards_of = lambda rows, completions: rewards.combine(rewards.score(rows, completions))  # noqa: E731
    start = time.perf_counter()
    with open(records_path, "a") as out:
        if not done:
            out.write(json.dumps({"settings": settings}) + "\n")
        for b in range(n_batches):
            if b in done:
                continue
            rows = dataset.select(range(b * batch_size, min((b + 1) * batch_size, len(dataset)))).to_list()
            with torch.no_grad():
                seed = eval_seed(settings["seed"], 0, b * batch_size)
                record = evaluate_batch(rollout, rows, n, seed, rewards_of, k_values, task.extract_answer)
            done[b] = {"batch": b, **record}
            out.write(json.dumps(done[b]) + "\n")
            out.flush()
            finished = sum(r["problems"] for r in done.values())
            running = sum(r["pass@1"] for r in done.values()) / finished if 1 in k_values else float("nan")
            progress(
                f"  {os.path.basename(records_path)[:-6]}: {finished}/{len(dataset)} problems, "
                f"{time.perf_counter() - start:.0f} s, Pass@1 so far {running:.3f}"
            )
    return summarize_records(list(done.values()), k_values, maj=task.extract_answer is not None)


def _read_records(
    path: str, settings: dict, sizes: dict[int, int], n: int, progress=print_progress
) -> dict[int, dict]:
    """The finished batches of an earlier run with the same settings (a ValueError for other settings). Records of
    other weights (the model at that path was trained again since) are discarded, with a message: the model is
    evaluated again. A last line cut short by an interruption is dropped from the file: that batch is generated
    again. Every record is checked against this evaluation (`sizes`: batch → problems, `n` completions each)."""
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
        problem = _record_problem(record, sizes, n, done)
        if problem:
            raise ValueError(
                f"{path} line {number} is not a batch of this evaluation ({problem}); delete the file to start over"
            )
        done[record["batch"]] = record
    return done


def _record_problem(record, sizes: dict[int, int], n: int, done: dict) -> str | None:
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
    if answers is not None and not (isinstance(answers, list) and len(answers) == len(correct)):
        return f"batch {batch}'s answers do not match its verdicts"
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


def decoding_description(settings: dict) -> str:
    if not settings["do_sample"]:
        return "greedy"
    return f"sampled, temperature {settings['temperature']}, top-p {settings['top_p']}, top-k {settings['top_k'] or 'off'}"


def evaluate(
    models: list[str],
    task: str,
    n: int = 8,
    k: list[int] = (1,),
    out_dir: str = "outputs/eval",
    split: str | None = None,
    source: str | None = None,
    limit: int | None = None,
    max_completion_length: int | None = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
    batch_size: int = 8,
    seed: int = 0,
    progress: Callable[[str], None] = print_progress,
    greedy: bool = False,
    top_k: int = 0,
) -> dict:
    """Evaluate every model on `task` (see the module docstring); returns and writes `results.json`:
    {"task", "settings", "models": {name: {"path", "pass@K"..., "maj@K"..., "mean_token_entropy", "wall_s"}}}.
    Decoding samples (`temperature` > 0, `top_p`, `top_k`; 0: off) unless `greedy` (or `temperature` = 0); greedy
    decoding gives n equal completions, so it takes n = 1. Bad input (unknown task, K outside 1..n, missing
    columns) fails before any model is loaded."""
    task_ = get_task(task)
    k_values = check_k(n, list(k))
    greedy = greedy or temperature == 0
    if greedy and n != 1:
        raise ValueError(f"greedy decoding gives the same completion n={n} times: evaluate it with n=1")
    if not greedy and not (temperature > 0 and 0 < top_p <= 1 and top_k >= 0):
        raise ValueError(
            f"sampling needs temperature > 0, 0 < top_p ≤ 1, top_k ≥ 0 (got {temperature}, {top_p}, {top_k})"
        )
    if not models:
        raise ValueError("give at least one model")
    dataset = load_problems(task_, split, source, limit)
    settings = {
        "format": RECORDS_FORMAT,
        "task": task,
        "split": split or task_.eval_split,
        "source": source,
        "problems": len(dataset),
        "n": n,
        "max_completion_length": max_completion_length or task_.max_completion_length,
        "do_sample": not greedy,
        "temperature": None if greedy else temperature,
        "top_p": None if greedy else top_p,
        "top_k": None if greedy else top_k,
        "batch_size": batch_size,
        "seed": seed,
    }
    os.makedirs(os.path.join(out_dir, "records"), exist_ok=True)
    results, taken = {"task": task, "settings": settings, "k": k_values, "models": {}}, set()
    progress(f"decoding: {decoding_description(settings)}")
    for path in models:
        name = _model_name(path, taken)
        progress(f"{name}: {task} × {len(dataset)} problems, n={n}")
        start = time.perf_counter()
        scores = evaluate_model(
            path,
            task_,
            dataset,
            n,
            k_values,
            os.path.join(out_dir, "records", f"{name}.jsonl"),
            {**settings, "model": path},
            batch_size,
            progress,
        )
        results["models"][name] = {"path": path, **scores, "wall_s": round(time.perf_counter() - start, 1)}
    atomic_write_text(os.path.join(out_dir, "results.json"), json.dumps(results, indent=1))
    plot_pass_at_k(results, os.path.join(out_dir, "pass_at_k.png"))
    plot_pareto(results, os.path.join(out_dir, "pareto.png"))
    return results
