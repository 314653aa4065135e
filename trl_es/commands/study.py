"""ES vs GRPO on one task at one wall-clock budget: the research's comparison in one command.

    trl-es study --task small_sums --model smollm2 --budget-minutes 20 --methods es,grpo,grpo-es,es-grpo --out DIR

Each method trains from the same model on the same prompts in the same order (no shuffling), with the task's reward
and the same completion length, until the budget of wall clock has passed (the step running then finishes):
`grpo` is TRL's GRPOTrainer (4 prompts × 4 completions per step, lr 1e-5), `es` is ESTrainer with the demo's
calibrated settings (N=8, σ=5e-3, α=5e-3, 8 prompts per step, greedy members, or sampling ones with --es-sample;
`--es-population`, `--es-sigma`, `--es-learning-rate` and `--es-space lowrank` change them, `--es-variant` applies one
of `study_settings.ES_VARIANTS` (per-prompt normalisation, Pass@k fitness, top-K members, noise reuse); `--es-anchor-decay λ`
pulls it toward the base after each update). Both train on transformers unless `--es-vllm` (ES's population
through an in-process vLLM engine, with the fastest ES measured there as its defaults: low-rank members in LoRA
slots, N=32, σ=1e-2, α=1e-2; `--es-space full` writes full-rank members in place) or `--grpo-vllm` (GRPOTrainer
with vLLM colocate, GPU only); the recorded settings say which engine each used (`use_vllm`).
`grpo-es` continues the `grpo` result with ES for another budget, `es-grpo` the `es` result with GRPO: two budgets
in all. Then the base and every result are evaluated on the task's held-out problems with the research's sampling
(`trl_es.evaluation`, through vLLM with `--use-vllm`: temperature 0.6, `--temperature` to change it; Pass@K and
Maj@K for the research's K = 1, 16, 32 up to `--n`; mean token entropy) and every update is measured against the base
(`trl_es.util.deltas.update_statistics`: relative L2 and s_τ; `trl_es.research.analysis`: the cosine between the ES and GRPO
updates, KL drift on a fixed off-task text sample). With `--heldout gpqa,mbpp,…` the base and every result are also
evaluated on those tasks (the same sampling; `--max-completion-length` if given, else each task's; DIR/heldout/):
the held-out change table, each result's Pass@K and Maj@K minus the base's in points averaged over the held-out
tasks (forgetting when negative). Through vLLM the token entropy is scored only with `--vllm-entropy` (it costs more
than generating on CPU).

Writes DIR/results.json, DIR/table.md (and the held-out change table), DIR/reward_vs_time.png, DIR/pass_at_k.png,
DIR/pareto.png and DIR/pass_vs_time.png (Pass@1 and Pass@K against wall clock: with `--marks M`, M evenly spaced
points of each stage are saved, their saving off the clock, and evaluated as the results are). Re-running
the command resumes: a method whose DIR/<method>/training.json exists is not trained again (an interrupted one
starts over) and the evaluation keeps its finished batches. With several `--seeds`, each seed's study goes to
DIR/seed-<s>/ and DIR gets the table of every metric's mean (min–max) over the seeds, their results and the training
rewards of every seed against time.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import os
import time

import torch
from transformers import TrainerCallback

from ..evaluation import (
    check_k,
    check_vllm_options,
    evaluate,
    evaluate_tasks,
    expand_tasks,
    print_progress,
    research_k,
)
from ..evaluation.report import averages, heldout_change, plot_pareto, plot_pass_at_k
from ..tasks import TASKS, get_task
from ..util.atomic import atomic_write_text
from .parser import command_parser
from .study_report import TAUS, plot_curves, plot_rewards, write_seeds_table, write_table
from .study_settings import ES_SETTINGS, ES_VARIANTS, ES_VLLM_SETTINGS, es_samples, stage_settings, trainer_settings
from .train import load_reward_funcs


METHODS = ("es", "grpo", "grpo-es", "es-grpo")
OFF_TASK_TEXTS = [
    "The river bends twice before it reaches the old mill at the edge of the village.",
    "She packed a thermos of tea, two apples and a map that was already falling apart at the folds.",
    "In spring the orchard smells of blossom, and by late summer the branches bend under the fruit.",
    "The committee met on Tuesday to discuss the new library opening hours and the parking problem.",
    "Bake the bread for forty minutes, until the crust is brown and it sounds hollow when tapped.",
    "A lighthouse keeper once wrote that the sea never looks the same colour two days in a row.",
    "The train was late again, so he read the newspaper twice and then watched the rain.",
    "Migrating birds use the stars, the sun and the earth's magnetic field to find their way.",
]
"""KL drift is measured on these sentences (no arithmetic, no instructions): how far a method moved the model's
next-token distribution away from the task."""


class Budget(TrainerCallback):
    """Stops training once `seconds` of training time have passed; records (seconds, step, reward) of each logged
    step; at `marks - 1` evenly spaced points before the end saves the model and `tokenizer` to `folder/mark-k` with
    (path, seconds, step): the points of a learning curve. Time spent saving is not counted."""

    def __init__(self, seconds: float, marks: int = 1, folder: str = "", tokenizer=None):
        self.seconds, self.times = seconds, [seconds * (k + 1) / marks for k in range(marks - 1)]
        self.folder, self.tokenizer, self.history, self.points = folder, tokenizer, [], []
        self.start = self.paused = 0.0

    def elapsed(self) -> float:
        return time.perf_counter() - self.start - self.paused

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            self.history.append((self.elapsed(), state.global_step, float(logs["reward"])))

    def on_step_end(self, args, state, control, model=None, **kwargs):
        while len(self.points) < len(self.times) and self.elapsed() >= self.times[len(self.points)]:
            saving, path = time.perf_counter(), os.path.join(self.folder, f"mark-{len(self.points) + 1}")
            self.points.append({"path": path, "seconds": round(self.elapsed(), 1), "step": state.global_step})
            model.save_pretrained(path)
            self.tokenizer.save_pretrained(path)
            self.paused += time.perf_counter() - saving
        if self.elapsed() >= self.seconds:
            control.should_training_stop = True
        return control


def train(kind: str, model: str, output_dir: str, dataset, options) -> dict:
    """One stage: `kind` ("es" or "grpo") trained from `model` for the budget, saved to `output_dir` (and its
    `--marks` points before the end to `output_dir/mark-k`)."""
    budget = Budget(options.budget_minutes * 60, options.marks, output_dir)
    common = dict(output_dir=output_dir, max_steps=options.max_steps, max_completion_length=options.max_completion_length,
                  seed=options.seed, shuffle_dataset=False, logging_steps=1, save_strategy="no", report_to="none",
                  disable_tqdm=True)  # fmt: skip
    if kind == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        args = GRPOConfig(**common, **trainer_settings(kind, options))
        trainer = GRPOTrainer(model, options.reward_funcs, args=args, train_dataset=dataset, callbacks=[budget])
        completions_per_step = args.per_device_train_batch_size
    else:
        from .. import ESConfig, ESTrainer

        args = ESConfig(
            **common, **trainer_settings(kind, options), generation_kwargs={"do_sample": es_samples(options)}
        )
        trainer = ESTrainer(model, options.reward_funcs, args=args, train_dataset=dataset, callbacks=[budget])
        completions_per_step = args.population_size * args.per_device_train_batch_size * args.num_generations
    budget.tokenizer = trainer.processing_class
    trainer.train()
    seconds = budget.elapsed()
    trainer.save_model()
    steps = trainer.state.global_step
    points = [*budget.points, {"path": output_dir, "seconds": round(seconds, 1), "step": steps}]
    for point in points:
        point["completions"] = point["step"] * completions_per_step
    return {"settings": stage_settings(kind, options), "steps": steps, "seconds": round(seconds, 1),
            "completions": steps * completions_per_step, "history": budget.history, "points": points}  # fmt: skip


def stage_inputs(kind: str, options, start: str) -> dict:
    """Everything a stage's result depends on: what it starts from (path and weights), the budget, the task and
    reward, the trainer's settings. A stage trained with other inputs is not reused."""
    weights = sorted(glob.glob(os.path.join(start, "*.safetensors")))
    digest = hashlib.sha256()
    for path in weights:
        with open(path, "rb") as file:
            for block in iter(lambda: file.read(1 << 24), b""):
                digest.update(block)
    return {"starts_from": start, "weights_sha256": digest.hexdigest() if weights else None,
            "budget_minutes": options.budget_minutes, "marks": options.marks, "max_steps": options.max_steps,
            "seed": options.seed,
            "task": options.task, "train_split": options.train_split, "reward": options.reward,
            "max_completion_length": options.max_completion_length, "settings": stage_settings(kind, options)}  # fmt: skip


def train_methods(options, dataset, progress) -> dict:
    """Every method's training record, training those not finished in an earlier run with the same inputs (a
    ValueError for a stage trained with other ones: its result would be reported beside this run's settings)."""
    records = {}
    for method in options.methods:
        output_dir = os.path.join(options.out, method)
        record_path = os.path.join(output_dir, "training.json")
        *first, kind = method.split("-")
        start = os.path.join(options.out, first[0]) if first else options.model
        inputs = stage_inputs(kind, options, start)
        if os.path.isfile(record_path):
            with open(record_path) as file:
                records[method] = json.load(file)
            changed = sorted(k for k in inputs if records[method].get("inputs", {}).get(k) != inputs[k])
            if changed:
                raise ValueError(
                    f"{output_dir} was trained with other {', '.join(changed)} than this run's: use another --out, or "
                    f"delete {output_dir} to train {method} again"
                )
            progress(f"{method}: trained in an earlier run ({records[method]['steps']} steps), not again")
            continue
        progress(f"{method}: {kind.upper()} from {start} for {options.budget_minutes:g} min with "
                 f"{stage_settings(kind, options)}")  # fmt: skip
        records[method] = train(kind, start, output_dir, dataset, options)
        records[method]["starts_from"] = first[0] if first else "base"
        records[method]["inputs"] = inputs
        atomic_write_text(record_path, json.dumps(records[method], indent=1))
        progress(f"{method}: {records[method]['steps']} steps in {records[method]['seconds']:.0f} s")
    return records


@torch.no_grad()
def measure_updates(base_path: str, paths: dict[str, str]) -> dict:
    """Per method: relative L2 and s_τ of θ − θ_base, KL drift on OFF_TASK_TEXTS; the ES/GRPO update cosine."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..research.analysis import mean_token_kl, update_cosine
    from ..util.deltas import update_statistics

    def load(path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    base, tokenizer = load(base_path), AutoTokenizer.from_pretrained(base_path)
    base_weights, weights, measures = dict(base.named_parameters()), {}, {}
    for method, path in paths.items():
        model = load(path)
        weights[method] = {name: p.detach() for name, p in model.named_parameters()}
        total = update_statistics(base_weights, weights[method], TAUS)["total"]
        measures[method] = {"relative_l2": total["relative_l2"], "nonzero_share": total["nonzero_share"],
                            "s_tau": {str(tau): share for tau, share in total["s_tau"].items()},
                            "kl_drift": mean_token_kl(base, model, tokenizer, OFF_TASK_TEXTS)}  # fmt: skip
    if "es" in weights and "grpo" in weights and measures["es"]["relative_l2"] and measures["grpo"]["relative_l2"]:
        measures["cosine_es_grpo"] = update_cosine(base_weights, weights["es"], weights["grpo"])
    return measures


def evaluate_heldout(options, tasks: list[str], k_values: list[int], paths: dict[str, str], progress) -> dict:
    """The base ("base") and every result evaluated on the held-out `tasks` (`evaluate_tasks`, DIR/heldout/):
    {"tasks", "train_task", "k", "models": {name: {"path", "tasks", "average"}}, "heldout_change"}, the held-out
    change of every result against the base in points."""
    names = {"base": options.model, **paths}
    evaluated = evaluate_tasks(list(names.values()), tasks, options.n, k_values, os.path.join(options.out, "heldout"),
                               limit=options.limit, max_completion_length=options.heldout_length,
                               temperature=options.temperature, seed=options.seed, progress=progress,
                               train_task=options.task, use_vllm=options.use_vllm,
                               vllm_entropy=options.vllm_entropy)  # fmt: skip
    by_path = {row["path"]: row for row in evaluated["models"].values()}
    heldout = {"tasks": tasks, "train_task": options.task, "k": k_values, "models": {}}
    for name, path in names.items():
        heldout["models"][name] = {"path": path, "tasks": by_path[path]["tasks"]}
        heldout["models"][name]["average"] = averages(heldout, name)
    heldout["heldout_change"] = heldout_change(heldout)
    return heldout


def check_study(options) -> None:
    """A ValueError for what the study's evaluation or its methods cannot run with, before anything trains."""
    if not (math.isfinite(options.temperature) and options.temperature > 0):
        raise ValueError(
            f"--temperature must be a finite number > 0: the evaluation samples --n completions, got "
            f"{options.temperature}"
        )
    if options.max_completion_length is not None and options.max_completion_length < 1:
        raise ValueError(f"--max-completion-length must be ≥ 1 token, got {options.max_completion_length}")
    check_vllm_options(options.use_vllm, options.vllm_entropy)
    for method in options.methods:
        first = method.split("-")[0]
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}: choose from {', '.join(METHODS)}")
        if "-" in method and first not in options.methods:
            raise ValueError(f"{method} continues the {first} result: list {first} among the methods too")
    trains_grpo = any("grpo" in method.split("-") for method in options.methods)
    if options.grpo_vllm and trains_grpo and not torch.cuda.is_available():
        raise ValueError(
            "--grpo-vllm needs a GPU: GRPOTrainer's weight sync into vLLM fails on vLLM's CPU backend (0.32: its CPU "
            "linear layers keep packed weights without a weight_loader). Leave GRPO on transformers (its fastest "
            "engine on CPU) or run on a GPU"
        )
    if options.es_population is not None and options.es_population < 2:
        raise ValueError(f"--es-population must be ≥ 2 members, got {options.es_population}")
    if options.marks < 1:
        raise ValueError(f"--marks must be ≥ 1, got {options.marks}")
    if options.budget_minutes <= 0:
        raise ValueError(f"--budget-minutes must be > 0, got {options.budget_minutes}")


def study(options, progress=print_progress) -> dict:
    """Train, evaluate and measure every method (see the module docstring); returns what results.json holds."""
    task = get_task(options.task)
    k_values = check_k(options.n, options.k or research_k(options.n))
    heldout = expand_tasks(options.heldout, []) if options.heldout else []
    check_study(options)
    from ..util.models import resolve_model

    options.model = resolve_model(options.model)
    options.heldout_length = options.max_completion_length  # None: each held-out task's own
    options.max_completion_length = options.max_completion_length or task.max_completion_length
    options.reward_funcs = load_reward_funcs([options.reward]) if options.reward else [task.reward]
    options.methods = sorted(options.methods, key=lambda m: ("-" in m, m))  # first stages before continuations
    os.makedirs(options.out, exist_ok=True)
    records = train_methods(options, task.load(options.train_split), progress)
    paths = {method: os.path.join(options.out, method) for method in options.methods}
    marks = [point["path"] for method in options.methods for point in records[method]["points"][:-1]]
    evaluated = evaluate([options.model, *paths.values(), *marks], options.task, options.n, k_values,
                         os.path.join(options.out, "eval"), limit=options.limit,
                         max_completion_length=options.max_completion_length, seed=options.seed,
                         temperature=options.temperature, progress=progress, use_vllm=options.use_vllm,
                         vllm_entropy=options.vllm_entropy)  # fmt: skip
    scores = {row["path"]: row for row in evaluated["models"].values()}
    measures = measure_updates(options.model, paths)
    results = {"task": options.task, "k": k_values, "budget_minutes": options.budget_minutes,
               "evaluation": evaluated["settings"], "models": {"base": {"path": options.model,
               "eval": scores[options.model]}}}  # fmt: skip
    for method, path in paths.items():
        curve = [{key: point[key] for key in ("seconds", "step", "completions")} | {f"pass@{k}": scores[point["path"]][
            f"pass@{k}"] for k in (k_values[0], k_values[-1])} for point in records[method]["points"]]  # fmt: skip
        results["models"][method] = {"path": path, "training": records[method], "eval": scores[path], "curve": curve,
                                     "update": measures[method]}  # fmt: skip
    if "cosine_es_grpo" in measures:
        results["cosine_es_grpo"] = measures["cosine_es_grpo"]
    if heldout:
        results["heldout"] = evaluate_heldout(options, heldout, k_values, paths, progress)
    atomic_write_text(os.path.join(options.out, "results.json"), json.dumps(results, indent=1))
    progress(write_table(results, os.path.join(options.out, "table.md")))
    plot_rewards([records], os.path.join(options.out, "reward_vs_time.png"))
    plot_curves([results], os.path.join(options.out, "pass_vs_time.png"))
    by_name = {"tasks": [options.task], "k": k_values,
               "models": {n: {"tasks": {options.task: r["eval"]}} for n, r in results["models"].items()}}  # fmt: skip
    plot_pass_at_k(by_name, os.path.join(options.out, "pass_at_k.png"))
    plot_pareto(by_name, os.path.join(options.out, "pareto.png"))
    return results


def study_parser():
    """The command's options (the module docstring)."""
    parser = command_parser("trl-es study", __doc__.splitlines()[0])
    parser.add_argument("--task", default="small_sums", help=", ".join(TASKS))
    parser.add_argument("--model", default="smollm2", help="the starting model (path or id; 'smollm2')")
    parser.add_argument("--budget-minutes", type=float, default=20.0, help="wall clock per method (per stage)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    parser.add_argument("--out", default="outputs/study", help="results, models and plots (resumes)")
    parser.add_argument("--train-split", default="train", help="the task's training split")
    parser.add_argument("--reward", default=None, help="train on this reward (a registry name or dotted path) "
                        "instead of the task's; the evaluation scores with the task's")  # fmt: skip
    parser.add_argument("--max-completion-length", type=int, default=None, help="default: the task's")
    parser.add_argument("--es-sample", action="store_true", help="ES members sample (temperature 1) as GRPO's "
                        "completions do, instead of generating greedily as the demo's")  # fmt: skip
    parser.add_argument("--es-space", choices=("full", "lowrank"), help="ES's search space: full-rank members, or "
                        "low-rank ones (es_search_space='lowrank', EGGROLL); default full, lowrank with --es-vllm")  # fmt: skip
    parser.add_argument("--es-population", type=int, default=None, help=f"ES's population size N (default "
                        f"{ES_SETTINGS['population_size']}, {ES_VLLM_SETTINGS['population_size']} with --es-vllm)")  # fmt: skip
    parser.add_argument("--es-sigma", type=float, default=None, help=f"ES's σ (default {ES_SETTINGS['sigma']}, "
                        f"{ES_VLLM_SETTINGS['sigma']} with --es-vllm)")  # fmt: skip
    parser.add_argument("--es-learning-rate", type=float, default=None, help=f"ES's α (default "
                        f"{ES_SETTINGS['learning_rate']}, {ES_VLLM_SETTINGS['learning_rate']} with --es-vllm)")  # fmt: skip
    parser.add_argument("--es-vllm", action="store_true", help="ES trains through an in-process vLLM engine, the "
                        "population in one call: low-rank members in its LoRA slots (full-rank ones written into its "
                        "weights with --es-space full), with the fastest settings measured there as defaults")  # fmt: skip
    parser.add_argument("--grpo-vllm", action="store_true", help="GRPOTrainer generates with vLLM colocate "
                        "(use_vllm=True; GPU only: its weight sync fails on vLLM's CPU backend)")  # fmt: skip
    parser.add_argument("--es-variant", choices=tuple(ES_VARIANTS), help="an ES variant over ES's settings "
                        "(`ES_VARIANTS`: per-prompt normalisation, Pass@k fitness, top-K members, noise reuse)")  # fmt: skip
    parser.add_argument("--es-anchor-decay", type=float, default=0.0, help="ES's anchored decay λ (es_anchor_decay): "
                        "θ ← θ − λ·(θ − θ₀) after each update; its KL drift and held-out change measure forgetting")  # fmt: skip
    parser.add_argument("--max-steps", type=int, default=1_000_000, help="a cap on steps besides the budget")
    parser.add_argument("--n", type=int, default=16, help="completions sampled per held-out problem")
    parser.add_argument("--k", default=None, help="comma-separated K values for Pass@K and Maj@K (None: the "
                        "research's 1, 16, 32 up to --n)")  # fmt: skip
    parser.add_argument("--temperature", type=float, default=0.6, help="the evaluation's sampling temperature (the "
                        "research's 0.6)")  # fmt: skip
    parser.add_argument("--heldout", default="", help="comma-separated held-out tasks (e.g. gpqa,mbpp,commonsenseqa,"
                        "countdown) the base and every result are evaluated on: the held-out change table")  # fmt: skip
    parser.add_argument("--limit", type=int, default=64, help="held-out problems evaluated")
    parser.add_argument("--use-vllm", action="store_true", help="evaluate through an in-process vLLM engine (as "
                        "`trl-es eval --use-vllm`; training: --es-vllm, --grpo-vllm); no token entropy unless "
                        "--vllm-entropy")  # fmt: skip
    parser.add_argument("--vllm-entropy", action="store_true", help="with --use-vllm, also score the token entropy "
                        "(as `trl-es eval --vllm-entropy`: costs more than generating on CPU)")  # fmt: skip
    parser.add_argument("--marks", type=int, default=1, help="points of each stage that are saved and evaluated: "
                        "Pass@1 and Pass@K against time (pass_vs_time.png); 1: the end only")  # fmt: skip
    parser.add_argument("--seeds", default="0", help="comma-separated training and sampling seeds: several give "
                        "one study per seed (DIR/seed-<s>) and the table of their spread in DIR")  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = study_parser()
    options = parser.parse_args(argv)
    options.methods = [m for m in options.methods.split(",") if m]
    options.heldout = [task for task in options.heldout.split(",") if task]
    if options.k is not None:
        try:
            options.k = [int(k) for k in options.k.split(",") if k]
        except ValueError:
            parser.error(f"--k must be comma-separated integers, got {options.k!r}")
    try:
        seeds = list(dict.fromkeys(int(s) for s in options.seeds.split(",") if s))
    except ValueError:
        seeds = []
    if not seeds:
        parser.error(f"--seeds must be comma-separated integers, got {options.seeds!r}")
    if len(seeds) == 1:
        options.seed = seeds[0]
        return study(options)
    return study_seeds(options, seeds)


def study_seeds(options, seeds: list[int], progress=print_progress) -> dict:
    """`study` once per seed in OUT/seed-<s>; OUT/results.json holds them, OUT/table.md their spread,
    OUT/reward_vs_time.png and OUT/pass_vs_time.png every seed's training rewards and curves."""
    out, by_seed = options.out, {}
    for seed in seeds:
        progress(f"seed {seed}")
        run = argparse.Namespace(**{**vars(options), "seed": seed, "out": os.path.join(out, f"seed-{seed}")})
        by_seed[seed] = study(run, progress)
    results = {"seeds": seeds, "by_seed": {str(seed): results for seed, results in by_seed.items()}}
    atomic_write_text(os.path.join(out, "results.json"), json.dumps(results, indent=1))
    progress(write_seeds_table(by_seed, os.path.join(out, "table.md")))
    runs = [{m: row["training"] for m, row in r["models"].items() if "training" in row} for r in by_seed.values()]
    plot_rewards(runs, os.path.join(out, "reward_vs_time.png"))
    plot_curves(list(by_seed.values()), os.path.join(out, "pass_vs_time.png"))
    return results
