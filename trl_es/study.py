"""ES vs GRPO on one task at one wall-clock budget: the research's comparison in one command.

    trl-es study --task small_sums --model smollm2 --budget-minutes 20 --methods es,grpo,grpo-es,es-grpo --out DIR

Each method trains from the same model on the same prompts in the same order (no shuffling), with the task's reward
and the same completion length, until the budget of wall clock has passed (the step running then finishes):
`grpo` is TRL's GRPOTrainer (4 prompts × 4 completions per step, lr 1e-5), `es` is ESTrainer with the demo's
calibrated settings (N=8, σ=5e-3, α=5e-3, 8 prompts per step, greedy members, or sampling ones with --es-sample).
`grpo-es` continues the `grpo` result with ES for another budget, `es-grpo` the `es` result with GRPO: two budgets
in all. Then the base and every result are evaluated on the task's held-out problems with the same sampling
(`trl_es.evaluation`: Pass@K and Maj@K, mean token entropy) and every update is measured against the base
(`trl_es.sparse.update_statistics`: relative L2 and s_τ; `trl_es.analysis`: the cosine between the ES and GRPO
updates, KL drift on a fixed off-task text sample).

Writes DIR/results.json, DIR/table.md, DIR/reward_vs_time.png, DIR/pass_at_k.png and DIR/pareto.png. Re-running
the command resumes: a method whose DIR/<method>/training.json exists is not trained again (an interrupted one
starts over) and the evaluation keeps its finished batches.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import time

import torch
from transformers import TrainerCallback

from .atomic import atomic_write_text
from .cli import command_parser
from .eval_report import plot_pareto, plot_pass_at_k, pyplot
from .evaluation import _report, check_k, evaluate
from .script import load_reward_funcs
from .tasks import TASKS, get_task


METHODS = ("es", "grpo", "grpo-es", "es-grpo")
ES_SETTINGS = {"population_size": 8, "sigma": 5e-3, "learning_rate": 5e-3, "per_device_train_batch_size": 8}
"""The demo's calibrated ES settings (trl_es.demo); members generate greedily unless --es-sample."""
GRPO_SETTINGS = {"learning_rate": 1e-5, "per_device_train_batch_size": 16, "num_generations": 4, "bf16": False}
"""TRL GRPOTrainer: 4 prompts × 4 completions per step, lr 1e-5 (TRL's default 1e-6 barely moves in minutes)."""
TAUS = (1e-3, 1.5e-3, 2e-3)
"""The research's thresholds for s_τ, the share of an update's nonzero entries with |Δ| ≤ τ."""
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


class Deadline(TrainerCallback):
    """Stops training once `seconds` of wall clock have passed since it began; records (seconds, step, reward) of
    each logged step."""

    def __init__(self, seconds: float):
        self.seconds, self.start, self.history = seconds, None, []

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            self.history.append((time.perf_counter() - self.start, state.global_step, float(logs["reward"])))

    def on_step_end(self, args, state, control, **kwargs):
        if time.perf_counter() - self.start >= self.seconds:
            control.should_training_stop = True
        return control


def stage_settings(kind: str, options) -> dict:
    """What a stage of `kind` ("es" or "grpo") trains with, as printed and saved."""
    if kind == "grpo":
        return {"trainer": "trl.GRPOTrainer", **GRPO_SETTINGS}
    return {"trainer": "trl_es.ESTrainer", **ES_SETTINGS, "do_sample": options.es_sample}


def train(kind: str, model: str, output_dir: str, dataset, options) -> dict:
    """One stage: `kind` ("es" or "grpo") trained from `model` for the budget, saved to `output_dir`."""
    deadline = Deadline(options.budget_minutes * 60)
    common = dict(output_dir=output_dir, max_steps=options.max_steps, max_completion_length=options.max_completion_length,
                  seed=options.seed, shuffle_dataset=False, logging_steps=1, save_strategy="no", report_to="none",
                  disable_tqdm=True)  # fmt: skip
    if kind == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        args = GRPOConfig(**common, **GRPO_SETTINGS)
        trainer = GRPOTrainer(model, options.reward_funcs, args=args, train_dataset=dataset, callbacks=[deadline])
        completions_per_step = args.per_device_train_batch_size
    else:
        from . import ESConfig, ESTrainer

        args = ESConfig(**common, **ES_SETTINGS, generation_kwargs={"do_sample": options.es_sample})
        trainer = ESTrainer(model, options.reward_funcs, args=args, train_dataset=dataset, callbacks=[deadline])
        completions_per_step = args.population_size * args.per_device_train_batch_size * args.num_generations
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    trainer.save_model()
    steps = trainer.state.global_step
    return {"settings": stage_settings(kind, options), "steps": steps, "seconds": round(seconds, 1),
            "completions": steps * completions_per_step, "history": deadline.history}  # fmt: skip


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
            "budget_minutes": options.budget_minutes, "max_steps": options.max_steps, "seed": options.seed,
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

    from .analysis import mean_token_kl, update_cosine
    from .sparse import update_statistics

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


def write_table(results: dict, path: str) -> str:
    """The research's form: one row per model, one column per metric."""
    k, ks = results["k"][-1], results["k"]
    columns = ["steps", "seconds", *(f"pass@{x}" for x in ks), f"maj@{k}", "entropy", "rel. L2",
               "s_τ " + "/".join(f"{t:g}" for t in TAUS), "KL drift"]  # fmt: skip
    lines = ["| model | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for name, row in results["models"].items():
        training, scores, update = row.get("training", {}), row["eval"], row.get("update", {})
        cells = [training.get("steps", ""), f"{training['seconds']:.0f}" if training else "",
                 *(f"{scores[f'pass@{x}']:.3f}" for x in ks), f"{scores.get(f'maj@{k}', float('nan')):.3f}",
                 f"{scores['mean_token_entropy']:.3f}", f"{update['relative_l2']:.2e}" if update else "",
                 "/".join(f"{s:.2f}" for s in update["s_tau"].values()) if update else "",
                 f"{update['kl_drift']:.4f}" if update else ""]  # fmt: skip
        lines.append(f"| {name} | " + " | ".join(map(str, cells)) + " |")
    if "cosine_es_grpo" in results:
        lines.append(f"\ncos(Δ_ES, Δ_GRPO) = {results['cosine_es_grpo']:.4f}")
    text = "\n".join(lines) + "\n"
    atomic_write_text(path, text)
    return text


def plot_rewards(records: dict, path: str) -> None:
    """Mean training reward against wall clock per method (a continued method after its first stage's time)."""
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(6, 4))
    for color, (method, record) in enumerate(records.items(), start=1):  # C0 is the base's in the Pass@K plots
        offset = records[record["starts_from"]]["seconds"] if record["starts_from"] != "base" else 0.0
        if record["history"]:
            seconds, _, rewards = zip(*record["history"], strict=True)
            axes.plot([offset + s for s in seconds], rewards, ".-", color=f"C{color}", label=method)
    axes.set_xlabel("wall clock (s)")
    axes.set_ylabel("mean training reward")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def study(options, progress=_report) -> dict:
    """Train, evaluate and measure every method (see the module docstring); returns what results.json holds."""
    task = get_task(options.task)
    k_values = check_k(options.n, options.k)
    for method in options.methods:
        first = method.split("-")[0]
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}: choose from {', '.join(METHODS)}")
        if "-" in method and first not in options.methods:
            raise ValueError(f"{method} continues the {first} result: list {first} among the methods too")
    if options.budget_minutes <= 0:
        raise ValueError(f"--budget-minutes must be > 0, got {options.budget_minutes}")
    from .models import resolve_model

    options.model = resolve_model(options.model)
    options.max_completion_length = options.max_completion_length or task.max_completion_length
    options.reward_funcs = load_reward_funcs([options.reward]) if options.reward else [task.reward]
    options.methods = sorted(options.methods, key=lambda m: ("-" in m, m))  # first stages before continuations
    os.makedirs(options.out, exist_ok=True)
    records = train_methods(options, task.load(options.train_split), progress)
    paths = {method: os.path.join(options.out, method) for method in options.methods}
    evaluated = evaluate([options.model, *paths.values()], options.task, options.n, k_values,
                         os.path.join(options.out, "eval"), limit=options.limit,
                         max_completion_length=options.max_completion_length, seed=options.seed,
                         progress=progress)  # fmt: skip
    scores = {row["path"]: row for row in evaluated["models"].values()}
    measures = measure_updates(options.model, paths)
    results = {"task": options.task, "k": k_values, "budget_minutes": options.budget_minutes,
               "evaluation": evaluated["settings"], "models": {"base": {"path": options.model,
               "eval": scores[options.model]}}}  # fmt: skip
    for method, path in paths.items():
        results["models"][method] = {"path": path, "training": records[method], "eval": scores[path],
                                     "update": measures[method]}  # fmt: skip
    if "cosine_es_grpo" in measures:
        results["cosine_es_grpo"] = measures["cosine_es_grpo"]
    atomic_write_text(os.path.join(options.out, "results.json"), json.dumps(results, indent=1))
    progress(write_table(results, os.path.join(options.out, "table.md")))
    plot_rewards(records, os.path.join(options.out, "reward_vs_time.png"))
    by_name = {"task": options.task, "k": k_values, "models": {n: r["eval"] for n, r in results["models"].items()}}
    plot_pass_at_k(by_name, os.path.join(options.out, "pass_at_k.png"))
    plot_pareto(by_name, os.path.join(options.out, "pareto.png"))
    return results


def main(argv: list[str] | None = None) -> dict:
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
    parser.add_argument("--max-steps", type=int, default=1_000_000, help="a cap on steps besides the budget")
    parser.add_argument("--n", type=int, default=16, help="completions sampled per held-out problem")
    parser.add_argument("--k", default="1,2,4,8,16", help="comma-separated K values for Pass@K and Maj@K")
    parser.add_argument("--limit", type=int, default=64, help="held-out problems evaluated")
    parser.add_argument("--seed", type=int, default=0, help="training and sampling seed")
    options = parser.parse_args(argv)
    options.methods = [m for m in options.methods.split(",") if m]
    try:
        options.k = [int(k) for k in options.k.split(",") if k]
    except ValueError:
        parser.error(f"--k must be comma-separated integers, got {options.k!r}")
    return study(options)
