"""Learning curves on the demo task: ES against TRL's GRPOTrainer, interleaved in one run, against time and work.

    python benchmarks/learning.py [--minutes 10] [--marks 5] [--seeds 0,1,2] [--methods grpo,es] [--out D]
    python benchmarks/learning.py --task small_sums_last --samples 32 --temperature 0.6   # the research's protocol
    python benchmarks/learning.py --methods es,anchor-0.1,anchor-0.3 --samples 0   # anchored decay: learning vs drift
    python benchmarks/learning.py --methods es,full-vllm-n32,lowrank-vllm-n64 --sigma 1e-3 --alpha 2e-3   # engines
    python benchmarks/learning.py --task small_sums_last --max-completion-length 32 --samples 16 --temperature 0.6 \
        --limit 32 --use-vllm --marks 2 --seeds 0 --methods es,full-vllm-n8,lowrank-vllm-n32   # the regime's screen

Every run starts from SmolLM2-135M-Instruct and trains on small sums (`first_integer_reward`, 12 new tokens) for
`--minutes` of wall clock. At `--marks` evenly spaced points of that budget the weights are saved (the saving time
is not counted: the clock pauses) with the wall-clock seconds, the steps and the completions generated so far, and
the run keeps its per-step fitness trace (`LOGGED`). After the run, outside its budget and in a process of its own,
each saved point is scored on the 64 held-out problems: greedy accuracy (the demo's check) and sampled (T=1) Pass@1
and Pass@8 with 8 completions per problem (`trl-es eval`'s loop and estimator; `--samples 0` leaves them out), and
its KL drift from the base on off-task text (`trl-es study`'s measure); `--task`, `--samples` and `--temperature`
change the task (trained and scored) and the sampled scoring, which then also reports Maj@n and the completions'
token entropy.

Methods are interleaved per seed, A B for even seed indices and B A for odd ones (A B B A …), each run in a fresh
process, so slow drifts of the machine fall on both. `es` is the demo's setting (N=8, σ=α=5e-3, 8 prompts, greedy
members); the other ES names are variants of it (`SETTINGS`); `grpo` is GRPOTrainer with `trl_es.commands.study`'s settings
(4 prompts × 4 completions, lr 1e-5); `grpo-es` and `es-grpo` train one for half the budget, then the other from its
weights (`SEQUENCES`). Prints, per method and mark, the mean and min–max over seeds; writes
`results.json` and a plot (`--plot`, default docs/img/learning_curves.png): greedy accuracy and Pass@8 against
seconds and against completions generated. Claim a lead only where the min–max bands stay apart.

Cost on 2 CPU cores: scoring a point takes ~3 minutes (64 greedy and 512 sampled completions), so a run of
10 minutes × 4 points takes ~23 minutes, and the default (2 methods × 3 seeds × 5 points) about 2.8 hours.
`--report RESULTS...` prints the table and plot of earlier results.json files, pooled (e.g. seeds run apart);
`--methods` then keeps only those methods.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

from trl_es.util.atomic import atomic_write_text


ES = {"population_size": 8, "sigma": 5e-3, "learning_rate": 5e-3, "per_device_train_batch_size": 8}
"""The demo's ES settings, which every ES variant overrides."""
SETTINGS = {
    "es": {},
    "antithetic-ranks": {"antithetic": True, "fitness_shaping": "centered_rank"},
    "antithetic-ranks-scaled": {"antithetic": True, "fitness_shaping": "centered_rank", "learning_rate": 1.5e-2},
    "alpha-cosine": {"learning_rate": 1e-2, "lr_scheduler_type": "cosine", "max_steps": 36},
    "sigma-decay": {"sigma": 1e-2, "sigma_decay": 0.95},
    "fewer-prompts": {"per_device_train_batch_size": 4},
    "more-members": {"population_size": 16, "per_device_train_batch_size": 4, "learning_rate": 7e-3},
    "sampled": {"generation_kwargs": {"do_sample": True}},
    "sampled-groups": {
        "generation_kwargs": {"do_sample": True},
        "temperature": 0.7,
        "num_generations": 4,
        "per_device_train_batch_size": 4,
    },
    "lowrank-n32": {"es_search_space": "lowrank", "population_size": 32, "learning_rate": 8e-3},
    "anchor-0.1": {"es_anchor_decay": 0.1},
    "anchor-0.3": {"es_anchor_decay": 0.3},
}
"""ES variants (overrides of `ES`). `antithetic-ranks-scaled` triples α: 8 centered ranks have std 0.33 where
z-scores have 1, so it takes the demo's step size with rank shaping. `alpha-cosine` anneals α from 2× the demo's to
0 over 36 steps, the steps the demo's ES reached in 10 minutes in a fast run (a budget that ends first stops it
earlier on the schedule). `sigma-decay` starts σ at 2× the demo's and multiplies it by 0.95 each step: the demo's σ
at step 14, 0.4× it at step 32. `more-members` spends the demo's 64 completions per step on 16 members × 4 prompts
instead of 8 × 8, with α × √2 to keep the step's norm ((1/N)·Σ z_i ε_i shrinks as 1/√N). `sampled-groups` scores
each member on 4 completions of each of 4 prompts sampled at T=0.7: a member's score averages 16 sampled
completions, where `sampled` has 8 at T=1."""
VLLM = {"use_vllm": True, "vllm_max_model_length": 2048}
"""ES's population through an in-process vLLM engine (members written in place, or low-rank ones in LoRA slots)."""


def engine_variants() -> dict[str, dict]:
    """Each ES engine at N = 8, 32, 64 (`full-n8` is `es`): α × √(N/8) keeps the step's norm as `more-members`
    does; σ is the demo's (a sweep passes `--sigma`/`--alpha` to change both)."""
    variants = {}
    for n in (8, 32, 64):
        larger = {"population_size": n, "learning_rate": round(ES["learning_rate"] * (n / 8) ** 0.5, 5)}
        variants |= {
            f"full-vllm-n{n}": {**larger, **VLLM},
            f"lowrank-vllm-n{n}": {**larger, **VLLM, "es_search_space": "lowrank"},
        }
        if n > 8:
            variants[f"full-n{n}"] = larger
    return variants


SETTINGS |= engine_variants()
SETTINGS |= {
    "lowrank-vllm-n32-cosine": {
        **SETTINGS["lowrank-vllm-n32"],
        "sigma": 1e-2,
        "learning_rate": 2e-2,
        "lr_scheduler_type": "cosine",
        "max_steps": 121,
    },
    "lowrank-vllm-n32-half-alpha": {**SETTINGS["lowrank-vllm-n32"], "sigma": 1e-2, "learning_rate": 1e-2},
}
"""The σ/α sweep's winner on the low-rank vLLM engine (N = 32, σ = 1e-2, α = 2e-2) made to hold past its peak:
`-cosine` anneals α from 2e-2 to 0 over the 121 updates the constant-α winner reached in 48 minutes (a shorter
budget stops it earlier on the schedule), `-half-alpha` keeps α constant at 1e-2. Run them without `--sigma`/`--alpha`,
which would override both."""


def variants() -> dict[str, dict]:
    """`trl-es study`'s ES variants (`trl_es.commands.study_settings.ES_VARIANTS`), each over today's winner
    (`lowrank-vllm-n32-half-alpha`: low-rank members in one vLLM call, N = 32, σ = α = 1e-2)."""
    from trl_es.commands.study_settings import ES_VARIANTS

    winner, found = SETTINGS["lowrank-vllm-n32-half-alpha"], {}
    for name, variant in ES_VARIANTS.items():
        settings = {key: value for key, value in variant.items() if key != "do_sample"}
        sampling = {"generation_kwargs": {"do_sample": True}} if variant.get("do_sample") else {}
        found[name] = {**winner, **settings, **sampling}
    return found


SETTINGS |= variants()
SEQUENCES = {"grpo-es": ("grpo", "es"), "es-grpo": ("es", "grpo")}
"""Two methods in sequence, each for half the budget (the research's GRPO → ES and ES → GRPO)."""


TASK = {"name": "small_sums", "samples": 8, "temperature": 1.0, "length": 12, "limit": None, "use_vllm": False}
"""The task trained and scored, the sampled scoring's completions per problem and temperature (`--task`,
`--samples`, `--temperature`; the research's protocol: `--task small_sums_last --samples 32 --temperature 0.6`), the
new tokens of training (`--max-completion-length`, the demo's 12; scoring takes the task's own), the held-out
problems scored (`--limit`, default all 64) and the sampled scoring's engine (`--use-vllm`: an in-process vLLM
engine, token entropy scored afterwards by the model)."""
LOGGED = ("reward", "es/population_reward_std", "frac_reward_zero_std")
"""Kept from every logged training step (with the step and the run's seconds): the trace of the fitness signal."""


SWEEP = {}
"""σ and α for every ES method of this run (`--sigma`, `--alpha`): one point of a sweep."""
HELDOUT = {"name": None, "limit": 64, "length": 128}
"""A task never trained on (`--heldout`, e.g. commonsenseqa): each run's last point is also scored on it, sampled as
the task above (n, T, engine), on its first `limit` problems with `length` new tokens (docs/study.md's held-out
protocol; the base's numbers are `trl-es eval`'s under the same settings). Without the Hub the task's rows come from
`TRL_ES_DATA` (tests/data holds commonsenseqa's)."""


def train(method: str, seed: int, minutes: float, marks: int, folder: str) -> list[dict]:
    """One budgeted run in this process; the saved points. A sequence ("grpo-es", "es-grpo") trains its first
    method for half the budget (half the marks) and its second from the first's end for the rest; its points count
    seconds, steps and completions from the start of the first."""
    if method in SEQUENCES:
        first, second = SEQUENCES[method]
        points = stage(first, seed, minutes / 2, marks // 2, os.path.join(folder, f"1-{first}"))
        start = points[-1]
        later = stage(
            second, seed, minutes / 2, marks - marks // 2, os.path.join(folder, f"2-{second}"), start["path"]
        )
        offset = {key: start[key] for key in ("seconds", "step", "completions")}
        return points + [point | {key: point[key] + offset[key] for key in offset} for point in later]
    return stage(method, seed, minutes, marks, folder)


def stage(method: str, seed: int, minutes: float, marks: int, folder: str, model: str | None = None) -> list[dict]:
    """`method` trained from `model` (default SmolLM2-135M-Instruct) for `minutes`; its `marks` saved points."""
    from trl_es.commands.study import Budget
    from trl_es.commands.study_settings import GRPO_SETTINGS
    from trl_es.tasks import get_task
    from trl_es.util.models import smollm2_dir

    task = get_task(TASK["name"])

    model = model or smollm2_dir()
    common = dict(output_dir=os.path.join(folder, "run"), max_steps=100_000, max_completion_length=TASK["length"],
                  seed=seed, save_strategy="no", report_to="none", disable_tqdm=True, logging_steps=1)  # fmt: skip
    budget = Budget(minutes * 60, marks, folder)
    if method == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        args = GRPOConfig(**common, **GRPO_SETTINGS)
        per_step = args.per_device_train_batch_size  # completions per step
        trainer = GRPOTrainer(model, task.reward, args=args, train_dataset=task.load("train"),
                              callbacks=[budget])  # fmt: skip
    else:
        from trl_es import ESConfig, ESTrainer

        args = ESConfig(**{**common, "generation_kwargs": {"do_sample": False}, **ES, **SETTINGS[method], **SWEEP})
        per_step = args.population_size * args.per_device_train_batch_size * args.num_generations
        trainer = ESTrainer(model, task.reward, args=args, train_dataset=task.load("train"),
                            callbacks=[budget])  # fmt: skip
    budget.tokenizer = trainer.processing_class
    trainer.train()
    seconds, end = budget.elapsed(), os.path.join(folder, f"mark-{marks}")
    trainer.model.save_pretrained(end)
    trainer.processing_class.save_pretrained(end)
    points = [*budget.points, {"path": end, "seconds": round(seconds, 1), "step": trainer.state.global_step}]
    at = {step: round(second, 1) for second, step, _ in budget.history}
    points[-1]["log"] = [{"step": log["step"], "seconds": at.get(log["step"]),
                          **{key: log[key] for key in LOGGED if key in log}}
                         for log in trainer.state.log_history if "reward" in log]  # fmt: skip
    return [point | {"completions": point["step"] * per_step} for point in points]


def score(points: list[dict]) -> list[dict]:
    """Greedy held-out accuracy, KL drift from the base on off-task text (`trl_es.commands.study.OFF_TASK_TEXTS`)
    and, unless `TASK["samples"]` is 0, sampled Pass@1 / Pass@n (Maj@n, token entropy) of each saved point, n =
    `TASK["samples"]` (then its weights are removed)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_es.commands.study import OFF_TASK_TEXTS
    from trl_es.evaluation import evaluate
    from trl_es.research.analysis import mean_token_kl
    from trl_es.util.models import smollm2_dir

    base = AutoModelForCausalLM.from_pretrained(smollm2_dir()).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    for point in points:
        stage_dir = os.path.dirname(point["path"])  # a sequence's stages each have a mark-1: records kept apart
        n, name = TASK["samples"], TASK["name"]
        greedy = evaluate([point["path"]], name, n=1, k=[1], out_dir=os.path.join(stage_dir, "greedy"), greedy=True,
                          batch_size=64, limit=TASK["limit"], progress=lambda message: None)  # fmt: skip
        (g,) = greedy["models"].values()
        model = AutoModelForCausalLM.from_pretrained(point["path"]).eval()
        point.update(greedy=g["pass@1"], kl_drift=mean_token_kl(base, model, tokenizer, OFF_TASK_TEXTS))
        if n:
            sampled = evaluate([point["path"]], name, n=n, k=[1, n], out_dir=os.path.join(stage_dir, "sampled"),
                               temperature=TASK["temperature"], limit=TASK["limit"], use_vllm=TASK["use_vllm"],
                               vllm_entropy=TASK["use_vllm"], progress=lambda message: None)  # fmt: skip
            (s,) = sampled["models"].values()
            point.update(entropy=s["mean_token_entropy"], **{key: s[key] for key in s if "@" in key})
        if HELDOUT["name"] and point is points[-1]:
            heldout = evaluate([point["path"]], HELDOUT["name"], n=max(n, 1), k=[1, max(n, 1)],
                               out_dir=os.path.join(stage_dir, "heldout"), temperature=TASK["temperature"],
                               limit=HELDOUT["limit"], max_completion_length=HELDOUT["length"],
                               use_vllm=TASK["use_vllm"], vllm_entropy=TASK["use_vllm"],
                               progress=lambda message: None)  # fmt: skip
            (h,) = heldout["models"].values()
            kept = {key: h[key] for key in h if "@" in key or key == "mean_token_entropy"}
            point["heldout"] = {"task": HELDOUT["name"], **kept}
        shutil.rmtree(point.pop("path"))
    return points


def plot(results: list[dict], path: str) -> None:
    """Greedy accuracy, Pass@n (when sampled) and KL drift (when measured) — mean over seeds, min–max band —
    against seconds and against completions."""
    from trl_es.evaluation.report import pyplot

    plt = pyplot()
    first = results[0]["points"][0]
    metrics = ["greedy", *[key for key in (f"pass@{TASK['samples']}", "kl_drift") if key in first]]
    labels = {"greedy": "held-out greedy accuracy", "kl_drift": "KL drift from the base (off-task text)"}
    figure, axes = plt.subplots(len(metrics), 2, figsize=(10, 3.5 * len(metrics)), sharey="row", squeeze=False)
    for method in dict.fromkeys(r["method"] for r in results):
        runs = [r["points"] for r in results if r["method"] == method]
        n = min(len(points) for points in runs)
        for row, metric in enumerate(metrics):
            for col, x_name in enumerate(("seconds", "completions")):
                xs = [sum(points[k][x_name] for points in runs) / len(runs) for k in range(n)]
                values = [[points[k][metric] for points in runs] for k in range(n)]
                mean = [sum(v) / len(v) for v in values]
                line = axes[row][col].plot(xs, mean, marker="o", label=f"{method} ({len(runs)} seeds)")[0]
                axes[row][col].fill_between(xs, [min(v) for v in values], [max(v) for v in values],
                                            color=line.get_color(), alpha=0.2)  # fmt: skip
                axes[row][col].set_xlabel("wall-clock seconds" if x_name == "seconds" else "completions generated")
                axes[row][col].set_ylabel(labels.get(metric, f"held-out {metric}"))
    axes[0][0].legend()
    figure.suptitle(f"{TASK['name']}, SmolLM2-135M-Instruct: mean over seeds, band = min–max")
    figure.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="training budget per run")
    parser.add_argument("--marks", type=int, default=5, help="points of each run that are saved and scored")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument(
        "--methods",
        help=f"comma-separated, of grpo, {', '.join([*SETTINGS, *SEQUENCES])} (default grpo,es; with "
        "--report: only these methods of the files)",
    )
    parser.add_argument("--task", default=TASK["name"], help="a built-in task (trained and scored)")
    parser.add_argument("--samples", type=int, default=TASK["samples"], help="sampled completions per problem "
                        "(0: greedy accuracy and KL drift only)")  # fmt: skip
    parser.add_argument("--temperature", type=float, default=TASK["temperature"], help="of the sampled scoring")
    parser.add_argument("--max-completion-length", type=int, default=TASK["length"], help="new tokens in training")
    parser.add_argument("--limit", type=int, help="held-out problems scored (default: all of the task's test split)")
    parser.add_argument("--use-vllm", action="store_true", help="sampled scoring through an in-process vLLM engine")
    parser.add_argument("--sigma", type=float, help="σ of every ES method (a sweep's point; default each one's)")
    parser.add_argument("--alpha", type=float, help="α of every ES method (a sweep's point; default each one's)")
    parser.add_argument("--heldout", help="a task never trained on (e.g. commonsenseqa): each run's last point is also "
                        f"scored on its first {HELDOUT['limit']} problems, sampled as --samples/--temperature")  # fmt: skip
    parser.add_argument("--out", default="outputs/learning")
    parser.add_argument("--plot", default="docs/img/learning_curves.png")
    parser.add_argument("--report", nargs="+", metavar="RESULTS", help="only print the table and plot of "
                        "results.json files (several: runs of different seeds, pooled)")  # fmt: skip
    parser.add_argument("--one", nargs=2, metavar=("METHOD", "SEED"), help=argparse.SUPPRESS)
    parser.add_argument("--score", metavar="FOLDER", help=argparse.SUPPRESS)
    options = parser.parse_args()
    TASK.update(
        name=options.task,
        samples=options.samples,
        temperature=options.temperature,
        length=options.max_completion_length,
        limit=options.limit,
        use_vllm=options.use_vllm,
    )
    SWEEP.update({key: value for key, value in (("sigma", options.sigma), ("learning_rate", options.alpha)) if value})
    HELDOUT["name"] = options.heldout
    passed = {"--task": options.task, "--samples": options.samples, "--temperature": options.temperature,
              "--max-completion-length": options.max_completion_length, "--limit": options.limit,
              "--sigma": options.sigma, "--alpha": options.alpha, "--heldout": options.heldout}  # fmt: skip
    task_options = [part for flag, value in passed.items() if value is not None for part in (flag, str(value))]
    task_options += ["--use-vllm"] if options.use_vllm else []
    if options.report:
        results = [run for path in options.report for run in json.load(open(path))["results"]]
        methods = options.methods.split(",") if options.methods else list(dict.fromkeys(r["method"] for r in results))
        missing = [m for m in methods if all(r["method"] != m for r in results)]
        if missing:
            parser.error(f"no runs of {missing} in {options.report}")
        return report([r for r in results if r["method"] in methods], methods, options.plot)
    if options.one:  # training alone: the scoring's vLLM engine would not fit beside a vLLM trainer's memory
        method, seed = options.one
        folder = os.path.join(options.out, f"{method}-{seed}")
        points = train(method, int(seed), options.minutes, options.marks, folder)
        atomic_write_text(os.path.join(folder, "points.json"), json.dumps(points))
        return
    if options.score:
        points = json.load(open(os.path.join(options.score, "points.json")))
        print("RESULT " + json.dumps(score(points)))
        return
    if options.heldout:  # an unknown task fails before any training, not after it
        from trl_es.tasks import get_task

        try:
            get_task(options.heldout)
        except ValueError as error:
            parser.error(f"--heldout: {error}")
    methods, seeds = (options.methods or "grpo,es").split(","), [int(s) for s in options.seeds.split(",")]
    unknown = [m for m in methods if m != "grpo" and m not in SETTINGS and m not in SEQUENCES]
    if unknown:
        parser.error(f"unknown methods {unknown}")
    results, failed = [], []
    for index, seed in enumerate(seeds):
        for method in methods if index % 2 == 0 else methods[::-1]:  # A B, then B A: A B B A …
            command = [sys.executable, __file__, "--one", method, str(seed), "--minutes", str(options.minutes),
                       "--marks", str(options.marks), "--out", options.out, *task_options]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True)  # trained in a fresh process,
            if not done.returncode:  # scored in another
                folder = os.path.join(options.out, f"{method}-{seed}")
                done = subprocess.run([sys.executable, __file__, "--score", folder, *task_options],
                                      capture_output=True, text=True)  # fmt: skip
            line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if done.returncode or line is None:  # reported, and the other runs go on
                failed.append(f"{method} seed {seed}")
                print(f"{method} seed {seed} failed:\n{done.stderr[-3000:]}", file=sys.stderr, flush=True)
                continue
            results.append({"method": method, "seed": seed, "points": json.loads(line.removeprefix("RESULT "))})
            last = results[-1]["points"][-1]
            print(f"{method} seed {seed}: greedy {last['greedy']:.3f}, KL drift {last['kl_drift']:.4f} after "
                  f"{last['step']} steps, {last['seconds']:.0f} s", flush=True)  # fmt: skip
            # after every run: nothing is lost
            record = {"minutes": options.minutes, "marks": options.marks, "task": dict(TASK), "sweep": dict(SWEEP),
                      "heldout": dict(HELDOUT), "results": results}  # fmt: skip
            atomic_write_text(os.path.join(options.out, "results.json"), json.dumps(record, indent=1))
    if results:
        report(results, [m for m in methods if any(r["method"] == m for r in results)], options.plot)
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


def report(results: list[dict], methods: list[str], plot_path: str) -> None:
    """The plot and, per method and mark, the mean (and min–max) over the seeds of every measured metric."""
    plot(results, plot_path)
    n, first = TASK["samples"], results[0]["points"][0]
    columns = [("greedy (min–max)", lambda at: span(at, "greedy"))]
    if f"pass@{n}" in first:
        columns += [("Pass@1", lambda at: f"{mean(at, 'pass@1'):.3f}"), (f"Pass@{n} (min–max)", lambda at: span(at, f"pass@{n}"))]  # fmt: skip
    if f"maj@{n}" in first:
        columns += [(f"Maj@{n}", lambda at: f"{mean(at, f'maj@{n}'):.3f}"), ("entropy", lambda at: f"{mean(at, 'entropy'):.3f}")]  # fmt: skip
    if "kl_drift" in first:
        columns += [("KL drift (min–max)", lambda at: span(at, "kl_drift", ".4f"))]
    print("\n| method | mark | seconds | completions | " + " | ".join(name for name, _ in columns) + " |")
    print("|---|---:|---:|---:|" + "---|" * len(columns))
    for method in methods:
        runs = [r["points"] for r in results if r["method"] == method]
        for k in range(min(len(points) for points in runs)):
            at = [points[k] for points in runs]
            cells = " | ".join(cell(at) for _, cell in columns)
            print(f"| {method} | {k + 1} | {mean(at, 'seconds'):.0f} | {mean(at, 'completions'):.0f} | {cells} |")
    last = [(r["method"], r["seed"], r["points"][-1]["heldout"]) for r in results if "heldout" in r["points"][-1]]
    if last:
        keys = [key for key in last[0][2] if key != "task"]
        print(f"\nheld out ({last[0][2]['task']}), each run's last point:\n")
        print("| method | seed | " + " | ".join(keys) + " |")
        print("|---|---:|" + "---:|" * len(keys))
        for method, seed, heldout in last:
            print(f"| {method} | {seed} | " + " | ".join(f"{heldout[key]:.3f}" for key in keys) + " |")


def mean(points: list[dict], key: str) -> float:
    return sum(p[key] for p in points) / len(points)


def span(points: list[dict], key: str, form: str = ".3f") -> str:
    """Mean (min–max) over the seeds."""
    low, high = min(p[key] for p in points), max(p[key] for p in points)
    return f"{mean(points, key):{form}} ({low:{form}}–{high:{form}})"


if __name__ == "__main__":
    main()
