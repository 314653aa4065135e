"""Pass@K / Maj@K / token-entropy evaluation of models on tasks: `trl-es eval` and its Python API.

    trl-es eval --model smollm2 --model outputs/es --suite easy --protocol paper --limit 50 --out-dir outputs/eval

For each model (loaded once) and task, n completions are sampled per problem (transformers `generate`, the trainer's
generation backend, chosen in one place: `evaluate_model`) and scored by the task's reward (correct ⇔ reward ≥
`SUCCESS_THRESHOLD`, `trl_es.tasks`). Per problem: the unbiased Pass@K and Maj@K (over the extracted answers) and the
completions' token entropy (`trl_es.evaluation.metrics`; through vLLM only with `vllm_entropy`); the model's scores on
a task are their means.
`evaluate_batch` is the one evaluation loop: `ESTrainer.evaluate` runs it too. Problems are generated in fixed
batches, each with its own seed, and every finished batch is appended to `<out-dir>/records/<task>/<model>.jsonl`:
each (model, task) resumes where it stopped and gives the same numbers. Writes `results.json` and `tables.md` (the
research's Pass@K and Maj@K tables, rows = models, columns = task × K and the Average over tasks, and the held-out
change table, `trl_es.evaluation.report`), `pass_at_k.png` (each model's Pass@K profile per task) and `pareto.png`
(Pass@1 against Pass@K_max per task, with the front). `--protocol` and `--suite`: `trl_es.evaluation.protocol`.
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
from ..generation import VLLMGeneration
from ..rewards import RewardFunctions
from ..rollout import PlainRollout, Rollout
from ..tasks import SUCCESS_THRESHOLD, Task, get_task
from ..tasks.data import completion_text
from ..util.atomic import atomic_write_text
from .metrics import maj_at_k, pass_at_k, vote_classes
from .models import ScoredVLLMGeneration, check_vllm_options, load_model, model_name, vllm_engine
from .protocol import resolve_protocol
from .records import RECORDS_FORMAT, read_records, summarize_records
from .report import averages, heldout_change, plot_pareto, plot_pass_at_k, tables


def print_progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def score_problems(
    rows: list[dict],
    correct: list[bool],
    answers: list | None,
    n: int,
    k_values: list[int],
    same_answer: Callable[[str, str], bool] | None = None,
) -> dict:
    """Pass@K and Maj@K summed over `rows`, from their n-per-problem verdicts and answers (prompt-major order); a
    problem's answers that `same_answer` (the task's `Task.same_answer`) holds equal are one vote."""
    sums = {f"pass@{k}": 0.0 for k in k_values}
    if answers is not None:
        sums.update({f"maj@{k}": 0.0 for k in k_values})
    for p in range(len(rows)):
        verdicts = correct[p * n : (p + 1) * n]
        votes = None if answers is None else answers[p * n : (p + 1) * n]
        if votes is not None and same_answer is not None:
            votes = vote_classes(votes, same_answer)
        for k in k_values:
            sums[f"pass@{k}"] += pass_at_k(n, sum(verdicts), k)
            if votes is not None:
                sums[f"maj@{k}"] += maj_at_k(votes, verdicts, k)
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
    same_answer: Callable[[str, str], bool] | None = None,
) -> dict:
    """One batch of problems: n completions per row of θ from the `rollout` (completion seeds from the batch's
    `seed`; an agent run's environments reset under `key`), rewarded by `rewards_of(rows, completions)` (a
    tensor, NaN = no reward); a completion is correct when its reward is ≥ `success_threshold`. Returns the batch's
    record: the problems' summed Pass@K (and Maj@K over the answers `extract` finds, grouped by `same_answer`:
    `score_problems`), the sums of rewards, tokens and token entropies, and each completion's verdict and answer."""
    seeds = completion_seeds(seed, len(rows), n)
    result = rollout(rows, n, seeds, key=key, record_entropy=rollout.records_entropy)
    rewards = torch.as_tensor(rewards_of(rows, result), dtype=torch.float64)
    correct = (rewards >= success_threshold).tolist()
    answers = [extract(completion_text(c)) for c in result.completions] if extract else None
    valid = ~rewards.isnan()
    return {
        "problems": len(rows),
        **score_problems(rows, correct, answers, n, k_values, same_answer),
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


def evaluate_model(
    model_path: str,
    problems: dict[str, tuple[Task, object, dict]],
    n: int,
    k_values: list[int],
    records_dir: str,
    name: str,
    batch_size: int = 8,
    progress: Callable[[str], None] = print_progress,
    use_vllm: bool = False,
    vllm_entropy: bool = False,
) -> dict[str, dict]:
    """Load the model at `model_path` once and evaluate it on every task of `problems` ({task: (Task, dataset,
    settings)}), each task's batches appended to `records_dir/<task>/<name>.jsonl` (resuming from the batches already
    there). Returns {task: scores (with the task's `wall_s`)}. The generation backend is chosen here, once: transformers
    `generate`, or with `use_vllm` an in-process vLLM engine on the model's directory (every completion its own
    request under its own seed, as in training; no token entropy unless `vllm_entropy`: then scored afterwards by the
    loaded model, `ScoredVLLMGeneration`)."""
    from ..generation import TransformersGeneration, decoding_config

    model, tokenizer, eos_ids = load_model(model_path)
    weights = weights_hash(dict(model.named_parameters()))  # the records' model
    engine = vllm_engine(model) if use_vllm else None

    def generation(settings: dict):
        decoding = {key: settings[key] for key in ("do_sample", "temperature", "top_p", "top_k")}
        config = decoding_config(tokenizer, eos_ids, settings["max_completion_length"], **decoding)
        if engine is None:
            return TransformersGeneration(model, tokenizer, config, eos_ids)
        through_vllm = ScoredVLLMGeneration if vllm_entropy else VLLMGeneration
        return through_vllm(engine, model, tokenizer, config, eos_ids, None)

    scores = {}
    for task_name, (task, dataset, settings) in problems.items():
        start = time.perf_counter()
        settings = {**settings, "model": model_path, "weights_sha256": weights}
        os.makedirs(os.path.join(records_dir, task_name), exist_ok=True)
        records_path = os.path.join(records_dir, task_name, f"{name}.jsonl")
        rollout = PlainRollout(generation(settings))
        label = f"{name} on {task_name}"
        scores[task_name] = evaluate_task(rollout, task, dataset, n, k_values, records_path, settings, batch_size,
                                          label, progress)  # fmt: skip
        scores[task_name]["wall_s"] = round(time.perf_counter() - start, 1)
    return scores


def evaluate_task(
    rollout: Rollout,
    task: Task,
    dataset,
    n: int,
    k_values: list[int],
    records_path: str,
    settings: dict,
    batch_size: int,
    label: str,
    progress: Callable[[str], None] = print_progress,
) -> dict:
    """Sample n completions per problem of `dataset` from the `rollout`, appending one JSON line per batch to
    `records_path` (resuming from the batches already there), and return the scores (without `mean_token_entropy`
    when the rollout records no entropy)."""
    n_batches = -(-len(dataset) // batch_size)
    sizes = {b: min(batch_size, len(dataset) - b * batch_size) for b in range(n_batches)}
    done = read_records(records_path, settings, sizes, n, task.extract_answer is not None, progress)
    for record in done.values():  # Pass@K / Maj@K for this run's K, from the kept verdicts and answers
        problems, correct, answers = range(record["problems"]), record["correct"], record["answers"]
        record.update(score_problems(problems, correct, answers, n, k_values, task.same_answer))
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
                record = evaluate_batch(rollout, rows, n, seed, rewards_of, k_values, task.extract_answer,
                                        same_answer=task.same_answer)  # fmt: skip
            done[b] = {"batch": b, **record}
            out.write(json.dumps(done[b]) + "\n")
            out.flush()
            finished = sum(r["problems"] for r in done.values())
            running = sum(r["pass@1"] for r in done.values()) / finished if 1 in k_values else float("nan")
            progress(
                f"  {label}: {finished}/{len(dataset)} problems, {time.perf_counter() - start:.0f} s, "
                f"Pass@1 so far {running:.3f}"
            )
    summary = summarize_records(list(done.values()), k_values, maj=task.extract_answer is not None)
    if not rollout.records_entropy:
        del summary["mean_token_entropy"]
    return summary


def decoding_description(settings: dict) -> str:
    if not settings["do_sample"]:
        return "greedy"
    return f"sampled, temperature {settings['temperature']}, top-p {settings['top_p']}, top-k {settings['top_k'] or 'off'}"


def make_folder(out_dir: str) -> None:
    """`out_dir` made a folder (with its parents); a ValueError naming it when it cannot be (a file there, or in its
    path)."""
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as error:
        raise ValueError(
            f"--out-dir {out_dir!r} cannot be made a folder ({error.strerror}); choose another"
        ) from error


def evaluate_tasks(
    models: list[str],
    tasks: list[str],
    n: int | None = None,
    k: list[int] | None = None,
    out_dir: str = "outputs/eval",
    split: str | None = None,
    source: str | None = None,
    limit: int | None = None,
    max_completion_length: int | None = None,
    temperature: float | None = None,
    top_p: float = 1.0,
    batch_size: int = 8,
    seed: int = 0,
    progress: Callable[[str], None] = print_progress,
    greedy: bool = False,
    top_k: int = 0,
    protocol: str | None = None,
    train_task: str | None = None,
    use_vllm: bool = False,
    vllm_entropy: bool = False,
) -> dict:
    """Evaluate every model on every task (see the module docstring); returns and writes `results.json`:
    {"tasks", "k", "protocol", "train_task", "settings": {task: settings}, "models": {name: {"path", "wall_s",
    "tasks": {task: {"pass@K"..., "maj@K"..., "mean_token_entropy", "wall_s", ...}}, "average": {...}}},
    "heldout_change": {name: {...}}, "tables": {"pass", "maj", "heldout"}}. `n`, `k`, `temperature` and
    `max_completion_length` left None come from the `protocol` ("paper", "paper-hard"), else from
    `protocol.DEFAULTS`. Decoding samples (`temperature` > 0, `top_p`, `top_k`; 0: off) unless `greedy` (or
    `temperature` = 0); greedy decoding gives n equal completions, so it takes n = 1. `train_task`: the task the
    models were trained on, left out of the held-out change. `use_vllm`: generate through vLLM (recorded: records of
    the two backends are not mixed), without token entropy (no `mean_token_entropy`) unless `vllm_entropy`, which
    scores it by teacher forcing in transformers. Bad input (unknown task, K outside 1..n, batch size or completion length
    below 1, a temperature that is not finite, missing columns or vLLM, an `out_dir` that cannot be a folder) fails
    before any model is loaded or any file written."""
    tasks, n, k_values, protocol_record, problems = plan_evaluation(
        models, tasks, n, k, split, source, limit, max_completion_length, temperature, top_p, batch_size, seed, greedy,
        top_k, protocol, train_task, use_vllm, vllm_entropy,
    )  # fmt: skip
    settings = {name: record for name, (_, _, record) in problems.items()}
    make_folder(out_dir)
    results, taken = {"tasks": tasks, "k": k_values, "protocol": protocol_record, "train_task": train_task,
                      "settings": settings, "models": {}}, set()  # fmt: skip
    progress(f"decoding: {decoding_description(settings[tasks[0]])}")
    for path in models:
        name = model_name(path, taken)
        progress(f"{name}: {', '.join(f'{t} × {len(d)}' for t, (_, d, _) in problems.items())} problems, n={n}")
        start = time.perf_counter()
        scores = evaluate_model(path, problems, n, k_values, os.path.join(out_dir, "records"), name, batch_size,
                                progress, use_vllm, vllm_entropy)  # fmt: skip
        results["models"][name] = {"path": path, "wall_s": round(time.perf_counter() - start, 1), "tasks": scores}
        results["models"][name]["average"] = averages(results, name)
    write_results(results, out_dir)
    return results


def plan_evaluation(
    models, tasks, n, k, split, source, limit, max_completion_length, temperature, top_p, batch_size, seed, greedy,
    top_k, protocol, train_task, use_vllm, vllm_entropy,
) -> tuple[list[str], int, list[int], dict, dict]:  # fmt: skip
    """`evaluate_tasks`'s arguments checked (a ValueError for bad input, before any model loads) and resolved:
    (the tasks without repeats, n, the K values, the protocol's record, {task: (task, its problems, its records'
    settings)})."""
    tasks = list(dict.fromkeys(tasks))
    if not tasks:
        raise ValueError("give at least one task")
    task_of = {name: get_task(name) for name in tasks}
    if train_task is not None:
        get_task(train_task)
    values, protocol_record = resolve_protocol(
        protocol, n=n, k=None if k is None else list(k), temperature=0.0 if greedy else temperature,
        max_completion_length=max_completion_length,
    )  # fmt: skip
    check_decoding(values, top_p, top_k, batch_size)
    check_vllm_options(use_vllm, vllm_entropy)
    if not models:
        raise ValueError("give at least one model")
    if len(tasks) > 1 and (split is not None or source is not None):
        raise ValueError("--split and --source name one task's data: evaluate that task on its own")
    n, k_values = values["n"], check_k(values["n"], values["k"])
    backend = {"backend": "vllm", **({} if vllm_entropy else {"entropy": False})} if use_vllm else {}
    sampling = None if values["temperature"] == 0 else {"temperature": values["temperature"], "top_p": top_p,
                                                         "top_k": top_k}  # fmt: skip
    problems = {}
    for name, task in task_of.items():
        dataset = load_problems(task, split, source, limit)
        length = values["max_completion_length"] or task.max_completion_length
        record = record_settings(name, task, dataset, split, source, n, length, sampling, batch_size, seed) | backend
        problems[name] = (task, dataset, record)
    return tasks, n, k_values, protocol_record, problems


def record_settings(name, task, dataset, split, source, n, length, sampling, batch_size, seed) -> dict:
    """What an evaluation of task `name` is, as its records' first line keeps it (a resumed run must match it):
    the data, n, the token budget, the decoding (`sampling`: temperature, top_p, top_k; None: greedy)."""
    return {
        "format": RECORDS_FORMAT,
        "task": name,
        "split": split or task.eval_split,
        "source": source,
        "problems": len(dataset),
        "n": n,
        "max_completion_length": length,
        "do_sample": sampling is not None,
        **(sampling or dict.fromkeys(("temperature", "top_p", "top_k"))),
        "batch_size": batch_size,
        "seed": seed,
    }


def check_decoding(values: dict, top_p: float, top_k: int, batch_size: int) -> None:
    """A ValueError for decoding settings an evaluation cannot run with (`values`: the protocol's resolved n, k,
    temperature and max_completion_length; temperature 0 is greedy)."""
    n, temperature, length = values["n"], values["temperature"], values["max_completion_length"]
    if temperature == 0 and n != 1:
        raise ValueError(f"greedy decoding gives the same completion n={n} times: evaluate it with n=1")
    if temperature != 0 and not (math.isfinite(temperature) and temperature > 0 and 0 < top_p <= 1 and top_k >= 0):
        raise ValueError(
            f"sampling needs a finite temperature > 0, 0 < top_p ≤ 1, top_k ≥ 0 (got {temperature}, {top_p}, {top_k})"
        )
    if length is not None and length < 1:
        raise ValueError(f"--max-completion-length must be ≥ 1 token, got {length}")
    if batch_size < 1:
        raise ValueError(f"--batch-size must be ≥ 1 problem per generate call, got {batch_size}")


def write_results(results: dict, out_dir: str) -> None:
    """The held-out change and the tables into `results`, then `results.json`, `tables.md`, `pass_at_k.png` and
    `pareto.png` into `out_dir`."""
    results["heldout_change"] = heldout_change(results)
    results["tables"] = tables(results)
    atomic_write_text(os.path.join(out_dir, "results.json"), json.dumps(results, indent=1))
    text = "\n\n".join(table for table in results["tables"].values() if table) + "\n"
    atomic_write_text(os.path.join(out_dir, "tables.md"), text)
    plot_pass_at_k(results, os.path.join(out_dir, "pass_at_k.png"))
    plot_pareto(results, os.path.join(out_dir, "pareto.png"))


def evaluate(models: list[str], task: str, *args, **kwargs) -> dict:
    """`evaluate_tasks` on one task (the same arguments after it, the same files), seen as that task's results:
    {"task", "settings", "k", "protocol", "models": {name: {"path", "pass@K"..., "maj@K"..., "mean_token_entropy",
    "wall_s", ...}}}."""
    results = evaluate_tasks(models, [task], *args, **kwargs)
    rows = {name: {"path": row["path"], **row["tasks"][task]} for name, row in results["models"].items()}
    return {"task": task, "settings": results["settings"][task], "k": results["k"], "protocol": results["protocol"],
            "models": rows}  # fmt: skip
